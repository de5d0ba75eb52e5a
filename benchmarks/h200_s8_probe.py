"""The eighth session's one-off probe, kept as the record of how benchmarks/h200_s8_* were measured (not
part of the reference; run from the repository root on a GPU):
  python benchmarks/h200_s8_probe.py profile OUT.json [run.py flags]   each kernel's time in one eager phase
  python benchmarks/h200_s8_probe.py sweep OUT.json     a prototype GEMV (gemv2 below) against cuBLAS, norm_gemv
  python benchmarks/h200_s8_probe.py sweep2 OUT.json    norm_gemv / head_gemv block sizes and the bf16 MoE GEMV
                                                        configs; "old kernel": main 3224e19's kernels.py,
                                                        copied to .lead/kernels_old.py (head_gemv's warps
                                                        were NORM_GEMV_WARPS then, HEAD_GEMV_WARPS now)
profile and sweep ran on main 3224e19 (norm_gemv: its kernel then); sweep2 on 3224e19 with the new
_norm_gemv_kernel (one row: the next tile in flight, the products summed once), as committed after it."""
import json
import math
import sys
from functools import partial

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
import kernels  # noqa: E402
import kernels_bench as kb  # noqa: E402


def profile(flags, phases=("decode_step", "verify/decode"), out=None):
    import run
    cfg = run.settle(run.parse_args(flags), torch.device("cuda"), 1)
    b = run.prepare(cfg, torch.device("cuda"))
    calls = run.phase_calls(b, cfg.context_len[0])
    res = {}
    for phase in phases:
        key, fn, inputs = calls[phase]
        n, top = kb._step_kernels(partial(fn, *inputs))
        res[phase] = dict(n=n, total_us=sum(v[1] for v in top.values()), top={k: v for k, v in top.items()})
        print(f"== {flags} {phase}: {n} kernels, {res[phase]['total_us']:.1f} us")
        for name, (c, us) in list(top.items())[:30]:
            print(f"  {c:5d}  {us:9.1f} us  {us / c:7.2f} us each  {name}")
    if out:
        json.dump(res, open(out, "w"))


