"""Session 9 sweep: norm_gemv's elementwise [rows, BLOCK_N, BLOCK_K] accumulator at 1-8 rows against
cuBLAS (with the RMSNorm for q_b) and the form before it (kernels_s8.py beside this file, main's kernels.py of
session 8), and head_gemv at 1-4 rows. bf16, Kimi-K2 TP-8 shapes, CUDA graphs over weight sets past
the L2 (kernels_bench._graph_ms). Each result is checked against the twin (max abs error over the
largest output).

    git show cda301d:kernels.py > benchmarks/kernels_s8.py             # "the form before", beside this file
    python benchmarks/h200_s9_sweep_gemv.py OUT.json [--budget-s 270]  # repository root, one H200, < 5 minutes
    python benchmarks/h200_s9_sweep_gemv.py --dry OUT.json             # CPU interpreter, tiny shapes: that it runs

It ran as .lead/sweep9_gemv.py on 2026-12-01 (benchmarks/h200_s9_sweep_gemv.{log,json}), with the
kernel's several-row blocks of its first form: 8 warps, 8 W rows a program at long K.

Order: every baseline first (twin, old kernel, new default at every use and row count), then
head_gemv, then the norm_gemv grids (rows 2, 4, 3, 8, then 1: one row was swept in session 8). Past
--budget-s seconds the grids left are skipped (counted in the JSON); the JSON is rewritten after
every grid, so a killed run leaves what it had.

Grid per (use, rows), deduplicated by what runs (BLOCK_N, BLOCK_K, K slices, warps): BLOCK_N in 4,
8, 16, 32 x warps 4, 8, each at the longest step (64..1024 columns, at most K) whose accumulator
rows x BLOCK_N x BLOCK_K fits kernels.NORM_GEMV_ACC_REGS a thread, K whole (programs 264); then the
default's blocks at programs 528 and 1024 (K split where that makes slices) and at half its step.
"""
import os
import sys

DRY = "--dry" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import kernels  # noqa: E402
import model  # noqa: E402

DEV = "cpu" if DRY else "cuda"
DT = torch.float32 if DRY else torch.bfloat16    # the interpreter rounds to bf16 toward zero: float32 there
USES = ({"q_a+kv_a": (40, 320, False), "q_b": (24, 256, True), "o_proj": (72, 128, False)} if DRY else
        {"q_a+kv_a": (2112, 7168, False), "q_b": (1536, 1536, True), "o_proj": (7168, 1024, False)})
ROWS = (1, 2, 3) if DRY else (1, 2, 3, 4, 8)
GRID_ROWS = (2, 3, 1) if DRY else (2, 4, 3, 8, 1)
HEADS = dict(H=2, d=16, R=8, C=32) if DRY else dict(H=8, d=128, R=64, C=512)
T0 = time.perf_counter()


