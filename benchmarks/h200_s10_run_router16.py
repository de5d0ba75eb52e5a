"""run.py with the router's blocks of the sweep's best one-token point at 384 experts (16 experts x 512, 14 slices)."""
import runpy, sys
sys.path.insert(0, ".")
import kernels
kernels.ROUTER_BLOCK_E, kernels.ROUTER_SPLIT_D = 16, 14
sys.argv = ["run.py"] + sys.argv[1:]
runpy.run_path("run.py", run_name="__main__")
