"""Routed experts, GEMV-shaped: fused_moe's variant for a few tokens (CUDA-core products, INT4
unpacked in registers, a bf16 shared expert inside the launch), and the expert weights as stored."""
import math
from dataclasses import dataclass

import torch

from . import common
from .common import _counters, _jit, _last_program, _silu_mul, _wait_for_prior, tl, triton


@dataclass
class ExpertWeights:
    """One projection of E experts as stored; W[e] has the logical shape [out, in].

    fmt "plain": data [E, out, in] bf16 / fp16 / fp32.
    fmt "fp8":   data [E, out, in] float8_e4m3fn; scale [E, row blocks, col blocks] fp32 (the
                 checkpoint's weight_scale_inv over this rank's slice); W[r, c] = data[r, c] *
                 scale[(r + offset[0]) // block[0], (c + offset[1]) // block[1]] (a slice may start
                 inside a block: offset).
    fmt "int4":  data [E, out, in/8] int32, element c in word c//8 at bits 4*(c%8)..+3 as q + 8;
                 scale [E, out, in/group]; W[r, c] = (nibble - 8) * scale[r, c // group]."""
    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple = (1, 1)
    offset: tuple = (0, 0)
    group: int = 1

    @property
    def shape(self):  # [E, out, in]
        E, out, inp = self.data.shape
        return E, out, inp * 8 if self.fmt == "int4" else inp


FORMATS = {"plain": 0, "fp8": 1, "int4": 2}


def _weight_args(w, block_k):
    """Pointers, strides and FP8 block constants (block, offset) of one ExpertWeights, in the
    kernels' order."""
    scale = w.scale if w.scale is not None else w.data   # plain: never read
    strides = (w.data.stride(0), w.data.stride(1), scale.stride(0), scale.stride(1),
               scale.stride(2) if scale.dim() == 3 else 0)
    per_row = w.fmt == "fp8" and w.block[1] % block_k == 0 and w.offset[1] % block_k == 0
    return scale, strides, (*w.block, *w.offset), per_row


# Routed experts, GEMV-shaped (decode and verify: a few tokens)
#
# With 1-4 tokens most experts serve one token, and the tile variant's tiles of 16 pairs run tl.dot
# on 15 padding rows with too few programs to keep HBM busy (8 experts x 256 rows at decode). Here
# the products run on the CUDA cores instead (dequantized weights times the activation,
# broadcast-multiply into an fp32 [BLOCK_N, BLOCK_K] accumulator, one tl.sum per program), with no
# align and no combine launch. gate_up: a program per (BLOCK_N rows of I, pair), each its own pass
# over its expert's rows (a few tokens in bf16 and FP8: GEMV_LEADER_TOKENS); the pairs of an
# expert that several tokens picked run side by side, the later passes reading the rows mostly
# from L2 (one program serving them all, one pass after another, is slower where tokens share
# experts: python -m kernels.bench --moe --distinct 8). In INT4 a program serving 2 to 8 pairs of
# its expert at once (the row unpacked once, the activations a tile's rows) is at most 10% faster
# with 8 experts for 2 to 32 tokens and 8-150% slower under uniform routing: the products on the
# CUDA cores, not the unpack, bound it (benchmarks/shapes/kernels_int4_gemv_pairs.json).
# Writes h = silu(g) * u * route_w per pair, fp32 [P, I] (INT4: in the plane order below).
# down: a program per (token, BLOCK_N rows of D), token-major so no combine is needed: the K
# experts of the token, each [BLOCK_N, I], times that pair's h, summed in registers, stored once.
# Programs of one row block for all tokens are adjacent in launch order, so an expert shared by
# tokens is fetched from HBM about once and read from L2 by the others. So this variant issues an
# expert's bytes once a pair, not once (the tile variant reads each distinct expert once). A bf16
# shared expert beside quantized experts (INT4 and FP8: fused_moe's shared) rides in the same two
# launches: SHARED_SPLIT more programs a row block of gate_up compute its gate and up over slices
# of D for every token, one token after another (_shared_gate_up, the loop form; FP8 from
# SHARED_DOT_MIN_TOKENS the dot form instead: 16-row tiles times all tokens at once through tl.dot,
# _shared_gate_up_dot); the last of them to finish (an atomic counter a row block or tile, as
# norm_gemv's) adds the splits in split order and stores h = silu(g) * u once, fp32 [N, I]
# (_shared_h), and each down program adds its rows from that one vector a token (_shared_down).
# INT4 without unpacking to natural order: nibble j of word w is element 8w + j, so
# the activation comes as 8 planes (plane j = elements 8w + j, contiguous in w: x is permuted once
# per call, or the router kernel wrote them beside its logits; h is written that way by gate_up) and
# each plane meets nibble j of the same words. A nibble becomes a float by the exponent trick
# (_nibble), and the group scale multiplies each word's 8 products once. bf16 activations (the
# model's) take the packed form instead (above _fma2): 4 planes of bf16 pairs, two elements an
# instruction, h bf16 (as the plain module's).
# The INT4 kernels are their own (see above _nibble): whole 16-byte words a thread, unmasked where
# the shapes divide, the next step's words in flight, down's K experts in one tile.

# Block sizes by format, up to / above GEMV_SMALL_TOKENS tokens: dict(gate_up=(BLOCK_N, BLOCK_K,
# UNROLL, num_warps, SUB), down=(BLOCK_N, BLOCK_K, num_warps, SUB)); INT4: dict(gate_up=(BLOCK_N,
# BLOCK_W words a step, num_warps), down=(BLOCK_N, BLOCK_C words a step over the K experts side by
# side, num_warps)). A tile has BLOCK_N * SUB rows of BLOCK_K: SUB > 1 (FP8) lays SUB consecutive
# 128-column scale blocks of a weight row out as rows of their own, so a step is one scale a tile
# row and still 32 threads a weight row (at decode only 2048 gate/up rows exist). bf16 gate_up: 4
# rows, one step of 512 in flight at decode (with the shared expert as a 9th pair at I 256, 64 row
# blocks x 9 pairs: 576 programs share the SMs), steps of 256 from 3 tokens; down 8 rows at
# decode, 16 above. FP8: down 16 rows.
# INT4: gate_up 1 row of 128 words, down 4 rows of 128 (8 rows of 256 on 2 warps would shuffle the
# shared expert's tiles through shared memory). Re-derived by `python -m kernels.bench --moe --sweep
# gemv` (INT4 with the shared expert: add --shared).
GEMV_CONFIGS = {
    "plain": (dict(gate_up=(4, 512, 1, 4, 1), down=(8, 256, 4, 1)),
              dict(gate_up=(4, 256, 4, 4, 1), down=(16, 256, 4, 1))),
    "fp8": (dict(gate_up=(4, 128, 2, 4, 4), down=(16, 128, 4, 2)),) * 2,
    "int4": (dict(gate_up=(1, 128, 1), down=(4, 128, 1)),) * 2}
