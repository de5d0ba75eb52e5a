"""The test suite's environment and markers.

    gpu        needs a CUDA GPU; skipped elsewhere
    multi_gpu  needs a 2-rank torchrun world on 2 GPUs (see test_tp.py); skipped elsewhere
    triton     needs Triton: on CUDA natively, on a CPU under its interpreter (TRITON_INTERPRET=1,
               set here before anything imports Triton); skipped without triton
    slow       long on 2 CPU cores (test_cli.py's end-to-end runs, its check of BENCHMARKS.md's
               tables, test_kernels.py's largest interpreter runs); run by default (deselect
               with -m "not slow")

`python -m pytest -q` runs every test the machine can run (`-n 2 --dist loadfile`: a test file a
process, over 2, as CI runs them); `-m gpu`, `-m triton` or `-m "not gpu"` select by marker.
"""
import os
import tempfile

# one thread a process unless asked otherwise: CI has 2 cores, and the tests spawn ranks and run.py
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton's CPU interpreter runs the kernels' small cases on a machine without CUDA; set before
# anything imports Triton (its decorators read it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def patch_the_language_once_a_kernel():
    """Triton's interpreter (3.7) patches triton.language for a kernel's run, and again at every
    call of a device function inside the run, walking the language's members each time (40% of a
    fused MoE test's time) to find nothing left to patch where the modules it patches (tl, tl.core:
    those among the function's globals) were patched already in this run. Here such a call skips
    the walk; one naming a module not yet patched in the run patches as before. Left alone if the
    interpreter's internals differ."""
    try:
        import inspect

        from triton.runtime import interpreter
        langs = (interpreter.tl, interpreter.tl.core)
    except (ImportError, AttributeError):
        return
    real = getattr(interpreter, "_patch_lang", None)
    if real is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched = set()                             # the modules patched in the kernel's run (ids)
    modules = {}                                # function -> the ids of the modules it would patch

    def patch_lang(fn):
        if fn not in modules:
            modules[fn] = {id(v) for v in fn.__globals__.values()
                           if inspect.ismodule(v) and v in langs}
        mine = modules[fn]
        if patched and mine <= patched:                    # a device function inside a kernel
            return interpreter._LangPatchScope()
        kernel = not patched
        scope = real(fn)
        patched.update(mine)
        if kernel:
            restore = scope.restore

            def restore_and_end():
                patched.clear()
                restore()
            scope.restore = restore_and_end
        return scope
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    patch_the_language_once_a_kernel()

import kernels  # noqa: E402
from checkpoint import init_random, save_target  # noqa: E402
from model import Transformer  # noqa: E402
from testing import TRITON_DEVICE, tiny  # noqa: E402

MARKERS = {
    "gpu": "needs a CUDA GPU",
    "multi_gpu": "needs 2 GPUs in a 2-rank torchrun world",
    "triton": "needs Triton (natively on CUDA, under its interpreter on a CPU)",
    "slow": "long on 2 CPU cores; run by default (deselect with -m \"not slow\")",
}


def pytest_configure(config):
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


RUN_MULTI_GPU = "torchrun --nproc-per-node 2 -m pytest -q -m multi_gpu"


def multi_gpu_missing():
    if not torch.cuda.is_available():
        return f"needs 2 CUDA GPUs and this machine has none; on one with 2, run: {RUN_MULTI_GPU}"
    if os.environ.get("WORLD_SIZE") != "2" or torch.cuda.device_count() < 2:
        return f"needs a 2-rank torchrun world on 2 GPUs; run: {RUN_MULTI_GPU}"
    return None


def missing():
    """Marker -> why its tests cannot run on this machine (None: they can)."""
    gpu = torch.cuda.is_available()
    triton = kernels.fused_moe_available(TRITON_DEVICE, torch.float32)
    return {
        "gpu": None if gpu else ("needs a CUDA GPU and this machine has none; on one, run: "
                                 "python -m pytest -q -m gpu"),
        "multi_gpu": multi_gpu_missing(),
        "triton": None if triton else ("needs Triton (on CUDA, or its CPU interpreter with "
                                       "TRITON_INTERPRET=1): pip install triton"),
    }


def pytest_collection_modifyitems(config, items):
    reasons = missing()
    for item in items:
        for name, reason in reasons.items():
            if reason and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=reason))
                break


@pytest.fixture(scope="module")
def tiny_ckpt():
    """The tiny model (seed 1, float64, TP 1) saved as a sharded checkpoint: yields (the
    checkpoint's folder, the model)."""
    with tempfile.TemporaryDirectory() as d:
        m = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=torch.float64),
                        1)
        save_target(m, d, max_shard_bytes=200_000)
        yield d, m
