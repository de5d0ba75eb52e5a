"""The router: logits, then group-limited top-k selection and weights, and its swap."""
import torch

import model

from . import common, moe_gemv
from .common import (_counters, _jit, _pow2, _prefetch_matrix_rows, _wait_for_prior, launch,
                     tl, triton)
from .moe_gemv import _check_planes


# Router
#
# DeepSeek-V3's noaux_tc routing for few tokens (decode, verify) in two kernels. The logits x @ W^T
# in float32: W is [E, D] bf16 as the checkpoints store it (5.5 MB at Kimi-K2's 384 x 7168; float32
# where the model runs in float32), each element exact in float32, and must be read by many SMs at
# once, so programs take a block of experts and one of ROUTER_SPLIT_D slices of D each and store
# partial sums. The selection kernel, a program a token, then selects: the partial sums added,
# sigmoid scores, the correction bias added for selection only, groups kept by the sum of their
# two best biased scores (n_group > 1), the top K experts of the kept groups, their unbiased
# scores normalized and scaled. The same selection code can also run in the logits kernel's last
# program to finish (an atomic counter, as norm_gemv's), for every token in turn, saving a launch:
# up to ROUTER_SELECT_MAX_TOKENS tokens on a GPU (0: never; a serial tail, measured slower) and
# under Triton's CPU interpreter always in the chunks' kernel (the fewest interpreted ops). Past
# ROUTER_GEMV_MAX_TOKENS tokens cuBLAS computes the logits and the selection kernel selects. With
# UNIFORM (SIMULATED balanced routing, model.Router's routing "uniform") the choice is fixed
# instead: pair j = n*K + i of the N*K token-expert pairs goes to expert j mod E, weighed by that
# expert's unbiased score, normalized and scaled as usual; the logits are computed as always (their
# cost stays), only the top-k rounds are skipped.
# Two logits kernels by the tokens N. Up to ROUTER_DOT_MIN_TOKENS - 1 the chunks' kernel: every
# token meets the program's one weight tile in turn, ROUTER_CHUNK at a time, each token's dot
# products reduced across the program's warps, so the tile (ROUTER_TILE elements, the bytes a
# program has in flight) does not shrink with the tokens and a verify's router is one step a
# program, as a decode's; beside INT4 experts it also writes x as the INT4 GEMV's activation planes
# (router_topk's planes; SharedExpertInLaunch), which saves fused_moe its permute launch. From
# ROUTER_DOT_MIN_TOKENS the tensor cores' kernel: every token against the tile at once (tl.dot), no
# reduction across warps a token; the planes then by a copy.

