"""Router kernel block sweep: router_topk at Kimi-K2 TP-8 shapes, 16 layers' weights in one graph (past the L2)."""
import json, sys, torch
sys.path.insert(0, ".")
import kernels, model
from kernels_bench import _graph_ms, copy_bandwidth_GBps
out_path = sys.argv[1]
bw = copy_bandwidth_GBps()
CONFIGS = [(8, 8192, 8), (8, 4096, 14), (4, 4096, 8), (16, 8192, 14), (8, 8192, 4), (2, 2048, 8), (8, 2048, 28),
           (16, 16384, 8)]
rows = []
L = 16
for E in (384, 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(E, 7168, device="cuda", generator=g) / 64 for _ in range(L)]
    bias = torch.randn(E, device="cuda", generator=g) / 10
    for N in (1, 4):
        xs = [torch.randn(N, 7168, device="cuda", generator=g).bfloat16() for _ in range(L)]
        floor_us = E * 7168 * 4 / bw / 1e3
        for be, tile, split in CONFIGS:
            kernels.ROUTER_BLOCK_E, kernels.ROUTER_TILE, kernels.ROUTER_SPLIT_D = be, tile, split
            for routing in ("uniform", "model"):
                calls = [lambda x=x, w=w: kernels.router_topk(x, w, bias, 8, 1, 1, True, 2.827, uniform=routing == "uniform")
                         for x, w in zip(xs, ws)]
                try:
                    us = _graph_ms(calls) * 1e3
                except Exception as e:
                    print(E, N, be, tile, split, routing, "ERR", str(e)[:200], flush=True); continue
                rows.append(dict(E=E, N=N, block_e=be, tile=tile, split_d=split, routing=routing, us=us, floor_us=floor_us))
                print(f"E {E} N {N} block_e {be:2d} tile {tile:5d} split_d {split:2d} {routing:7s}: {us:6.2f} us "
                      f"(floor {floor_us:.2f})", flush=True)
json.dump(dict(copy_GBps=bw, rows=rows), open(out_path, "w"), indent=1)