# in tokens, not pairs: a shared expert's extra slot a token moves no boundary
GEMV_SMALL_TOKENS = 2
# The GEMV variant up to this many tokens (fused_moe's rule, variant=None; in tokens, not pairs, so
# a shared expert routed as one more slot a token moves no boundary), by format and by a rank's
# expert width I (Kimi-K2's 2048 split over TP 8, 4, 2), from `python -m kernels.bench --moe [--tp
# N]` (D 7168, 384 experts, 1 to 32 tokens, uniform routing) on the H200. At TP 8 (I 256):
#  - FP8: the GEMV at 1.51-2.20x its floor, the tiles at 7.11x (1 token) down to 1.63x (32
#    tokens); the tiles are 7% slower at 16 tokens (232.7 against 216.6 us) and 5.5% faster at 32
#    (393.4 against 416.4: BENCHMARKS.md, Kernel level, shapes/kernels_crossover_tip.json), but
#    there the GEMV also carries the bf16 shared expert, which beside the tiles runs alone (12.7 us
#    a layer at 32 tokens: the INT4 shared-forms table there): 32;
#  - INT4: the GEMV at 1.6-2.3x from 2 tokens (2.9x at 1); the tiles in the MMA's operand order
#    (moe.py's section above _int4_mma_row), on an H100: 1.67x, 1.54x, 1.41x at 8, 16, 32 tokens
#    against the GEMV's 1.26x, 1.34x, 1.38x with the router's planes (BENCHMARKS.md, Routing,
#    "INT4's tiles in the MMA's operand order"): 32;
#  - bf16, 128 experts and the shared expert folded in as expert 129 (SharedExpertInLaunch: every
#    token picks it; run.py's shapes): the GEMV wins at 1 and 2 tokens (30 against 54 us, 53
#    against 59), the tiles from 3 (72 against 81): 2.
# At TP 4 (I 512) and TP 2 (I 1024), no shared expert, us a layer (benchmarks/shapes/
# kernels_tp{4,2}_moe.json, kernels_tp{4,2}_fp8_16to32_moe.json): FP8 GEMV / tiles 395 / 407 at 16
# tokens, 494 / 499 at 20, 589 / 581 at 24 and 780 / 699 at 32 (TP 4), 771 / 782, 957 / 953, 1151 /
# 1075 and 1518 / 1313 (TP 2): 20; INT4 the GEMV at every count (TP 4, the MMA-order tiles with
# the configs before moe._int4_configs' re-sweep, H100: 158.8 / 220.4 at 8 tokens, 583.1 / 631.0
# at 32, routing/kernels_int4_mma_tp4_ae12fb0.json; TP 2 against an older INT4 tile kernel,
# c1c0373's, 3.3-4.6x slower): 32; bf16 172 / 194 at 2 and 245 / 242 at 3 at TP 2: 2. bf16 at TP 4
# stays at 2 though its GEMV led up to 8 tokens there (315 / 320 at 8, 615 / 579 at 16): those
# rows lack the shared expert that SharedExpertInLaunch folds in as one more expert a token, which
# the GEMV reads once a token and the tiles once, as in TP 8's rows; they are not measured with it.
GEMV_MAX_TOKENS = {"plain": {256: 2, 512: 2, 1024: 2}, "fp8": {256: 32, 512: 20, 1024: 20},
                   "int4": {256: 32, 512: 32, 1024: 32}}


def gemv_max_tokens(fmt, I):
    """GEMV_MAX_TOKENS for weight format fmt at the measured expert width nearest I (by ratio: a
    tiny test model's takes TP 8's, an unsplit 2048 TP 2's)."""
    by_width = GEMV_MAX_TOKENS[fmt]
    return by_width[min(by_width, key=lambda w: abs(math.log2(I / w)))]


GEMV_MAX_PAIRS = 1024   # a program a pair and row block: the largest call measured and tested
# Up to this many tokens gate_up serves an expert's pairs from its first pair's program, one pass
# after another (the "leader" form), above it a program a pair (INT4: always). bf16, at its 1-2
# tokens: the leader form's compiled loop keeps fewer registers live, 18 against 24 us a layer's
# gate_up at 1 token (python -m kernels.bench --moe --formats plain --variants gemv). FP8 with its
# shared expert in the launch: verify of 3 and 4 tokens 0.07 and 0.12 ms faster a step in the
# leader form, 5 to 32 tokens 0.15 to 0.76 ms slower (run.py --quant fp8, both forms).
GEMV_LEADER_TOKENS = {"plain": 2, "fp8": 4}


def _gemv_configs(fmt, N, on_gpu):
    if not on_gpu:  # the CPU interpreter: few, large programs
        if fmt == "int4":
            return dict(gate_up=(32, 8, 4), down=(64, 32, 4))
        return dict(gate_up=(32, 64, 1, 4, 1), down=(64, 64, 4, 1))
    return GEMV_CONFIGS[fmt][N > GEMV_SMALL_TOKENS]


