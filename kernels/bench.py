"""Micro-benchmarks of the kernels' Triton kernels on a GPU: each kernel against its plain twin
and its floor, captured in CUDA graphs and timed by device events (medians), the bytes of one
replay past the L2; achieved GB/s against the copy bandwidth measured in the same run.

    python -m kernels.bench [--moe | --small | --draft] [--sweep [VARIANTS]] [--variants dot,gemv]
    [--json OUT]
                            [--formats plain,fp8,int4] [--tokens 1,2,3,4,8,32] [--shared]
                            [--distinct 8,16,32] [--tp 8]
        --moe: the fused MoE only (each weight format, token count and variant against its floor);
        without it the MLA decode attention, the router, add + RMSNorm, SwiGLU, RoPE + cache
        write, norm_gemv (q_a + kv_a also with the input add + norm inside) and head_gemv follow.
        --small: the router, add + RMSNorm, SwiGLU, RoPE + cache write, norm_gemv and head_gemv
        only, at --tokens rows (default 1,4; --sweep: norm_gemv's block configurations).
        --draft: the EAGLE-3 head's step and extend, plain and with kernels.accelerate_draft's
        swaps.
    python -m kernels.bench --precision [--tokens 1,3,8,32] [--json OUT]
        the INT4 GEMV's packed form (bf16 activations) against its fp32 form: errors, no timing.
    python -m kernels.bench --router [--tokens 1,2,..] [--json OUT]
        the router kernel at 1 to 16 tokens (or those given), its selection in the logits
        kernel's last program and in a launch of its own (router.ROUTER_SELECT_MAX_TOKENS), 16
        routers in a graph (their weights past the L2).
    python -m kernels.bench --align [--tokens 4,8,16,32] [--json OUT]
        the tile variant's align (its two launches) at the bf16 layout's 129 experts and 9 a
        token and at 384 experts and 8 a token, with and without the adaptive variant's share.
    python -m kernels.bench [--json OUT] --pdl [RUN.PY FLAGS]
        run.py's captured phases with programmatic dependent launch off and on, in one process.
    python -m kernels.bench --mla-blocks [--json OUT]
        the MLA decode kernel at blocks of up to 32 and 16 query rows.
One mode a run (--moe, --small, --pdl, --mla-blocks, --draft, --router, --align,
--precision). Flags no run can use, and then a machine without CUDA, are refused
(argparse's usage and error, exit 2) before any timing.
"""
import math
import os
import shlex
import sys
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import kernels
import model
from kernels import (add_rmsnorm, common, head_gemv, mla, mla_decode_attention,
                     mla_rope_cache_write, norm_gemv, router, silu_mul)
from kernels.bench_moe import benchmark_moe, int4_precision
from kernels.bench_timing import copy_bandwidth_GBps, graph_ms, kernel_ms
from kernels.common import triton


# ---------------------------------------------------------------------------------------------
# The kernels other than the fused MoE (its benchmark: bench_moe.py, run by --moe here): each
# kernel against its plain twin, both captured in CUDA graphs and timed by events around replays
# (medians), the input sets rotated so that the bytes of one replay exceed the L2 (MLA: as many
# sets as 250 MB of the slots read need, at most 32, so a short cache's replay can stay in the L2:
# its rows say how many MB a replay reads); achieved GB/s against the measured copy bandwidth.


def _mla_n_sets(B, used):
    """Input sets of an MLA benchmark: as many as a replay reading 250 MB of cached slots needs,
    2 to 32."""
    return max(2, min(32, math.ceil(2.5e8 / (B * used * 576 * 2))))


def _mla_sets(B, T, S, used, n_sets, H=8, C=512, R=64, dtype=torch.bfloat16):
    """Input sets of mla_decode_attention on the GPU: each row's T new tokens end at slot used - 1
    of an S-slot cache."""
    table = torch.stack(model.rope_tables(R, 50000.0, None, S, "cuda"), -1)
    pos = (used - T + torch.arange(T, device="cuda")).expand(B, T).contiguous()
    new = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype)   # noqa: E731
    return [dict(q_lat=new(B, T, H, C), q_pe=new(B, T, H, R), kv=new(B, T, C), k_pe=new(B, T, R),
                 norm_weight=torch.ones(C, device="cuda",
                                        dtype=dtype), eps=1e-6, rope=table[pos], positions=pos,
                 kv_cache=new(B, S, C), pe_cache=new(B, S, R)) for _ in range(n_sets)]


def _mla_plain(s, scale):
    """The plain twin of one decode step's attention core: model.MLA.write_cache's lines, then
    model.absorbed_attention over the whole cache view, masked."""
    pos, kv_cache, pe_cache = s["positions"], s["kv_cache"], s["pe_cache"]
    rows = torch.arange(pos.shape[0], device="cuda").unsqueeze(1)
    kv_cache[rows, pos] = torch.nn.functional.rms_norm(s["kv"], s["norm_weight"].shape,
                                                       s["norm_weight"], s["eps"])
    pe_cache[rows, pos] = model.apply_rope(s["k_pe"], s["rope"])
    hidden = torch.arange(kv_cache.shape[1], device="cuda") > pos.unsqueeze(-1)
    return model.absorbed_attention(s["q_lat"], model.apply_rope(s["q_pe"], s["rope"]), kv_cache,
                                    pe_cache, hidden,
                                    scale)


# (cache slots, used)
MLA_POINTS = ((320, 256), (4096, 4096), (32768, 32768), (32768, 256), (32768, 4096))