# Past this many tokens cuBLAS's logits (and a copy into the INT4 GEMV's planes) before the
# selection kernel
ROUTER_GEMV_MAX_TOKENS = 32
# Up to this many tokens the logits kernel's last program selects; past it the selection kernel, a
# program a token. 0: on the H200 the launch of its own is as fast or faster at every count, under
# the model's routing and SIMULATED uniform (python -m kernels.bench --router, measured with a graph
# of 8 routers of float32 weights past the L2, 88 MB; bench_router's graph holds 16 of bf16 weights,
# the same bytes: 9.4 against 10.5 us at 1 token, the model's; BENCHMARKS.md, Kernel level). The
# INT4 decode step under the model's routing took 0.19 ms less with this 0 and one warp below than
# with 2 and four warps (3.725 -> 3.539 ms; verify 0.03-0.11 less at 2-32 tokens): the last
# program's selection is a serial tail after every logits program. Under Triton's CPU interpreter
# the last program still selects (_select_in_kernel).
ROUTER_SELECT_MAX_TOKENS = 0
# warps of the selection kernel's program: its K rounds of max, first index and weight are
# reductions over the E scores, on one warp by shuffles alone, on more also across warps through
# shared memory (4 warps: 1.0-1.3 us more at 1-32 tokens under the model's routing, the same
# under uniform; python -m kernels.bench --router)
ROUTER_SELECT_WARPS = 1
# D slices, at most: one step of a tile a program (7 slices of 1024: 672 programs for 384
# experts, 224 for 128) (python -m kernels.bench --small)
ROUTER_SPLIT_D = 8
# The chunks' kernel (measured with float32 weights; µs a call: python -m kernels.bench --router
# with a graph of 8 such routers past the L2, 88 MB (bench_router's graph holds 16 of bf16 weights,
# the same bytes), 384 experts; verify: run.py's sweep, 61 routers; BENCHMARKS.md: Verify sweep,
# Kept): 4 experts a program, a tile of 4096 elements (1024 columns of D a step, 64 a thread) on 2
# warps, 4 tokens at a time. 8 experts and 8192 elements on 4 warps, 8 tokens at a time, were
# 0.3-4.6 us slower a call at every count (verify 0.11-0.24 ms more at 10-12 tokens, 0.02-0.08 at
# 5-8, in every format). All 16 tokens at once on 8 warps took 33 us at 12 tokens against 14 at 8.
# With bf16 weights (a tile half the bytes) 8192 elements on 2 or 4 warps were 0.2-0.4 us faster at
# 1-4 tokens under the model's routing, 0.2-0.5 slower under uniform and 0.3-2.0 slower at 8-12
# (BENCHMARKS.md, Tried and not kept).
ROUTER_BLOCK_E = 4          # experts a program
ROUTER_TILE = 4096          # elements of the [experts, D] weight tile a program holds
ROUTER_WARPS = 2            # its warps: a token's sums reduced across them
ROUTER_CHUNK = 4            # tokens a program takes at once against its tile (loads in flight)
# From this many tokens to ROUTER_GEMV_MAX_TOKENS the tensor cores' kernel (_router_dot_kernel),
# then the selection kernel. ROUTER_DOT = (BLOCK_E experts a program, BLOCK_D columns a step,
# warps, D slices at most). With float32 weights, without the planes 14.4-15.1 us a call at 9-32
# tokens (9.3-9.6 at 16-32 with bf16 weights, one tf32 product a step) against the chunks' 15.7,
# 18.0, 22.5 and 27.0 at 12, 16, 24 and 32 (on 8 warps 23-24, with 28 slices of D
# 16-29, 32 experts a program 16-25). Beside INT4 experts, the planes stored by a copy: verify
# 0.16-0.96 ms less at 16-32 tokens than the chunks' kernel writing them (8 experts, 8192
# elements, 4 warps, 8 tokens at a time). Storing the planes inside it took 27-53 us a call;
# inside the chunks' 4-expert form, 7-17 us a call more at 16-32 (205 registers a thread against
# 120 without; on 4 warps 96, yet as slow: not explained).
ROUTER_DOT_MIN_TOKENS = 13
ROUTER_DOT = (16, 128, 4, 8)


