"""Routed experts: fused_moe (its tile variant here, its GEMV variant in moe_gemv.py) and the
experts swaps (GroupedExperts, FusedExperts, SharedExpertInLaunch)."""
import torch
import torch.nn.functional as F

import model

from . import common, moe_gemv
from .stacked import stack_rows
from .common import (HAVE_TRITON, AttachAgain, _jit, _silu_mul, _wait_for_prior, interpreting, tl,
                     triton)
from .moe_gemv import (FORMATS, GEMV_MAX_PAIRS, SHARED_SPLIT, ExpertWeights, _check_planes,
                       _gemv_configs, _weight_args, gemv_max_tokens)


# y[n] = sum_k w[n, k] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, k]
#
# The tile variant (the GEMV variant, moe_gemv.py, serves a few tokens: gemv_max_tokens).
# Launches of a fixed grid for given (N, K, E): align (sort the P pairs by expert on the device,
# each expert's pairs padded to whole BLOCK_M tiles; two launches, counting then placing, a program
# per chunk of pairs), gate_up (a program per (tile of pairs of one expert, BLOCK_N rows of I): both
# projections, SiLU and the product; FP8's (TILE_SPLIT) and INT4's may split D, a silu launch then
# finishing h), down (a program per (tile, BLOCK_N rows of D): routing weight applied, one fp32 row
# per pair) and combine (the K rows of a token summed). A tile holds pairs of one expert only, and
# every tile of an expert reads that expert's weights, so an expert picked by up to BLOCK_M tokens
# is read exactly once. At most min(E, P) + P // BLOCK_M tiles exist (sum over experts of ceil(count
# / BLOCK_M)); that bound sizes the buffers and the grids, and tiles left unused exit at once.
# Weights are read as stored (bf16 / fp32, FP8 e4m3 with block scales, INT4 packed words with group
# scales), dequantized in registers; products accumulate in fp32. Deterministic: no atomics, so a
# graph replay equals the eager call.

# pairs per tile: tl.dot's smallest M. With N <= a few hundred and 384 experts most experts get 1-4
# tokens, so a larger tile would only add padding rows (python -m kernels.bench --moe --sweep dot).
# INT4 tiles of 32 were slower even where 8 experts serve 32 tokens a layer (fewer programs, not
# less dequantization: BENCHMARKS.md, Tried and not kept)
BLOCK_M = 16
# bf16 / fp32 tiles at a TP-8 rank's expert width (I 256): the token-expert pairs at which gate_up
# takes 64 weight rows a program instead of 32, as ranges [first, last] (last None: no end). From
# the verify sweep with either width (BENCHMARKS.md, Verify sweep): 64 rows won at 7-8 tokens and
# from 16, lost at 10-12 (the model's bf16 launch has 9 pairs a token: 8 experts and the shared one)
PLAIN_WIDE_PAIRS = ((55, 72), (128, None))
PLAIN_WIDE_WIDTH = 256
# bf16 / fp32 and FP8 tiles: gate_up splits D into this many parts up to the given token-expert
# pairs, as (most pairs, parts) in ascending order (past the last: whole), by format
TILE_SPLIT = {"fp8": ((128, 7), (256, 4))}
# The adaptive variant (fused_moe) runs the tiles where the call's distinct experts are at most
# ADAPTIVE_SHARE / ADAPTIVE_SCALE of its token-expert pairs, else the GEMV. From the kernel
# benchmark (FP8, 8 to 32 tokens, each token's experts from D of 384; BENCHMARKS.md, Routing, "FP8:
# the GEMV; the tiles; the adaptive variant"): at D 384 the tiles win at 32 tokens with 192 of 256
# pairs distinct (0.75; 367.3 against 416.6 µs) and lose at 16 with 108 of 128 (0.84; the GEMV 6%
# faster, 216.7 against 229.9) and at 8 with 61 of 64; at D 32 and 8 (fewer distinct) they win at
# every count. With every pair distinct (run.py's uniform routing) a verify with the tiles from 5
# tokens took 2.4-5.6 ms more at 5-32 tokens (BENCHMARKS.md, Tried and not kept). In the step, under
# the trained probe's routing trace, the tiles it picked at 10-16 tokens (0.65-0.74 of the pairs
# distinct) were no faster than the GEMV with the variant's fixed costs; from 24 tokens (0.51-0.70)
# they were faster
ADAPTIVE_SHARE, ADAPTIVE_SCALE = 3, 4
# the align's two launches (_moe_count_kernel, _moe_place_kernel): a program per ALIGN_CHUNK pairs
# (the count a [ALIGN_CHUNK, E] one-hot, the place a [ALIGN_CHUNK, ALIGN_CHUNK] compare), padding
# rows and unused tiles written ALIGN_FILL a step (not swept). In a graph on the H200 (python -m
# kernels.bench --align): 2.8-3.6 µs a call at 129 experts, 3.3-4.0 at 384, 4 to 32 tokens
ALIGN_CHUNK, ALIGN_FILL = 32, 512
# columns of D a combine program sums (not swept: the combine is a small share)
COMBINE_BLOCK = 1024
# elements of h a silu program makes, after a gate_up split over D (not swept: P * I elements, a
# small share)
SILU_BLOCK = 1024


def _configs(fmt, P, I, on_gpu, dtype=torch.bfloat16):
    """Block sizes (BLOCK_N, BLOCK_K, num_warps, num_stages) of gate_up and down by weight format
    and token-expert pairs P (and, for bf16, the experts' width I), re-derived by
    `python -m kernels.bench --moe --sweep dot`:
     - gate_up BLOCK_N 16 up to 16 pairs (decode, P = 8: 8 expert tiles, 16 programs each fill 132
       SMs), 32 above (from 3 tokens at K = 8: half the activation loads and loop overhead per
       weight byte);
     - BLOCK_K 128 for bf16 and FP8 (the checkpoint's scale block: one scale a row and k-step,
       applied after the dot);
     - bf16 at I 256 (PLAIN_WIDE_PAIRS): gate_up 64 rows from 55 to 72 pairs and from 128. At 7
       tokens the model's 32-row grid has 57 expert tiles x 8 programs = 456 programs against 392
       at 6 tokens, and a layer's experts took 42 µs more at kernel level (133.8 -> 175.6, uniform
       routing over 384); 64 rows: 150.2 µs at 7, 173.9 at 8 (benchmarks/shapes/
       kernels_plain_dot_5to8_moe.json, kernels_plain_wide_moe.json). Other widths keep 32 rows
       (not measured);
     - down BLOCK_N 64 (D = 7168: 112 programs an expert tile; its other sizes move little); FP8
       with 16-bit activations 128 (1-4% less than 64 at 8, 16 and 32 tokens under uniform
       routing, 10-16% with 8 experts at 8 and 16; TP 4 2%; fp32 activations keep 64: 128 rows
       need 245 KB of shared memory);
     - FP8 gate_up split over D (TILE_SPLIT): 7 parts up to 128 pairs, 4 up to 256 (against
       whole: 3-4% less at 8, 16 and 32 tokens under uniform routing, 16-25% less with 8 experts
       at 8 and 16; TP 4 at 24 and 32 tokens: within 1.3% uniform, 16% less with 8 experts).
       Sweeps at I 256 and 512: benchmarks/routing/kernels_fp8_tiles_split_sweep_moe.json,
       kernels_fp8_tp4_tiles_moe.json.
    INT4: _int4_configs."""
    if fmt == "int4":
        return _int4_configs(P, on_gpu)
    # Triton's CPU interpreter runs programs one by one, ~0.1 ms an op: fewest, largest
    if not on_gpu:
        return dict(gate_up=(64, 128, 4, 1, 1), down=(64, 128, 4, 1))
    wide = fmt == "plain" and I == PLAIN_WIDE_WIDTH and any(
        first <= P and (last is None or P <= last) for first, last in PLAIN_WIDE_PAIRS)
    rows = 64 if wide else 16 if P <= 16 else 32
    split = next((parts for most, parts in TILE_SPLIT.get(fmt, ()) if P <= most), 1)
    wide_down = fmt == "fp8" and dtype != torch.float32
    return dict(gate_up=(rows, 128, 4, 4, split), down=(128 if wide_down else 64, 128, 4, 3))