def bench_mla(bw, rows, points=MLA_POINTS, shapes=((1, 1), (1, 4), (4, 1), (4, 4))):
    """mla_decode_attention (RoPE, cache write and attention in one kernel, then the merge) against
    its plain twin; "kernels alone": the profiled kernel time of one eager call
    (what run.py's component table sums), without the launch gaps a graph replay still has."""
    scale = 0.1
    print(f"\nMLA decode step, Kimi-K2 TP 8 (H=8, C=512, R=64), bf16; copy bandwidth {bw:.0f} GB/s")
    print(f"{'B':>2} {'T':>2} {'cache':>6} {'used':>6} {'MB read':>8} {'torch us':>9} "
          f"{'kernel us':>9} {'speedup':>7} {'kernel GB/s':>11} {'of copy':>7} "
          f"{'kernels alone us':>16}")
    for S, used in points:
        for B, T in shapes:
            # cache slots read + queries and output
            nbytes = B * used * 576 * 2 + 2 * B * T * 8 * 576 * 2
            sets = _mla_sets(B, T, S, used, _mla_n_sets(B, used))
            plain = graph_ms([partial(_mla_plain, s, scale) for s in sets])
            fast = graph_ms([partial(mla_decode_attention, **s, softmax_scale=scale)
                              for s in sets])
            alone = kernel_ms(partial(mla_decode_attention, **sets[0], softmax_scale=scale))[0]
            gbps = nbytes / fast / 1e6
            print(f"{B:>2} {T:>2} {S:>6} {used:>6} {nbytes / 1e6:>8.2f} {plain * 1e3:>9.1f} "
                  f"{fast * 1e3:>9.1f} {plain / fast:>6.1f}x {gbps:>11.0f} {gbps / bw:>6.0%} "
                  f"{alone * 1e3:>16.1f}")
            rows.append(dict(kernel="mla_decode", B=B, T=T, cache=S, used=used, bytes=nbytes,
                             torch_ms=plain, kernel_ms=fast, kernels_alone_ms=alone, GBps=gbps,
                             replay_MB=len(sets) * nbytes / 1e6))   # under 50: from the L2
            del sets


def bench_mla_block_m(out=None, blocks=(32, 16), points=MLA_POINTS[:4],
                      shapes=((1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 8), (4, 4))):
    """bench_mla once a block size: every launch at blocks of up to `block` query rows (both of
    kernels.mla.mla_block_m's limits set to it for the run): the data behind
    MLA_SHORT_CACHE_SLOTS. Each row carries its max_block_m."""
    saved, rows = (mla.MLA_MAX_BLOCK_M, mla.MLA_SHORT_BLOCK_M), []
    bw = copy_bandwidth_GBps()
    try:
        for block in blocks:
            mla.MLA_MAX_BLOCK_M = mla.MLA_SHORT_BLOCK_M = block
            print(f"\nquery rows a program: up to {block}")
            block_rows = []
            bench_mla(bw, block_rows, points, shapes)
            rows += [dict(r, max_block_m=block) for r in block_rows]
    finally:
        mla.MLA_MAX_BLOCK_M, mla.MLA_SHORT_BLOCK_M = saved
    _emit(rows, bw, out)


def bench_mla_merge_absorb(rows, points=((320, 256), (4096, 4096), (32768, 32768)),
                           shapes=((1, 1), (1, 4), (4, 1))):
    """The attention with W_uv's product after it, the two ways NormGemvMLA + DecodeAttentionKernel
    can run them: the merge launch then head_gemv (three launches), or the parts merged inside
    W_uv's launch (mla_merge_absorb: two; past its register budget it takes the three itself)."""
    scale = 0.1
    print("\nMLA decode step with W_uv (Kimi-K2 TP 8, bf16): the merge launch + head_gemv against "
          "the merge in W_uv's launch")
    # kv_b's value half
    w_uv = (torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5)[:, 128:]

    def launches(s):      # the merge launch, then W_uv's
        return head_gemv(mla_decode_attention(**s, softmax_scale=scale), w_uv)

    def merged(s):        # the merge inside W_uv's launch
        parts = mla_decode_attention(**s, softmax_scale=scale, merge=False)
        return kernels.mla_merge_absorb(parts, s["positions"], w_uv)

    for S, used in points:
        for B, T in shapes:
            sets = _mla_sets(B, T, S, used, _mla_n_sets(B, used))
            three = graph_ms([partial(launches, s) for s in sets]) * 1e3
            two = graph_ms([partial(merged, s) for s in sets]) * 1e3
            print(f"  B {B} T {T} cache {S:>6} used {used:>6}: merge launch + head_gemv "
                  f"{three:6.1f} us, merged in W_uv's launch {two:6.1f} us", flush=True)
            rows.append(dict(kernel="mla_merge_absorb", B=B, T=T, cache=S, used=used,
                             three_launches_us=three,
                             merged_us=two))
            del sets


# Sweep points of bench_mla_configs: at the long cache the tiles (BLOCK_N, num_stages, num_warps)
# with split lengths (None: the rule), at the short one the split lengths; the merge kernel's
# BLOCK_C beside. A split length changes no compiled kernel, the rest do (~1 s each).
MLA_SWEEP = {(32768, 1): dict(blocks=((64, 3, 8), (64, 3, 4), (32, 3, 8), (32, 3, 4)),
                              splits=(None, 128),
                              combine_block_c=(128,)),
             (32768, 4): dict(blocks=((64, 3, 8), (32, 3, 8)), splits=(None,),
                              combine_block_c=(128,)),
             (320, 1): dict(blocks=((64, 3, 8), (64, 3, 4), (32, 3, 8), (32, 3, 4)),
                            splits=(None, 32, 128),
                            combine_block_c=(128,)),
             (320, 4): dict(blocks=((64, 3, 8), (32, 3, 8)), splits=(None, 128),
                            combine_block_c=())}