@_jit
def _router_kernel(x_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, ids_ptr, wout_ptr, v_ptr, N, E, D,
                   d_per_split,
                   s_xn, s_we, s_ps, s_pn, s_idn, s_wn, E_PER_G, G, scale,
                   SPLITS: tl.constexpr, PLANES: tl.constexpr, K: tl.constexpr,
                   TOPK_GROUP: tl.constexpr,
                   NORM: tl.constexpr, GROUPED: tl.constexpr, UNIFORM: tl.constexpr,
                   SHARED: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_G: tl.constexpr,
                   BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr, SELECT: tl.constexpr,
                   CHUNK: tl.constexpr, PREFETCH: tl.constexpr):
    """part[j, n, e] = sum over d in slice j of x[n, d] * W[e, d] in float32 (CHUNK tokens at a
    time, _router_chunk), then (SELECT), in the last program, _router_select over all N (<=
    BLOCK_N) tokens. x [N, D] (any float dtype), W [E, D] bf16 or float32, part [SPLITS, N, E]
    float32 (last dims contiguous), count one int32 zero. PLANES: the programs of expert block 0
    also write their slice of x as the INT4 GEMV's activation (fused_moe's planes,
    moe_gemv.activation_planes): 1, fp32 nibble planes [N, 8, D/8]; 2, bf16 pair planes (v_ptr a
    bf16 view of them). PREFETCH: the bytes of each of its W rows a program asks the L2 for
    before its wait (common._prefetch_matrix_rows). Grid: (cdiv(E, BLOCK_E), SPLITS)."""
    eb, j = tl.program_id(0), tl.program_id(1)
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    d_end = tl.minimum((j + 1) * d_per_split, D)
    _prefetch_matrix_rows(w_ptr, e, E, s_we, j * d_per_split, d_end, PREFETCH)
    _wait_for_prior()
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    # one step a program up to ROUTER_GEMV_MAX_TOKENS tokens
    for d0 in range(j * d_per_split, d_end, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        w = _weight_tile(w_ptr, e, E, d, d_end, s_we)
        if BLOCK_N <= CHUNK:  # one chunk, unrolled (c a constant)
            acc = _router_chunk(acc, x_ptr, v_ptr, 0, N, D, d, d_end, w, n, eb, s_xn, PLANES,
                                CHUNK)
        else:
            for c in range(0, N, CHUNK):  # each token against the same tile, CHUNK at a time
                acc = _router_chunk(acc, x_ptr, v_ptr, c, N, D, d, d_end, w, n, eb, s_xn, PLANES,
                                    CHUNK)
    _store_part(part_ptr, acc, j, n, N, e, E, s_ps, s_pn)
    if not SELECT:   # the selection kernel selects, launched next
        return
    # common._last_program's handshake, written out: the grid's size is read after the counter's
    # add, where a call would read it before the barrier (its argument)
    tl.debug_barrier()  # every thread's stores before the counter's release
    if tl.atomic_add(count_ptr, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")  # the last program: every partial sum is stored
        _router_select(part_ptr, bias_ptr, ids_ptr, wout_ptr, 0, N, s_ps, s_pn, s_idn, s_wn,
                       E_PER_G, G, scale,
                       SPLITS, K, TOPK_GROUP, NORM, GROUPED, UNIFORM, SHARED, BLOCK_N, BLOCK_G,
                       BLOCK_EG, BLOCK_K)


@_jit
def _weight_tile(w_ptr, e, E, d, d_end, s_we):
    """The logits kernels' weight tile: W [E, D] (bf16 or float32) at experts e and columns d (those
    below d_end, the end of the program's slice), zero elsewhere, [len(e), len(d)] float32."""
    return tl.load(w_ptr + e[:, None] * s_we + d[None, :],
                   mask=(e < E)[:, None] & (d < d_end)[None, :], other=0.0).to(tl.float32)


@_jit
def _store_part(part_ptr, acc, j, n, N, e, E, s_ps, s_pn):
    """The logits kernels' partial sums acc [len(n), len(e)] of slice j into part [SPLITS, N, E]."""
    tl.store(part_ptr + j * s_ps + n[:, None] * s_pn + e[None, :], acc,
             mask=(n < N)[:, None] & (e < E)[None, :])


@_jit
def _router_chunk(acc, x_ptr, v_ptr, c, N, D, d, d_end, w, n, eb, s_xn, PLANES: tl.constexpr,
                  CHUNK: tl.constexpr):
    """_router_kernel's tokens c .. c + CHUNK - 1 (those < N) against its weight tile w [BLOCK_E,
    BLOCK_D] at columns d: each token's dot products added into its row of acc [BLOCK_N, BLOCK_E],
    and (PLANES, expert block eb 0) its slice of x stored as the INT4 GEMV's planes."""
    for i in tl.static_range(CHUNK):
        t = c + i
        ok = (t < N) & (d < d_end)[None, :]
        x = tl.load(x_ptr + t * s_xn + d[None, :], mask=ok, other=0.0).to(tl.float32)  # [1, BD]
        acc = tl.where(n[:, None] == t, acc + tl.sum(x * w, 1)[None, :], acc)
        if PLANES == 1:
            if eb == 0:
                tl.store(v_ptr + t * D + (d % 8 * (D // 8) + d // 8)[None, :], x, mask=ok)
        elif PLANES == 2:
            if eb == 0:
                pos = 2 * (d % 4 * (D // 8) + d // 8) + d % 8 // 4
                tl.store(v_ptr + t * D + pos[None, :], x.to(tl.bfloat16), mask=ok)
    return acc


@_jit
def _router_dot_kernel(x_ptr, w_ptr, part_ptr, N, E, D, d_per_split, s_xn, s_we, s_ps, s_pn,
                       EXACT_X: tl.constexpr, EXACT_W: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr):
    """part[j, n, e] as _router_kernel's, every token at once: x [BLOCK_N, BLOCK_D] times the
    weight tile [BLOCK_E, BLOCK_D] transposed by tl.dot, BLOCK_D columns a step over slice j, no
    reduction across warps a token. EXACT_X (x bf16 or fp16, exact in tf32): on the tensor cores,
    each product exact and accumulated in float32: one tf32 product where W is exact in tf32 too
    (EXACT_W: W bf16), else W as its tf32 high part plus the rest, two tf32 products whose sum
    holds W to about 2^-21 of itself; without EXACT_X (float32 x) float32 products. No
    INT4 planes, no selection: the selection kernel follows. PREFETCH: as _router_kernel's.
    Grid: (cdiv(E, BLOCK_E), SPLITS)."""
    eb, j = tl.program_id(0), tl.program_id(1)
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    d_end = tl.minimum((j + 1) * d_per_split, D)
    _prefetch_matrix_rows(w_ptr, e, E, s_we, j * d_per_split, d_end, PREFETCH)
    _wait_for_prior()
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    for d0 in range(j * d_per_split, d_end, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        w = _weight_tile(w_ptr, e, E, d, d_end, s_we)
        ok = (n < N)[:, None] & (d < d_end)[None, :]
        x = tl.load(x_ptr + n[:, None] * s_xn + d[None, :], mask=ok, other=0.0).to(tl.float32)
        if EXACT_X and EXACT_W:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32")
        elif EXACT_X:
            hi = (w.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            acc = tl.dot(x, tl.trans(hi), acc, input_precision="tf32")
            acc = tl.dot(x, tl.trans(w - hi), acc, input_precision="tf32")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    _store_part(part_ptr, acc, j, n, N, e, E, s_ps, s_pn)


@_jit
def _router_select_kernel(part_ptr, bias_ptr, ids_ptr, wout_ptr, N, s_ps, s_pn, s_idn, s_wn,
                          E_PER_G, G, scale,
                          SPLITS: tl.constexpr, K: tl.constexpr, TOPK_GROUP: tl.constexpr,
                          NORM: tl.constexpr, GROUPED: tl.constexpr, UNIFORM: tl.constexpr,
                          SHARED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """_router_select for token n = program_id(0) from the logits as SPLITS partial sums [SPLITS,
    N, E] float32 (the logits kernel's part; cuBLAS's whole logits: SPLITS 1). Grid: (N,)."""
    _wait_for_prior()
    _router_select(part_ptr, bias_ptr, ids_ptr, wout_ptr, tl.program_id(0), N, s_ps, s_pn, s_idn,
                   s_wn, E_PER_G, G,
                   scale, SPLITS, K, TOPK_GROUP, NORM, GROUPED, UNIFORM, SHARED, 1, BLOCK_G,
                   BLOCK_EG, BLOCK_K)


@_jit
def _router_select(part_ptr, bias_ptr, ids_ptr, wout_ptr, n0, N, s_ps, s_pn, s_idn, s_wn, E_PER_G,
                   G, scale,
                   SPLITS: tl.constexpr, K: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   NORM: tl.constexpr,
                   GROUPED: tl.constexpr, UNIFORM: tl.constexpr, SHARED: tl.constexpr,
                   BLOCK_N: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    """ids[n], wout[n] = the K experts of tokens n = n0 .. n0 + BLOCK_N - 1 (those < N) and their
    weights, best first (UNIFORM: experts (n*K + i) mod E, i < K), then with SHARED expert E and
    weight 1 in column K. part [SPLITS, N, E] float32 partial sums of the logits (E = G * E_PER_G,
    expert e = g * E_PER_G + j; read from L2: another program stored them), bias [E] float32; ids
    [N, K (+1)] int64, wout [N, K (+1)] float32."""
    n = n0 + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    if UNIFORM:   # the fixed choice; the chosen experts' logits gathered from the partial sums
        ids = (n[:, None] * K + k[None, :]) % (G * E_PER_G)  # [BLOCK_N, BLOCK_K]
        logit = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for s in tl.static_range(SPLITS):
            logit += tl.load(part_ptr + s * s_ps + n[:, None] * s_pn + ids, mask=(n < N)[:, None],
                             other=0.0,
                             cache_modifier=".cg")
        w = tl.sigmoid(logit)
    else:
        g = tl.arange(0, BLOCK_G)[None, :, None]
        j = tl.arange(0, BLOCK_EG)[None, None, :]
        e = g * E_PER_G + j  # [1, BLOCK_G, BLOCK_EG] expert ids
        ok = (n < N)[:, None, None] & (g < G) & (j < E_PER_G)  # [BLOCK_N, BLOCK_G, BLOCK_EG]
        logit = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_EG], tl.float32)
        for s in tl.static_range(SPLITS):
            logit += tl.load(part_ptr + s * s_ps + n[:, None, None] * s_pn + e, mask=ok, other=0.0,
                             cache_modifier=".cg")
        ids, w = _top_k(tl.sigmoid(logit), bias_ptr, e, ok, g, j, G, E_PER_G, k, K, TOPK_GROUP,
                        GROUPED, BLOCK_N,
                        BLOCK_G, BLOCK_EG, BLOCK_K)
    w = tl.where(k[None, :] < K, w, 0.0)
    if NORM:
        w = w / (tl.sum(w, 1) + 1e-20)[:, None]
    out = (n < N)[:, None] & (k < K)[None, :]
    tl.store(ids_ptr + n[:, None] * s_idn + k[None, :], ids.to(tl.int64), mask=out)
    tl.store(wout_ptr + n[:, None] * s_wn + k[None, :], w * scale, mask=out)
    if SHARED:  # the shared expert as expert E of the fused MoE launch, weight 1
        tl.store(ids_ptr + n * s_idn + K, tl.zeros([BLOCK_N], tl.int64) + G * E_PER_G, mask=n < N)
        tl.store(wout_ptr + n * s_wn + K, tl.full([BLOCK_N], 1.0, tl.float32), mask=n < N)


@_jit
def _top_k(score, bias_ptr, e, ok, g, j, G, E_PER_G, k, K: tl.constexpr, TOPK_GROUP: tl.constexpr,
           GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
           BLOCK_EG: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """noaux_tc selection from the scores [BLOCK_N, BLOCK_G, BLOCK_EG], every token at once: (ids
    [BLOCK_N, BLOCK_K] int32, their unbiased scores)."""
    biased = tl.where(ok, score + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
    if GROUPED:  # keep the TOPK_GROUP groups whose two best biased scores sum highest
        best = tl.argmax(biased, 2)                                       # [BLOCK_N, BLOCK_G]
        second = tl.max(tl.where(j == best[:, :, None], float("-inf"), biased), 2)
        gid = tl.arange(0, BLOCK_G)[None, :]
        gscore = tl.where(gid < G, tl.max(biased, 2) + second, float("-inf"))
        keep = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = gid == tl.argmax(gscore, 1)[:, None]
            keep = keep | top
            gscore = tl.where(top, float("-inf"), gscore)
        biased = tl.where(keep[:, :, None], biased, float("-inf"))
    # K rounds on the [BLOCK_N, BLOCK_G, BLOCK_EG] scores as they are: each the best score, the
    # first expert holding it (argmax's tie rule), then that expert masked. (Reshaping them to
    # [BLOCK_N, BLOCK_G * BLOCK_EG] for one argmax selected wrong experts on the H200 at BLOCK_N 2
    # with groups: test_router_kernel_equals_twin[deepseek-v3].)
    flat = g * BLOCK_EG + j   # [1, BLOCK_G, BLOCK_EG]
    ids = tl.zeros([BLOCK_N, BLOCK_K], tl.int32)
    w = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in tl.static_range(K):  # the top K, best first
        best = tl.max(tl.max(biased, 2), 1)[:, None, None]
        top = tl.min(tl.min(tl.where(biased == best, flat, BLOCK_G * BLOCK_EG), 2), 1)[:, None]
        hit = flat == top[:, :, None]
        ids = tl.where(k[None, :] == i, top // BLOCK_EG * E_PER_G + top % BLOCK_EG, ids)
        w = tl.where(k[None, :] == i, tl.sum(tl.sum(tl.where(hit, score, 0.0), 2), 1)[:, None], w)
        biased = tl.where(hit, float("-inf"), biased)
    return ids, w


def _select_in_kernel(N, device):
    """Whether the logits kernel's last program selects for the N tokens (else the selection
    kernel, a program a token): up to ROUTER_SELECT_MAX_TOKENS on a GPU; always under Triton's CPU
    interpreter, which runs programs one by one (one program: the fewest interpreted ops)."""
    return N <= ROUTER_SELECT_MAX_TOKENS or device.type != "cuda"


def router_topk(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling, uniform=False,
                shared_slot=False, planes=None):
    """model.Router.forward in a logits kernel and a selection kernel (past ROUTER_GEMV_MAX_TOKENS
    tokens: cuBLAS's logits; see the section above): x [N, D], weight [E, D] bf16 or float32,
    bias [E] float32 -> ids int64 [N, K], weights float32 [N, K]. uniform: SIMULATED balanced
    routing (pair j = n*K + i to expert j mod E), as model.Router's routing "uniform";
    shared_slot: a column K more, expert E with weight 1 (the shared expert in the fused MoE
    launch); both in the same kernels. planes: a tensor from moe_gemv.empty_planes(x) that
    receives x as the INT4 GEMV's activation planes (fused_moe's planes), written by the logits
    kernel (past ROUTER_GEMV_MAX_TOKENS: a copy)."""
    N, D = x.shape
    E = weight.shape[0]
    if (weight.dtype not in (torch.float32, torch.bfloat16) or bias.dtype != torch.float32
            or weight.shape != (E, D) or bias.shape != (E,)):
        raise ValueError(f"router_topk: needs a bf16 or float32 weight [E, {D}] and a float32 "
                         f"bias [E], got {weight.dtype} {list(weight.shape)} and {bias.dtype} "
                         f"{list(bias.shape)} (float64: use the plain path)")
    if weight.stride(1) != 1:
        raise ValueError(f"router_topk: weight's rows must be contiguous (stride 1), got strides "
                         f"{weight.stride()}")
    common.check_unit_stride("router_topk", "bias", bias)
    if (E % n_group or not 1 <= topk_group <= n_group or top_k > E // n_group * topk_group
            or n_group > 1 and E // n_group < 2):   # a group scores by its two best experts
        raise ValueError(f"router_topk: {E} experts in {n_group} groups, {topk_group} kept, "
                         f"cannot give top {top_k} (groups of at least 2)")
    if planes is not None:
        _check_planes(planes, x)
    ids = torch.empty(N, top_k + bool(shared_slot), device=x.device, dtype=torch.int64)
    weights = torch.empty(N, top_k + bool(shared_slot), device=x.device, dtype=torch.float32)
    if N == 0:
        return ids, weights
    select = dict(K=top_k, TOPK_GROUP=topk_group, NORM=bool(norm_topk_prob), GROUPED=n_group > 1
                  and not uniform,
                  UNIFORM=bool(uniform), SHARED=bool(shared_slot), BLOCK_G=_pow2(n_group, 1),
                  BLOCK_EG=_pow2(E // n_group, 1), BLOCK_K=_pow2(top_k, 1))
    if N > ROUTER_GEMV_MAX_TOKENS:
        logits = torch.nn.functional.linear(x.float(), weight.float())
        _router_select_kernel[(N,)](logits, bias, ids, weights, N, 0, logits.stride(0),
                                    ids.stride(0), weights.stride(0),
                                    E // n_group, n_group, float(scaling), SPLITS=1, **select,
                                    launch_pdl=common.PDL, num_warps=ROUTER_SELECT_WARPS)
        if planes is not None:
            moe_gemv.activation_planes(x, planes)
        return ids, weights
    _router_gemv(x, weight, bias, ids, weights, planes, n_group, float(scaling), select)
    return ids, weights


def _router_gemv(x, weight, bias, ids, weights, planes, n_group, scaling, select):
    """router_topk up to ROUTER_GEMV_MAX_TOKENS tokens into ids and weights: the logits kernel,
    selecting in its last program or followed by the selection kernel (_select_in_kernel); from
    ROUTER_DOT_MIN_TOKENS the tensor cores' logits kernel (and a copy into the planes), then the
    selection kernel."""
    (N, D), E = x.shape, weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    dot = N >= ROUTER_DOT_MIN_TOKENS
    in_kernel = _select_in_kernel(N, x.device) and not dot
    if dot:
        block_e, block_d, warps, split_d = ROUTER_DOT
    else:
        block_e, block_d = ROUTER_BLOCK_E, ROUTER_TILE // ROUTER_BLOCK_E
        warps, split_d = ROUTER_WARPS, ROUTER_SPLIT_D
    d_per_split = triton.cdiv(triton.cdiv(D, split_d), block_d) * block_d
    splits = triton.cdiv(D, d_per_split)
    part = torch.empty(splits, N, E, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(E, block_e), splits)
    prefetch = common.prefetch_bytes(d_per_split * weight.element_size())
    if dot:
        _router_dot_kernel[grid](
            x, weight, part, N, E, D, d_per_split, x.stride(0), weight.stride(0), part.stride(0),
            part.stride(1), EXACT_X=x.dtype in (torch.bfloat16, torch.float16),
            EXACT_W=weight.dtype == torch.bfloat16,
            BLOCK_N=_pow2(N, 16), BLOCK_E=block_e, BLOCK_D=block_d, PREFETCH=prefetch,
            launch_pdl=common.PDL, num_warps=warps)
        if planes is not None:
            moe_gemv.activation_planes(x, planes)
    else:
        v, kind = part, 0                      # (v is never read without planes)
        if planes is not None:                 # pair planes (int32): the kernel stores bf16 halves
            v, kind = ((planes.view(torch.bfloat16), 2) if planes.dtype == torch.int32
                       else (planes, 1))
        _router_kernel[grid](
            x, weight, part, _counters(x.device), bias, ids, weights, v, N, E, D,
            d_per_split, x.stride(0), weight.stride(0), part.stride(0), part.stride(1),
            ids.stride(0), weights.stride(0), E // n_group, n_group, scaling, SPLITS=splits,
            PLANES=kind, BLOCK_N=_pow2(N, 1), BLOCK_E=block_e, BLOCK_D=block_d, **select,
            SELECT=in_kernel, CHUNK=min(_pow2(N, 1), ROUTER_CHUNK), PREFETCH=prefetch,
            launch_pdl=common.PDL, num_warps=warps)
    if not in_kernel:
        _router_select_kernel[(N,)](part, bias, ids, weights, N, part.stride(0), part.stride(1),
                                    ids.stride(0), weights.stride(0), E // n_group, n_group,
                                    scaling, SPLITS=splits, **select,
                                    launch_pdl=common.PDL, num_warps=ROUTER_SELECT_WARPS)

launch.router_topk = router_topk

class RouterKernel(model.Router):
    """"router": logits, selection and weights in Triton (SIMULATED uniform routing too).
    shared_slot: one more column, expert E with weight 1 for every token ([N, K + 1]), made in the
    same kernels (SharedExpertInLaunch). A choice made outside (routing "distinct", "trace":
    model.Router's `choice`): the kernel routes as the model's router, then the choice is copied
    over its first K columns; the weights stay those of the router's own picks, as model.Router
    keeps them."""

    def forward(self, x, shared_slot=False, planes=None):
        a = self.args
        K = a.num_experts_per_tok
        ids, weights = launch.router_topk(
            x, self.weight, self.e_score_correction_bias, K, a.n_group, a.topk_group,
            a.norm_topk_prob, a.routed_scaling_factor, uniform=self.routing == "uniform",
            shared_slot=shared_slot, planes=planes)
        if self.choice is not None:
            ids[:, :K].copy_(self.choice(ids[:, :K]))
        return ids, weights