def _int4_configs(P, on_gpu):
    """_configs for INT4 (its own kernels, the section above _int4_mma_row): gate_up (BLOCK_N weight
    rows, BLOCK_K, num_warps, num_stages, SPLIT: the parts of D), down (the same, then BLOCKS: the
    row blocks a program makes in turn). 64 rows and steps of 128-column blocks: the MMA order
    (_check_int4_tiles). Up to 256 pairs from a sweep of these kernels at 8 and 32 tokens, uniform
    routing and 8 distinct experts, one kernel's config at a time (H100, the layer's us in
    benchmarks/routing/kernels_int4_mma_sweep_ae12fb0.json):
     - gate_up 64 rows of 256 elements in 2 stages, D in 7 parts: uniform routing, 32 tokens,
       gate_up 175 us against 215 in 3 stages and 4 parts (the layer 292 against 327), 8 tokens
       64 against 75; 8 experts at 8 tokens 17.3 against 22.4, at 32 within 1 us of the best;
     - down 64 rows of 128 in 3 stages: uniform at 32 tokens 90 us against 104 in 2 stages, at 8
       35 against 39; 8 experts within 0.5 us;
     - down's programs each making BLOCKS (the fifth entry) row blocks in turn: 2 up to 128
       pairs, 4 up to 256, 1 above. With the tile in element order (the kernels before the MMA
       order), the layer in us with 1 / 2 / 4 blocks, with 8 experts: 43.1 / 38.5 / 42.5 at 8
       tokens, 54.6 / 40.8 / 45.3 at 16, 78.0 / 68.3 / 63.0 at 32; uniform: 140.2 / 138.6 /
       141.7, 222.5 / 216.7 / 216.5, 444.3 / 426.7 / 424.1
       (benchmarks/routing/kernels_int4_tiles_down_blocks_{1,2,4}.json).
    Above 256 pairs (past 32 tokens, where only the tiles serve INT4) the configs are the element
    order's (whole D in 3 stages, down in 2: at 64 and 128 tokens, uniform, 685 and 871 us against
    695 and 875 in 2 parts; kernels_int4_dot_sweep_large_555e516.json), not swept in the MMA
    order."""
    if not on_gpu:   # the interpreter: fewest, largest
        return dict(gate_up=(64, 128, 4, 1, 1), down=(64, 128, 4, 1, 1))
    if P <= 256:
        return dict(gate_up=(64, 256, 4, 2, 7), down=(64, 128, 4, 3, 2 if P <= 128 else 4))
    return dict(gate_up=(64, 256, 4, 3, 1), down=(64, 128, 4, 2, 1))


@_jit
def _moe_count_kernel(ids_ptr, counts_ptr, sorted_pair_ptr, tile_expert_ptr, P, TILES,
                      E_PAD: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """The align's first launch: counts[c, e] = the pairs of chunk c (pairs c * CHUNK onwards) whose
    expert is e; and, for this program's share of the TILES tiles, sorted_pair[r] = P (a padding
    row) and tile_expert[t] = -1 (unused) (_moe_place_kernel then writes the used ones).

    ids_ptr: int [P] expert of pair p = n*K + k (ids [N, K] flattened), values in [0, E).
    counts_ptr: int32 [cdiv(P, CHUNK), E_PAD] out. Grid: (cdiv(P, CHUNK),)."""
    _wait_for_prior()
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
    experts = tl.arange(0, E_PAD)
    tl.store(counts_ptr + c * E_PAD + experts,
             tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0))
    share = tl.cdiv(TILES, tl.num_programs(0))
    for start in range(c * share * BLOCK_M, (c + 1) * share * BLOCK_M, FILL):
        r = start + tl.arange(0, FILL)
        tl.store(sorted_pair_ptr + r, tl.full([FILL], 0, tl.int32) + P,
                 mask=(r < (c + 1) * share * BLOCK_M) & (r < TILES * BLOCK_M))
    for start in range(c * share, (c + 1) * share, FILL):
        t = start + tl.arange(0, FILL)
        tl.store(tile_expert_ptr + t, tl.full([FILL], -1, tl.int32),
                 mask=(t < (c + 1) * share) & (t < TILES))


@_jit
def _moe_place_kernel(ids_ptr, counts_ptr, sorted_pair_ptr, tile_expert_ptr, use_tiles_ptr, P,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      SHARE: tl.constexpr, SCALE: tl.constexpr):
    """The align's second launch: each pair's row (its expert's first tile * BLOCK_M + the pairs of
    that expert before it, in pair order: stable) for the pairs of chunk c, and the tile -> expert
    map for the experts e with e % chunks == c (the tiles past the last used one keep -1 from
    _moe_count_kernel). Every program sums the chunks' counts itself (the experts' totals and the
    counts of earlier chunks).
    SHARE > 0 (the adaptive variant): the tiles only where the call's distinct experts are at most
    SHARE / SCALE of its pairs (every tile unused otherwise), and that choice in use_tiles_ptr,
    int32 [1]: 1 where the tiles serve the call, else 0.

    sorted_pair_ptr: int32 [max_tiles * BLOCK_M] out: the pair in each tile row (padding rows keep
    P). tile_expert_ptr: int32 [max_tiles] out. Grid: (cdiv(P, CHUNK),)."""
    _wait_for_prior()
    c, chunks = tl.program_id(0), tl.num_programs(0)
    experts = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], tl.int32)
    before = tl.zeros([E_PAD], tl.int32)                               # earlier chunks' pairs
    for j in range(0, chunks):
        n = tl.load(counts_ptr + j * E_PAD + experts)
        total += n
        before += tl.where(j < c, n, 0)
    kept = total > 0
    if SHARE > 0:  # one choice for the whole call: every program sums the same totals
        use_tiles = tl.sum(kept.to(tl.int32), 0) * SCALE <= P * SHARE
        kept &= use_tiles
        if c == 0:
            tl.store(use_tiles_ptr, use_tiles.to(tl.int32))
    tiles = tl.where(kept, (total + BLOCK_M - 1) // BLOCK_M, 0)
    first_tile = tl.cumsum(tiles, 0) - tiles                           # [E_PAD]
    i = tl.arange(0, CHUNK)
    p = c * CHUNK + i
    ids = tl.load(ids_ptr + p, mask=p < P, other=0)
    # a pair's rank among its expert's pairs in this chunk: the earlier pairs with its expert
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), 1)
    row = tl.gather(first_tile * BLOCK_M + before, ids, 0) + rank
    placed = p < P
    if SHARE > 0:  # only the pairs of experts with tiles
        placed &= tl.gather(tiles, ids, 0) > 0
    tl.store(sorted_pair_ptr + row, p.to(tl.int32), mask=placed)
    mine = experts % chunks == c
    for j in range(0, tl.max(tl.where(mine, tiles, 0), 0)):          # an expert's j-th tile
        tl.store(tile_expert_ptr + first_tile + j, experts, mask=mine & (j < tiles))