def bench_mla_configs(rows, sweep=MLA_SWEEP):
    """Tile, pipeline depth, warps, split length and the merge's columns a program, at B = 1 on a
    cache of S slots all used (us a call, graph)."""
    print("\nMLA kernel configurations (B=1; us a call in a graph)")
    saved = (dict(mla.MLA_BLOCK_N), dict(mla.MLA_NUM_STAGES), mla.MLA_NUM_WARPS,
             mla.MLA_COMBINE_BLOCK_C)

    def time_it(sets, what, split=None):
        try:
            us = graph_ms([partial(mla_decode_attention, **s, softmax_scale=0.1, split_len=split)
                            for s in sets]) * 1e3
        # a configuration that does not fit (shared memory) is reported, not fatal
        except Exception as e:
            print(f"  {what}: {type(e).__name__}: {str(e)[:120]}")
            return
        print(f"  {what}: {us:7.1f} us", flush=True)
        rows.append(dict(kernel="mla_config", what=what, us=us))

    for (S, T), points in sweep.items():
        sets = _mla_sets(1, T, S, S, _mla_n_sets(1, S))
        print(f" T {T}, {S} slots used ({S * 576 * 2 / 1e6:.2f} MB)")
        for block_n, stages, warps in points["blocks"]:
            mla.MLA_BLOCK_N[torch.bfloat16], mla.MLA_NUM_STAGES[torch.bfloat16] = block_n, stages
            mla.MLA_NUM_WARPS = warps
            for split in points["splits"]:
                time_it(sets, f"T {T} S {S} BLOCK_N {block_n} stages {stages} warps {warps} "
                              f"split {split or 'rule'}", split)
        mla.MLA_BLOCK_N[torch.bfloat16], mla.MLA_NUM_STAGES[torch.bfloat16] = (
            saved[0][torch.bfloat16], saved[1][torch.bfloat16])
        mla.MLA_NUM_WARPS = saved[2]
        for block_c in points["combine_block_c"]:
            mla.MLA_COMBINE_BLOCK_C = block_c
            time_it(sets, f"T {T} S {S} default blocks, merge BLOCK_C {block_c}")
        mla.MLA_COMBINE_BLOCK_C = saved[3]
        del sets


def bench_router(tokens=(1, 2, 3, 4, 5, 6, 8, 12, 16)):
    """The router kernel at Kimi-K2's 384 experts, the model's routing and SIMULATED uniform, with
    the selection in the logits kernel's last program and in a launch of its own (a program a
    token), whatever router.ROUTER_SELECT_MAX_TOKENS says (from router.ROUTER_DOT_MIN_TOKENS the
    tensor cores' logits, the selection always apart: both columns time the same launches). A
    graph replays 16 routers, each with weights of its own (88 MB of bf16, past the L2), as a
    step reads its 60 layers' routers; no INT4 planes."""
    print("\nrouter, 384 experts, bf16 (us per call, in a graph of 16 routers): selection in the "
          "last program | in its own launch")
    routers, saved, rows = _routers(16), router.ROUTER_SELECT_MAX_TOKENS, []
    try:
        for N in tokens:
            xs = [torch.randn(N, 7168, device="cuda", dtype=torch.bfloat16) for _ in routers]
            for routing in ("model", "uniform"):
                times = []
                for r in routers:
                    r.routing = routing
                for limit in (router.ROUTER_GEMV_MAX_TOKENS, 0):   # in the last program, apart
                    router.ROUTER_SELECT_MAX_TOKENS = limit
                    times.append(graph_ms([partial(r, x) for r, x in zip(routers, xs)]))
                print(f"  N={N:2d} {routing:7s}: {times[0] * 1e3:6.1f} | {times[1] * 1e3:6.1f}")
                rows.append(dict(kernel="router", N=N, routing=routing,
                                 last_program_ms=times[0], own_launch_ms=times[1]))
    finally:
        router.ROUTER_SELECT_MAX_TOKENS = saved
    return dict(rows=rows, routers=len(routers), device=torch.cuda.get_device_name(),
                torch=torch.__version__)


def _align_draw(E, K):
    """One token's K expert ids: run.py's bf16 layout (E 129) has 8 routed and the shared expert,
    id 128, in every token; otherwise K of E."""
    if E == 129:
        shared = torch.full((1,), 128, device="cuda")
        return torch.cat([torch.randperm(128, device="cuda")[:K - 1], shared])
    return torch.randperm(E, device="cuda")[:K]


def bench_align(tokens=(4, 8, 16, 32), sets=8):
    """The tile variant's align (kernels.moe.align: its count and place launches), µs a call in a
    graph of `sets` calls on uniform routings of their own: run.py's bf16 layout (128 experts and
    the shared one as expert 129, 9 a token) and 384 experts, 8 a token; share 0 (the tile variant)
    and the adaptive variant's ADAPTIVE_SHARE."""
    print(f"\nalign (us per call, in a graph of {sets}): experts, a token's pairs, tokens, share")
    rows = []
    for E, K in ((129, 9), (384, 8)):
        for N in tokens:
            ids = [torch.stack([_align_draw(E, K) for _ in range(N)]).view(-1)
                   for _ in range(sets)]
            for share in (0, kernels.moe.ADAPTIVE_SHARE):
                us = graph_ms([partial(kernels.moe.align, i, E, share) for i in ids]) * 1e3
                print(f"  E={E:3d} K={K} N={N:2d} share {share}: {us:5.2f}")
                rows.append(dict(kernel="align", E=E, K=K, N=N, share=share, us=us))
    return dict(rows=rows, device=torch.cuda.get_device_name(), torch=torch.__version__)


def _routers(n):
    """n router kernels at Kimi-K2's shapes, each with random weights of its own."""
    args, out = model.ModelArgs(n_routed_experts=384), []
    for _ in range(n):
        r = kernels.RouterKernel(args, "cuda", torch.bfloat16)
        with torch.no_grad():
            r.weight.normal_(0, 0.01)
            r.e_score_correction_bias.normal_(0, 0.1)
        out.append(r)
    return out