@_jit
def _gemv_step(acc, v_ptr, k0, K_IN, w_ptr, s_ptr, n, kb, n_ok, stride_wn, stride_sr, stride_sc,
               off_r, off_c,
               FMT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr,
               SCALE_PER_ROW: tl.constexpr):
    """acc [R, BLOCK_K] fp32 += W[n, k] * v[k] elementwise for tile row r: n[r], k = k0 + kb[r] +
    [0, BLOCK_K) (summed over k by the caller). kb: [R] column offsets (FP8 sub-blocks) or 0. Plain
    and FP8 (INT4 has kernels of its own below).

    v_ptr: the activation row [K_IN]. w_ptr, s_ptr: one expert's weight and scale (ExpertWeights
    layouts)."""
    if FMT == 0:                                         # the activation broadcast over the rows
        k = k0 + tl.arange(0, BLOCK_K)
        wt = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :],
                     mask=n_ok[:, None] & (k < K_IN)[None, :],
                     other=0.0)
        acc += wt.to(tl.float32) * tl.load(v_ptr + k, mask=k < K_IN,
                                           other=0.0).to(tl.float32)[None, :]
    else:
        k = k0 + kb[:, None] + tl.arange(0, BLOCK_K)[None, :]              # [R, BLOCK_K]
        k_ok = k < K_IN
        ok = n_ok[:, None] & k_ok
        wt = tl.load(w_ptr + n[:, None] * stride_wn + k, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + k, mask=k_ok, other=0.0).to(tl.float32)  # per tile row (sub-blocks)
        if SCALE_PER_ROW:
            s = tl.load(s_ptr + ((n + off_r) // BLOCK_R) * stride_sr
                        + ((k0 + kb + off_c) // BLOCK_C) * stride_sc,
                        mask=n_ok & (k0 + kb < K_IN), other=0.0)
            acc += wt * s[:, None] * v
        else:
            acc += wt * tl.load(s_ptr + ((n + off_r) // BLOCK_R)[:, None] * stride_sr
                                + ((k + off_c) // BLOCK_C) * stride_sc, mask=ok, other=0.0) * v
    return acc


@_jit
def _expert_pairs(ids_ptr, p, P, P_PAD: tl.constexpr):
    """The pairs of pair p's expert: (same [P_PAD] bool, rank [P_PAD]: each one's place among them,
    leader: p is the first of them)."""
    q = tl.arange(0, P_PAD)
    same = tl.load(ids_ptr + q, mask=q < P, other=-1) == tl.load(ids_ptr + p)
    return same, tl.cumsum(same.to(tl.int32), 0) - 1, tl.min(tl.where(same, q, P_PAD), 0) == p


@_jit
def _shared_gate_up(x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, p, pid_n,
                    D: tl.constexpr,
                    I: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr,
                    EVEN: tl.constexpr):
    """The bf16 shared expert's gate and up rows of row block pid_n (BLOCK_N rows of I) over split
    s = p + SPLIT of D, for every token: raw sums into part [2, SPLIT, N, I] fp32; the row block's
    last split to finish makes h = silu(g) * u of them into hs [N, I] fp32 (_shared_h; count_ptr:
    the counters, one a row block). D / SPLIT columns a split (SHARED_SPLIT makes it about as many
    bytes a program as a routed expert's quantized rows). x_ptr: the activations [N, D]; sg_ptr,
    su_ptr: the shared gate and up weights [I, D]. The GEMV kernels run it in SPLIT programs of
    their own for each row block, numbered first (pair numbers p in [-SPLIT, 0)) and so launched
    first, since each runs its N tokens one after another."""
    s = p + SPLIT
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    CHUNK: tl.constexpr = (D + SPLIT - 1) // SPLIT
    hi = tl.minimum((s + 1) * CHUNK, D)
    for t in range(N):
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(s * CHUNK, hi, BLOCK_K):
            k = (k0 + tl.arange(0, BLOCK_K))[None, :]
            if EVEN:
                xv = tl.load(x_ptr + t * D + k).to(tl.float32)
                gw, uw = tl.load(sg_ptr + n[:, None] * D + k), tl.load(su_ptr + n[:, None] * D + k)
            else:
                ok = n_ok[:, None] & (k < hi)
                xv = tl.load(x_ptr + t * D + k, mask=k < hi, other=0.0).to(tl.float32)
                gw = tl.load(sg_ptr + n[:, None] * D + k, mask=ok, other=0.0)
                uw = tl.load(su_ptr + n[:, None] * D + k, mask=ok, other=0.0)
            acc_g += gw.to(tl.float32) * xv
            acc_u += uw.to(tl.float32) * xv
        tl.store(part_ptr + (s * N + t) * I + n, tl.sum(acc_g, 1), mask=n_ok)
        tl.store(part_ptr + ((SPLIT + s) * N + t) * I + n, tl.sum(acc_u, 1), mask=n_ok)
    _shared_h(part_ptr, hs_ptr, count_ptr, N, pid_n, n, n_ok, I, SPLIT)


@_jit
def _shared_part(x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, p, pid_n,
                 D: tl.constexpr, I: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                 SHARED_K: tl.constexpr, EVEN_SHARED: tl.constexpr, SLICES: tl.constexpr,
                 N_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """A GEMV gate_up kernel's shared program p (in [-SPLIT, 0)) of row block pid_n: the loop form
    (_shared_gate_up) or, SLICES > 0, the dot form (_shared_gate_up_dot)."""
    if SLICES > 0:
        _shared_gate_up_dot(x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N,
                            pid_n * SPLIT + p + SPLIT, D, I, SLICES, N_PAD, SHARED_K, PRECISION)
    else:
        _shared_gate_up(x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, p, pid_n, D, I,
                        SPLIT, BLOCK_N, SHARED_K, EVEN_SHARED)


@_jit
def _shared_gate_up_dot(x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, f,
                        D: tl.constexpr, I: tl.constexpr, SLICES: tl.constexpr,
                        N_PAD: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """_shared_gate_up with the tokens as a tl.dot's columns, so each weight is read once for all
    N tokens (the loop form reads its slice once a token). Shared program f (of cdiv(I, BLOCK_N) *
    SPLIT) takes rows 16 (f // SLICES) .. + 16 of gate and up over slice f % SLICES of D, if
    that tile exists (f < cdiv(I, 16) * SLICES; the other shared programs return): [16, N_PAD]
    sums a projection into part [2, SLICES, N, I], then _shared_h with a counter a tile."""
    tile, s = f // SLICES, f % SLICES
    if tile >= (I + 15) // 16:
        return
    n = tile * 16 + tl.arange(0, 16)
    n_ok = n < I
    t = tl.arange(0, N_PAD)
    CHUNK: tl.constexpr = ((D + SLICES - 1) // SLICES + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    acc_g = tl.zeros([16, N_PAD], tl.float32)
    acc_u = tl.zeros([16, N_PAD], tl.float32)
    for k0 in range(s * CHUNK, tl.minimum((s + 1) * CHUNK, D), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < D
        xt = tl.load(x_ptr + t[None, :] * D + k[:, None], mask=k_ok[:, None] & (t < N)[None, :],
                     other=0.0)                                              # [BLOCK_K, N_PAD]
        w_ok = n_ok[:, None] & k_ok[None, :]
        gw = tl.load(sg_ptr + n[:, None] * D + k[None, :], mask=w_ok, other=0.0)
        uw = tl.load(su_ptr + n[:, None] * D + k[None, :], mask=w_ok, other=0.0)
        if INTERPRETED:  # Triton's interpreter: its tl.dot of bf16 operands is wrong; fp32 exact
            gw, uw, xt = gw.to(tl.float32), uw.to(tl.float32), xt.to(tl.float32)
        acc_g = tl.dot(gw, xt, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(uw, xt, acc_u, input_precision=PRECISION)
    ok = n_ok[:, None] & (t < N)[None, :]
    tl.store(part_ptr + (s * N + t[None, :]) * I + n[:, None], acc_g, mask=ok)
    tl.store(part_ptr + ((SLICES + s) * N + t[None, :]) * I + n[:, None], acc_u, mask=ok)
    _shared_h(part_ptr, hs_ptr, count_ptr, N, tile, n, n_ok, I, SLICES)


@_jit
def _shared_h(part_ptr, hs_ptr, count_ptr, N, pid_n, n, n_ok, I: tl.constexpr, SPLIT: tl.constexpr):
    """Once this split's partial sums are stored: the last of row block pid_n's SPLIT programs to
    finish adds every split's g and u (part [2, SPLIT, N, I]) in split order and stores h = silu(g)
    * u into hs [N, I] at rows n, for every token; it resets the row block's counter
    count_ptr[pid_n] to 0."""
    if _last_program(count_ptr, pid_n, SPLIT):   # the other splits are stored: add them
        for t in range(N):
            g = tl.zeros(n.shape, tl.float32)
            u = tl.zeros(n.shape, tl.float32)
            for s in tl.static_range(SPLIT):  # in split order (.cg: from L2, never a stale L1 line)
                g += tl.load(part_ptr + (s * N + t) * I + n, mask=n_ok, other=0.0,
                             cache_modifier=".cg")
                u += tl.load(part_ptr + ((SPLIT + s) * N + t) * I + n, mask=n_ok, other=0.0,
                             cache_modifier=".cg")
            tl.store(hs_ptr + t * I + n, _silu_mul(g, u), mask=n_ok)


@_jit
def _shared_down(hs_ptr, sd_ptr, token, n, n_ok, I: tl.constexpr, I_PAD: tl.constexpr):
    """The bf16 shared expert's down rows n for one token, fp32 [BLOCK_N]: its down weights sd_ptr
    [D, I] times the token's h = silu(g) * u, row `token` of gate_up's hs [N, I] fp32 (_shared_h;
    I_PAD: a power of two >= I)."""
    i = tl.arange(0, I_PAD)[None, :]
    h = tl.load(hs_ptr + token * I + i, mask=i < I, other=0.0)
    wt = tl.load(sd_ptr + n[:, None] * I + i, mask=n_ok[:, None] & (i < I),
                 other=0.0).to(tl.float32)
    return tl.sum(wt * h, 1)


@_jit
def _moe_gemv_gate_up_kernel(v_ptr, h_ptr, ids_ptr, route_w_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, P,
                             stride_we, stride_wn, stride_se, stride_sr, stride_sc, off_r, off_c,
                             TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                             FMT: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                             UNROLL: tl.constexpr, SCALE_PER_ROW: tl.constexpr, part_ptr, hs_ptr,
                             count_ptr,
                             sg_ptr, su_ptr, N, SPLIT: tl.constexpr, SHARED_K: tl.constexpr,
                             EVEN_SHARED: tl.constexpr, SHARED_SLICES: tl.constexpr,
                             SHARED_N_PAD: tl.constexpr, SHARED_PRECISION: tl.constexpr,
                             LEADER: tl.constexpr, P_PAD: tl.constexpr, use_tiles_ptr,
                             ADAPTIVE: tl.constexpr):
    """h[p, i] = silu(gate[e] @ x[n]) * (up[e] @ x[n]) * route_w[p] for pair p = n*K + k, e = ids[p]
    (plain and FP8 weights).

    v_ptr: the activations [N, D] (x's dtype). h_ptr: fp32 [P, I] out. ids_ptr: int [P];
    route_w_ptr: fp32 [P]. g_ptr / u_ptr, gs_ptr / us_ptr: gate and up weights and scales, [E, I, D]
    as ExpertWeights (same strides). Grid: (cdiv(I, BLOCK_N), SPLIT + P); pair p is program
    SPLIT + p; LEADER: only the first pair of each expert works, for all of its P pairs (P_PAD: a
    power of two >= P). SPLIT > 0: the first SPLIT programs of each row block take a bf16 shared
    expert (_shared_gate_up; part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N: its arguments;
    SHARED_K columns a step; SHARED_SLICES > 0: its dot form, _shared_gate_up_dot). ADAPTIVE: the
    programs return where use_tiles_ptr (int32 [1]) is 1: the tiles served the call (fused_moe's
    adaptive variant)."""
    _wait_for_prior()
    pid_n, p = tl.program_id(0), tl.program_id(1) - SPLIT
    if SPLIT > 0:
        if p < 0:
            _shared_part(v_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, p, pid_n, D, I,
                         SPLIT, BLOCK_N, SHARED_K, EVEN_SHARED, SHARED_SLICES, SHARED_N_PAD,
                         SHARED_PRECISION)
            return
    if ADAPTIVE:
        if tl.load(use_tiles_ptr) != 0:
            return
    e = tl.load(ids_ptr + p).to(tl.int64)
    g_ptr, u_ptr = g_ptr + e * stride_we, u_ptr + e * stride_we
    gs_ptr, us_ptr = gs_ptr + e * stride_se, us_ptr + e * stride_se
    r = tl.arange(0, BLOCK_N * SUB)  # tile rows: (row of I, sub-block)
    n, kb = pid_n * BLOCK_N + r // SUB, (r % SUB) * BLOCK_K
    if LEADER:  # GEMV_LEADER_TOKENS: the expert's first pair serves all of its pairs
        same, rank, leader = _expert_pairs(ids_ptr, p, P, P_PAD)
        if not leader:
            return
        q = tl.arange(0, P_PAD)
        for c in range(tl.sum(same.to(tl.int32), 0)):                      # each pair of the expert
            _gate_up_pass(tl.sum(tl.where(same & (rank == c), q, 0), 0), v_ptr, h_ptr, route_w_ptr,
                          g_ptr, gs_ptr, u_ptr, us_ptr, n, kb, pid_n, stride_wn, stride_sr,
                          stride_sc, off_r, off_c, TOPK, D, I, FMT, BLOCK_R, BLOCK_C, BLOCK_N,
                          BLOCK_K, SUB, UNROLL, SCALE_PER_ROW)
    else:
        _gate_up_pass(p, v_ptr, h_ptr, route_w_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, n, kb, pid_n,
                      stride_wn, stride_sr, stride_sc, off_r, off_c, TOPK, D, I, FMT, BLOCK_R,
                      BLOCK_C, BLOCK_N, BLOCK_K, SUB, UNROLL, SCALE_PER_ROW)


@_jit
def _gate_up_pass(pair, v_ptr, h_ptr, route_w_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, n, kb, pid_n,
                  stride_wn, stride_sr, stride_sc, off_r, off_c, TOPK: tl.constexpr,
                  D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SUB: tl.constexpr, UNROLL: tl.constexpr, SCALE_PER_ROW: tl.constexpr):
    """h of one pair at the tile rows n (row of I, sub-block kb): a pass over its expert's gate
    and up rows (pointers and constants as _moe_gemv_gate_up_kernel's, offset to the expert)."""
    n_ok = n < I
    v = v_ptr + (pair // TOPK).to(tl.int64) * D
    acc_g = tl.zeros([BLOCK_N * SUB, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N * SUB, BLOCK_K], tl.float32)
    for k0 in range(0, D, BLOCK_K * SUB * UNROLL):
        for s in tl.static_range(UNROLL):  # independent loads in flight
            k1 = k0 + s * BLOCK_K * SUB
            acc_g = _gemv_step(acc_g, v, k1, D, g_ptr, gs_ptr, n, kb, n_ok, stride_wn, stride_sr,
                               stride_sc, off_r, off_c, FMT, BLOCK_K, BLOCK_R, BLOCK_C,
                               SCALE_PER_ROW)
            acc_u = _gemv_step(acc_u, v, k1, D, u_ptr, us_ptr, n, kb, n_ok, stride_wn, stride_sr,
                               stride_sc, off_r, off_c, FMT, BLOCK_K, BLOCK_R, BLOCK_C,
                               SCALE_PER_ROW)
    g, u = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
    if SUB > 1:  # the sub-blocks of each row
        g, u = tl.sum(tl.reshape(g, [BLOCK_N, SUB]), 1), tl.sum(tl.reshape(u, [BLOCK_N, SUB]), 1)
    h = _silu_mul(g, u) * tl.load(route_w_ptr + pair)
    i = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + pair.to(tl.int64) * I + i, h, mask=i < I)


@_jit
def _tile_rows(use_tiles, y_ptr, token, d, d_ok, TOPK: tl.constexpr, D: tl.constexpr):
    """Where use_tiles (fused_moe's adaptive variant: the tiles served the call), the sum in k order
    of the token's K rows y[pair, d] (the tiles' output, fp32 [P, D], routing weights in); else
    zeros (nothing loaded). fp32 [len(d)]."""
    y = tl.zeros(d.shape, tl.float32)
    for k in tl.static_range(TOPK):
        pair = token * TOPK + k
        y += tl.load(y_ptr + pair.to(tl.int64) * D + d, mask=d_ok & use_tiles, other=0.0)
    return y


@_jit
def _moe_gemv_down_kernel(h_ptr, out_ptr, ids_ptr, w_ptr, s_ptr,
                          stride_we, stride_wn, stride_se, stride_sr, stride_sc, off_r, off_c,
                          TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                          SCALE_PER_ROW: tl.constexpr, hs_ptr, sd_ptr, SHARED: tl.constexpr,
                          I_PAD: tl.constexpr, use_tiles_ptr, y_ptr, ADAPTIVE: tl.constexpr):
    """out[n, d] = sum_k (down[e] @ h[n*K + k])[d], e = ids[n*K + k] (route weights are in h; plain
    and FP8).

    h_ptr: fp32 [P, I] from gate_up. out_ptr: [N, D], x's dtype. w_ptr / s_ptr: down weights and
    scales, [E, D, I] as ExpertWeights. SHARED: a bf16 shared expert too, weight 1 (_shared_down;
    hs_ptr, sd_ptr: its arguments). ADAPTIVE: where use_tiles_ptr (int32 [1]) is 1 the tiles served
    the call, and each token's K rows of their y_ptr (fp32 [P, D]) are summed in place of the
    products (_tile_rows).
    Grid: (N, cdiv(D, BLOCK_N))."""
    _wait_for_prior()
    token, pid_n = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BLOCK_N * SUB)
    n, kb = pid_n * BLOCK_N + r // SUB, (r % SUB) * BLOCK_K
    n_ok = n < D
    acc = tl.zeros([BLOCK_N * SUB, BLOCK_K], tl.float32)
    gemv = True
    if ADAPTIVE:
        gemv = tl.load(use_tiles_ptr) == 0
    # the branch inside the loop: the ids' loads issue beside the flag's, not after it (the branch
    # around the loop: 3-24 µs more a layer at 8 to 32 tokens, FP8, python -m kernels.bench)
    for k in tl.static_range(TOPK):                                         # the token's K experts
        pair = token * TOPK + k
        e = tl.load(ids_ptr + pair).to(tl.int64)
        if gemv:
            for k0 in tl.static_range(0, I, BLOCK_K * SUB):
                acc = _gemv_step(acc, h_ptr + pair.to(tl.int64) * I, k0, I, w_ptr + e * stride_we,
                                 s_ptr + e * stride_se,
                                 n, kb, n_ok, stride_wn, stride_sr, stride_sc, off_r, off_c,
                                 FMT, BLOCK_K, BLOCK_R, BLOCK_C, SCALE_PER_ROW)
    y = tl.sum(acc, 1)
    if SUB > 1:
        y = tl.sum(tl.reshape(y, [BLOCK_N, SUB]), 1)
    d = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if ADAPTIVE:
        y += _tile_rows(gemv == 0, y_ptr, token, d, d < D, TOPK, D)
    if SHARED:
        y += _shared_down(hs_ptr, sd_ptr, token, d, d < D, I, I_PAD)
    tl.store(out_ptr + token.to(tl.int64) * D + d, y.to(out_ptr.dtype.element_ty), mask=d < D)


# INT4 GEMV kernels. A weight tile is [rows, words] (word w holds elements 8w..8w+7); with one warp
# a program and 128 words a step (the defaults) each thread holds the same 4 words (a 16-byte load)
# of every row of the tile, so the activation planes loaded for its words serve all of its rows,
# gate's and up's, in the tile's own layout (sm_90 code checked: no shuffle through shared memory in
# a step). Where the shapes divide the blocks (EVEN, Kimi-K2's) no load is masked: a masked load
# zeroes its destination registers first, one move a word. gate_up issues the next step's words
# before it unpacks this step's (Triton pipelines only loads that feed tl.dot). down lays the
# token's K experts side by side as columns of one tile, so all of their words are in flight at once
# instead of one expert after another.

@_jit
def _nibble(words, high, J: tl.constexpr, magic):
    """(nibble J of each word) - 8 in fp32, exactly: the nibble ORed into the mantissa of 2^23 is
    the float 2^23 + nib * 2^b (b its bit position), and one FMA scales and subtracts. A float's
    mantissa has 23 bits: nibbles 5-7 come from high = words >> 12 (bits 8-19). magic: 0x4B000000,
    the bits of 2^23, passed at run time so that the AND and the OR compile to one instruction (LOP3
    takes one immediate: were both constants known at compile time, the sm_90 code would hold two
    instructions a nibble)."""
    if J < 5:
        f = ((words & (15 << (4 * J))) | magic).to(tl.float32, bitcast=True)
        return f * (1.0 / (1 << (4 * J))) - (8388608.0 / (1 << (4 * J)) + 8.0)
    else:
        f = ((high & (15 << (4 * J - 12))) | magic).to(tl.float32, bitcast=True)
        return f * (1.0 / (1 << (4 * J - 12))) - (8388608.0 / (1 << (4 * J - 12)) + 8.0)


# bf16 activations (the model's dtype) take the packed form: two bf16 in one 32-bit register, so one
# fma.rn.bf16x2 does two elements' work. Nibbles j and j + 4 of a word sit 16 bits apart: one AND-OR
# puts both into the mantissas of two bf16 128.0 (128 + q; nibbles 1 and 3, shifted to bits 3-6:
# 128 + 8q), one packed FMA makes them q - 8 exactly, one more multiplies them by the activation
# pair (x[8w + j], x[8w + j + 4]) and adds. The activation comes as 4 pair planes [N, 4, D/8] of
# such words (pair_planes). A word's 4 pairs accumulate in bf16 (each FMA rounds to bf16's 8-bit
# mantissa, as the plain module's bf16 dequantized weights are rounded), its two halves then in
# fp32 times the group scale: against the fp32 form about as precise as the plain module (python
# -m kernels.bench --precision). About 2.4 instructions an element in the sm_90 loop against 3.4
# unpacking to fp32 (the errors and times of both: BENCHMARKS.md, Kernel level).
BF16_MAGIC = 0x43004300                          # two bf16 128.0, the bits as an int32
_c = tl.constexpr if common.HAVE_TRITON else int
# bf16 pairs as int32 bits: (128 + q) * 1 - 136 and (128 + 8q) * 0.125 - 24 are q - 8
BF16_ONE, BF16_M136 = _c(0x3F803F80), _c(0xC308C308 - (1 << 32))
BF16_EIGHTH, BF16_M24 = _c(0x3E003E00), _c(0xC1C0C1C0 - (1 << 32))
BF16_NEG_ZEROS = _c(0x80008000 - (1 << 32))   # two bf16 -0.0: an FMA's addend that keeps x, -0 too
INTERPRETED = _c(common.HAVE_TRITON and common.interpreting())  # Triton's CPU interpreter
ASM = _c(common.HAVE_TRITON and not common.interpreting())     # inline PTX (not interpreted)


@_jit
def _fma2(a, b, c):
    """a * b + c on int32 words of two bf16 each, rounded to bf16 (fma.rn.bf16x2). Triton's
    interpreter has no inline asm: there each half in fp32 (the product of two bf16 is exact), then
    rounded to the nearest bf16, ties to even, as the GPU rounds."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        lo = (_low(a) * _low(b) + _low(c)).to(tl.int32, bitcast=True)
        hi = (_high(a) * _high(b) + _high(c)).to(tl.int32, bitcast=True)
        lo = ((lo + 0x7FFF + ((lo >> 16) & 1)) >> 16) & 0xFFFF
        return lo | (((hi + 0x7FFF + ((hi >> 16) & 1)) >> 16) << 16)


@_jit
def _low(pair):
    """The low bf16 of int32 words, as fp32 (exact)."""
    return (pair << 16).to(tl.float32, bitcast=True)


@_jit
def _high(pair):
    """The high bf16 of int32 words, as fp32 (exact)."""
    return (pair & -65536).to(tl.float32, bitcast=True)


@_jit
def _packed_word(words, x_ptrs, PLANE: tl.constexpr, ok, EVEN: tl.constexpr, magic):
    """sum over j of (nibble j of each word - 8) * x[8w + j] in fp32 [R, BW], the products by bf16
    pairs (the packed form above). x_ptrs [BW]: pair plane 0's words, PLANE words apart."""
    acc = tl.zeros(words.shape, tl.int32)                  # two bf16 zeros
    for j in tl.static_range(4):
        acc = _fma2(_q_pair(words, j, magic), _plane(x_ptrs, j, PLANE, ok, EVEN), acc)
    return _low(acc) + _high(acc)


@_jit
def _q_pair(words, J: tl.constexpr, magic):
    """(nibbles J and J + 4 of each word) - 8 as a pair of bf16 in an int32, exactly (the packed
    form above; magic: BF16_MAGIC)."""
    if J % 2 == 0:
        return _fma2(((words >> (4 * J)) & 0x000F000F) | magic, tl.full([1, 1], BF16_ONE, tl.int32),
                     tl.full([1, 1], BF16_M136, tl.int32))
    return _fma2(((words >> (4 * J - 3)) & 0x00780078) | magic,
                 tl.full([1, 1], BF16_EIGHTH, tl.int32), tl.full([1, 1], BF16_M24, tl.int32))


@_jit
def _int4_tile(w_ptr, s_ptr, rows_ok, w, W: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """One step of one INT4 matrix: words [R, BW] and their group scales (fp32), read at word
    columns w [BW] of the rows whose pointers are w_ptr, s_ptr [R, 1]."""
    g = (w * 8 // GROUP)[None, :]
    if EVEN:
        return tl.load(w_ptr + w[None, :]), tl.load(s_ptr + g).to(tl.float32)
    ok = rows_ok[:, None] & (w < W)[None, :]
    return tl.load(w_ptr + w[None, :], mask=ok, other=0), tl.load(s_ptr + g, mask=ok,
                                                                  other=0.0).to(tl.float32)


@_jit
def _plane(ptrs, J: tl.constexpr, PLANE: tl.constexpr, ok, EVEN: tl.constexpr):
    """Activation plane J (elements 8w + J) at words w as [1, BW] fp32; ptrs [BW]: plane 0's words,
    PLANE words apart. Loaded 2-d, so it comes in the weight tile's own layout (a 1-d load needs
    another and a shuffle through shared memory a plane, as the compiled code shows)."""
    if EVEN:
        return tl.load((ptrs + J * PLANE)[None, :])
    return tl.load((ptrs + J * PLANE)[None, :], mask=ok[None, :], other=0.0)


@_jit
def _gate_up_words(g_rows, gs_rows, u_rows, us_rows, n_ok, start, W: tl.constexpr,
                   GROUP: tl.constexpr,
                   BLOCK_W: tl.constexpr, EVEN: tl.constexpr):
    """Gate's and up's words and scales of the BLOCK_W words at `start` (masked unless EVEN)."""
    w = start + tl.arange(0, BLOCK_W)
    gw, gs = _int4_tile(g_rows, gs_rows, n_ok, w, W, GROUP, EVEN)
    uw, us = _int4_tile(u_rows, us_rows, n_ok, w, W, GROUP, EVEN)
    return gw, gs, uw, us


@_jit
def _gate_up_products(gw, gs, uw, us, v, start, magic, W: tl.constexpr, BLOCK_W: tl.constexpr,
                      EVEN: tl.constexpr, PACKED: tl.constexpr):
    """One step's scaled products [R, BLOCK_W] of gate and up (each word's 8 summed), v: the
    planes (PACKED: the pair planes, magic BF16_MAGIC; else fp32 planes, MAGIC)."""
    w = start + tl.arange(0, BLOCK_W)
    if PACKED:
        return (_packed_word(gw, v + w, W, w < W, EVEN, magic) * gs,
                _packed_word(uw, v + w, W, w < W, EVEN, magic) * us)
    g_high, u_high = gw >> 12, uw >> 12
    t_g = tl.zeros(gw.shape, tl.float32)
    t_u = tl.zeros(uw.shape, tl.float32)
    for j in tl.static_range(8):
        x = _plane(v + w, j, W, w < W, EVEN)
        t_g += _nibble(gw, g_high, j, magic) * x
        t_u += _nibble(uw, u_high, j, magic) * x
    return t_g * gs, t_u * us


@_jit
def _store_int4_h(h_ptr, route_w_ptr, p, n, n_ok, acc_g, acc_u, I: tl.constexpr,
                  PACKED: tl.constexpr):
    """Pair p's h = silu(g) * u * its routing weight at rows n, from the step sums acc_g, acc_u
    [len(n), BW], in the order down reads: plane order (fp32) or pair-plane order (PACKED, bf16),
    as _moe_gemv_int4_gate_up_kernel says."""
    g, u = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
    h = _silu_mul(g, u) * tl.load(route_w_ptr + p)
    if PACKED:
        tl.store(h_ptr + p.to(tl.int64) * I + 2 * ((n % 4) * (I // 8) + n // 8) + n % 8 // 4,
                 h.to(tl.bfloat16), mask=n_ok)
    else:
        tl.store(h_ptr + p.to(tl.int64) * I + (n % 8) * (I // 8) + n // 8, h, mask=n_ok)


@_jit
def _moe_gemv_int4_gate_up_kernel(v_ptr, h_ptr, ids_ptr, route_w_ptr, g_ptr, gs_ptr, u_ptr, us_ptr,
                                  stride_we, stride_wn, stride_se, stride_sr, magic, x_ptr,
                                  part_ptr, hs_ptr,
                                  count_ptr, sg_ptr, su_ptr, N,
                                  TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                                  GROUP: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                                  EVEN: tl.constexpr, SPLIT: tl.constexpr, SHARED_K: tl.constexpr,
                                  EVEN_SHARED: tl.constexpr, SHARED_SLICES: tl.constexpr,
                                  SHARED_N_PAD: tl.constexpr, SHARED_PRECISION: tl.constexpr,
                                  PACKED: tl.constexpr, use_tiles_ptr, ADAPTIVE: tl.constexpr,
                                  PAIRS: tl.constexpr):
    """_moe_gemv_gate_up_kernel for INT4 weights: v_ptr the activations as fp32 planes [N, 8, D/8]
    (plane j = elements 8w + j), h written in plane order (element i of row p at (i % 8) * I/8 + i
    // 8), the planes down reads; PACKED (bf16 x): v_ptr the pair planes [N, 4, D/8] (int32), h bf16
    in pair-plane order (element i of row p at 2 ((i % 4) I/8 + i // 8) + (i % 8) // 4 of the
    row's I). BLOCK_W words (8 BLOCK_W elements) a step; EVEN: the blocks divide I and D/8, so no
    load is masked. Grid: (cdiv(I, BLOCK_N), SPLIT + P): the first SPLIT programs of each row block
    take the bf16 shared expert (_shared_gate_up; x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr,
    su_ptr, N: its arguments; SPLIT 0: none; SHARED_K bf16 columns a step; SHARED_SLICES > 0: its
    dot form), launched first since each runs its N tokens one after another; pair p is program
    SPLIT + p. ADAPTIVE: as _moe_gemv_gate_up_kernel's, and a program takes PAIRS pairs in turn
    (SPLIT + p // PAIRS; fewer programs to find the flag set: _adaptive_fold)."""
    _wait_for_prior()
    pid_n, p = tl.program_id(0), tl.program_id(1) - SPLIT
    if SPLIT > 0:
        if p < 0:
            _shared_part(x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, p, pid_n, D, I,
                         SPLIT, BLOCK_N, SHARED_K, EVEN_SHARED, SHARED_SLICES, SHARED_N_PAD,
                         SHARED_PRECISION)
            return
    if ADAPTIVE:
        if tl.load(use_tiles_ptr) != 0:
            return
    for i in range(PAIRS):    # PAIRS 1 (the GEMV variant): the pass alone, compiled as no loop
        if PAIRS == 1 or p * PAIRS + i < N * TOPK:       # the last program's pairs past P: none
            _int4_gate_up_pair(p * PAIRS + i, pid_n, v_ptr, h_ptr, ids_ptr, route_w_ptr, g_ptr,
                               gs_ptr, u_ptr, us_ptr, stride_we, stride_wn, stride_se, stride_sr,
                               magic, TOPK, D, I, GROUP, BLOCK_N, BLOCK_W, EVEN, PACKED)


@_jit
def _int4_gate_up_pair(p, pid_n, v_ptr, h_ptr, ids_ptr, route_w_ptr, g_ptr, gs_ptr, u_ptr, us_ptr,
                       stride_we, stride_wn, stride_se, stride_sr, magic, TOPK: tl.constexpr,
                       D: tl.constexpr, I: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN: tl.constexpr,
                       PACKED: tl.constexpr):
    """_moe_gemv_int4_gate_up_kernel's work for pair p: h's rows of row block pid_n."""
    W: tl.constexpr = D // 8
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    g_rows, u_rows = (g_ptr + e * stride_we + n[:, None] * stride_wn,
                      u_ptr + e * stride_we + n[:, None] * stride_wn)
    gs_rows, us_rows = (gs_ptr + e * stride_se + n[:, None] * stride_sr,
                        us_ptr + e * stride_se + n[:, None] * stride_sr)
    v = v_ptr + (p // TOPK).to(tl.int64) * (D // 2 if PACKED else D)
    acc_g = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    gw, gs, uw, us = _gate_up_words(g_rows, gs_rows, u_rows, us_rows, n_ok, 0, W, GROUP, BLOCK_W,
                                    EVEN)
    for w0 in range(0, W, BLOCK_W):
        # the next step's words, in flight while this one is unpacked (EVEN: the last step reloads
        # its own, so no load needs a mask or a branch; two steps ahead run slower)
        start = w0 + BLOCK_W
        if EVEN:
            start = tl.minimum(start, W - BLOCK_W)
        gw1, gs1, uw1, us1 = _gate_up_words(g_rows, gs_rows, u_rows, us_rows, n_ok, start, W,
                                            GROUP, BLOCK_W, EVEN)
        pg, pu = _gate_up_products(gw, gs, uw, us, v, w0, magic, W, BLOCK_W, EVEN, PACKED)
        acc_g += pg
        acc_u += pu
        gw, gs, uw, us = gw1, gs1, uw1, us1
    _store_int4_h(h_ptr, route_w_ptr, p, n, n_ok, acc_g, acc_u, I, PACKED)


@_jit
def _int4_down_step(c0, token, n, n_ok, h_ptr, ids_ptr, w_ptr, s_ptr, stride_we, stride_wn,
                    stride_se, stride_sr, magic, TOPK: tl.constexpr, I: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr,
                    PACKED: tl.constexpr):
    """One step of _moe_gemv_int4_down_kernel: its rows n times columns c0 .. c0 + BLOCK_C of the
    token's K experts side by side, each column's 8 products scaled, fp32 [len(n), BLOCK_C]."""
    W: tl.constexpr = I // 8
    c = c0 + tl.arange(0, BLOCK_C)
    pair = token * TOPK + c // W
    w = c % W
    if EVEN:
        e = tl.load(ids_ptr + pair).to(tl.int64)
        words = tl.load(w_ptr + e[None, :] * stride_we + n[:, None] * stride_wn + w[None, :])
        s = tl.load(s_ptr + e[None, :] * stride_se + n[:, None] * stride_sr
                    + (w * 8 // GROUP)[None, :])
    else:
        c_ok = c < TOPK * W
        ok = n_ok[:, None] & c_ok[None, :]
        e = tl.load(ids_ptr + pair, mask=c_ok, other=0).to(tl.int64)
        words = tl.load(w_ptr + e[None, :] * stride_we + n[:, None] * stride_wn + w[None, :],
                        mask=ok, other=0)
        s = tl.load(s_ptr + e[None, :] * stride_se + n[:, None] * stride_sr
                    + (w * 8 // GROUP)[None, :], mask=ok, other=0.0)
    if PACKED:
        h_row = h_ptr + pair.to(tl.int64) * (I // 2) + w                   # pair plane j at + j W
        t = _packed_word(words, h_row, W, c < TOPK * W, EVEN, magic)
    else:
        high = words >> 12
        h_row = h_ptr + pair.to(tl.int64) * I + w                          # plane j at + j * W
        t = tl.zeros(words.shape, tl.float32)
        for j in tl.static_range(8):
            t += _nibble(words, high, j, magic) * _plane(h_row, j, W, c < TOPK * W, EVEN)
    return t * s.to(tl.float32)


@_jit
def _moe_gemv_int4_down_kernel(h_ptr, out_ptr, ids_ptr, w_ptr, s_ptr, stride_we, stride_wn,
                               stride_se, stride_sr, magic,
                               hs_ptr, sd_ptr,
                               TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                               GROUP: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr,
                               SHARED: tl.constexpr, I_PAD: tl.constexpr, PACKED: tl.constexpr,
                               use_tiles_ptr, y_ptr, ADAPTIVE: tl.constexpr, BLOCKS: tl.constexpr):
    """_moe_gemv_down_kernel for INT4 weights, h in plane order (gate_up's). A tile's columns are
    the token's K experts' words side by side (column c: expert slot c // (I/8), word c % (I/8)),
    BLOCK_C columns a step; PACKED: h as gate_up's bf16 pair planes, read as int32 [P, 4, I/8].
    SHARED: the bf16 shared expert too, weight 1 (_shared_down: gate_up's h
    = silu(g) * u hs [N, I] fp32 times its down weights sd_ptr [D, I]; I_PAD: a power of two >= I).
    ADAPTIVE: as _moe_gemv_down_kernel's, and a program makes BLOCKS row blocks in turn (fewer
    programs where the tiles served the call: _adaptive_fold).
    Grid: (N, cdiv(D, BLOCK_N * BLOCKS))."""
    _wait_for_prior()
    token, pid_n = tl.program_id(0), tl.program_id(1)
    for j in range(BLOCKS):   # BLOCKS 1 (the GEMV variant): the pass alone, compiled as no loop
        if BLOCKS == 1 or (pid_n * BLOCKS + j) * BLOCK_N < D:     # the last's blocks past D: none
            _int4_down_rows(token, pid_n * BLOCKS + j, h_ptr, out_ptr, ids_ptr, w_ptr, s_ptr,
                            stride_we, stride_wn, stride_se, stride_sr, magic, hs_ptr, sd_ptr, TOPK,
                            D, I, GROUP, BLOCK_N, BLOCK_C, EVEN, SHARED, I_PAD, PACKED,
                            use_tiles_ptr, y_ptr, ADAPTIVE)


@_jit
def _int4_down_rows(token, pid_n, h_ptr, out_ptr, ids_ptr, w_ptr, s_ptr, stride_we, stride_wn,
                    stride_se, stride_sr, magic, hs_ptr, sd_ptr, TOPK: tl.constexpr,
                    D: tl.constexpr, I: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_C: tl.constexpr, EVEN: tl.constexpr, SHARED: tl.constexpr,
                    I_PAD: tl.constexpr, PACKED: tl.constexpr, use_tiles_ptr, y_ptr,
                    ADAPTIVE: tl.constexpr):
    """_moe_gemv_int4_down_kernel's work for one token and row block pid_n of out."""
    W: tl.constexpr = I // 8
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    acc = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    gemv = True
    if ADAPTIVE:
        gemv = tl.load(use_tiles_ptr) == 0
    if gemv:
        for c0 in tl.static_range(0, TOPK * W, BLOCK_C):
            acc += _int4_down_step(c0, token, n, n_ok, h_ptr, ids_ptr, w_ptr, s_ptr, stride_we,
                                   stride_wn, stride_se, stride_sr, magic, TOPK, I, GROUP, BLOCK_C,
                                   EVEN, PACKED)
    y = tl.sum(acc, 1)
    if ADAPTIVE:
        y += _tile_rows(gemv == 0, y_ptr, token, n, n_ok, TOPK, D)
    if SHARED:
        y += _shared_down(hs_ptr, sd_ptr, token, n, n_ok, I, I_PAD)
    tl.store(out_ptr + token.to(tl.int64) * D + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def _gemv_args(w, block_k, sub):
    """_weight_args for the GEMV kernels: strides, row/column offsets, and the constexprs (block
    sizes, per-row scale, SUB: 1 where the scale is not one per row and step)."""
    scale, strides, (br, bc, off_r, off_c), per_row = _weight_args(w, block_k)
    # one scale per row and step only where every step is whole: the FP8 graph test (128x128 blocks
    # over a 64 x 32 matrix, steps mostly masked) read NaN on the H200 through that path, not
    # through this fallback (one scale an element, tested on the GPU with masked steps); not
    # reproduced on the CPU
    per_row = per_row and w.shape[2] % (block_k * sub) == 0
    return scale, strides, (off_r, off_c), dict(BLOCK_R=br, BLOCK_C=bc, SCALE_PER_ROW=per_row,
                                                SUB=sub if per_row else 1)


MAGIC = 0x4B000000   # the bits of the float 2^23 (_nibble)
# a bf16 shared expert's gate and up split over D in this many programs a row block: bf16 is 4x
# INT4's bytes, 2x FP8's, so its programs take as long as the routed ones (python -m kernels.bench
# --moe --shared)
SHARED_SPLIT = {"int4": 4, "fp8": 2}
# SharedExpertInLaunch gives the GEMV launches its bf16 shared expert up to this many tokens; above,
# the shared expert runs alone beside them (SharedExpertInLaunch.shared_alone: a gate-up GEMM, the
# SwiGLU, the down GEMM adding onto the routed sum). Each of its SHARED_SPLIT programs a row block
# runs the tokens one after another, so in the launch it costs more with every token. INT4, µs a
# layer (BENCHMARKS.md, Kernel level, shapes/kernels_int4_shared_forms.json: python -m
# kernels.bench --moe --formats int4 --variants gemv --shared): in the launch (the loop form)
# 2.5 more than the routed experts alone at 1 token, 10.3 at 8, 14.6 at 12, 19.4 at 16; alone
# 12.0-12.7 at any count. Chosen from the verify sweep with both limits, one H200 run each
# (python run.py --skip-e2e --cuda-graph on --preset kimi-k2.5 --speculative-num-steps 2, and
# --quant fp8 --speculative-attention-mode decode): INT4 with 4 here is 0.19-0.38 ms slower at 5
# to 8 tokens than with 8 and equal elsewhere; FP8 in the launch is as fast or faster at every
# count to 28.
SHARED_MAX_TOKENS = {"int4": 8, "fp8": 32}
# gate_up's shared programs in the dot form (_shared_gate_up_dot) from this many tokens, by format
# (absent: the loop form always); each weight read once for all tokens, not once a token. FP8 (4
# warps a program): the verify sweep 0.29 to 3.14 ms a step faster at 5 to 32 tokens, within 0.04
# at 1 to 4 (python run.py --skip-e2e --cuda-graph on --quant fp8 --speculative-attention-mode
# decode, both forms in one H200 call). INT4 (a warp a program): slower at every count, 19.8
# against the loop form's 18.7 us a layer at 1 token, 92.7 against 80.5 at 8 (python -m
# kernels.bench --moe --formats int4 --variants gemv --shared, both forms)
SHARED_DOT_MIN_TOKENS = {"fp8": 1}
SHARED_DOT_SLICES = 8    # slices of D a 16-row tile (16 tiles at I 256: 128 programs); not swept
# columns a step of the dot form: at 64 the INT4 gate_up kernel keeps the loop form's 64 registers
# a thread on sm_90 (128 at 128 columns: half the resident one-warp programs); not timed
SHARED_DOT_K = 64


def _shared_dot(fmt, N):
    """Whether gate_up's shared programs take the dot form at N tokens (SHARED_DOT_MIN_TOKENS)."""
    return fmt in SHARED_DOT_MIN_TOKENS and N >= SHARED_DOT_MIN_TOKENS[fmt]


def _shared_args(shared, fmt, N, I, D, block_n, warps, placeholder, dot=False):
    """The GEMV launches' keyword arguments for fused_moe's shared expert: (gate_up's, down's); none
    there: SPLIT 0, SHARED False and `placeholder` for the pointers (never read). block_n, warps:
    gate_up's; each of its row blocks (dot: each tile of 16 rows) takes one of the shared counters.
    dot: gate_up's shared programs in the dot form (_shared_gate_up_dot), SHARED_DOT_SLICES slices
    of D a tile, as few programs a row block (SPLIT) as make enough."""
    dev = placeholder.device
    rows = 16 if dot else block_n
    blocks = triton.cdiv(I, rows)
    if shared and blocks > common.COUNTERS:
        raise ValueError(f"fused_moe: the shared expert's {I} rows make more than "
                         f"{common.COUNTERS} row blocks of {rows}")
    split = 0 if not shared else (triton.cdiv(blocks * SHARED_DOT_SLICES, triton.cdiv(I, block_n))
                                  if dot else SHARED_SPLIT[fmt])
    slices = SHARED_DOT_SLICES if shared and dot else 0
    part = (torch.empty(2, slices or split, N, I, dtype=torch.float32, device=dev) if shared
            else placeholder)
    # silu(g) * u
    hs = torch.empty(N, I, dtype=torch.float32, device=dev) if shared else placeholder
    sg, su, sd = shared or (placeholder,) * 3
    count = _counters(dev) if shared else placeholder
    # columns a step (the loop form: 16 bytes of bf16 a thread)
    step = SHARED_DOT_K if dot else max(16, 256 * warps // block_n)
    even = bool(split) and I % block_n == 0 and D % (split * step) == 0
    gate_up = dict(part_ptr=part, hs_ptr=hs, count_ptr=count, sg_ptr=sg, su_ptr=su, N=N,
                   SPLIT=split, SHARED_K=step, EVEN_SHARED=even, SHARED_SLICES=slices,
                   SHARED_N_PAD=max(16, triton.next_power_of_2(N)),
                   SHARED_PRECISION="ieee" if shared and sg.dtype == torch.float32 else "tf32")
    return gate_up, dict(hs_ptr=hs, sd_ptr=sd, SHARED=bool(shared), I_PAD=triton.next_power_of_2(I))


def pair_planes(x, out=None):
    """x [N, D] as the packed INT4 GEMV reads a bf16 activation: 4 pair planes [N, 4, D/8] of int32
    words, word w of plane j holding the bf16 x[8w + j] (low half) and x[8w + j + 4] (high), into
    `out` where given (a torch copy, one launch)."""
    N, D = x.shape
    out = torch.empty(N, 4, D // 8, dtype=torch.int32, device=x.device) if out is None else out
    pairs = x.reshape(N, D // 8, 2, 4).permute(0, 3, 1, 2)          # [N, j, w, half]
    out.view(torch.bfloat16).view(N, 4, D // 8, 2).copy_(pairs)
    return out


def nibble_planes(x, out=None):
    """x [N, D] as the INT4 GEMV kernels read an activation: 8 fp32 planes [N, 8, D/8], plane j =
    elements 8w + j (a torch copy, one launch), into `out` where given."""
    N, D = x.shape
    out = torch.empty(N, 8, D // 8, dtype=torch.float32, device=x.device) if out is None else out
    return out.copy_(x.reshape(N, D // 8, 8).transpose(1, 2))


def activation_planes(x, out=None):
    """x as the INT4 GEMV kernels read it: pair planes for bf16 x (the packed form), else fp32
    nibble planes; into `out` (empty_planes(x)) where given."""
    return pair_planes(x, out) if x.dtype == torch.bfloat16 else nibble_planes(x, out)


def _planes_spec(x):
    """The shape and dtype of activation_planes(x): bf16 pairs in int32 words, or fp32 planes."""
    N, D = x.shape
    if x.dtype == torch.bfloat16:
        return (N, 4, D // 8), torch.int32
    return (N, 8, D // 8), torch.float32


def empty_planes(x):
    """An uninitialized tensor for activation_planes(x) (router_topk writes it)."""
    shape, dtype = _planes_spec(x)
    return torch.empty(shape, dtype=dtype, device=x.device)


def _check_planes(planes, x):
    """fused_moe's and router_topk's planes: as empty_planes(x) makes them, on x's device."""
    (want, dtype), D = _planes_spec(x), x.shape[1]
    if (D % 8 or planes.shape != want or planes.dtype != dtype or not planes.is_contiguous()
            or planes.device != x.device):
        raise ValueError(f"planes must be a contiguous {dtype} {list(want)} tensor on {x.device} "
                         f"for {x.dtype} x {list(x.shape)} (D a multiple of 8), got {planes.dtype} "
                         f"{list(planes.shape)} on {planes.device}")


def _adaptive_args(tiles, placeholder):
    """The GEMV kernels' adaptive arguments: tiles None (the GEMV variant) or (use_tiles int32 [1],
    the tiles' y fp32 [P, D]); gate_up's and down's keywords."""
    use_tiles, y = tiles or (placeholder, placeholder)
    return (dict(use_tiles_ptr=use_tiles, ADAPTIVE=tiles is not None),
            dict(use_tiles_ptr=use_tiles, y_ptr=y, ADAPTIVE=tiles is not None))


# INT4's adaptive variant: its GEMV launches hold about this many programs at most, each taking
# several pairs (gate_up) or row blocks (down) in turn, since where the tiles served the call each
# program still costs its launch to find the flag set (on an H100, 80 us at 32 tokens for gate_up's
# 65,536). With 4,096 (not swept) the adaptive layer took 1.1-2.8x less time where the tiles ran
# and 16-19% more where the GEMV ran (BENCHMARKS.md, Routing, "INT4's adaptive variant")
ADAPTIVE_PROGRAMS = 4096


def _adaptive_fold(tiles, units, others):
    """The units (pairs, row blocks) a program of the INT4 GEMV's adaptive launch takes in turn,
    where the grid's other axis has `others` programs; 1 without tiles (the GEMV variant)."""
    return 1 if tiles is None else max(1, triton.cdiv(units * others, ADAPTIVE_PROGRAMS))


def _fused_moe_gemv_int4(x, ids, route_w, gate, up, down, cfg, shared=None, planes=None,
                         tiles=None):
    """The GEMV variant for INT4 weights (see _fused_moe_gemv); shared, planes, tiles: its."""
    (N, D), P, I, dev = x.shape, ids.numel(), gate.shape[1], x.device
    K = P // N
    packed = x.dtype == torch.bfloat16
    magic = BF16_MAGIC if packed else MAGIC          # the form's exponent bits (_nibble, _fma2)
    v = activation_planes(x) if planes is None else planes
    h = torch.empty(P, I, dtype=torch.bfloat16 if packed else torch.float32, device=dev)
    bn, bw, warps = cfg["gate_up"]
    sh_gate_up, sh_down = _shared_args(shared, "int4", N, I, D, bn, warps, h,
                                       cfg.get("shared_dot", _shared_dot("int4", N)))
    ad_gate_up, ad_down = _adaptive_args(tiles, ids)
    s = gate.data.stride(), gate.scale.stride()
    row_blocks = triton.cdiv(I, bn)
    pairs = _adaptive_fold(tiles, P, row_blocks)
    _moe_gemv_int4_gate_up_kernel[(row_blocks, sh_gate_up["SPLIT"] + triton.cdiv(P, pairs))](
        v, h, ids, route_w, gate.data, gate.scale, up.data, up.scale, s[0][0], s[0][1], s[1][0],
        s[1][1], magic, x, TOPK=K, D=D, I=I, GROUP=gate.group,
        BLOCK_N=bn, BLOCK_W=bw, EVEN=I % bn == 0 and D % (8 * bw) == 0, **sh_gate_up,
        **ad_gate_up, PAIRS=pairs, PACKED=packed, launch_pdl=common.PDL, num_warps=warps)
    bn, bc, warps = cfg["down"]
    out = torch.empty(N, D, dtype=x.dtype, device=dev)
    s = down.data.stride(), down.scale.stride()
    blocks = _adaptive_fold(tiles, triton.cdiv(D, bn), N)
    _moe_gemv_int4_down_kernel[(N, triton.cdiv(D, bn * blocks))](
        h.view(torch.int32) if packed else h, out, ids, down.data, down.scale, s[0][0], s[0][1],
        s[1][0], s[1][1], magic, TOPK=K, D=D, I=I, GROUP=down.group, BLOCK_N=bn, BLOCK_C=bc,
        EVEN=D % bn == 0 and K * I // 8 % bc == 0, **sh_down, **ad_down, BLOCKS=blocks,
        PACKED=packed, launch_pdl=common.PDL, num_warps=warps)
    return out


def _fused_moe_gemv(x, ids, route_w, gate, up, down, fmt, cfg, shared=None, planes=None,
                    tiles=None):
    """The GEMV variant (see its section); arguments as fused_moe's, already checked and
    flattened. tiles: fused_moe's adaptive variant, (use_tiles int32 [1], the tiles' y fp32 [P,
    D]): where the tiles served the call, the pair programs return and down sums each token's rows
    of y."""
    if fmt == "int4":
        return _fused_moe_gemv_int4(x, ids, route_w, gate, up, down, cfg, shared, planes, tiles)
    (N, D), P, I, dev = x.shape, ids.numel(), gate.shape[1], x.device
    K = P // N
    bn, bk, unroll, warps, sub = cfg["gate_up"]
    h = torch.empty(P, I, dtype=torch.float32, device=dev)  # [P, I], route weight in
    gs, strides, offs, const = _gemv_args(gate, bk, sub)
    sh_gate_up, sh_down = _shared_args(shared, fmt, N, I, D, bn, warps, h,
                                       cfg.get("shared_dot", _shared_dot(fmt, N)))
    ad_gate_up, ad_down = _adaptive_args(tiles, ids)
    leader = N <= GEMV_LEADER_TOKENS.get(fmt, 0)
    _moe_gemv_gate_up_kernel[(triton.cdiv(I, bn), sh_gate_up["SPLIT"] + P)](
        x, h, ids, route_w, gate.data, gs, up.data, _weight_args(up, bk)[0], P, *strides, *offs,
        TOPK=K, D=D, I=I, FMT=FORMATS[fmt], BLOCK_N=bn, BLOCK_K=bk, UNROLL=unroll, LEADER=leader,
        P_PAD=max(16, triton.next_power_of_2(P)) if leader else 16,  # 16: unused, one compile
        **const, **sh_gate_up, **ad_gate_up, launch_pdl=common.PDL, num_warps=warps)
    bn, bk, warps, sub = cfg["down"]
    out = torch.empty(N, D, dtype=x.dtype, device=dev)
    ds, strides, offs, const = _gemv_args(down, bk, sub)
    _moe_gemv_down_kernel[(N, triton.cdiv(D, bn))](
        h, out, ids, down.data, ds, *strides, *offs, TOPK=K, D=D, I=I, FMT=FORMATS[fmt], BLOCK_N=bn,
        BLOCK_K=bk,
        **const, **sh_down, **ad_down, launch_pdl=common.PDL, num_warps=warps)
    return out