@triton.jit
def gemv2_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_split, s_xm, s_wn, s_om,
                 SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BARRIER: tl.constexpr):
    kernels._wait_for_prior()
    pid, s = tl.program_id(0), tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    lo = s * k_split
    steps = (tl.minimum(lo + k_split, K) - lo) // BLOCK_K
    w_rows = w_ptr + n[:, None].to(tl.int64) * s_wn + kk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w = tl.load(w_rows + lo)
    for i in range(steps):
        k0 = lo + i * BLOCK_K
        w1 = tl.load(w_rows + lo + tl.minimum(i + 1, steps - 1) * BLOCK_K)
        if BARRIER:
            tl.debug_barrier()
        wf = w.to(tl.float32)
        if BLOCK_M == 1:
            acc1 += wf * tl.load(x_ptr + k0 + kk).to(tl.float32)[None, :]
        else:
            for m in tl.static_range(BLOCK_M):
                h = tl.load(x_ptr + m * s_xm + k0 + kk, mask=(kk >= 0) & (m < M), other=0.0).to(tl.float32)
                acc = tl.where(rows[:, None] == m, acc + tl.sum(wf * h[None, :], 1)[None, :], acc)
        w = w1
    if BLOCK_M == 1:
        acc = tl.sum(acc1, 1)[None, :]
    last = pid >= 0
    if SPLITS > 1:
        ok = (rows < M)[:, None]
        tl.store(part_ptr + (s * M + rows[:, None]) * N + n[None, :], acc, mask=ok)
        tl.debug_barrier()
        last = tl.atomic_add(count_ptr + pid, 1) == SPLITS - 1
        if last:
            tl.atomic_xchg(count_ptr + pid, 0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for t in range(SPLITS):
                acc += tl.load(part_ptr + (t * M + rows[:, None]) * N + n[None, :], mask=ok, other=0.0,
                               cache_modifier=".cg")
    tl.store(out_ptr + rows[:, None] * s_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & last)


def gemv2(x, w, block_n, block_k, programs, warps, barrier):
    M, K = x.shape
    N = w.shape[0]
    assert N % block_n == 0 and K % block_k == 0
    steps = K // block_k
    slices = min(steps, max(1, programs // (N // block_n)))
    k_split = triton.cdiv(steps, slices) * block_k
    slices = triton.cdiv(K, k_split)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    part = torch.empty(slices, M, N, device=x.device, dtype=torch.float32)
    gemv2_kernel[(N // block_n, slices)](x, w, out, part, kernels._counters(x.device), M, N, K, k_split,
                                         x.stride(0), w.stride(0), out.stride(0), SPLITS=slices,
                                         BLOCK_M=kernels._pow2(M, 1), BLOCK_N=block_n, BLOCK_K=block_k,
                                         BARRIER=barrier, num_warps=warps, num_stages=1, launch_pdl=kernels.PDL)
    return out


def sweep(out):
    rows = []
    bw = kb.copy_bandwidth_GBps()
    print(f"copy {bw:.0f} GB/s")
    dt = torch.bfloat16
    for name, N, K in (("q_a+kv_a", 2112, 7168), ("o_proj", 7168, 1024)):
        sets = max(2, min(16, math.ceil(150e6 / (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(sets)]
        for M in (1, 4):
            xs = [torch.randn(M, K, device="cuda", dtype=dt) for _ in range(sets)]
            ref = torch.nn.functional.linear(xs[0], ws[0]).float()
            base = kb._graph_ms([partial(torch.nn.functional.linear, x, w) for x, w in zip(xs, ws)]) * 1e3
            cur = kb._graph_ms([partial(kernels.norm_gemv, x, w) for x, w in zip(xs, ws)]) * 1e3
            print(f"{name} M {M}: cuBLAS {base:.2f} us ({N * K * 2 / base / 1e3:.0f} GB/s), norm_gemv {cur:.2f}", flush=True)
            rows.append(dict(proj=name, M=M, cublas_us=base, norm_gemv_us=cur))
            best = None
            shapes = ((8, 1024), (16, 512), (16, 1024), (32, 256), (32, 512)) if M == 1 else \
                ((8, 512), (16, 256), (16, 512), (32, 256))
            for bn, bk in shapes:
                if True:
                    for programs in (264, 528, 1056):
                        for warps in (4, 8):
                            for barrier in (False, True):
                                if N % bn or K % bk:
                                    continue
                                try:
                                    y = gemv2(xs[0], ws[0], bn, bk, programs, warps, barrier).float()
                                    err = (y - ref).abs().max().item()
                                    us = kb._graph_ms([partial(gemv2, x, w, bn, bk, programs, warps, barrier)
                                                       for x, w in zip(xs, ws)]) * 1e3
                                except Exception as e:
                                    print(f"  {bn, bk, programs, warps, barrier}: {type(e).__name__} {str(e)[:80]}")
                                    continue
                                rows.append(dict(proj=name, M=M, cfg=[bn, bk, programs, warps, barrier], us=us,
                                                 err=err))
                                if best is None or us < best[0]:
                                    best = (us, (bn, bk, programs, warps, barrier))
                                print(f"  {name} M {M} {bn:3d} {bk:5d} {programs:5d} {warps} {int(barrier)}: {us:6.2f} us "
                                      f"({N * K * 2 / us / 1e3:5.0f} GB/s) err {err:.2e}", flush=True)
            print(f"BEST {name} M {M}: {best}  cuBLAS {base:.2f}  norm_gemv {cur:.2f}", flush=True)
    json.dump(dict(copy_GBps=bw, rows=rows), open(out, "w"))


def _old():
    import importlib.util
    spec = importlib.util.spec_from_file_location("kernels_old", ".lead/kernels_old.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sweep2(out):
    """The new norm_gemv kernel at every use, head_gemv block sizes, and the bf16 MoE GEMV configs at K 8 and 9."""
    import itertools
    old = _old()
    rows = []
    bw = kb.copy_bandwidth_GBps()
    print(f"copy {bw:.0f} GB/s", flush=True)
    dt = torch.bfloat16
    F = torch.nn.functional
    uses = {  # name: N, K, norm, Ms, sweep grid (bn, bk, programs, warps)
        "q_a+kv_a": (2112, 7168, False, (1,), ((8, 16), (512, 1024), (132, 264, 528), (4, 8))),
        "o_proj": (7168, 1024, False, (1,), ((16, 32, 64), (256, 512, 1024), (132, 264), (4, 8))),
        "q_b": (1536, 1536, True, (1, 2, 4), ((8, 16, 32), (256, 512, 1024), (132, 264, 528), (4, 8))),
        "dense_gate_up": (4608, 7168, False, (1,), ((8, 16, 32), (512, 1024), (264, 528), (8,))),
        "dense_down": (7168, 2304, False, (1,), ((16, 32), (256, 512), (264, 528), (8,))),
    }
    for name, (N, K, has_norm, Ms, grid) in uses.items():
        sets = max(2, min(16, math.ceil(150e6 / (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(sets)]
        g = (1 + 0.1 * torch.randn(K, device="cuda")).to(dt) if has_norm else None
        for M in Ms:
            xs = [torch.randn(M, K, device="cuda", dtype=dt) for _ in range(sets)]

            def twin(x, w):
                if g is not None:
                    x = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt) * g
                return F.linear(x, w)
            ref = twin(xs[0], ws[0]).float()
            base = kb._graph_ms([partial(twin, x, w) for x, w in zip(xs, ws)]) * 1e3
            was = kb._graph_ms([partial(old.norm_gemv, x, w, g, 1e-6) for x, w in zip(xs, ws)]) * 1e3
            now = kb._graph_ms([partial(kernels.norm_gemv, x, w, g, 1e-6) for x, w in zip(xs, ws)]) * 1e3
            print(f"{name} M {M}: twin {base:.2f} us, old kernel {was:.2f}, new kernel default {now:.2f} "
                  f"({N * K * 2 / bw / 1e3:.2f} floor)", flush=True)
            rows.append(dict(use=name, M=M, twin_us=base, old_us=was, new_default_us=now))
            best = None
            grid_m = grid if M == 1 else ((16, 32), (128, 256, 512), (264, 528, 1024), (4, 8))
            for bn, bk, programs, warps in itertools.product(*grid_m):
                if bn * bk > 16384:
                    continue
                try:
                    y = kernels.norm_gemv(xs[0], ws[0], g, 1e-6, bn, bk, programs, warps).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    us = kb._graph_ms([partial(kernels.norm_gemv, x, w, g, 1e-6, bn, bk, programs, warps)
                                       for x, w in zip(xs, ws)]) * 1e3
                except Exception as e:
                    print(f"  {bn, bk, programs, warps}: {type(e).__name__} {str(e)[:80]}")
                    continue
                rows.append(dict(use=name, M=M, cfg=[bn, bk, programs, warps], us=us, err=err))
                if best is None or us < best[0]:
                    best = (us, (bn, bk, programs, warps))
                print(f"  {name} M {M} {bn:3d} {bk:5d} {programs:5d} {warps}: {us:6.2f} us "
                      f"({N * K * 2 / us / 1e3:5.0f} GB/s) err {err:.1e}", flush=True)
            print(f"BEST {name} M {M}: {best}  twin {base:.2f}  old {was:.2f}", flush=True)
    # head_gemv: the new kernel over its block sizes, the old one, and the einsums with the copies the model makes
    kv_bs = [torch.randn(8, 256, 512, device="cuda", dtype=dt) / 512 ** 0.5 for _ in range(8)]
    for M in (1, 2, 3, 4):
        for name in ("W_uk", "W_uv"):
            if name == "W_uk":
                xs = [torch.randn(1, M, 8, 192, device="cuda", dtype=dt)[..., :128] for _ in kv_bs]
                wts = [kv[:, :128].transpose(1, 2) for kv in kv_bs]          # [H, C, d] strided

                def twin(x, kv):
                    return torch.einsum("bthd,hdc->bthc", x, kv[:, :128]).reshape(1, -1, 512)
                knobs = ("HEAD_GEMV_BLOCK_N_STRIDED", (32, 64, 128))
            else:
                xs = [torch.randn(1, M, 8, 512, device="cuda", dtype=dt) for _ in kv_bs]
                wts = [kv[:, 128:] for kv in kv_bs]

                def twin(x, kv):
                    return torch.einsum("bthc,hdc->bthd", x, kv[:, 128:]).flatten(2)
                knobs = ("HEAD_GEMV_BLOCK_N", (8, 16, 32))
            base = kb._graph_ms([partial(twin, x, kv) for x, kv in zip(xs, kv_bs)]) * 1e3
            was = kb._graph_ms([partial(old.head_gemv, x, w) for x, w in zip(xs, wts)]) * 1e3
            rows.append(dict(use=name, M=M, twin_us=base, old_us=was))
            line = f"{name} M {M}: einsum+copy {base:.2f} us, old kernel {was:.2f};"
            keep = (getattr(kernels, knobs[0]), kernels.HEAD_GEMV_WARPS)
            for bn, warps in itertools.product(knobs[1], (2, 4, 8)):
                setattr(kernels, knobs[0], bn)
                kernels.HEAD_GEMV_WARPS = warps
                us = kb._graph_ms([partial(kernels.head_gemv, x, w) for x, w in zip(xs, wts)]) * 1e3
                rows.append(dict(use=name, M=M, cfg=[bn, warps], us=us))
                line += f" {bn}/{warps} {us:.2f}"
            setattr(kernels, knobs[0], keep[0])
            kernels.HEAD_GEMV_WARPS = keep[1]
            print(line, flush=True)
    # bf16 MoE GEMV at 1 token: K 8 (no shared slot) and 9 (the shared expert as expert E)
    E, I, D = 129, 256, 7168
    gen = torch.Generator("cuda").manual_seed(0)
    ws = [kb._random_experts("plain", E, o, i, "cuda", gen) for o, i in ((I, D), (I, D), (D, I))]
    x = torch.randn(1, D, device="cuda", dtype=dt)
    for K in (8, 9):
        calls_ids = [torch.tensor([[(8 * c + j) % 128 for j in range(8)] + ([128] if K == 9 else [])],
                                  device="cuda") for c in range(4)]
        rw = torch.rand(1, K, device="cuda")
        floor_us = K * 3 * I * D * 2 / bw / 1e3
        default = kernels._gemv_configs("plain", 1, True)

        def t(cfg):
            run = lambda: [kernels.fused_moe(x, ids, rw, *ws, configs=cfg, variant="gemv") for ids in calls_ids]
            us = kb._graph_ms([run]) * 1e3 / len(calls_ids)
            _, by = kb._kernel_ms(run)
            return us, {k[:30]: v * 1e3 / len(calls_ids) for k, v in by.items()}
        us, by = t(None)
        print(f"MoE K {K}: default {default} {us:.2f} us (floor {floor_us:.2f}) {by}", flush=True)
        rows.append(dict(moe_K=K, cfg=None, us=us, by=by, floor_us=floor_us))
        for bn, bk, unroll, warps in itertools.product((2, 4, 8), (512, 1024), (1, 2), (4, 8)):
            cfg = dict(gate_up=(bn, bk, unroll, warps, 1))
            try:
                us, by = t(cfg)
            except Exception as e:
                print(f"  gate_up {cfg}: {type(e).__name__} {str(e)[:80]}")
                continue
            rows.append(dict(moe_K=K, cfg=cfg, us=us, by=by))
            print(f"  K {K} gate_up {bn, bk, unroll, warps}: {us:.2f} us {by}", flush=True)
        for bn, warps in itertools.product((8, 16, 32, 64), (2, 4, 8)):
            cfg = dict(down=(bn, 256, warps, 1))
            us, by = t(cfg)
            rows.append(dict(moe_K=K, cfg=cfg, us=us, by=by))
            print(f"  K {K} down {bn, warps}: {us:.2f} us {by}", flush=True)
    json.dump(dict(copy_GBps=bw, rows=rows), open(out, "w"))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "profile":
        profile(sys.argv[3:], out=sys.argv[2])
    elif what == "sweep2":
        sweep2(sys.argv[2])
    else:
        sweep(sys.argv[2])