def bench_small(rows, Ms=None):
    """Router (model and SIMULATED uniform routing), add + RMSNorm, SwiGLU, RoPE + cache write
    against their twins at Kimi-K2 TP 8 shapes."""
    print("\nsmall kernels, Kimi-K2 shapes, bf16 (us per call, in a graph; 8 input sets)")
    m = _small_modules()
    for N in Ms or (1, 4):
        for name, (plain_calls, fast_calls) in _small_pairs(m, N).items():
            plain, fast = graph_ms(plain_calls), graph_ms(fast_calls)
            print(f"  {name:32s} N={N}: torch {plain * 1e3:7.1f}  kernel {fast * 1e3:7.1f}  "
                  f"({plain / fast:.1f}x)")
            rows.append(dict(kernel=name, N=N, torch_ms=plain, kernel_ms=fast))


def _small_modules():
    """bench_small's modules and caches: the plain router and its kernel on the same weights,
    the layer norm and the latent norm, the RoPE table, the latent caches."""
    fast = _routers(1)[0]
    routers = {"torch": model.Router(fast.args, "cuda", torch.bfloat16), "triton": fast}
    routers["torch"].load_state_dict(fast.state_dict())
    norm = model.RMSNorm(7168, 1e-6, "cuda", torch.bfloat16)
    lat_norm = model.RMSNorm(512, 1e-6, "cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.fill_(1.0)
        lat_norm.weight.fill_(1.0)
    table = torch.stack(model.rope_tables(64, 50000.0, None, 4096, "cuda"), -1)
    kv_cache = torch.randn(4, 4096, 512, device="cuda", dtype=torch.bfloat16)
    pe_cache = torch.randn(4, 4096, 64, device="cuda", dtype=torch.bfloat16)
    return SimpleNamespace(routers=routers, norm=norm, lat_norm=lat_norm, table=table,
                           kv_cache=kv_cache, pe_cache=pe_cache)


def _small_pairs(m, N):
    """{name: (plain calls, kernel calls)} at N rows, one call per input set."""
    def randn(*shape):
        return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(8)]

    def router(x, impl, routing):
        m.routers[impl].routing = routing
        return m.routers[impl](x)

    def rope_plain(q_pe, kv, k_pe):
        rows_ = torch.arange(q_pe.shape[0], device="cuda").unsqueeze(1)
        m.kv_cache[rows_, pos] = m.lat_norm(kv)
        m.pe_cache[rows_, pos] = model.apply_rope(k_pe, rope)
        return model.apply_rope(q_pe, rope)

    def rope_kernel(q_pe, kv, k_pe):
        return mla_rope_cache_write(q_pe, kv, k_pe, m.lat_norm.weight, 1e-6, rope, pos,
                                    m.kv_cache, m.pe_cache)

    xs, ys, gate_ups = randn(N, 7168), randn(N, 7168), randn(N, 512)
    qs = [q[..., 128:] for q in randn(1, N, 8, 192)]
    kvs = [kv.split([512, 64], -1) for kv in randn(1, N, 576)]
    pos = (100 + torch.arange(N, device="cuda")).unsqueeze(0)
    rope = m.table[pos]
    return {
        "router (fp32 logits GEMV + selection)": (
            [partial(router, x, "torch", "model") for x in xs],
            [partial(router, x, "triton", "model") for x in xs]),
        "router, SIMULATED uniform routing": (
            [partial(router, x, "torch", "uniform") for x in xs],
            [partial(router, x, "triton", "uniform") for x in xs]),
        "SwiGLU silu * up, I 256": (
            [lambda g=g: F.silu(g[:, :256]) * g[:, 256:] for g in gate_ups],
            [lambda g=g: silu_mul(g[:, :256], g[:, 256:]) for g in gate_ups]),
        "add + RMSNorm": (
            [lambda x=x, y=y: m.norm(x + y) for x, y in zip(xs, ys)],
            [lambda x=x, y=y: add_rmsnorm(x, y, m.norm.weight, 1e-6) for x, y in zip(xs, ys)]),
        "RoPE + cache write": (
            [partial(rope_plain, q, *kv) for q, kv in zip(qs, kvs)],
            [partial(rope_kernel, q, *kv) for q, kv in zip(qs, kvs)]),
    }


