"""(Run from the repository root: python benchmarks/h200_s12_sweep.py out.json.) q_a + kv_a with the input add + norm inside: block_n x warps x programs at 1-4 rows, against the two launches."""
import os, sys, json, math; sys.path.insert(0, os.getcwd())
from functools import partial
import torch, kernels_bench as kb
from kernels import norm_gemv, add_rmsnorm
dt, N, K = torch.bfloat16, 2112, 7168
sets = math.ceil(150e6 / (N * K * 2))
ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(sets)]
g = torch.ones(K, device="cuda", dtype=dt)
out = []
for M in (1, 2, 3, 4):
    xs, rs = ([torch.randn(M, K, device="cuda", dtype=dt) for _ in range(sets)] for _ in range(2))
    two = kb._graph_ms([(lambda x=x, r=r, w=w: norm_gemv(add_rmsnorm(r, x, g, 1e-6)[1], w)) for x, r, w in zip(xs, rs, ws)]) * 1e3
    gemv = kb._graph_ms([partial(norm_gemv, x, w) for x, w in zip(xs, ws)]) * 1e3
    ref = norm_gemv(add_rmsnorm(rs[0], xs[0], g, 1e-6)[1], ws[0]).float()
    print(f"M {M}: two launches {two:.1f} us, the GEMV alone {gemv:.1f}", flush=True)
    out.append(dict(M=M, two=two, gemv=gemv))
    for bn in (4, 8, 16, 32):
        for warps in (4, 8):
            for programs in (264, 528):
                for bk in (None,):
                    try:
                        f = [partial(norm_gemv, x, w, g, 1e-6, residual=r, block_n=bn, warps=warps, programs=programs, block_k=bk) for x, r, w in zip(xs, rs, ws)]
                        err = (f[0]()[0].float() - ref).abs().max().item()
                        us = kb._graph_ms(f) * 1e3
                    except Exception as e:
                        print(f"  bn {bn} warps {warps} programs {programs} bk {bk}: {type(e).__name__} {str(e)[:80]}", flush=True); continue
                    print(f"  bn {bn:2d} warps {warps} programs {programs} bk {bk}: {us:6.1f} us  err {err:.3g}", flush=True)
                    out.append(dict(M=M, bn=bn, warps=warps, programs=programs, bk=bk, us=us, err=err))
json.dump(out, open(sys.argv[1], "w"), indent=1)