def _old():
    spec = importlib.util.spec_from_file_location("kernels_s8", os.path.join(HERE, "kernels_s8.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(calls):
    """us of one call: the calls captured in one graph and replayed (median); --dry: one eager pass."""
    if DRY:
        t = time.perf_counter()
        for f in calls:
            f()
        return (time.perf_counter() - t) / len(calls) * 1e6
    import kernels_bench as kb
    return kb._graph_ms(calls) * 1e3


def rel_err(y, ref):
    ref = ref.float()
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def default_cfg(N, K, M):
    """(block_n, block_k, programs, warps) that norm_gemv picks by itself, and its K slices."""
    bn, step_bytes, warps = kernels.NORM_GEMV_BLOCKS["long" if K >= kernels.NORM_GEMV_LONG_K else "short"]
    bk = kernels._norm_gemv_step(M, bn, step_bytes, warps, K, torch.empty((), dtype=DT).element_size())
    return (bn, bk, kernels.NORM_GEMV_PROGRAMS, warps), kernels._k_slices(N, K, bn, bk, kernels.NORM_GEMV_PROGRAMS)[0]


def grid(N, K, M):
    """The configurations of the module docstring, deduplicated by (block_n, block_k, slices, warps)."""
    bm = kernels._pow2(M, 1)
    (dbn, dbk, _, dw), dslices = default_cfg(N, K, M)
    seen = {(dbn, dbk, dslices, dw)}
    out = []

    def add(bn, bk, programs, warps):
        key = (bn, bk, kernels._k_slices(N, K, bn, bk, programs)[0], warps)
        if key not in seen:
            seen.add(key)
            out.append((bn, bk, programs, warps))
    for bn, warps in itertools.product((4, 8, 16, 32), (4, 8)):
        fit = [bk for bk in (64, 128, 256, 512, 1024)
               if bk <= kernels._pow2(K) and bm * bn * bk <= kernels.NORM_GEMV_ACC_REGS * 32 * warps]
        if fit:
            add(bn, fit[-1], kernels.NORM_GEMV_PROGRAMS, warps)
    for programs in (528, 1024):
        add(dbn, dbk, programs, dw)
    if dbk // 2 >= 64:
        add(dbn, dbk // 2, kernels.NORM_GEMV_PROGRAMS, dw)
    return out[:3] if DRY else out


def main(path, budget_s):
    old = _old()
    res = dict(device=torch.cuda.get_device_name() if not DRY else "cpu (interpreter)", dry=DRY,
               copy_GBps=None, rows=[], best={}, skipped=[])

    def dump():
        res["elapsed_s"] = time.perf_counter() - T0
        with open(path, "w") as f:
            json.dump(res, f)
    if not DRY:
        import kernels_bench as kb
        res["copy_GBps"] = kb.copy_bandwidth_GBps()
        print(f"{res['device']}: copy {res['copy_GBps']:.0f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(9)
    state = {}
    # 1. baselines: the twin, the old kernel, the new default
    for name, (N, K, has_norm) in USES.items():
        sets = 2 if DRY else max(2, min(16, math.ceil(150e6 / (N * K * 2))))
        ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to(DEV, DT) for _ in range(sets)]
        norm = None
        if has_norm:
            norm = model.RMSNorm(K, 1e-6, DEV, DT)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.1 * torch.randn(K, generator=gen))
        g = None if norm is None else norm.weight

        def twin(x, w, norm=norm):
            return F.linear(x if norm is None else norm(x), w)
        for M in ROWS:
            xs = [torch.randn(M, K, generator=gen).to(DEV, DT) for _ in range(sets)]
            ref = twin(xs[0], ws[0])
            cfg, slices = default_cfg(N, K, M)
            row = dict(use=name, M=M, N=N, K=K, default=list(cfg), default_slices=slices,
                       twin_us=timed([partial(twin, x, w) for x, w in zip(xs, ws)]),
                       old_us=timed([partial(old.norm_gemv, x, w, g, 1e-6) for x, w in zip(xs, ws)]),
                       old_err=rel_err(old.norm_gemv(xs[0], ws[0], g, 1e-6), ref),
                       new_us=timed([partial(kernels.norm_gemv, x, w, g, 1e-6) for x, w in zip(xs, ws)]),
                       new_err=rel_err(kernels.norm_gemv(xs[0], ws[0], g, 1e-6), ref))
            res["rows"].append(row)
            state[name, M] = (N, K, xs, ws, g, ref)
            print(f"{name:8s} M {M}: twin {row['twin_us']:6.2f} us  old {row['old_us']:6.2f} (err {row['old_err']:.1e})"
                  f"  new default {cfg} x{slices} {row['new_us']:6.2f} (err {row['new_err']:.1e})"
                  f"  floor {N * K * 2 / res['copy_GBps'] / 1e3 if res['copy_GBps'] else float('nan'):.2f}",
                  flush=True)
    dump()
    # 2. head_gemv: the old kernel, the new default, and its knobs, against the einsums with the model's copies
    H, d, R, C = HEADS["H"], HEADS["d"], HEADS["R"], HEADS["C"]
    kv_bs = [(torch.randn(H, 2 * d, C, generator=gen) / C ** 0.5).to(DEV, DT) for _ in range(2 if DRY else 8)]
    for M in ((1, 2) if DRY else (1, 2, 3, 4)):
        for name in ("W_uk", "W_uv"):
            if name == "W_uk":
                xs = [torch.randn(1, M, H, d + R, generator=gen).to(DEV, DT)[..., :d] for _ in kv_bs]
                wts = [kv[:, :d].transpose(1, 2) for kv in kv_bs]                       # [H, C, d], K strided

                def twin(x, kv):
                    return torch.einsum("bthd,hdc->bthc", x, kv[:, :d]).reshape(1, -1, H * C)
                knob, values = "HEAD_GEMV_BLOCK_N_STRIDED", (32, 64)
            else:
                xs = [torch.randn(1, M, H, C, generator=gen).to(DEV, DT) for _ in kv_bs]
                wts = [kv[:, d:] for kv in kv_bs]                                       # [H, d, C]

                def twin(x, kv):
                    return torch.einsum("bthc,hdc->bthd", x, kv[:, d:]).flatten(2)
                knob, values = "HEAD_GEMV_BLOCK_N", (8, 16)
            ref = twin(xs[0], kv_bs[0]).reshape(M, -1)
            row = dict(use=name, M=M, twin_us=timed([partial(twin, x, kv) for x, kv in zip(xs, kv_bs)]),
                       old_us=timed([partial(old.head_gemv, x, w) for x, w in zip(xs, wts)]),
                       old_err=rel_err(old.head_gemv(xs[0], wts[0]).reshape(M, -1), ref),
                       new_us=timed([partial(kernels.head_gemv, x, w) for x, w in zip(xs, wts)]),
                       new_err=rel_err(kernels.head_gemv(xs[0], wts[0]).reshape(M, -1), ref),
                       default=[getattr(kernels, knob), kernels.HEAD_GEMV_WARPS, kernels.NORM_GEMV_ACC_REGS])
            res["rows"].append(row)
            line = (f"{name} M {M}: einsum+copy {row['twin_us']:.2f} us  old {row['old_us']:.2f}  new default "
                    f"{row['new_us']:.2f} (err {row['new_err']:.1e});  block_n/warps/acc_regs:")
            keep = (getattr(kernels, knob), kernels.HEAD_GEMV_WARPS, kernels.NORM_GEMV_ACC_REGS)
            K, elem = xs[0].shape[-1], xs[0].element_size()

            def runs(bn, warps, regs):    # what head_gemv launches: (block_n, warps, its step)
                saved = kernels.NORM_GEMV_ACC_REGS
                kernels.NORM_GEMV_ACC_REGS = regs
                try:
                    return bn, warps, kernels._norm_gemv_step(M, bn, kernels.HEAD_GEMV_STEP_BYTES, warps, K, elem)
                finally:
                    kernels.NORM_GEMV_ACC_REGS = saved
            seen = {runs(*keep)}
            try:
                for bn, warps, regs in itertools.product(values, (4, 8), (64, 128)):
                    key = runs(bn, warps, regs)
                    if key in seen:
                        continue
                    seen.add(key)
                    setattr(kernels, knob, bn)
                    kernels.HEAD_GEMV_WARPS, kernels.NORM_GEMV_ACC_REGS = warps, regs
                    err = rel_err(kernels.head_gemv(xs[0], wts[0]).reshape(M, -1), ref)
                    us = timed([partial(kernels.head_gemv, x, w) for x, w in zip(xs, wts)])
                    res["rows"].append(dict(use=name, M=M, cfg=[bn, warps, regs], us=us, err=err))
                    line += f" {bn}/{warps}/{regs} (step {key[2]}) {us:.2f}"
            finally:
                setattr(kernels, knob, keep[0])
                kernels.HEAD_GEMV_WARPS, kernels.NORM_GEMV_ACC_REGS = keep[1], keep[2]
            print(line, flush=True)
    dump()
    # 3. norm_gemv grids
    for M in GRID_ROWS:
        for name in USES:
            N, K, xs, ws, g, ref = state[name, M]
            base = next(r for r in res["rows"] if r["use"] == name and r["M"] == M and "twin_us" in r)
            best = (base["new_us"], base["default"] + ["default"])
            cfgs = grid(N, K, M)
            for i, (bn, bk, programs, warps) in enumerate(cfgs):
                if time.perf_counter() - T0 > budget_s:
                    res["skipped"].append(dict(use=name, M=M, configs=len(cfgs) - i))
                    print(f"  {name} M {M}: {len(cfgs) - i} configurations skipped (past {budget_s} s)", flush=True)
                    break
                slices = kernels._k_slices(N, K, bn, bk, programs)[0]
                try:
                    err = rel_err(kernels.norm_gemv(xs[0], ws[0], g, 1e-6, bn, bk, programs, warps), ref)
                    us = timed([partial(kernels.norm_gemv, x, w, g, 1e-6, bn, bk, programs, warps)
                                for x, w in zip(xs, ws)])
                except Exception as e:    # noqa: BLE001 (a configuration the compiler refuses, say)
                    print(f"  {name} M {M} {bn, bk, programs, warps}: {type(e).__name__} {str(e)[:100]}", flush=True)
                    continue
                res["rows"].append(dict(use=name, M=M, cfg=[bn, bk, programs, warps], slices=slices, us=us, err=err))
                if us < best[0]:
                    best = (us, [bn, bk, programs, warps])
                print(f"  {name:8s} M {M} {bn:3d} {bk:5d} {programs:5d} x{slices:<2d} {warps}: {us:6.2f} us "
                      f"({N * K * 2 / us / 1e3:5.0f} GB/s) err {err:.1e}", flush=True)
            res["best"][f"{name} M {M}"] = dict(us=best[0], cfg=best[1], twin_us=base["twin_us"],
                                                old_us=base["old_us"], new_default_us=base["new_us"])
            print(f"BEST {name} M {M}: {best[1]} {best[0]:.2f} us  twin {base['twin_us']:.2f}  "
                  f"old {base['old_us']:.2f}  new default {base['new_us']:.2f}", flush=True)
            dump()
    print("\nsummary (us): use, rows: twin / old / new default / best [block_n, block_k, programs, warps]")
    for key, b in res["best"].items():
        print(f"  {key:14s} {b['twin_us']:6.2f} / {b['old_us']:6.2f} / {b['new_default_us']:6.2f} / "
              f"{b['us']:6.2f} {b['cfg']}")
    dump()
    print(f"done in {time.perf_counter() - T0:.0f} s: {path}", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--dry"]
    budget = 270.0
    if "--budget-s" in args:
        i = args.index("--budget-s")
        budget = float(args[i + 1])
        del args[i:i + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    main(args[0], budget)