def bench_norm_gemv(bw, rows, sweep=False, Ms=None):
    """norm_gemv at Kimi-K2 TP-8 shapes against the plain RMSNorm + cuBLAS: q_a + kv_a (stacked, no
    norm, as NormGemvMLA.q_kv_a), q_b with q_a_layernorm, o_proj (no norm); the weight sets rotated
    past the L2. head_gemv against the einsums with the copy the model makes of their permuted
    output (bench_head_gemv). Each at more than 1 row also with x's rows in smaller groups, a
    program a group (group_rows; None: the default, one group for norm_gemv, HEAD_GEMV_GROUP_ROWS
    for head_gemv), and norm_gemv in each form forced (dot False: the CUDA cores', True: the
    tensor cores'; None: its rule, gemv.NORM_GEMV_DOT_MIN_ROWS).
    sweep: block configurations too, among them K whole in a program (programs 1: no split of K,
    whatever the row blocks)."""
    print(f"\nnorm_gemv, Kimi-K2 TP 8, bf16 (us per call in a graph; GB/s of the weight; copy "
          f"{bw:.0f} GB/s)")
    dt = torch.bfloat16
    # (BLOCK_N, BLOCK_K, programs, group_rows, dot) at M 1; programs 1 keeps K whole in a program
    # (no split of K)
    sweep_points = [(16, 256, 1024, None, False), (64, 256, 1024, None, False),
                    (32, 256, 512, None, False), (32, 256, 2048, None, False),
                    (32, 512, 1024, None, False), (32, 256, 1, None, False)] if sweep else []
    for name, N, K, has_norm in (("q_a+kv_a", 2112, 7168, False), ("q_b", 1536, 1536, True),
                                 ("o_proj", 7168, 1024, False)):
        sets = max(2, min(16, math.ceil(150e6 / (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(sets)]
        norm = model.RMSNorm(K, 1e-6, "cuda", dt) if has_norm else None
        if norm is not None:
            with torch.no_grad():
                norm.weight.fill_(1.0)
        for M in Ms or (1, 4):
            xs = [torch.randn(M, K, device="cuda", dtype=dt) for _ in range(sets)]

            def plain(x, w):
                return torch.nn.functional.linear(x if norm is None else norm(x), w)
            base = graph_ms([partial(plain, x, w) for x, w in zip(xs, ws)]) * 1e3
            configs = ([(None, None, None, None, None)]
                       + [(None, None, None, r, False) for r in _group_sizes(M)]
                       + [(None, None, None, None, dot) for dot in (False, True)])
            for bn, bk, programs, group_rows, dot in configs + (sweep_points if M == 1 else []):
                g = None if norm is None else norm.weight
                try:
                    calls = [partial(norm_gemv, x, w, g, 1e-6, block_n=bn, block_k=bk,
                                     programs=programs, group_rows=group_rows, dot=dot)
                             for x, w in zip(xs, ws)]
                    us = graph_ms(calls) * 1e3
                except Exception as e:   # a configuration past the SM's shared memory, say
                    print(f"  {name:9s} M {M}  config {bn, bk, programs} group_rows "
                          f"{group_rows} dot {dot}: {type(e).__name__} {str(e)[:80]}")
                    continue
                print(f"  {name:9s} M {M}  config {bn, bk, programs} group_rows {group_rows} "
                      f"dot {dot}: "
                      f"kernel {us:6.1f} us ({N * K * 2 / us / 1e3:5.0f} GB/s)  twin {base:6.1f} "
                      f"us ({N * K * 2 / base / 1e3:5.0f} GB/s)", flush=True)
                rows.append(dict(kernel="norm_gemv", proj=name, M=M, config=[bn, bk, programs],
                                 group_rows=group_rows, dot=dot, us=us, twin_us=base))
    bench_input_norm_in_qkva(rows, Ms)
    bench_head_gemv(rows, Ms)


def bench_head_gemv(rows, Ms=None):
    """head_gemv at Kimi-K2 TP-8 heads (MLA's absorbed W_uk and W_uv, views of one kv_b_proj
    weight) against the einsums with the copy the model makes of their permuted output, in its
    default groups of rows and in groups of 1, 2, 4 and 8 below M."""
    dt = torch.bfloat16
    # W_uk, W_uv [H, 128, C] of one buffer
    kv_b = torch.randn(8, 256, 512, device="cuda", dtype=dt) / 512 ** 0.5
    w_uk, w_uv = kv_b.split([128, 128], 1)
    for M in Ms or (1, 4):
        for name, x, w, eq in (("q_lat (W_uk)",
                                torch.randn(M, 8, 192, device="cuda", dtype=dt)[..., :128],
                                w_uk.transpose(1, 2), "mhd,hcd->mhc"),
                               ("o (W_uv)", torch.randn(M, 8, 512, device="cuda", dtype=dt), w_uv,
                                "mhc,hdc->mhd")):
            def twin(x, w, eq):   # the einsum and the copy the model makes of its permuted output
                return torch.einsum(eq, x, w).contiguous()
            # 1 MB of weights: in L2 either way
            base = graph_ms([partial(twin, x, w, eq)] * 8) * 1e3
            for group_rows in [None] + _group_sizes(M):
                us = graph_ms([partial(head_gemv, x, w, group_rows=group_rows)] * 8) * 1e3
                print(f"  {name:12s} M {M} group_rows {group_rows}: kernel {us:6.1f} us  twin "
                      f"(einsum) {base:6.1f} us")
                rows.append(dict(kernel="head_gemv", proj=name, M=M, group_rows=group_rows,
                                 us=us, twin_us=base))


def _group_sizes(M):
    """The groups of rows a program tried at M rows beside the default: 1, 2, 4 and 8 below M."""
    return [r for r in (1, 2, 4, 8) if r < M]


def bench_input_norm_in_qkva(rows, Ms=None):
    """q_a + kv_a (Kimi-K2, stacked) with the layer's input residual add + RMSNorm inside the GEMV
    (norm_gemv with a residual, as kernels.InputNormInQKVA runs it) against the two launches it
    replaces: add_rmsnorm, then the GEMV without a norm; the weight sets rotated past the L2."""
    dt, N, K = torch.bfloat16, 2112, 7168
    sets = math.ceil(150e6 / (N * K * 2))
    ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(sets)]
    g = torch.ones(K, device="cuda", dtype=dt)

    def two_launches(x, r, w):
        return norm_gemv(add_rmsnorm(r, x, g, 1e-6)[1], w)
    for M in Ms or (1, 2, 3, 4):
        xs, rs = ([torch.randn(M, K, device="cuda", dtype=dt) for _ in range(sets)]
                  for _ in range(2))
        base = graph_ms([partial(two_launches, x, r, w) for x, r, w in zip(xs, rs, ws)]) * 1e3
        for group_rows in [None] + _group_sizes(M):
            us = graph_ms([partial(norm_gemv, x, w, g, 1e-6, residual=r, group_rows=group_rows)
                           for x, r, w in zip(xs, rs, ws)]) * 1e3
            print(f"  add+norm+q_a+kv_a M {M} group_rows {group_rows}: kernel {us:6.1f} us  twin "
                  f"(add_rmsnorm, then the GEMV) {base:6.1f} us", flush=True)
            rows.append(dict(kernel="norm_gemv", proj="add+norm+q_a+kv_a", M=M,
                             group_rows=group_rows, us=us, twin_us=base))


def _emit(rows, bw, out=None):
    """Print the rows as one JSON line (with the device, versions and copy bandwidth), and write it
    to out."""
    import json
    line = json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, command=_command,
                           copy_GBps=bw, rows=rows))
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")
    print(line)