@_jit
def _accumulate(acc, xt, k0, K_IN, w_ptr, s_ptr, n, n_ok, stride_wn, stride_sr, stride_sc,
                block_r, block_c, off_r, off_c,
                FMT: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
                PRECISION: tl.constexpr):
    """acc [BM, BN] += X[rows, k0:k0+BK] @ W[n, k0:k0+BK]^T, W of one expert read as stored (plain
    or FP8; INT4 has kernels of its own below).

    xt [BM, BK]: that activation tile. w_ptr, s_ptr: the expert's weight and scale (ExpertWeights
    layouts); n: [BN] output rows. FMT 0 plain, 1 FP8 blocks. SCALE_PER_ROW (FP8): the k-step lies
    inside one column block, so the scale is one per row, applied to the dot's result."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K_IN
    wt = tl.load(w_ptr + n[None, :] * stride_wn + k[:, None],
                 mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if FMT == 0:  # the load feeds the dot directly (Triton pipelines it through shared memory)
        acc = tl.dot(xt, wt.to(xt.dtype), acc, input_precision=PRECISION)
    elif SCALE_PER_ROW:
        s = tl.load(s_ptr + ((n + off_r) // block_r) * stride_sr
                    + ((k0 + off_c) // block_c) * stride_sc, mask=n_ok, other=0.0)
        acc += tl.dot(xt, wt.to(xt.dtype), input_precision=PRECISION) * s[None, :]
    else:
        s = tl.load(s_ptr + ((n + off_r) // block_r)[None, :] * stride_sr
                    + ((k + off_c) // block_c)[:, None] * stride_sc,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(xt, (wt.to(tl.float32) * s).to(xt.dtype), acc, input_precision=PRECISION)
    return acc


@_jit
def _moe_gate_up_kernel(x_ptr, h_ptr, part_ptr, sorted_pair_ptr, tile_expert_ptr, g_ptr, gs_ptr,
                        u_ptr, us_ptr,
                        P, TOPK, D, I, stride_we, stride_wn, stride_se, stride_sr, stride_sc,
                        block_r, block_c, off_r, off_c,
                        FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                        SCALE_PER_ROW: tl.constexpr, PRECISION: tl.constexpr):
    """h[pair, i] = silu(gate[e] @ x[n]) * (up[e] @ x[n]) for the pair in each tile row (n = pair //
    K), over part pid_k of SPLIT of D: SPLIT 1 stores h, else the fp32 sums of gate and up,
    part[pid_k, pair, 0 / 1, i] (the silu launch adds them), as the INT4 tiles do.

    x_ptr: [N, D] contiguous, the compute dtype. h_ptr: [P, I] out, x's dtype. g_ptr / u_ptr and
    gs_ptr / us_ptr: gate and up weights and scales, [E, I, D]-shaped as ExpertWeights (same
    strides for both). sorted_pair_ptr, tile_expert_ptr: from the align kernel. Grid:
    (cdiv(I, BLOCK_N), max_tiles, SPLIT)."""
    _wait_for_prior()
    pid_n, tile, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + rows)
    row_ok = pair < P
    x_row = (pair // TOPK).to(tl.int64) * D
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    PART = tl.cdiv(tl.cdiv(D, SPLIT), BLOCK_K) * BLOCK_K
    for k0 in range(pid_k * PART, tl.minimum(pid_k * PART + PART, D), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)                                    # one load for gate and up
        xt = tl.load(x_ptr + x_row[:, None] + k[None, :],
                     mask=row_ok[:, None] & (k < D)[None, :], other=0.0)
        acc_g = _accumulate(acc_g, xt, k0, D, g_ptr + e * stride_we, gs_ptr + e * stride_se, n,
                            n_ok, stride_wn, stride_sr, stride_sc, block_r, block_c, off_r, off_c,
                            FMT, BLOCK_K, SCALE_PER_ROW, PRECISION)
        acc_u = _accumulate(acc_u, xt, k0, D, u_ptr + e * stride_we, us_ptr + e * stride_se, n,
                            n_ok, stride_wn, stride_sr, stride_sc, block_r, block_c, off_r, off_c,
                            FMT, BLOCK_K, SCALE_PER_ROW, PRECISION)
    ok = row_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        h = _silu_mul(acc_g, acc_u)
        tl.store(h_ptr + pair[:, None].to(tl.int64) * I + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=ok)
    else:
        part = part_ptr + ((pid_k * P + pair[:, None]).to(tl.int64) * 2) * I + n[None, :]
        tl.store(part, acc_g, mask=ok)
        tl.store(part + I, acc_u, mask=ok)


@_jit
def _moe_down_kernel(h_ptr, y_ptr, sorted_pair_ptr, tile_expert_ptr, route_w_ptr, w_ptr, s_ptr,
                     P, D, I, stride_we, stride_wn, stride_se, stride_sr, stride_sc,
                     block_r, block_c, off_r, off_c,
                     FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr,
                     SCALE_PER_ROW: tl.constexpr, PRECISION: tl.constexpr):
    """y[pair, d] = route_w[pair] * (down[e] @ h[pair])[d] for the pair in each tile row.

    h_ptr: [P, I] from gate_up (or the silu launch). y_ptr: fp32 [P, D] out, one row per pair (every
    pair's row is written once). route_w_ptr: fp32 [P], the routing weights flattened. w_ptr /
    s_ptr: down weights and scales, [E, D, I]-shaped as ExpertWeights. Grid: (cdiv(D, BLOCK_N),
    max_tiles)."""
    _wait_for_prior()
    pid_n, tile = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + rows)
    row_ok = pair < P
    h_row = pair.to(tl.int64) * I
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ht = tl.load(h_ptr + h_row[:, None] + k[None, :],
                     mask=row_ok[:, None] & (k < I)[None, :], other=0.0)
        acc = _accumulate(acc, ht, k0, I, w_ptr + e * stride_we, s_ptr + e * stride_se, n, n_ok,
                          stride_wn, stride_sr, stride_sc, block_r, block_c, off_r, off_c,
                          FMT, BLOCK_K, SCALE_PER_ROW, PRECISION)
    route_w = tl.load(route_w_ptr + pair, mask=row_ok, other=0)
    tl.store(y_ptr + pair[:, None].to(tl.int64) * D + n[None, :], acc * route_w[:, None],
             mask=row_ok[:, None] & n_ok[None, :])


# INT4 tiles: the weights as the MMA's first operand. A tile's pairs (at most BLOCK_M = 16, mostly
# 1 to 4 under uniform routing) are the product's narrow side, INT4_ROWS = 64 weight rows its tall
# side (sm_90's wgmma: 64 rows a warp group): acc [64, BLOCK_M] += W [64, 128] @ X [128, BLOCK_M],
# one tl.dot a projection and INT4_K = 128 columns. _int4_mma_block dequantizes W in registers
# straight into the order in which the MMA takes its first operand from registers, so the tile
# never passes through shared memory: a dot's result does not depend on the order of its k (X's
# rows come in the same order) nor on which weight row an accumulator row holds (the stores put
# each where it belongs). The 16 words a row [64, 16] arrive as Triton lays out such a load for 4
# warps where it knows a row's words 16-byte aligned (the launcher specializes on row strides that
# are multiples of 16 words: D and I multiples of 128, as Kimi-K2's; elsewhere the same results
# through shared memory): a thread holds 4 consecutive words of a row; lanes take words 4-15 by
# fours (2 bits) and rows 0-7 (3 bits), warps rows 8-31, registers row 32. Each word's 8 nibbles
# lie in its thread, as pairs j and j + 4 in one 32-bit register (the packed form below: one FMA
# makes q - 8, one the scale). The MMA's first operand in registers wants: lanes at k bits 1-2 and
# rows 0-7 (row bits 0-2), warps at rows 16-63, registers at k bits 0 and 3-6 and row bit 3, k bit
# 0 the pair of a register. So the MMA's row r holds weight row _int4_mma_row(r) (row bits 3-5
# rotated) and its column c actual k (_in_int4_mma_order): c's bits, high to low, are (w bits 1-0,
# j bit 0, j bit 1, w bits 3-2, j bit 2) for nibble j of word w, k = 8w + j: the words' lane bits
# where the MMA's lanes hold k, a register's two nibbles its pair. The layout of the joins, the
# permute and the reshape then equals the MMA operand's up to the order of a thread's registers,
# and Triton converts it without data movement (sm_90 code compiled on a CPU, gate_up at Kimi-K2's
# shapes in steps of 256: no shared memory stores or ldmatrix for W; in 3 stages 95 registers a
# thread and 706 instructions a warp and step, against 227 and 1,054 with the tile in element
# order, whose conversion went through shared memory). X [128, BLOCK_M] is loaded in k order
# (cp.async, pipelined) and permuted to the columns' order (_in_int4_mma_order), in shared memory
# as any second operand. Nibbles become q - 8 by the exponent trick (moe_gemv._nibble, _q_pair),
# times their group scale rounded once to the compute dtype, as the plain module's dequantization
# rounds: for bf16 activations and scales in pairs through fma.rn.bf16x2 (the packed form; the
# same bits as the fp32 form's product rounded to bf16: a 4-bit by 8-bit significand product is
# exact in fp32).
# Words, scales and X feed the dot, so Triton's pipeliner issues them num_stages - 1 steps ahead
# (cp.async). A step of BLOCK_K (a multiple of INT4_K) makes BLOCK_K / INT4_K such blocks in turn.
# gate_up splits D into SPLIT parts (grid axis 2): where tokens share a few experts the tiles are
# few, and a program stepping through all of D alone leaves the SMs idle. Each part writes its fp32
# sums of gate and up for its pairs (part [SPLIT, P, 2, I]), and the silu launch adds the parts in
# order, then SiLU times up; SPLIT 1: gate_up writes h itself. h is [P, I], a row a pair.
INT4_ROWS, INT4_K = 64, 128


@_jit
def _int4_mma_row(BN: tl.constexpr):
    """[BN]: the weight row (of the program's INT4_ROWS) that row r of _int4_mma_block holds."""
    r = tl.arange(0, BN)
    return (r & 7) + ((r >> 3) & 1) * 32 + ((r >> 4) & 3) * 8


@_jit
def _in_int4_mma_order(xt, BLOCK_M: tl.constexpr):
    """xt [INT4_K, BLOCK_M], k in order, with its rows in the order of _int4_mma_block's
    columns: row c takes k = 8w + j, c's bits (high to low) w bits 1-0, j bit 0, j bit 1, w bits
    3-2, j bit 2."""
    xt = tl.reshape(xt, (4, 4, 2, 2, 2, BLOCK_M))       # k = 32 w_hi + 8 w_lo + 4 j2 + 2 j1 + j0
    return tl.reshape(tl.permute(xt, (1, 4, 3, 0, 2, 5)), (128, BLOCK_M))


@_jit
def _int4_mma_block(w_rows, s_rows, rows_ok, k0, magic, K_IN: tl.constexpr, GROUP: tl.constexpr,
                    EVEN: tl.constexpr, DTYPE: tl.constexpr, PACKED: tl.constexpr):
    """W[_int4_mma_row order, k0 + the order of _in_int4_mma_order]: [INT4_ROWS, INT4_K] of DTYPE.

    w_rows, s_rows [INT4_ROWS, 1]: the rows' word and group-scale pointers, in weight row order;
    rows_ok [INT4_ROWS, 1]: the rows inside the matrix; K_IN: elements a row. EVEN: no load masked.
    PACKED (bf16 scales and DTYPE; magic then moe_gemv.BF16_MAGIC, else moe_gemv.MAGIC): the
    packed form (the section above), else each nibble in fp32 times its scale, rounded once."""
    tl.static_assert(w_rows.shape[0] == 64 and 128 % GROUP == 0 and GROUP % 8 == 0)
    w = k0 // 8 + tl.arange(0, 16)
    g = k0 // GROUP + tl.arange(0, 128 // GROUP)
    if EVEN:
        words = tl.load(w_rows + w[None, :])                                      # [64, 16]
        s = tl.load(s_rows + g[None, :])
    else:
        words = tl.load(w_rows + w[None, :], mask=rows_ok & (w < K_IN // 8)[None, :], other=0)
        s = tl.load(s_rows + g[None, :], mask=rows_ok & (g < K_IN // GROUP)[None, :], other=0.0)
    if PACKED:
        s = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        s = s | (s << 16)                                                 # (s, s) as an int32
    else:
        s = s.to(tl.float32)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (64, 128 // GROUP, GROUP // 8)), (64, 16))
    if PACKED:   # nibbles J and J + 4: [64, 16, 2]
        t0, t1 = _scaled_pair(words, 0, s, magic), _scaled_pair(words, 1, s, magic)
        t2, t3 = _scaled_pair(words, 2, s, magic), _scaled_pair(words, 3, s, magic)
    else:
        high = words >> 12
        t0 = tl.join(_scaled(words, high, 0, s, magic, DTYPE),
                     _scaled(words, high, 4, s, magic, DTYPE))
        t1 = tl.join(_scaled(words, high, 1, s, magic, DTYPE),
                     _scaled(words, high, 5, s, magic, DTYPE))
        t2 = tl.join(_scaled(words, high, 2, s, magic, DTYPE),
                     _scaled(words, high, 6, s, magic, DTYPE))
        t3 = tl.join(_scaled(words, high, 3, s, magic, DTYPE),
                     _scaled(words, high, 7, s, magic, DTYPE))
    z = tl.join(tl.join(t0, t1), tl.join(t2, t3))          # [row, w, j bit 2, j bit 0, j bit 1]
    # row bits (5, 4-3, 2-0), w bits (3-2, 1-0), j bits 2, 0, 1 -> rows (4-3, 5, 2-0), columns
    # (w 1-0, j 0, j 1, w 3-2, j 2)
    z = tl.reshape(z, (2, 4, 8, 4, 4, 2, 2, 2))
    return tl.reshape(tl.permute(z, (1, 0, 2, 4, 6, 7, 3, 5)), (64, 128))


@_jit
def _scaled(words, high, J: tl.constexpr, s, magic, DTYPE: tl.constexpr):
    """Nibble J of each word times its group scale, in fp32, rounded once to DTYPE."""
    return (moe_gemv._nibble(words, high, J, magic) * s).to(DTYPE)


@_jit
def _scaled_pair(words, J: tl.constexpr, s2, magic):
    """Nibbles J and J + 4 of each word times their group scale (s2: the bf16 pair (s, s)), each
    rounded once, joined: [..., 2] bf16. The pair splits by truncation and a bitcast."""
    v = moe_gemv._fma2(moe_gemv._q_pair(words, J, magic), s2,
                       tl.full([1, 1], moe_gemv.BF16_NEG_ZEROS, tl.int32))
    return tl.join(v.to(tl.int16).to(tl.bfloat16, bitcast=True),
                   (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))


@_jit
def _moe_int4_gate_up_kernel(x_ptr, h_ptr, part_ptr, sorted_pair_ptr, tile_expert_ptr, g_ptr,
                             gs_ptr, u_ptr, us_ptr, P, TOPK, stride_we, stride_wn, stride_se,
                             stride_sr, magic, D: tl.constexpr, I: tl.constexpr,
                             GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
                             PACKED: tl.constexpr, PRECISION: tl.constexpr):
    """_moe_gate_up_kernel for INT4 weights (the section above), over part pid_k of SPLIT of D:
    h[pair, i] for the BLOCK_N (= INT4_ROWS) rows i of program pid_n and the pairs of one tile
    (SPLIT 1), else the fp32 sums of gate and up, part[pid_k, pair, 0 / 1, i]. Grid: (cdiv(I,
    BLOCK_N), max_tiles, SPLIT)."""
    _wait_for_prior()
    pid_n, tile, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(sorted_pair_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))[None, :]
    x_col = (pair // TOPK).to(tl.int64) * D
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]                 # weight row order
    g_rows, u_rows = g_ptr + e * stride_we + n * stride_wn, u_ptr + e * stride_we + n * stride_wn
    gs_rows = gs_ptr + e * stride_se + n * stride_sr
    us_rows = us_ptr + e * stride_se + n * stride_sr
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    PART: tl.constexpr = (D + SPLIT * BLOCK_K - 1) // (SPLIT * BLOCK_K) * BLOCK_K
    # a trip count known at compile time (the last part's steps past D masked; EVEN: there are
    # none): with the bound computed at run time ptxas serializes the wgmma (C7515), each waiting
    # for the one before it
    for step in range(PART // BLOCK_K):
        for b in tl.static_range(BLOCK_K // 128):
            k0 = pid_k * PART + step * BLOCK_K + b * 128
            k = (k0 + tl.arange(0, 128))[:, None]
            xt = tl.load(x_ptr + x_col + k, mask=(pair < P) & (k < D), other=0.0)   # [128, BM]
            xt = _in_int4_mma_order(xt, BLOCK_M)
            acc_g = tl.dot(_int4_mma_block(g_rows, gs_rows, n < I, k0, magic, D, GROUP, EVEN,
                                           xt.dtype, PACKED), xt, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(_int4_mma_block(u_rows, us_rows, n < I, k0, magic, D, GROUP, EVEN,
                                           xt.dtype, PACKED), xt, acc_u, input_precision=PRECISION)
    n = (pid_n * BLOCK_N + _int4_mma_row(BLOCK_N))[:, None]          # the accumulator's row order
    ok = (pair < P) & (n < I)
    if SPLIT == 1:
        h = _silu_mul(acc_g, acc_u)
        tl.store(h_ptr + pair.to(tl.int64) * I + n, h.to(h_ptr.dtype.element_ty), mask=ok)
    else:
        part = part_ptr + ((pid_k * P + pair).to(tl.int64) * 2) * I + n
        tl.store(part, acc_g, mask=ok)
        tl.store(part + I, acc_u, mask=ok)


@_jit
def _moe_silu_kernel(part_ptr, h_ptr, use_tiles_ptr, P, I: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK: tl.constexpr, ADAPTIVE: tl.constexpr):
    """h[pair, i] = silu(sum_s part[s, pair, 0, i]) * sum_s part[s, pair, 1, i], s in order.

    part_ptr: fp32 [SPLIT, P, 2, I] from the gate_up kernel; h_ptr: [P, I]. ADAPTIVE: nothing
    where use_tiles_ptr (int32 [1], the align's choice) is 0 (the GEMV serves; part holds nothing).
    Grid: (cdiv(P * I, BLOCK),)."""
    _wait_for_prior()
    if ADAPTIVE:
        if tl.load(use_tiles_ptr) == 0:
            return
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = c < P * I
    at = (c // I) * 2 * I + c % I
    g = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        g += tl.load(part_ptr + s * P * 2 * I + at, mask=ok, other=0.0)
        u += tl.load(part_ptr + s * P * 2 * I + at + I, mask=ok, other=0.0)
    tl.store(h_ptr + c, _silu_mul(g, u).to(h_ptr.dtype.element_ty), mask=ok)


@_jit
def _moe_int4_down_kernel(h_ptr, y_ptr, sorted_pair_ptr, tile_expert_ptr, route_w_ptr, w_ptr,
                          s_ptr, P, stride_we, stride_wn, stride_se, stride_sr, magic,
                          D: tl.constexpr, I: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCKS: tl.constexpr, EVEN: tl.constexpr, PACKED: tl.constexpr,
                          PRECISION: tl.constexpr):
    """_moe_down_kernel for INT4 weights (the section above): y[pair, d] for BLOCKS row blocks of
    BLOCK_N (= INT4_ROWS) rows d (program pid_n's, in turn) and the pairs of one tile, h read by
    pair. The row blocks and the steps of I run as one loop, so the next block's first words are
    in flight while this block's last step is multiplied. Grid: (cdiv(D, BLOCK_N * BLOCKS),
    max_tiles)."""
    _wait_for_prior()
    pid_n, tile = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(sorted_pair_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))[None, :]
    h_col = pair.to(tl.int64) * I
    route_w = tl.load(route_w_ptr + pair, mask=pair < P, other=0)
    STEPS: tl.constexpr = (I + BLOCK_K - 1) // BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for j in range(0, BLOCKS * STEPS):
        row0 = (pid_n * BLOCKS + j // STEPS) * BLOCK_N
        n = (row0 + tl.arange(0, BLOCK_N))[:, None]                       # weight row order
        for b in tl.static_range(BLOCK_K // 128):
            k0 = (j % STEPS) * BLOCK_K + b * 128
            k = (k0 + tl.arange(0, 128))[:, None]
            ht = tl.load(h_ptr + h_col + k, mask=(pair < P) & (k < I), other=0.0)  # [128, BM]
            ht = _in_int4_mma_order(ht, BLOCK_M)
            acc = tl.dot(_int4_mma_block(w_ptr + e * stride_we + n * stride_wn,
                                         s_ptr + e * stride_se + n * stride_sr, n < D, k0, magic,
                                         I, GROUP, EVEN, ht.dtype, PACKED), ht, acc,
                         input_precision=PRECISION)
        if j % STEPS == STEPS - 1:   # the row block's last step: store it, start the next
            n = (row0 + _int4_mma_row(BLOCK_N))[:, None]                 # the accumulator's order
            tl.store(y_ptr + pair.to(tl.int64) * D + n, acc * route_w, mask=(pair < P) & (n < D))
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)


@_jit
def _moe_combine_kernel(y_ptr, out_ptr, D, TOPK, BLOCK_D: tl.constexpr):
    """out[n, d] = sum_k y[n*K + k, d], summed in fp32 in k order, stored in out's dtype.

    y_ptr: fp32 [N*K, D]; out_ptr: [N, D]. Grid: (N, cdiv(D, BLOCK_D))."""
    _wait_for_prior()
    token, pid_d = tl.program_id(0), tl.program_id(1)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k in range(0, TOPK):
        acc += tl.load(y_ptr + (token * TOPK + k).to(tl.int64) * D + d, mask=d < D, other=0)
    tl.store(out_ptr + token.to(tl.int64) * D + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


def _check_weights(gate, up, down, D):
    fmt = gate.fmt
    if fmt not in FORMATS or up.fmt != fmt or down.fmt != fmt:
        raise ValueError(f"fused_moe: weight formats {gate.fmt}, {up.fmt}, {down.fmt}; all three "
                         f"must be one of {sorted(FORMATS)}")
    E, I, D_in = gate.shape
    if up.shape != gate.shape or down.shape != (E, D, I) or D_in != D:
        raise ValueError(f"fused_moe: gate {list(gate.shape)}, up {list(up.shape)}, "
                         f"down {list(down.shape)} do not fit hidden {D}: expected [E, I, D], "
                         "[E, I, D], [E, D, I]")
    layout = [(w.data.stride(), w.scale is None or w.scale.stride(), w.block, w.offset, w.group)
              for w in (gate, up)]
    if layout[0] != layout[1]:
        raise ValueError("fused_moe: gate and up must be stored alike (strides, scales, blocks): "
                         "one kernel reads both")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if w.data.stride(-1) != 1 or (w.scale is not None and w.scale.stride(-1) != 1):
            raise ValueError(f"fused_moe: {name} weights and scales must be contiguous along "
                             "their last dim")
        if fmt == "int4" and (w.data.dtype != torch.int32 or w.group % 8 or w.shape[2] % w.group):
            raise ValueError(f"fused_moe: {name} INT4 needs int32 words and a group ({w.group}) "
                             f"that is a multiple of 8 and divides the input dim {w.shape[2]}")
        if fmt == "fp8" and (w.data.dtype != torch.float8_e4m3fn or w.scale is None):
            raise ValueError(f"fused_moe: {name} FP8 needs float8_e4m3fn weights and block scales")
        if fmt == "int4" and w.scale is None:
            raise ValueError(f"fused_moe: {name} INT4 needs its group scales")
        if fmt != "plain" and not _scales_cover(w):
            raise ValueError(f"fused_moe: {name} scales {list(w.scale.shape)}, expected "
                             f"{list(_scale_shape(w))} for weights {list(w.shape)} ({fmt}"
                             + (", or more blocks" if fmt == "fp8" else "") + ")")
    return fmt, E, I


def _scales_cover(w):
    """Whether w's scales cover every weight the kernels read (INT4: exactly its groups; FP8: at
    least the blocks over its slice)."""
    have, need = tuple(w.scale.shape), _scale_shape(w)
    if w.fmt == "int4":
        return have == need
    return len(have) == 3 and have[0] == need[0] and all(h >= n for h, n in zip(have, need))


def _scale_shape(w):
    """The scales an ExpertWeights of format int4 or fp8 must carry: a group's, or the blocks
    over this rank's slice (starting `offset` into a block)."""
    E, out, inp = w.shape
    if w.fmt == "int4":
        return E, out, inp // w.group
    (br, bc), (r0, c0) = w.block, w.offset
    return E, -(-(r0 + out) // br), -(-(c0 + inp) // bc)


VARIANTS = ("gemv", "dot", "adaptive")
# the adaptive variant in place of the GEMV from this many tokens, by format (absent: never)
ADAPTIVE_MIN_TOKENS = {}


def gemv_rule(fmt, N, K, I):
    """fused_moe's variant when none is named: "gemv" up to moe_gemv.gemv_max_tokens(fmt, I) tokens
    (and GEMV_MAX_PAIRS pairs; "adaptive" instead from ADAPTIVE_MIN_TOKENS), else "dot". A rule on
    shapes only (I: the experts' width), so a captured graph keeps its variant."""
    if N > gemv_max_tokens(fmt, I) or N * K > GEMV_MAX_PAIRS:
        return "dot"
    return "adaptive" if N >= ADAPTIVE_MIN_TOKENS.get(fmt, GEMV_MAX_PAIRS + 1) else "gemv"


def _check_shared(shared, fmt, variant, I, D, dtype):
    """fused_moe's shared expert: it rides in the INT4 and FP8 GEMV launches only, as contiguous
    [I, D], [I, D], [D, I] tensors in the compute dtype."""
    if fmt not in SHARED_SPLIT or variant == "dot":
        raise ValueError(f"fused_moe: a shared expert rides in the INT4 and FP8 GEMV launches "
                         f"only (variants gemv, adaptive), not {fmt} {variant} (plain experts: "
                         "make it expert E, as SharedExpertInLaunch does)")
    if ([list(t.shape) for t in shared] != [[I, D], [I, D], [D, I]]
            or any(t.dtype != dtype for t in shared)
            or any(not t.is_contiguous() for t in shared)):
        raise ValueError(f"fused_moe: shared expert {[list(t.shape) for t in shared]}: expected "
                         f"contiguous [{I}, {D}], [{I}, {D}], [{D}, {I}] in x's dtype {dtype}")


def fused_moe(x, ids, route_w, gate, up, down, configs=None, variant=None, shared=None,
              planes=None):
    """Routed experts in one pass over each distinct expert's weights:
    y[n] = sum_k route_w[n, k] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, k].

    x [N, D] (bf16, fp16 or fp32: the compute dtype; the tile variant rounds dequantized weights to
    it, the GEMV variant multiplies them in fp32), ids int [N, K] in [0, E) (not checked: that would
    read the device), route_w [N, K] (any float; used in fp32), gate / up / down: ExpertWeights of
    [E, I, D], [E, I, D], [E, D, I]. Returns [N, D] in x's dtype. variant: "gemv" (CUDA-core
    products, for a few tokens), "dot" (tiles of BLOCK_M pairs through tl.dot), "adaptive" (the
    tiles where the routing shares experts, else the GEMV, chosen on the device: ADAPTIVE_SHARE)
    or None (gemv_rule).
    configs: override the variant's block sizes (the benchmark's sweep; adaptive: the GEMV's).
    shared: (gate [I, D], up [I, D], down [D, I]) tensors in x's dtype, a shared expert added to
    every token with weight 1, in the same launches (INT4 and FP8 experts through the GEMV
    launches only, gemv or adaptive: the bf16 shared expert of Kimi-K2.5, and of
    Kimi-K2-Instruct's FP8 checkpoint, dequantized at load). planes: x already
    as the INT4 GEMV's activation planes (moe_gemv.activation_planes: pair planes for bf16 x, else
    fp32 nibble planes, in a tensor from moe_gemv.empty_planes; router_topk writes them beside its
    logits),
    read instead of permuting x again; the other variants and formats ignore them."""
    fmt, variant = _check_inputs(x, ids, route_w, gate, up, down, variant, shared, planes)
    N, K = ids.shape
    if N == 0:
        return x.new_empty(0, x.shape[1])
    x, ids, route_w = (x.contiguous(), ids.reshape(-1).contiguous(),
                       route_w.reshape(-1).float().contiguous())
    tiles = _configs(fmt, N * K, gate.shape[1], x.is_cuda, x.dtype)
    if variant == "dot":
        tiles = {**tiles, **(configs or {})}
        if fmt == "int4":
            _check_int4_tiles(tiles, gate, down)
        return _fused_moe_tile(x, ids, route_w, gate, up, down, fmt, K, tiles)
    cfg = {**_gemv_configs(fmt, N, x.is_cuda), **(configs or {})}
    if variant == "adaptive":
        return _fused_moe_adaptive(x, ids, route_w, gate, up, down, fmt, K, (cfg, tiles), shared,
                                   planes)
    return moe_gemv._fused_moe_gemv(x, ids, route_w, gate, up, down, fmt, cfg, shared, planes)


def _check_inputs(x, ids, route_w, gate, up, down, variant, shared, planes):
    """fused_moe's refusals, by shape, dtype and device (nothing read from the device); returns
    the weights' format and the variant to run."""
    if x.dim() != 2 or ids.shape != route_w.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: x {list(x.shape)}, ids {list(ids.shape)}, route_w "
                         f"{list(route_w.shape)}: expected [N, D], [N, K], [N, K]")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or ids.dtype.is_floating_point:
        raise ValueError(f"fused_moe: x must be bf16, fp16 or fp32 (got {x.dtype}), ids integers "
                         f"(got {ids.dtype})")
    (N, D), K = x.shape, ids.shape[1]
    fmt, E, I = _check_weights(gate, up, down, D)
    weights = (gate.data, gate.scale, up.data, up.scale, down.data, down.scale)
    if any(t is not None and t.device != x.device
           for t in (ids, route_w, *weights, *(shared or ()))):
        raise ValueError(f"fused_moe: every input must be on x's device {x.device}")
    variant = variant or gemv_rule(fmt, N, K, I)
    if variant not in VARIANTS or (variant != "dot" and N * K > GEMV_MAX_PAIRS):
        raise ValueError(f"fused_moe: variant {variant!r} for {N * K} token-expert pairs: 'dot', "
                         f"or 'adaptive' or 'gemv' up to {GEMV_MAX_PAIRS} pairs")
    if shared is not None:
        _check_shared(shared, fmt, variant, I, D, x.dtype)
    if planes is not None:
        _check_planes(planes, x)
    return fmt, variant


def _check_int4_tiles(cfg, gate, down):
    """The INT4 tiles' refusals (before any launch): their tile is laid out for the MMA's operand
    registers (the section above _int4_mma_row), so INT4_ROWS rows and whole INT4_K-column
    blocks a step, and a group that divides a block."""
    for name, w in (("gate_up", gate), ("down", down)):
        if cfg[name][0] != INT4_ROWS or cfg[name][1] % INT4_K:
            raise ValueError(f"fused_moe: INT4 tiles' {name} takes {INT4_ROWS} rows (BLOCK_N) and "
                             f"a multiple of {INT4_K} columns (BLOCK_K) a step, not "
                             f"{cfg[name][0]} and {cfg[name][1]}")
        if INT4_K % w.group or w.group % 8:
            raise ValueError(f"fused_moe: INT4 tiles need a group of 8 to {INT4_K} elements that "
                             f"divides {INT4_K}, not {w.group}")


def align(ids, E, share=0):
    """The tile variant's align: (sorted_pair int32 [max_tiles * BLOCK_M], tile_expert int32
    [max_tiles], use_tiles) for ids [P] (experts in [0, E)): each expert's pairs in pair order, in
    whole tiles of BLOCK_M rows, experts in ascending order, padding rows P; each tile's expert, -1
    for tiles left unused (max_tiles = min(E, P) + P // BLOCK_M, the section comment's bound).
    share 0: use_tiles None; else (the adaptive variant) the tiles only where the distinct experts
    are at most share / ADAPTIVE_SCALE of the pairs, and use_tiles int32 [1]: 1 if so, else 0; the
    bound then takes that many distinct experts at most (fewer programs that find no tile)."""
    P, dev = ids.numel(), ids.device
    distinct = min(E, P * share // ADAPTIVE_SCALE if share else P)
    max_tiles = max(1, distinct + P // BLOCK_M)
    sorted_pair = torch.empty(max_tiles * BLOCK_M, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    chunks, e_pad = triton.cdiv(P, ALIGN_CHUNK), triton.next_power_of_2(E)
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
    _moe_count_kernel[(chunks,)](ids, counts, sorted_pair, tile_expert, P, max_tiles,
                                 E_PAD=e_pad, CHUNK=ALIGN_CHUNK, FILL=ALIGN_FILL,
                                 BLOCK_M=BLOCK_M, num_warps=4, launch_pdl=common.PDL)
    use_tiles = torch.empty(1, dtype=torch.int32, device=dev) if share else None
    _moe_place_kernel[(chunks,)](ids, counts, sorted_pair, tile_expert,
                                 tile_expert if use_tiles is None else use_tiles, P,
                                 BLOCK_M=BLOCK_M, E_PAD=e_pad, CHUNK=ALIGN_CHUNK, SHARE=share,
                                 SCALE=ADAPTIVE_SCALE, num_warps=4, launch_pdl=common.PDL)
    return sorted_pair, tile_expert, use_tiles


def _fused_moe_tile(x, ids, route_w, gate, up, down, fmt, K, cfg):
    """fused_moe's tile variant: align, gate_up, down, combine (x [N, D], ids and route_w [N*K])."""
    (N, D), P, dev = x.shape, ids.numel(), x.device
    y = torch.empty(P, D, dtype=torch.float32, device=dev)                      # [P, D], weighted
    _tile_launches(x, y, align(ids, gate.shape[0]), route_w, gate, up, down, fmt, K, cfg)
    out = torch.empty(N, D, dtype=x.dtype, device=dev)
    _moe_combine_kernel[(N, triton.cdiv(D, COMBINE_BLOCK))](y, out, D, K, BLOCK_D=COMBINE_BLOCK,
                                                            num_warps=4, launch_pdl=common.PDL)
    return out


def _fused_moe_adaptive(x, ids, route_w, gate, up, down, fmt, K, cfgs, shared, planes):
    """fused_moe's adaptive variant: the tiles or the GEMV, chosen on the device from the routing
    (align with share ADAPTIVE_SHARE: the tiles where the call's distinct experts are at most that
    share of its pairs). Both paths are launched; the unchosen one's programs return at once (a
    captured graph's conditional node could skip its launches: torch 2.13 captures them,
    CUDAGraph.begin_capture_to_if_node, torch 2.11 does not). The GEMV launches always carry the
    shared expert, and their down either makes its products or, for the tiles, adds each token's
    rows of y (in place of the combine). cfgs: (the GEMV's block sizes, the tiles')."""
    P, D = ids.numel(), x.shape[1]
    tiles = align(ids, gate.shape[0], share=ADAPTIVE_SHARE)
    y = torch.empty(P, D, dtype=torch.float32, device=x.device)    # the tiles' rows, if chosen
    _tile_launches(x, y, tiles, route_w, gate, up, down, fmt, K, cfgs[1])
    return moe_gemv._fused_moe_gemv(x, ids, route_w, gate, up, down, fmt, cfgs[0], shared, planes,
                                    tiles=(tiles[2], y))


def _tile_launches(x, y, tiles, route_w, gate, up, down, fmt, K, cfg):
    """The tile variant's gate_up and down over the align's tiles (sorted_pair, tile_expert,
    use_tiles): y [P, D] fp32, the routing weight applied, written for the pairs in tiles."""
    D, I, P, dev = x.shape[1], gate.shape[1], route_w.numel(), x.device
    max_tiles = tiles[1].numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: exact, not tf32; else unused
    if fmt == "int4":
        _int4_tiles(x, y, tiles, route_w, gate, up, down, K, cfg, precision)
    else:
        h = torch.empty(P, I, dtype=x.dtype, device=dev)                         # [P, I]
        bn, bk, warps, stages, split = cfg["gate_up"]
        part = _gate_up_parts(split, P, I, dev)
        gs, strides, quant, per_row = _weight_args(gate, bk)
        _moe_gate_up_kernel[(triton.cdiv(I, bn), max_tiles, split)](
            x, h, part, *tiles[:2], gate.data, gs, up.data, _weight_args(up, bk)[0], P, K, D, I,
            *strides, *quant, FMT=FORMATS[fmt], BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
            SPLIT=split, SCALE_PER_ROW=per_row, PRECISION=precision,
            launch_pdl=common.PDL, num_warps=warps, num_stages=stages)
        _silu_of_parts(part, h, tiles[2])
        bn, bk, warps, stages = cfg["down"]
        ds, strides, quant, per_row = _weight_args(down, bk)
        _moe_down_kernel[(triton.cdiv(D, bn), max_tiles)](
            h, y, *tiles[:2], route_w, down.data, ds, P, D, I, *strides, *quant,
            FMT=FORMATS[fmt], BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, SCALE_PER_ROW=per_row,
            PRECISION=precision, launch_pdl=common.PDL, num_warps=warps, num_stages=stages)


def _gate_up_parts(split, P, I, device):
    """The tiles' gate_up output where it splits D: each part's fp32 sums of gate and up, [split,
    P, 2, I] (empty for split 1, where gate_up makes h itself)."""
    return torch.empty(split if split > 1 else 0, P, 2, I, dtype=torch.float32, device=device)


def _silu_of_parts(part, h, use_tiles):
    """h [P, I] = silu(the parts' gate sum) * their up sum (_moe_silu_kernel), where gate_up split
    D (part from _gate_up_parts); nothing for one part. use_tiles: the align's choice (the
    adaptive variant) or None."""
    split, P, _, I = part.shape
    if split > 1:
        _moe_silu_kernel[(triton.cdiv(P * I, SILU_BLOCK),)](
            part, h, part if use_tiles is None else use_tiles, P, I=I, SPLIT=split,
            BLOCK=SILU_BLOCK, ADAPTIVE=use_tiles is not None, launch_pdl=common.PDL, num_warps=4)


def _int4_tiles(x, y, tiles, route_w, gate, up, down, K, cfg, precision):
    """The tile variant's INT4 launches: gate_up (split over D where cfg says, then the silu
    launch), down; configs: gate_up (BLOCK_N weight rows, BLOCK_K elements a step, num_warps,
    num_stages, SPLIT), down (the same but SPLIT, then BLOCKS: the row blocks a program makes in
    turn). BLOCK_N: INT4_ROWS; BLOCK_K: a multiple of INT4_K (the section above _int4_mma_row)."""
    (D, I), P, max_tiles = (x.shape[1], gate.shape[1]), route_w.numel(), tiles[1].numel()
    strides = lambda w: (*w.data.stride()[:2], *w.scale.stride()[:2])   # noqa: E731
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)                        # [P, I]
    # _int4_mma_block's packed form where it gives the fp32 form's bits: bf16 x and scales
    packed = x.dtype == torch.bfloat16 and all(w.scale.dtype == torch.bfloat16
                                               for w in (gate, up, down))
    magic = moe_gemv.BF16_MAGIC if packed else moe_gemv.MAGIC
    bn, bk, warps, stages, split = cfg["gate_up"]
    part = _gate_up_parts(split, P, I, x.device)
    _moe_int4_gate_up_kernel[(triton.cdiv(I, bn), max_tiles, split)](
        x, h, part, *tiles[:2], gate.data, gate.scale, up.data, up.scale, P, K, *strides(gate),
        magic, D=D, I=I, GROUP=gate.group, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT=split, EVEN=D % (split * bk) == 0 and I % bn == 0, PACKED=packed,
        PRECISION=precision,
        launch_pdl=common.PDL, num_warps=warps, num_stages=stages)
    _silu_of_parts(part, h, tiles[2])
    bn, bk, warps, stages, blocks = cfg["down"]
    _moe_int4_down_kernel[(triton.cdiv(D, bn * blocks), max_tiles)](
        h, y, *tiles[:2], route_w, down.data, down.scale, P, *strides(down), magic, D=D, I=I,
        GROUP=down.group, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, BLOCKS=blocks,
        EVEN=I % bk == 0 and D % (bn * blocks) == 0, PACKED=packed, PRECISION=precision,
        launch_pdl=common.PDL, num_warps=warps, num_stages=stages)


def with_shared_slot(ids, weights, E):
    """The plain router's choice with the shared expert as expert E, weight 1: [N, K + 1]."""
    return F.pad(ids, (0, 1), value=E), F.pad(weights, (0, 1), value=1.0)


def grouped_mm_available(device, dtype):
    """torch._grouped_mm: bf16 on Hopper or newer; bf16 and float32 on the CPU."""
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.bfloat16, torch.float32)
    if device.type != "cuda":   # e.g. "meta" (sizing a model without memory)
        return False
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


def fused_moe_available(device, dtype):
    """The fused MoE can run here: Triton installed, a bf16 / fp16 / fp32 model, and CUDA, or
    Triton's CPU interpreter (TRITON_INTERPRET=1, which the CPU tests use)."""
    return (HAVE_TRITON and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (torch.device(device).type == "cuda" or interpreting()))


class GroupedExperts(model.Experts):
    """moe "grouped": the token-expert pairs sorted by expert, torch._grouped_mm over each expert's
    pairs with device-side offsets, each expert's weights read in place. Quantized experts: while
    the N*K pairs are fewer than the experts (decode, verify) the plain path dequantizes only the
    routed ones; past that (prefill) every expert is dequantized once per layer."""

    def forward(self, x, ids, weights):
        N, K = ids.shape
        if self.quantized and N * K < self.n_experts:
            return super().forward(x, ids, weights)
        by_expert, order = ids.flatten().sort(stable=True)                # [N*K] pairs by expert
        gate, up, down = (self.weights(p) for p in ("gate_proj", "up_proj", "down_proj"))
        experts = torch.arange(gate.shape[0], device=x.device, dtype=by_expert.dtype)
        offs = torch.searchsorted(by_expert, experts, right=True, out_int32=True)  # group ends
        xs = x[order // K]                                                 # [N*K, D] by expert
        h = F.silu(torch._grouped_mm(xs, gate.mT, offs=offs)) * torch._grouped_mm(xs,
                                                                                  up.mT, offs=offs)
        ys = torch._grouped_mm(h, down.mT, offs=offs)
        y = torch.empty_like(ys).index_copy_(0, order, ys).view(N, K, -1)  # back to token order
        return (model.at_least_f32(y) * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def expert_weights(proj):
    """One projection of model.Experts (a tensor, model.PackedExperts or model.Fp8Experts) as the
    fused MoE reads it."""
    if isinstance(proj, model.PackedExperts):
        return ExpertWeights("int4", proj.weight_packed, proj.weight_scale, group=proj.group)
    if isinstance(proj, model.Fp8Experts):
        return ExpertWeights("fp8", proj.weight, proj.weight_scale_inv, proj.block, proj.offset)
    return ExpertWeights("plain", proj)


class FusedExperts(GroupedExperts):
    """moe "fused": fused_moe (for a few tokens a GEMV per expert on the CUDA cores, else tiles
    of pairs sorted by expert on the device through tl.dot), reading each distinct expert's
    weights once, as stored. Above FUSED_MAX_TOKENS tokens (prefill) the grouped path where
    torch._grouped_mm runs, for plain experts only (it would dequantize every quantized expert of
    the layer at once)."""

    FUSED_MAX_TOKENS = 256

    def runs_fused(self, x):
        return (x.shape[0] <= self.FUSED_MAX_TOKENS or self.quantized
                or not grouped_mm_available(x.device, x.dtype))

    def forward(self, x, ids, weights, stacked=None, shared=None, planes=None):
        """stacked: SharedExpertInLaunch's [E + 1, ...] tensors, for ids that may name expert E;
        shared: its bf16 shared expert's weights beside INT4 or FP8 experts, planes: x as the router
        kernel wrote it for INT4 experts (fused_moe's shared and planes)."""
        if self.runs_fused(x):
            # torch.compile (run.py --compile) leaves the Triton launches alone: a graph break here
            # (around the whole of fused, which also builds the kernel's weight descriptors)
            return torch.compiler.disable(self.fused)(x, ids, weights, stacked,
                                                      shared=shared, planes=planes)
        return super().forward(x, ids, weights)

    # variant: fused_moe's
    def fused(self, x, ids, weights, stacked=None, variant=None, shared=None, planes=None):
        projs = stacked or [getattr(self, p) for p in ("gate_proj", "up_proj", "down_proj")]
        return fused_moe(x, ids, weights, *map(expert_weights, projs), variant=variant,
                         shared=shared, planes=planes)


class SharedExpertInLaunch(AttachAgain, model.MoE):
    """"shared_expert": the shared expert inside the fused launch. Plain routed experts: it is
    expert E, chosen by every token with weight 1 (K + 1 pairs a token); its weights move in as the
    last rows of [E + 1, ...] tensors, both modules' parameters becoming views of them, so a
    checkpoint loaded afterwards lands there under the same names. INT4 or FP8 routed experts
    (Kimi-K2.5; Kimi-K2-Instruct's FP8 checkpoint, whose shared expert is dequantized to bf16 at
    load): the GEMV launches take its weights beside theirs (fused_moe's shared), where the rule
    picks the GEMV variant, up to moe_gemv.SHARED_MAX_TOKENS tokens; above, it runs alone beside
    them (shared_alone: its gate and up one GEMM over their stacked weights, its down GEMM adding
    onto the routed output). gate_kernel (the combination with "router", declared in swaps.py): the
    router kernel writes the shared slot, and beside INT4 experts the activation planes they read
    (fused_moe's planes), so the launch that permutes x goes. Elsewhere (past FusedExperts' token
    limit, quantized tiles) the plain sum runs, the shared expert alone. Its experts are
    FusedExperts (a prerequisite in swaps.py's table)."""

    gate_kernel = False

    def attach(self):
        ex, sh = self.experts, self.shared_experts
        self.stacked = self.shared_gate_up = None
        if ex.quantized:
            self.shared_gate_up = stack_rows(sh.gate_proj, sh.up_proj)   # [2 I, D]: gate | up
            return
        self.stacked = []
        for routed, shared in ((ex.gate_proj, sh.gate_proj.weight), (ex.up_proj, sh.up_proj.weight),
                               (ex.down_proj, sh.down_proj.weight)):
            both = torch.cat([routed.data, shared.data.unsqueeze(0)])    # [E + 1, out, in]
            routed.data, shared.data = both[:-1], both[-1]
            self.stacked.append(both)

    def paths(self, x):
        """How partial_sum(x) runs, as two flags: the routed experts through fused_moe (else the
        plain sum: past FusedExperts' token limit, or quantized experts past the GEMV rule's GEMV
        or adaptive), and
        the shared expert inside that launch (else alone). The component table asks it too, to
        count the shared expert's bytes where its time goes."""
        ex, K = self.experts, self.gate.args.num_experts_per_tok
        w = expert_weights(ex.gate_proj)
        fused = ex.runs_fused(x) and (not ex.quantized
                                      or gemv_rule(w.fmt, x.shape[0], K, w.shape[1]) != "dot")
        return fused, fused and (self.stacked is not None
                                 or x.shape[0] <= moe_gemv.SHARED_MAX_TOKENS[w.fmt])

    def partial_sum(self, x):
        ex, sh = self.experts, self.shared_experts
        fused, in_launch = self.paths(x)
        if not fused:
            return super().partial_sum(x)
        if self.stacked is None:
            # INT4 experts read x as activation planes: the router kernel writes them (one launch
            # less)
            planes = None
            if self.gate_kernel and isinstance(ex.gate_proj, model.PackedExperts):
                planes = moe_gemv.empty_planes(x)
            ids, weights = self.gate(x) if planes is None else self.gate(x, planes=planes)
            if not in_launch:
                return self.shared_alone(x, ex(x, ids, weights, planes=planes))
            return ex(x, ids, weights,
                      shared=[sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight],
                      planes=planes)
        if self.gate_kernel:
            ids, weights = self.gate(x, shared_slot=True)
        else:
            ids, weights = with_shared_slot(*self.gate(x), self.experts.n_experts)
        return self.experts(x, ids, weights, self.stacked)

    def shared_alone(self, x, routed):
        """routed + the shared expert of x, in place: gate and up one GEMM over their stacked
        weights, the MLP's SwiGLU (a kernel where "silu_mul" swapped it), the down GEMM adding its
        product into routed (a partial sum, as the shared expert's own: the MoE all-reduces)."""
        sh = self.shared_experts
        h = sh.act(*F.linear(x, self.shared_gate_up).chunk(2, -1))
        return routed.addmm_(h, sh.down_proj.weight.t())

    @staticmethod
    def applies(moe):
        """One plain shared expert of a routed expert's shape (Kimi-K2, DeepSeek-V3:
        n_shared_experts 1): beside plain routed experts of its dtype, or INT4 or FP8 ones (it in
        the model's dtype)."""
        ex, sh = moe.experts, moe.shared_experts
        w = ex.gate_proj
        if isinstance(w, model.PackedExperts):
            dtype, shape = w.weight_scale.dtype, [w.weight_packed.shape[1],
                                                  w.weight_packed.shape[2] * 8]
        elif isinstance(w, model.Fp8Experts):
            dtype, shape = w.dtype, list(w.weight.shape[1:])
        else:
            dtype, shape = w.dtype, list(w.shape[1:])
        return sh.gate_proj.weight.dtype == dtype and list(sh.gate_proj.weight.shape) == shape

