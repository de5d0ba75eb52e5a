"""(Run from the repository root: python benchmarks/h200_s12_var.py out.json.) Why the input add + norm inside q_a + kv_a is slow at 2-4 rows: variants of _norm_gemv_kernel (ADD + NORM, one
slice), each against the kernel in kernels.py and the two launches, at 1-4 rows and 4 / 8 warps."""
import os, sys, json, math; sys.path.insert(0, os.getcwd())
from functools import partial
import torch, triton, triton.language as tl
import kernels, kernels_bench as kb
from kernels import norm_gemv, add_rmsnorm, _wait_for_prior


@triton.jit
def var_kernel(x_ptr, r_ptr, sum_ptr, g_ptr, w_ptr, out_ptr, M, N, K, eps, s_xm, s_wn,
               VAR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # VAR 1: x and r loaded one step ahead, as W; VAR 2: no store in the loop (program 0 stores the sum after
    # it); VAR 3: both
    _wait_for_prior()
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n[None, :, None]
    kb_ = tl.arange(0, BLOCK_K)
    k3 = kb_[None, None, :]
    rok = (rows < M)[:, None]
    x_rows, r_rows, sum_rows = x_ptr + rows[:, None] * s_xm, r_ptr + rows[:, None] * s_xm, sum_ptr + rows[:, None] * s_xm
    w_rows = w_ptr + n3 * s_wn
    last_k = (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    ss2 = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    w = tl.load(w_rows + k3, mask=(n3 < N) & (k3 < K), other=0.0)
    xa = tl.load(x_rows + kb_[None, :], mask=rok & (kb_ < K)[None, :], other=0.0)
    ra = tl.load(r_rows + kb_[None, :], mask=rok & (kb_ < K)[None, :], other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kb_
        kn = tl.minimum(k0 + BLOCK_K, last_k)
        w1 = tl.load(w_rows + kn + k3, mask=(n3 < N) & (kn + k3 < K), other=0.0)
        ok = rok & (k < K)[None, :]
        if VAR % 2 == 1:
            x1 = tl.load(x_rows + kn + kb_[None, :], mask=rok & (kn + kb_ < K)[None, :], other=0.0)
            r1 = tl.load(r_rows + kn + kb_[None, :], mask=rok & (kn + kb_ < K)[None, :], other=0.0)
            h = xa
            rr = ra
        else:
            h = tl.load(x_rows + k[None, :], mask=ok, other=0.0)
            rr = tl.load(r_rows + k[None, :], mask=ok, other=0.0)
        h = (h.to(tl.float32) + rr.to(tl.float32)).to(h.dtype)
        if VAR < 2:
            tl.store(sum_rows + k[None, :], h, mask=ok & (pid == 0))
        h = h.to(tl.float32)
        ss2 += h * h
        h = h * tl.load(g_ptr + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
        acc3 += w.to(tl.float32) * h[:, None, :]
        w = w1
        if VAR % 2 == 1:
            xa = x1
            ra = r1
    acc = tl.sum(acc3, 2)
    ss = tl.sum(ss2, 1)
    if VAR >= 2:
        if pid == 0:
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kb_
                ok = rok & (k < K)[None, :]
                hx = tl.load(x_rows + k[None, :], mask=ok, other=0.0)
                hr = tl.load(r_rows + k[None, :], mask=ok, other=0.0)
                tl.store(sum_rows + k[None, :], (hx.to(tl.float32) + hr.to(tl.float32)).to(hx.dtype), mask=ok)
    acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    tl.store(out_ptr + rows[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=rok & (n < N)[None, :])


def var_call(x, w, g, eps, r, var, bn, warps):
    M, K = x.shape
    N = w.shape[0]
    bk = kernels._norm_gemv_step(M, bn, 2048, warps, K, 2)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    summed = torch.empty_like(x)
    var_kernel[(triton.cdiv(N, bn),)](x, r, summed, g, w, out, M, N, K, eps, x.stride(0), w.stride(0), VAR=var,
                                      BLOCK_M=kernels._pow2(M, 1), BLOCK_N=bn, BLOCK_K=bk, launch_pdl=kernels.PDL,
                                      num_stages=1, num_warps=warps)
    return out, summed


dt, N, K = torch.bfloat16, 2112, 7168
sets = math.ceil(150e6 / (N * K * 2))
ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(sets)]
g = (1 + 0.1 * torch.randn(K, device="cuda")).to(dt)
res = []
for M in (1, 2, 3, 4):
    xs, rs = ([torch.randn(M, K, device="cuda", dtype=dt) for _ in range(sets)] for _ in range(2))
    want, want_sum = norm_gemv(xs[0], ws[0], g, 1e-6, residual=rs[0])
    two = kb._graph_ms([(lambda x=x, r=r, w=w: norm_gemv(add_rmsnorm(r, x, g, 1e-6)[1], w)) for x, r, w in zip(xs, rs, ws)]) * 1e3
    line = f"M {M}: two launches {two:5.1f}"
    for warps in (4, 8):
        cur = kb._graph_ms([partial(norm_gemv, x, w, g, 1e-6, residual=r, warps=warps) for x, r, w in zip(xs, rs, ws)]) * 1e3
        line += f" | w{warps} main {cur:5.1f}"
        for bn in ((8,) if M == 1 else (4, 16)):
            for var in (0, 1, 2, 3):
                got, got_sum = var_call(xs[0], ws[0], g, 1e-6, rs[0], var, bn, warps)
                ok = torch.equal(got_sum, want_sum) and (got.float() - want.float()).abs().max().item() < 0.02
                us = kb._graph_ms([partial(var_call, x, w, g, 1e-6, r, var, bn, warps) for x, r, w in zip(xs, rs, ws)]) * 1e3
                line += f" bn{bn}v{var} {us:5.1f}{'' if ok else '!'}"
                res.append(dict(M=M, warps=warps, bn=bn, var=var, us=us, ok=ok, main=cur, two=two))
    print(line, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