def benchmark_attention(out=None, small_only=False, sweep=False, Ms=None):
    """The attention-side kernels against their twins (small_only: no MLA decode attention), Ms:
    the rows (tokens) each small kernel and GEMV is timed at (None: 1 and 4; the input norm
    inside q_a + kv_a 1 to 4)."""
    rows = []
    torch.manual_seed(0)
    bw = copy_bandwidth_GBps()
    bench_small(rows, Ms)
    bench_norm_gemv(bw, rows, sweep, Ms)
    if not small_only:
        bench_mla(bw, rows)
        bench_mla_merge_absorb(rows)
        bench_mla_configs(rows)
    _emit(rows, bw, out)


# ---------------------------------------------------------------------------------------------
# Programmatic dependent launch (python -m kernels.bench --pdl [RUN.PY FLAGS] [--json OUT]):
# run.py's model, built from the same flags (default: one SIMULATED TP-8 rank of Kimi-K2, bf16), and
# its isolated phases captured in one process once per setting of the kernels' module flags (PDL
# off: the kernels' grid-dependency instructions are then no-ops; on); the graphs replay in
# alternation, 20 replays a round, and their outputs must be equal bit for bit (deterministic
# kernels; a missed wait would show).

PDL_SETTINGS = {"off": dict(PDL=False, PREFETCH=False), "on": dict(PDL=True, PREFETCH=True)}


def _flat(out):
    return torch.cat([t.float().flatten() for t in (out if isinstance(out, tuple) else (out,))
                      if t is not None])


def benchmark_pdl(run_flags, settings=PDL_SETTINGS,
                  phases=("decode_step", "verify/decode", "draft_step"),
                  rounds=7, reps=20):
    import statistics

    import components
    import report
    import run
    import timing
    from graphs import CudaGraphs
    cfg = run.settle(run.parse_args(run_flags), torch.device("cuda"), 1)
    b = timing.prepare(cfg, torch.device("cuda"))
    calls = timing.phase_calls(b, cfg.context_len[0])
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__,
                  run_flags=run_flags, header=report.header(b), phases={})
    default = {name: getattr(common, name) for flags in settings.values() for name in flags}
    for phase in (p for p in phases if p in calls):
        key, fn, inputs = calls[phase]
        runners, outs = {}, {}
        # captured (and warmed up) with the launches they replay
        for setting, flags in settings.items():
            for name, value in {**default, **flags}.items():
                setattr(common, name, value)
            runners[setting] = CudaGraphs("cuda")
            outs[setting] = _flat(runners[setting].run(key, fn, *inputs))
        times = {setting: [] for setting in settings}
        for _ in range(rounds):
            for setting, runner in runners.items():
                graph = runner.graphs[key][0]
                stamps = [(torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
                          for _ in range(reps)]
                for a, z in stamps:
                    a.record()
                    graph.replay()
                    z.record()
                torch.cuda.synchronize()
                times[setting] += [a.elapsed_time(z) for a, z in stamps]
        for name, value in default.items():
            setattr(common, name, value)
        # the kernels' own time, as run.py's component table sums it (an eager profile, PDL off)
        prof = components.profile_components(b.target, partial(fn, *inputs), gpu=True)
        row = result["phases"][phase] = dict(kernel_ms=prof.kernel_ms, kernels=prof.kernels,
                                             parts_ms=prof.parts_ms)
        first = next(iter(settings))
        for setting, t in times.items():
            ms = statistics.median(t)
            row[setting] = dict(ms=ms, gaps_ms=ms - prof.kernel_ms,
                                outputs_equal=torch.equal(outs[setting], outs[first]))
        print(f"{phase}: {prof.kernels} kernels, {prof.kernel_ms:.4f} ms summed; " + ", ".join(
            f"{setting} {row[setting]['ms']:.4f} ms (gaps {row[setting]['gaps_ms']:.4f})"
            + ("" if row[setting]["outputs_equal"] else " OUTPUTS DIFFER") for setting in settings))
    for name, value in default.items():
        setattr(common, name, value)
    return result


# ---------------------------------------------------------------------------------------------
# The EAGLE-3 head (python -m kernels.bench --draft [--json PATH]): one Kimi-K2 TP-8 rank's head
# (SIMULATED rank: D 7168, 8 local heads of 128, draft vocab 32000) as run.py times it: the extend
# of k + 1 = 4 rows and one chain step after ctx cached tokens, captured in CUDA graphs, plain and
# with the head's swaps (all of them, and all but the attention kernel), against the floor (run.py's
# draft_bytes over the copy bandwidth of the same run); the kernels of one eager step (profiler);
# and the attention kernel alone over its split lengths at 32768 slots.

def _draft_heads(names_list, max_seq_len):
    from draft import Eagle3Draft, draft_preset
    from checkpoint import init_random_draft, preset
    from tp import TP
    args = preset("kimi-k2", num_hidden_layers=1)
    target = model.Transformer(args, 1, max_seq_len, "cuda", torch.bfloat16, TP.simulate(8))
    torch.nn.init.normal_(target.embed_tokens.weight)    # the head reads the target's embedding
    heads = {}
    for names in names_list:
        head = init_random_draft(Eagle3Draft(draft_preset("kimi-k2", eagle_config=None), target), 1,
                                 rank_local=True)
        heads[names] = head
        kernels.accelerate_draft(head, names if names in ("all", "none") else names.split("+"))
    return heads


def _step_kernels(fn):
    """(kernels launched, {name: (count, us)}) of one eager fn() on the device (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = {}
    for e in events:
        n, us = names.get(e.name[:60], (0, 0.0))
        names[e.name[:60]] = (n + 1, us + e.time_range.elapsed_us())
    return len(events), dict(sorted(names.items(), key=lambda kv: -kv[1][1]))


def bench_draft(out=None, contexts=(256, 32768), k=3):
    from components import draft_bytes
    from verify import kv_bucket
    bw = copy_bandwidth_GBps()
    variants = ("none", "add_rmsnorm+silu_mul+fused_proj", "all")
    max_seq = kv_bucket(max(contexts) + 2 * k + 1, 1 << 20)
    heads = _draft_heads(variants, max_seq)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for ctx in contexts:
        kvd = kv_bucket(ctx + 2 * k + 1, max_seq)
        toks = torch.randint(0, 163840, (1, k + 1), device="cuda", generator=g)
        pos = ctx + torch.arange(k + 1, device="cuda").unsqueeze(0)
        aux = torch.randn(1, k + 1, 3 * 7168, device="cuda", generator=g, dtype=torch.bfloat16)
        last = torch.full((1,), k, device="cuda")
        for names, head in heads.items():
            first, hidden = head.extend(toks, pos, aux, last, kv_len=kvd)
            calls = dict(draft_extend=lambda: head.extend(toks, pos, aux, last, kv_len=kvd),
                         draft_step=lambda: head.chain(first, hidden, pos[:, -1], 2, kv_len=kvd))
            for phase, fn in calls.items():
                ms = graph_ms([fn])
                T = k + 1 if phase == "draft_extend" else 1
                floor = draft_bytes(head, ctx + T, 1, with_fc=phase == "draft_extend",
                                    tokens=T) / bw / 1e6
                n, top = _step_kernels(fn)
                rows.append(dict(phase=phase, ctx=ctx, kernels=names, ms=ms, floor_ms=floor,
                                 x_floor=ms / floor,
                                 launches=n, top={name: [c, round(us, 2)]
                                                  for name, (c, us) in list(top.items())[:12]}))
                print(f"{phase:13s} ctx {ctx:6d} {names:34s} {ms * 1e3:8.1f} us  "
                      f"floor {floor * 1e3:6.1f}  {ms / floor:5.2f}x  {n} kernels")
    rows += _bench_draft_attention(bw)
    _emit(rows, bw, out)


def _bench_draft_attention(bw, S=32768, G=8, HD=128):
    """kernels.draft_attention alone at the head's shapes, each split length, 1 and 4 tokens, the
    whole cache in use: us and GB/s of cache read."""
    rows = []
    cos, sin = model.rope_tables(HD, 1e6, None, S, "cuda")
    caches = [torch.randn(1, S, G, HD, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for T in (1, 4):
        q = torch.randn(1, T, G, HD, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        pos = S - T + torch.arange(T, device="cuda").unsqueeze(0)
        rope = cos[pos], sin[pos]
        for split in (None, 512, 1024, 2048, 4096):
            ms = graph_ms([lambda: kernels.draft_attention(q, k, v, *rope, pos,
                                                            *caches, 0.088, split)])
            gbps = 2 * S * G * HD * 2 / ms / 1e6
            block_n = kernels.eagle.DRAFT_ATTN_BLOCK_N[torch.bfloat16]
            used = split or kernels.draft_split_len(S, G, block_n, torch.device("cuda"))
            rows.append(dict(kernel="draft_attention", S=S, T=T, split_len=used, us=ms * 1e3,
                             GBps=gbps,
                             of_copy=gbps / bw))
            print(f"draft_attention S {S} T {T} split {used:5d}: {ms * 1e3:6.1f} us  "
                  f"{gbps:6.0f} GB/s  ({gbps / bw:.0%} of copy)")
    return rows


def _parser():
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m kernels.bench",
        description="Each Triton kernel against its plain twin and its floor, on a GPU.")
    p.add_argument("--json", metavar="PATH",
                   help="write the results: PATH with _moe / _attention before .json")
    p.add_argument("--sweep", nargs="?", const="dot,gemv", default="", metavar="VARIANTS",
                   help="also time the fused MoE's block-size sweep points, at N = 1, 3 and 4 or "
                        "at --tokens, of these variants (comma-separated: dot, gemv, adaptive, "
                        "whose points are its GEMV launches' configs; dot,gemv without a value)")
    p.add_argument("--moe", action="store_true",
                   help="time the fused MoE only (not attention and the small kernels)")
    p.add_argument("--small", action="store_true",
                   help="time the small kernels and norm_gemv only (no MoE, no attention); with "
                        "--sweep, norm_gemv's block configurations")
    p.add_argument("--formats", default="plain,fp8,int4",
                   help="fused MoE weight formats, comma-separated (default plain,fp8,int4)")
    p.add_argument("--tokens", default=None,
                   help="fused MoE token counts, comma-separated (default 1,2,3,4,8,32); with "
                        "--small the rows of each small kernel and GEMV (default 1,4); with "
                        "--router its token counts (default 1 to 16)")
    p.add_argument("--shared", action="store_true",
                   help="INT4 and FP8: also with a bf16 shared expert in the GEMV launch, "
                        "and that shared expert alone through torch")
    p.add_argument("--distinct", default="", metavar="POOLS",
                   help="fused MoE routing: each token's experts drawn from a fixed random set "
                        "of this many (comma-separated pool sizes, SIMULATED; default uniform "
                        "over all 384)")
    p.add_argument("--tp", type=int, default=8, metavar="N",
                   help="fused MoE: a Kimi-K2 rank's expert shapes at TP N (I = 2048 / N; "
                        "default 8)")
    p.add_argument("--variants", default="dot,gemv",
                   help="fused MoE variants to time in this run, comma-separated: "
                        "dot (tl.dot tiles), gemv, adaptive (the tiles or the GEMV, chosen on "
                        "the device from the routing); default dot,gemv")
    p.add_argument("--pdl", nargs=argparse.REMAINDER, metavar="RUN.PY FLAGS",
                   help="time run.py's captured phases with programmatic dependent launch off "
                        "and on, in one process (the flags after it build run.py's model; last "
                        "on the line)")
    p.add_argument("--align", action="store_true",
                   help="the tile variant's align at 4, 8, 16, 32 tokens (or --tokens), 129 and "
                        "384 experts, with and without the adaptive variant's share")
    p.add_argument("--router", action="store_true",
                   help="the router kernel at 1 to 16 tokens (or --tokens), its selection in the "
                        "logits kernel's last program and in a launch of its own")
    p.add_argument("--precision", action="store_true",
                   help="the INT4 GEMV's packed form (bf16 activations) against its fp32 form, "
                        "beside the plain twin and the tiles, at --tokens (no timing)")
    p.add_argument("--mla-blocks", action="store_true",
                   help="the MLA decode kernel with blocks of up to 32 and of up to 16 query "
                        "rows a program, 1 to 8 tokens, 320 to 32768 slots")
    p.add_argument("--draft", action="store_true",
                   help="time the EAGLE-3 head only: its step and extend, plain and "
                                                       "with its swaps, and its attention kernel")
    return p


def _ints(p, flag, text):
    """A comma-separated list of integers, or the parser's error naming the flag."""
    try:
        return tuple(int(n) for n in text.split(",") if n)
    except ValueError:
        p.error(f"{flag} {text!r}: comma-separated integers")


def _save(path, result):
    """Write a benchmark's result as JSON where --json named a path, with the command that made it
    (a result that is a dict)."""
    if path:
        import json
        with open(path, "w") as f:
            json.dump(dict(result, command=_command) if isinstance(result, dict) else result, f)


_command = None   # the command line of this run (main), written into its JSON


def _with_part(path, part):
    """--json's PATH for one part of the run: x.json -> x_moe.json (x -> x_moe.json)."""
    root, ext = os.path.splitext(path)
    return f"{root}_{part}{ext or '.json'}"


MODES = ("--moe", "--small", "--pdl", "--mla-blocks", "--draft", "--router", "--align",
         "--precision")   # each runs its own benchmark; one a run


def check_flags(p, a):
    """The flags no run can use, refused by the parser (one line naming them, status 2) before
    the CUDA check and any timing: two modes at once, --json where no file can be written (each
    part's file lies in its folder), values outside what a benchmark takes."""
    given = [flag for flag in MODES if getattr(a, flag[2:].replace("-", "_")) not in (False, None)]
    if len(given) > 1:
        p.error(f"{' and '.join(given)}: each runs its own benchmark; give one of them")
    if a.json:
        import baseline
        try:
            baseline.check_writable("--json", a.json)
        except ValueError as e:
            p.error(str(e))
    variants, sweep = a.variants.split(","), [v for v in a.sweep.split(",") if v]
    if not set(variants) | set(sweep) <= {"dot", "gemv", "adaptive"}:
        p.error(f"--variants {a.variants!r}, --sweep {a.sweep!r}: choose from dot, gemv, adaptive")
    if not set(a.formats.split(",")) <= {"plain", "fp8", "int4"}:
        p.error(f"--formats {a.formats!r}: choose from plain, fp8, int4")
    if a.tp not in (1, 2, 4, 8):
        p.error(f"--tp {a.tp}: one of 1, 2, 4, 8 (Kimi-K2's expert width 2048 split evenly)")
    if any(not 8 <= n <= 384 for n in _ints(p, "--distinct", a.distinct)):
        p.error(f"--distinct {a.distinct!r}: pool sizes from K = 8 to E = 384")
    _ints(p, "--tokens", a.tokens or "")


def main(argv=None):
    global _command
    p = _parser()
    a = p.parse_args(argv)
    _command = shlex.join(["python", "-m", "kernels.bench", *(sys.argv[1:] if argv is None
                                                              else argv)])
    check_flags(p, a)
    if not torch.cuda.is_available():
        p.error("times the kernels on a CUDA GPU, and this machine has none")
    if a.pdl is not None:
        _save(a.json, benchmark_pdl(a.pdl))
        return
    if a.mla_blocks:
        bench_mla_block_m(a.json)
        return
    if a.draft:
        bench_draft(a.json)
        return
    if a.router:
        _save(a.json, bench_router(_ints(p, "--tokens", a.tokens)) if a.tokens
              else bench_router())
        return
    if a.align:
        _save(a.json, bench_align(_ints(p, "--tokens", a.tokens)) if a.tokens else bench_align())
        return
    sweep = tuple(v for v in a.sweep.split(",") if v)
    if a.small:
        benchmark_attention(a.json, small_only=True, sweep=bool(sweep),
                            Ms=a.tokens and _ints(p, "--tokens", a.tokens))
        return
    tokens = _ints(p, "--tokens", a.tokens or "1,2,3,4,8,32")
    if a.precision:
        _save(a.json, int4_precision(tokens))
        return
    _save(a.json and _with_part(a.json, "moe"),
          benchmark_moe(sweep=sweep, variants=tuple(a.variants.split(",")), tokens=tokens,
                        formats=tuple(a.formats.split(",")), I=2048 // a.tp, shared=a.shared,
                        distinct=_ints(p, "--distinct", a.distinct) or None,
                        sweep_tokens=tokens if a.tokens else (1, 3, 4)))
    if not a.moe:
        benchmark_attention(a.json and _with_part(a.json, "attention"))


if __name__ == "__main__":
    main()
