"""MLA's decode step: RoPE, cache write and the absorbed attention split over slots, the merge
of the splits (alone, or inside W_uv's GEMV), RoPE + cache write alone, and their swaps."""
import math
from typing import NamedTuple

import torch

import model

from . import common
from .common import _jit, _pow2, _prefetch_matrix_rows, _wait_for_prior, launch, tl, triton
from .gemv import (HEAD_GEMV_BLOCK_N, HEAD_GEMV_MAX_ROWS, HEAD_GEMV_WARPS, NORM_GEMV_MAX_ROWS,
                   _head_gemv_blocks, head_gemv)


# MLA decode step: RoPE, cache write and the absorbed attention, split over slots, then a merge
#
# The absorbed path of MLA attends in the latent space: every head's query q_lat[h] (q_nope
# times W_uk[h]) meets the one latent row per slot, which is the key and the value at once, plus
# the rotary parts:  o_lat[t, h] = sum_s softmax_s(scale * (q_lat[t,h].kv[s] + q_pe[t,h].pe[s]))
# kv[s] over slots s <= positions[t]. All H heads (and T tokens) of a batch row share the slots, so
# one program loads a tile of slots once and uses it for its whole block of M = T*H query rows
# (two small matrix products per tile). Flash-decoding: one program per (part, batch row, block
# of query rows) writes a partial output and its log-sum-exp, and a second kernel merges them, or
# (mla_merge_absorb) the launch of the W_uv product that follows does: each of its programs merges
# its head's rows itself before its product, so the merge costs no launch of its own.
# Part 0 is the step's T new tokens: it normalizes and rotates their latents in registers (what
# model.MLA.write_cache computes, rounded alike), attends to them causally and writes them to
# their cache slots (slot = position). Parts 1, 2, ... cut the cached slots before the row's
# first new position into splits of `split_len` slots; they never read a slot part 0 writes, so
# no program waits for another. Every program rotates its own queries' rope parts. Programs read
# the positions on the device: a split past a row's first new position reads nothing, so one
# launch (one CUDA graph) serves any length up to the cache size, with no host read, at a cost
# that follows the length in use.
# The merge, o = sum_j 2^(lse_j - L) o_j / sum_j 2^(lse_j - L) over the parts j that hold a slot
# (L = max_j lse_j), runs in two kernels that must agree bit for bit: the combine, which stores
# o_lat, and the W_uv launch's (_mla_merge_absorb_kernel), which multiplies the o_lat the combine
# would have stored. So up to MLA_MERGE_IN_ORDER_PARTS parts both add them in one fixed order, one
# after another (_merge_latents), and not with tl.sum, whose order follows the layout the compiler
# picks in each kernel; past it only the combine runs, with every part in one load and tl.sum.

# Block sizes; `python -m kernels.bench` times the attention at these and sweeps the alternatives
# (bench_mla_configs). BLOCK_N slots a tile: 64 latent rows of 512 bf16 are 64 KB; three in flight
# (num_stages 3) fill most of the H200's 228 KB of shared memory, so one program runs an SM at a
# time and the split rule (mla_split_len) aims at one wave of programs. float32 (tests): half the
# rows, two stages. Query rows a program (mla_block_m): up to 32 (T = 4 tokens x 8 heads at TP 8)
# keep the fp32 accumulator [32, 512] at 64 registers a thread over 8 warps, and each block of rows
# reads the cache once. On a short cache (B x S <= MLA_SHORT_CACHE_SLOTS: one more pass over it
# costs about 2 us at the copy bandwidth) blocks of 16 rows are faster, as a 32-row program's own
# latency sets the time there (python -m kernels.bench --mla-blocks); 8 warps either way.
MLA_BLOCK_N = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
MLA_NUM_STAGES = {torch.bfloat16: 3, torch.float16: 3, torch.float32: 2}
MLA_NUM_WARPS = 8
MLA_MAX_BLOCK_M = 32
MLA_SHORT_BLOCK_M = 16
MLA_SHORT_CACHE_SLOTS = 8192
MLA_MIN_SPLIT = 64       # slots a split at least: one bf16 tile
# columns a merge program: 128 programs for 8 query rows, so the merge of 129 parts (32768 slots)
# is spread over the SMs (python -m kernels.bench, "merge BLOCK_C")
MLA_COMBINE_BLOCK_C = 32
# a merge program's in-order tile is one row of 32 columns: a float a thread of one warp (with 4
# warps each would hold a copy); all parts in one load: 4 warps (not swept)
MLA_COMBINE_WARPS = 1
# up to this many parts the combine adds them one after another, as mla_merge_absorb does (which
# runs only there); more, all in one load: unrolled, 129 parts take tens of seconds to compile
MLA_MERGE_IN_ORDER_PARTS = 16
# float32 partials a thread of mla_merge_absorb has in flight (a K step's parts of all its rows);
# more: the combine and head_gemv, two launches. bf16 at Kimi-K2's C = 512: up to 16 parts at 1 row,
# 8 at 2-4 rows (960 and 448 cached slots in splits of 64); sm_90 code then takes up to 255
# registers without spilling (check: compile the kernel for sm_90 and read its register count)
MLA_MERGE_ABSORB_REGS = 64
# rows B*T up to which DecodeAttentionKernel merges in W_uv's launch (with norm_gemv): one launch
# less at one row; at 4 rows the separate merge is faster (python -m kernels.bench,
# mla_merge_absorb)
MLA_MERGE_ABSORB_MAX_ROWS = 1
# rows B*T up to which the decode kernel's cache parts prefetch their first tile (PREFETCH),
# whatever computes the absorbed W_uk product launched before it (DecodeAttentionKernel's
# absorb_query): with "norm_gemv" swapped in, up to HEAD_GEMV_MAX_ROWS rows that is head_gemv,
# launched under PDL, so the prefetch overlaps that kernel's tail; without "norm_gemv", and past
# those rows, torch's product (cuBLAS, launched without PDL) precedes it, the programs start after
# it and the prefetch comes just before the loads it serves. Measured with run.py's default kernels
# (all, "norm_gemv" among them). Verify, two runs each in one call: INT4 at 20-32 tokens 0.015-0.054
# ms less on the mean than with the prefetch at every row (within the runs' spread), bf16 at 20
# tokens 0.03 less in both; INT4 at 3 tokens 0.023 less than without the prefetch (BENCHMARKS.md,
# Verify sweep, Kept)
MLA_PREFETCH_MAX_ROWS = HEAD_GEMV_MAX_ROWS


@_jit
def _rotated(x_rows, rope_rows, ok, R: tl.constexpr, BLOCK_R2: tl.constexpr):
    """RoPE of rows of R values: x_rows [N] pointers to each row's start, rope_rows [N] to its
    (cos, sin) pairs. Returns [N, 2 * BLOCK_R2] float32, pairs interleaved as stored (padding 0)."""
    i = tl.arange(0, BLOCK_R2)
    m = ok[:, None] & (2 * i < R)[None, :]
    xe = tl.load(x_rows[:, None] + 2 * i[None, :], mask=m, other=0.0).to(tl.float32)
    xo = tl.load(x_rows[:, None] + 2 * i[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    cos = tl.load(rope_rows[:, None] + 2 * i[None, :], mask=m, other=0.0)
    sin = tl.load(rope_rows[:, None] + 2 * i[None, :] + 1, mask=m, other=0.0)
    return tl.reshape(tl.join(xe * cos - xo * sin, xe * sin + xo * cos),
                      [x_rows.shape[0], 2 * BLOCK_R2])


@_jit
def _load_rows(rows, ok, N: tl.constexpr, BLOCK: tl.constexpr):
    """Rows of N values: rows [R] pointers to each row's start, ok [R] which rows exist.
    Returns [R, BLOCK] in the pointers' dtype (padding 0)."""
    i = tl.arange(0, BLOCK)
    return tl.load(rows[:, None] + i[None, :], mask=ok[:, None] & (i < N)[None, :], other=0.0)


@_jit
def _store_rows(rows, x, ok, N: tl.constexpr):
    """Stores the first N columns of x [R, BLOCK] at rows [R] (pointers to each row's start) where
    ok [R]."""
    i = tl.arange(0, x.shape[1])
    tl.store(rows[:, None] + i[None, :], x, mask=ok[:, None] & (i < N)[None, :])


@_jit
def _online_softmax_step(m_i, l_i, acc, s, n_ok, v, DOT_PRECISION: tl.constexpr):
    """One tile of keys in flash attention's running softmax: scores s [BLOCK_M, BLOCK_N] (scaled,
    base 2), n_ok [BLOCK_N] the keys that exist, v [BLOCK_N, BLOCK_D] their values. Takes and
    returns the running max m_i and sum l_i [BLOCK_M] and the unnormalized output acc
    [BLOCK_M, BLOCK_D], float32. m_i starts finite (-1e30), so a row with no key in the tile keeps
    its state (no inf - inf)."""
    s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@_jit
def _softmax_new_tokens(s, pos, pos_t, t_ok, v, DOT_PRECISION: tl.constexpr):
    """Part 0's attention, one tile: scores s [BLOCK_M, BLOCK_T] (scaled, base 2) of query rows at
    positions pos [BLOCK_M] against the new tokens at pos_t [BLOCK_T] (t_ok: those that exist), a
    row seeing the tokens at or before its position; v [BLOCK_T, BLOCK_D] their values. Returns
    m_i, l_i, acc as _online_softmax_step, this tile the only one (nothing to rescale)."""
    s = tl.where((pos_t[None, :] <= pos[:, None]) & t_ok[None, :], s, float("-inf"))
    m_i = tl.maximum(tl.max(s, 1), -1e30)       # finite, also for padding rows (no inf - inf)
    p = tl.exp2(s - m_i[:, None])
    l_i = tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@_jit
def _store_partial(po_rows, lse_rows, m_i, l_i, acc, ok, N: tl.constexpr):
    """A part's result for the merge, where ok [BLOCK_M]: its output acc / l_i (rows of N values at
    po_rows [BLOCK_M], pointers to each row's start) and its log-sum-exp m_i + log2(l_i) (at
    lse_rows [BLOCK_M]); a row that saw no key gets output 0 and lse -inf."""
    seen = l_i > 0
    _store_rows(po_rows, acc / tl.where(seen, l_i, 1.0)[:, None], ok, N)
    tl.store(lse_rows, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")),
             mask=ok)


@_jit
def _mla_scores(q, qpe, kv, pe, scale_log2, DOT_PRECISION: tl.constexpr):
    """The absorbed scores q [BLOCK_M, BLOCK_C] . kv [BLOCK_N, BLOCK_C] + qpe . pe (rope parts,
    [*, 2 * BLOCK_R2]), times scale_log2 (base 2): [BLOCK_M, BLOCK_N] float32."""
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
    return tl.dot(qpe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION) * scale_log2


@_jit
def _mla_new_latents(kv_rows, kpe_rows, rope_rows, w_ptr, eps, ok, C: tl.constexpr, R: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_R2: tl.constexpr):
    """The new tokens' cache rows, as model.MLA.write_cache computes them: kv_rows, kpe_rows
    [BLOCK_T] pointers to each token's latent (C values) and rope key (R), rope_rows [BLOCK_T] to
    its (cos, sin) pairs, ok [BLOCK_T] the tokens that exist. Returns the latents RMS-normalized
    (weight w, eps; [BLOCK_T, BLOCK_C]) and the keys rotated ([BLOCK_T, 2 * BLOCK_R2]), in kv's
    dtype."""
    dt = kv_rows.dtype.element_ty
    offs_c = tl.arange(0, BLOCK_C)
    x = _load_rows(kv_rows, ok, C, BLOCK_C).to(tl.float32)
    w = tl.load(w_ptr + offs_c, mask=offs_c < C, other=0.0).to(tl.float32)
    kv = (x / tl.sqrt(tl.sum(x * x, 1) / C + eps)[:, None] * w[None, :]).to(dt)
    return kv, _rotated(kpe_rows, rope_rows, ok, R, BLOCK_R2).to(dt)


@_jit
def _attend_cached(q, qpe, kvc_row, s_cs, pec_row, s_ps, lo, hi, scale_log2, C: tl.constexpr,
                   R: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Flash attention of query rows q [BLOCK_M, BLOCK_C] and rotated qpe [BLOCK_M, 2 * BLOCK_R2]
    over the cached slots [lo, hi) of one batch row (kvc_row, pec_row: its cache rows' start),
    BLOCK_N slots a tile. Returns the running max m_i and sum l_i (base 2) and the unnormalized
    output acc [BLOCK_M, BLOCK_C], float32; m_i stays finite where no slot is seen."""
    offs_c, offs_r = tl.arange(0, q.shape[1]), tl.arange(0, qpe.shape[1])
    c_ok, r_ok = offs_c < C, offs_r < R
    m_i = tl.full([q.shape[0]], -1e30, tl.float32)     # running max (finite: no inf - inf)
    l_i = tl.zeros([q.shape[0]], tl.float32)           # running sum of 2^(score - max)
    acc = tl.zeros([q.shape[0], q.shape[1]], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kv = tl.load(kvc_row + offs_n[:, None] * s_cs + offs_c[None, :],
                     mask=n_ok[:, None] & c_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
        pe = tl.load(pec_row + offs_n[:, None] * s_ps + offs_r[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, 2 * BLOCK_R2]
        s = _mla_scores(q, qpe, kv, pe, scale_log2, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, n_ok, kv, DOT_PRECISION)
    return m_i, l_i, acc


@_jit
def _attend_new_tokens(q, qpe, pos, pos_row, s_post, kv_row, s_kvt, kpe_row, s_kpt, rope_row,
                       s_rt, w_ptr, eps, T, kvc_row, s_cs, pec_row, s_ps, write,
                       scale_log2, C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_R2: tl.constexpr, BLOCK_T: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Part 0 of _mla_decode_kernel: the query rows (q, qpe, their positions pos) against the
    row's T new tokens, made in registers from kv and kpe (normalized, rotated); where write
    (m-block 0), the new latents and rope keys also go to their slots in the caches. The _row
    pointers are the batch row's. Returns the softmax state (m_i, l_i, acc)."""
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    pos_t = tl.load(pos_row + offs_t * s_post, mask=t_ok, other=0)               # their slots
    kv_new, pe_new = _mla_new_latents(kv_row + offs_t * s_kvt, kpe_row + offs_t * s_kpt,
                                      rope_row + offs_t * s_rt, w_ptr, eps, t_ok,
                                      # [BLOCK_T, BLOCK_C], [BLOCK_T, 2 * BLOCK_R2]
                                      C, R, BLOCK_C, BLOCK_R2)
    if write:
        _store_rows(kvc_row + pos_t * s_cs, kv_new, t_ok, C)
        _store_rows(pec_row + pos_t * s_ps, pe_new, t_ok, R)
    s = _mla_scores(q, qpe, kv_new, pe_new, scale_log2, DOT_PRECISION)      # [BLOCK_M, BLOCK_T]
    return _softmax_new_tokens(s, pos, pos_t, t_ok, kv_new, DOT_PRECISION)


@_jit
def _mla_decode_kernel(q_ptr, qpe_ptr, kv_ptr, kpe_ptr, w_ptr, rope_ptr, pos_ptr, kvc_ptr, pec_ptr,
                       po_ptr, lse_ptr,
                       T, H, M, kv_len, split_len, eps, scale_log2,
                       s_qb, s_qt, s_qh, s_qpb, s_qpm, s_kvb, s_kvt, s_kpb, s_kpt, s_rb, s_rt,
                       s_posb, s_post,
                       s_cb, s_cs, s_pb, s_ps, s_pob, s_pom, s_pos, s_lb, s_lm,
                       C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_R2: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
                       PREFETCH_PE: tl.constexpr):
    """One part (see the section's head) for a block of query rows of one batch row.

    Query row m = t*H + h of row b sees the slots s < kv_len with s <= pos[b, t]; a row's T
    positions are consecutive (a decode step, a chain's verify). The new tokens come from kv
    [B, T, C] (normalized here: RMSNorm with weight w and eps) and kpe [B, T, R] (rotated here),
    the slots before pos[b, 0] from the caches kvc [B, >=kv_len, C] and pec [B, >=kv_len, R], where
    part 0's m-block 0 writes the new ones. q [B, T, H, C] through its strides (the einsum's
    permuted output is read in place) and qpe [B, M, R] (not rotated): last dim contiguous, one
    dtype with kv, kpe and the caches; rope [B, T, R/2, 2] float32 (cos, sin); pos int64 [B, T].
    po [B, M, parts, C] and lse [B, M, parts] float32 get the part's partial output and log2 of its
    sum (with the max; -inf where no slot), where the part holds a slot. PREFETCH, PREFETCH_PE:
    the bytes of each latent and rope key row of its first tile of slots that a cache part asks
    the L2 for before its wait (common._prefetch_matrix_rows; kernels of earlier steps wrote them).
    Grid: (parts, B, cdiv(M, BLOCK_M))."""
    part, b, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if part > 0:
        first = (part - 1) * split_len + tl.arange(0, BLOCK_N)
        _prefetch_matrix_rows(kvc_ptr + b * s_cb, first, kv_len, s_cs, 0, C, PREFETCH)
        _prefetch_matrix_rows(pec_ptr + b * s_pb, first, kv_len, s_ps, 0, R, PREFETCH_PE)
    _wait_for_prior()
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    t_m = offs_m // H
    q = _load_rows(q_ptr + b * s_qb + t_m * s_qt + (offs_m % H) * s_qh, row_ok, C,
                   BLOCK_C)  # [BLOCK_M, BLOCK_C]
    qpe = _rotated(qpe_ptr + b * s_qpb + offs_m * s_qpm, rope_ptr + b * s_rb + t_m * s_rt, row_ok,
                   R, BLOCK_R2).to(q.dtype)  # [BLOCK_M, 2 * BLOCK_R2]
    if part == 0:   # the new tokens, in registers
        pos = tl.load(pos_ptr + b * s_posb + t_m * s_post, mask=row_ok, other=-1)  # [BLOCK_M]
        m_i, l_i, acc = _attend_new_tokens(
            q, qpe, pos, pos_ptr + b * s_posb, s_post, kv_ptr + b * s_kvb, s_kvt,
            kpe_ptr + b * s_kpb, s_kpt, rope_ptr + b * s_rb, s_rt, w_ptr, eps, T,
            kvc_ptr + b * s_cb, s_cs, pec_ptr + b * s_pb, s_ps, mb == 0, scale_log2,
            C, R, BLOCK_C, BLOCK_R2, BLOCK_T, DOT_PRECISION)
        holds = part == 0
    else:           # cached slots [lo, hi): this split's, before the row's first new position
        lo = (part - 1) * split_len
        hi = tl.minimum(tl.minimum(tl.load(pos_ptr + b * s_posb), kv_len), lo + split_len)
        m_i, l_i, acc = _attend_cached(q, qpe, kvc_ptr + b * s_cb, s_cs, pec_ptr + b * s_pb, s_ps,
                                       lo, hi,
                                       scale_log2, C, R, BLOCK_N, DOT_PRECISION)
        holds = lo < hi
    _store_partial(po_ptr + b * s_pob + offs_m * s_pom + part * s_pos,
                   lse_ptr + b * s_lb + offs_m * s_lm + part,
                   m_i, l_i, acc, row_ok & holds, C)


@_jit
def _parts_used(pos_first, kv_len, split_len):
    """The parts that hold a slot for a batch row whose first new position is at pos_first (a
    pointer, or a block of them): part 0 (the new tokens) and the splits of the slots before it."""
    return 1 + tl.cdiv(tl.minimum(tl.load(pos_first), kv_len), split_len)


@_jit
def _merge_latents(po_rows, lse_rows, s_pos, cols, col_ok, n_used, PARTS: tl.constexpr):
    """Flash-decoding's merge of the parts j < n_used: sum_j 2^(lse_j - L) o_j / sum_j 2^(lse_j -
    L), L = max_j lse_j, for R rows. po_rows [R, 1] point at each row's part 0 (part j is j * s_pos
    further), lse_rows [R, 1] at its log2 sum of part 0 (part j: j further); cols [1, BLOCK] the
    columns wanted (col_ok: those that exist); n_used [R, 1] <= PARTS (part 0 always holds).
    Returns [R, BLOCK] float32. The parts are added in order, j = 0, 1, ..., one explicit fma each:
    the bits follow neither the layouts the compiler picks (tl.sum's order does) nor where it
    would contract a multiply and an add, so every kernel that merges with this gets the same o.
    The loops are unrolled, all parts' loads in flight at once, and every value is [R, BLOCK] (a
    row's lse loaded in each of its columns), so no step changes layout."""
    po = po_rows + cols  # [R, BLOCK]
    lse_at = lse_rows + tl.zeros_like(cols)
    n_used = n_used + tl.zeros_like(cols)
    top = tl.full(po.shape, float("-inf"), tl.float32)
    for j in tl.static_range(PARTS):
        top = tl.maximum(top, tl.load(lse_at + j, mask=j < n_used, other=float("-inf")))
    acc = tl.zeros(po.shape, tl.float32)
    total = tl.zeros(po.shape, tl.float32)
    for j in tl.static_range(PARTS):
        # 0 where unused
        w = tl.exp2(tl.load(lse_at + j, mask=j < n_used, other=float("-inf")) - top)
        acc = tl.fma(tl.load(po + j * s_pos, mask=(j < n_used) & col_ok, other=0.0), w, acc)
        total += w
    return acc / total


@_jit
def _mla_combine_kernel(po_ptr, lse_ptr, pos_ptr, o_ptr, M, kv_len, split_len,
                        s_pob, s_pom, s_pos, s_lb, s_lm, s_posb, s_ob, s_om,
                        C: tl.constexpr, BLOCK_C: tl.constexpr, PARTS: tl.constexpr,
                        BLOCK_S: tl.constexpr,
                        IN_ORDER: tl.constexpr):
    """o[b, m] = the merge of the parts that hold a slot (part 0, the new tokens, and the splits of
    the slots before the row's first position). IN_ORDER: one part after another (_merge_latents),
    as mla_merge_absorb adds them; else all parts in one load (BLOCK_S >= PARTS) and tl.sum.
    po [B, M, PARTS, C] and lse [B, M, PARTS] float32 from _mla_decode_kernel (last dims
    contiguous); pos int64 [B, T]; o [B, M, C] (any float dtype). Grid: (B * M, cdiv(C,
    BLOCK_C))."""
    _wait_for_prior()
    row, cb = tl.program_id(0), tl.program_id(1)
    b, m = row // M, row % M
    if IN_ORDER:
        one = tl.zeros([1, 1], tl.int32)  # the program's one row, as a block
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]              # [1, BLOCK_C]
        out = _merge_latents(po_ptr + b * s_pob + m * s_pom + one,
                             lse_ptr + b * s_lb + m * s_lm + one, s_pos,
                             offs_c, offs_c < C, _parts_used(pos_ptr + b * s_posb + one, kv_len,
                                                             split_len), PARTS)
    else:
        n_used = _parts_used(pos_ptr + b * s_posb, kv_len, split_len)
        j = tl.arange(0, BLOCK_S)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        # [BLOCK_S]
        lse = tl.load(lse_ptr + b * s_lb + m * s_lm + j, mask=j < n_used, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))
        part = tl.load(po_ptr + b * s_pob + m * s_pom + j[:, None] * s_pos + offs_c[None, :],
                       # [BLOCK_S, BLOCK_C]
                       mask=(j < n_used)[:, None] & (offs_c < C)[None, :], other=0.0)
        out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(o_ptr + b * s_ob + m * s_om + offs_c, out.to(o_ptr.dtype.element_ty), mask=offs_c < C)


@_jit
def _mla_merge_absorb_kernel(po_ptr, lse_ptr, pos_ptr, w_ptr, out_ptr, rows, T, H, N, K, kv_len,
                             split_len,
                             s_pob, s_pom, s_pos, s_lb, s_lm, s_posb, s_wh, s_wn, s_or, s_oh,
                             groups, PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PREFETCH: tl.constexpr):
    """out[r, h, n] = sum_k o[r, h, k] * W[h, n, k] for the rows r = b*T + t, with o[r, h] the merge
    of query row m = t*H + h of batch row b, as _mla_combine_kernel stores it (rounded to W's
    dtype): the combine and head_gemv's product in one launch. Each program merges its head's rows
    for itself, from the partials in L2, a K step at a time (_merge_latents), and multiplies them by
    its BLOCK_N rows of W[h] as _norm_gemv_kernel does for head_gemv (the same steps of BLOCK_K, the
    next W tile in flight, the products added elementwise and summed over k at the end: on sm_90
    the same layouts, so the same order), so out equals head_gemv of the combine's o bit for bit.
    po [B, M, PARTS, K] and lse [B, M, PARTS] float32 from _mla_decode_kernel (last dims
    contiguous); pos int64 [B, T]; W [H, N, K] (K contiguous); out [rows, H, N] (rows strided, N
    contiguous) of W's dtype; the rows in head_gemv's groups of BLOCK_M, a program a group
    (program q of axis 0: W's row block q // groups, group q % groups). PREFETCH: the bytes of
    each of its W rows a program asks the L2 for before its wait (common._prefetch_matrix_rows).
    Grid: (cdiv(N, BLOCK_N) * groups, H)."""
    q, h = tl.program_id(0), tl.program_id(1)
    pid = q // groups
    _prefetch_matrix_rows(w_ptr + h * s_wh, pid * BLOCK_N + tl.arange(0, BLOCK_N), N, s_wn, 0, K,
                          PREFETCH)
    _wait_for_prior()
    r_all = (q % groups) * BLOCK_M + tl.arange(0, BLOCK_M)
    r = tl.minimum(r_all, rows - 1)  # padding rows repeat the last one, not stored
    b, m = r // T, (r % T) * H + h
    po_rows = (po_ptr + b * s_pob + m * s_pom)[:, None]  # [BLOCK_M, 1]
    lse_rows = (lse_ptr + b * s_lb + m * s_lm)[:, None]
    n_used = _parts_used(pos_ptr + b * s_posb, kv_len, split_len)[:, None]
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n[None, :, None]  # W's tile [1, BLOCK_N, BLOCK_K]
    kb = tl.arange(0, BLOCK_K)
    k3 = kb[None, None, :]
    w_rows = w_ptr + h * s_wh + n3 * s_wn
    last_k = (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K                            # the last step
    # the products, summed over k at the end
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    w = tl.load(w_rows + k3, mask=(n3 < N) & (k3 < K), other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kb
        k1 = tl.minimum(k0 + BLOCK_K, last_k) + k3  # the next step's (the last: its own)
        w1 = tl.load(w_rows + k1, mask=(n3 < N) & (k1 < K), other=0.0)
        o = _merge_latents(po_rows, lse_rows, s_pos, k[None, :], (k < K)[None, :], n_used, PARTS)
        # [BLOCK_M, BLOCK_K]: o_lat as the combine stores it
        o = o.to(w_ptr.dtype.element_ty).to(tl.float32)
        acc3 += w.to(tl.float32) * o[:, None, :]
        w = w1
    acc = tl.sum(acc3, 2)                                                   # [m, n]
    tl.store(out_ptr + r[:, None] * s_or + h * s_oh + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(r_all < rows)[:, None] & (n < N)[None, :])


def mla_block_m(rows, batch, kv_len):
    """Query rows a program of the MLA decode kernel, for `rows` = T x H query rows a batch row
    and a cache of kv_len slots: see the block sizes above. Host ints only."""
    most = MLA_SHORT_BLOCK_M if batch * kv_len <= MLA_SHORT_CACHE_SLOTS else MLA_MAX_BLOCK_M
    return min(most, _pow2(rows))


def mla_split_len(kv_len, batch, m_blocks, block_n, device):
    """Slots per split: enough splits that a full cache and the new tokens' part give one
    program per SM (one wave), each split at least MLA_MIN_SPLIT slots and a whole number of
    tiles. Host ints only."""
    want = max(1, common.sm_count(device) // (batch * m_blocks) - 1)
    split = max(MLA_MIN_SPLIT, math.ceil(kv_len / want))
    return math.ceil(split / block_n) * block_n


class MLAParts(NamedTuple):
    """mla_decode_attention's output before the merge: each part's normalized output partial
    [B, M, parts, C] and log2 of its sum lse [B, M, parts] (float32; parts past a row's first
    position hold nothing and are never read), the slots a split (split_len) and the cache's
    length (kv_len), which with the positions give the parts in use."""
    partial: torch.Tensor
    lse: torch.Tensor
    split_len: int
    kv_len: int


def _check_norm_weight(launcher, norm_weight, kv):
    """kv_a_layernorm's weight, [C] on kv's device, or a ValueError naming the launcher."""
    C = kv.shape[-1]
    if norm_weight.shape != (C,) or norm_weight.device != kv.device:
        raise ValueError(f"{launcher}: norm_weight {list(norm_weight.shape)} on "
                         f"{norm_weight.device}: needs [{C}] on {kv.device}")
    common.check_unit_stride(launcher, "norm_weight", norm_weight)


def _check_decode_inputs(q_lat, q_pe, kv, k_pe, rope, positions, kv_cache, pe_cache):
    """mla_decode_attention's inputs, or a ValueError that names what does not fit."""
    B, T, H, C = q_lat.shape
    R, S = q_pe.shape[-1], kv_cache.shape[1]
    if (q_pe.shape[:3] != (B, T, H) or kv.shape != (B, T, C) or k_pe.shape != (B, T, R) or R % 2
            or rope.shape != (B, T, R // 2, 2) or kv_cache.shape != (B, S, C)
            or pe_cache.shape != (B, S, R)):
        raise ValueError(f"mla_decode_attention: shapes q_lat {list(q_lat.shape)}, "
                         f"q_pe {list(q_pe.shape)}, kv {list(kv.shape)}, k_pe {list(k_pe.shape)}, "
                         f"rope {list(rope.shape)}, kv_cache {list(kv_cache.shape)}, "
                         f"pe_cache {list(pe_cache.shape)} do not fit [B, T, H, C], [B, T, H, R], "
                         "[B, T, C], [B, T, R], [B, T, R/2, 2], [B, S, C], [B, S, R] with R even")
    if positions.shape != (B, T) or positions.dtype != torch.int64 or rope.dtype != torch.float32:
        raise ValueError(f"mla_decode_attention: positions must be int64 [{B}, {T}] and rope "
                         f"float32, got {positions.dtype} {list(positions.shape)} and {rope.dtype}")
    dtypes = {x.dtype for x in (q_lat, q_pe, kv, k_pe, kv_cache, pe_cache)}
    if len(dtypes) != 1 or q_lat.dtype not in MLA_BLOCK_N:
        raise ValueError("mla_decode_attention: needs one dtype of "
                         f"{sorted(map(str, MLA_BLOCK_N))} for the queries, the new latents and "
                         f"the cache, got {sorted(map(str, dtypes))} (float64: use the plain path)")
    for name, x in dict(q_pe=q_pe, kv=kv, k_pe=k_pe, kv_cache=kv_cache, pe_cache=pe_cache).items():
        if x.stride(-1) != 1:
            raise ValueError(f"mla_decode_attention: {name}'s last dim must be contiguous")


def mla_decode_attention(q_lat, q_pe, kv, k_pe, norm_weight, eps, rope, positions, kv_cache,
                         pe_cache,
                         softmax_scale, split_len=None, merge=True):
    """MLA's decode-mode step after the projections, in two launches (the parts, the merge):
    writes each new token's normalized latent and rotated rope key at slot = its position, as
    model.MLA.write_cache does, and returns the absorbed attention of the rotated queries over
    the slots <= their positions, o_lat [B, T, H, C] in q_lat's dtype. q_lat [B, T, H, C] (read
    through its strides: the absorbed einsum's head-major output is not copied), q_pe [B, T, H, R]
    (not rotated), kv [B, T, C] and k_pe [B, T, R] (kv_a's halves), norm_weight [C] with eps
    (kv_a_layernorm), rope [B, T, R/2, 2] float32 (cos, sin) at the positions, positions int64 [B,
    T] on the device, consecutive in a row, kv_cache [B, S, C] and pe_cache [B, S, R] (views of the
    caches, strided over B and S; last dims contiguous, as for every input but q_lat). No
    host read: S, not the positions, sets the launch. merge=False: one launch, and the parts
    (MLAParts) come back unmerged, for mla_merge_absorb."""
    B, T, H, C = q_lat.shape
    R, S = q_pe.shape[-1], kv_cache.shape[1]
    _check_decode_inputs(q_lat, q_pe, kv, k_pe, rope, positions, kv_cache, pe_cache)
    _check_norm_weight("mla_decode_attention", norm_weight, kv)
    M = T * H
    q = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()   # read through its B, T, H strides
    qpe = q_pe.reshape(B, M, R)
    rope = rope if rope.stride(-1) == 1 and rope.stride(-2) == 2 else rope.contiguous()
    block_n = MLA_BLOCK_N[q_lat.dtype]
    prefetch = B * T <= MLA_PREFETCH_MAX_ROWS
    block_m = mla_block_m(M, B, S)
    m_blocks = triton.cdiv(M, block_m)
    split_len = split_len or mla_split_len(S, B, m_blocks, block_n, q_lat.device)
    parts = 1 + triton.cdiv(S, split_len)
    partial = torch.empty(B, M, parts, C, device=q_lat.device, dtype=torch.float32)
    lse = torch.empty(B, M, parts, device=q_lat.device, dtype=torch.float32)
    _mla_decode_kernel[(parts, B, m_blocks)](
        q, qpe, kv, k_pe, norm_weight, rope, positions, kv_cache, pe_cache, partial, lse,
        T, H, M, S, split_len, float(eps), softmax_scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), qpe.stride(0), qpe.stride(1), kv.stride(0),
        kv.stride(1), k_pe.stride(0), k_pe.stride(1), rope.stride(0), rope.stride(1),
        positions.stride(0), positions.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), pe_cache.stride(0), pe_cache.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        C=C, R=R, BLOCK_C=_pow2(C), BLOCK_R2=_pow2(R // 2, 8), BLOCK_T=_pow2(T), BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        PREFETCH=common.prefetch_bytes(C * kv_cache.element_size()) if prefetch else 0,
        PREFETCH_PE=common.prefetch_bytes(R * pe_cache.element_size()) if prefetch else 0,
        launch_pdl=common.PDL, num_warps=MLA_NUM_WARPS, num_stages=MLA_NUM_STAGES[q_lat.dtype])
    unmerged = MLAParts(partial, lse, split_len, S)
    return mla_combine(unmerged, positions, q_lat.dtype).view(B, T, H, C) if merge else unmerged


def mla_combine(unmerged, positions, dtype):
    """The merge of mla_decode_attention's parts (MLAParts) into o_lat [B, M, C] of `dtype`: one
    launch."""
    partial, lse, split_len, kv_len = unmerged
    B, M, parts, C = partial.shape
    out = torch.empty(B, M, C, device=partial.device, dtype=dtype)
    # the CPU interpreter: fewest programs
    block_c = MLA_COMBINE_BLOCK_C if partial.is_cuda else _pow2(C)
    in_order = parts <= MLA_MERGE_IN_ORDER_PARTS
    _mla_combine_kernel[(B * M, triton.cdiv(C, block_c))](
        partial, lse, positions, out, M, kv_len, split_len,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        positions.stride(0), out.stride(0), out.stride(1),
        C=C, BLOCK_C=block_c, PARTS=parts, BLOCK_S=_pow2(parts), IN_ORDER=in_order,
        launch_pdl=common.PDL,
        num_warps=MLA_COMBINE_WARPS if in_order else 4)
    return out


def mla_merge_absorb(unmerged, positions, w_uv):
    """head_gemv(o_lat, w_uv) with o_lat the merge of mla_decode_attention's parts (merge=False),
    in one launch instead of two, and equal bit for bit: out[b, t, h] = W_uv[h] @ o_lat[b, t, h],
    [B, T, H, N] in w_uv's dtype. Each program (H x N / HEAD_GEMV_BLOCK_N of them for each of
    head_gemv's groups of rows) merges its head's rows of its group itself (the parts in use from
    L2; at Kimi-K2's N = 128, 16 programs a head redo that small merge side by side) before its
    product. w_uv [H, N, C] (K = C contiguous; a view of kv_b_proj's weight) of the model's dtype,
    positions int64 [B, T] as given to the attention; at most NORM_GEMV_MAX_ROWS rows B*T, as
    head_gemv. Past MLA_MERGE_IN_ORDER_PARTS parts, or where a K step's parts of all rows do not fit
    MLA_MERGE_ABSORB_REGS a thread: the combine, then head_gemv."""
    partial, lse, split_len, kv_len = unmerged
    B, M, parts, C = partial.shape
    H = w_uv.shape[0]
    T = M // H
    if (w_uv.dim() != 3 or w_uv.shape[2] != C or w_uv.stride(2) != 1 or positions.shape != (B, T)
            or M != T * H):
        raise ValueError(f"mla_merge_absorb: partial {list(partial.shape)}, positions "
                         f"{list(positions.shape)} and w_uv {list(w_uv.shape)} do not fit "
                         "[B, T*H, parts, C], [B, T] and [H, N, C] (C contiguous)")
    rows, N = B * T, w_uv.shape[1]
    if (w_uv.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or rows > NORM_GEMV_MAX_ROWS):
        raise ValueError(f"mla_merge_absorb: runs bf16, fp16 or float32 and at most "
                         f"{NORM_GEMV_MAX_ROWS} rows, got {w_uv.dtype} and {rows} rows (use the "
                         "plain path)")
    # head_gemv's groups and steps: the same sums
    groups, block_m, block_k = _head_gemv_blocks(rows, HEAD_GEMV_BLOCK_N, C, w_uv.element_size())
    if (parts > MLA_MERGE_IN_ORDER_PARTS
            or parts * block_m * block_k > MLA_MERGE_ABSORB_REGS * 32 * HEAD_GEMV_WARPS):
        return head_gemv(mla_combine(unmerged, positions, w_uv.dtype).view(B, T, H, C), w_uv)
    out = torch.empty(B, T, H, N, device=partial.device, dtype=w_uv.dtype)
    if rows and N and H:
        _mla_merge_absorb_kernel[(triton.cdiv(N, HEAD_GEMV_BLOCK_N) * groups, H)](
            partial, lse, positions, w_uv, out, rows, T, H, N, C, kv_len, split_len,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            positions.stride(0), w_uv.stride(0), w_uv.stride(1), H * N, N, groups,
            PARTS=parts, BLOCK_M=block_m, BLOCK_N=HEAD_GEMV_BLOCK_N, BLOCK_K=block_k,
            PREFETCH=common.prefetch_bytes(C * w_uv.element_size()),
            num_warps=HEAD_GEMV_WARPS, num_stages=1, launch_pdl=common.PDL)
    return out


# ---------------------------------------------------------------------------------------------
# RoPE fused with the cache write
#
# What MLA does with each new token before attending, in one program per token: normalize the
# latent (kv_a_layernorm) and write it to its cache slot (slot = position), rotate k_pe and write
# it beside, and rotate the token's H query rotary parts. RoPE turns interleaved pairs
# (x[2i], x[2i+1]) by the angle whose (cos, sin) the table gives for the token's position.


@_jit
def _rope_cache_kernel(q_ptr, kv_ptr, kpe_ptr, w_ptr, rope_ptr, pos_ptr, kv_cache_ptr, pe_cache_ptr,
                       qo_ptr,
                       T, H, eps, s_qb, s_qt, s_qh, s_kvb, s_kvt, s_kpb, s_kpt, s_rb, s_rt, s_posb,
                       s_post,
                       s_cb, s_cs, s_pb, s_ps, s_ob, s_ot, s_oh,
                       C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_H: tl.constexpr,
                       BLOCK_R2: tl.constexpr):
    """For token (b, t) at slot p = pos[b, t]: kv_cache[b, p] = RMSNorm(kv[b, t]) * w,
    pe_cache[b, p] = rope(kpe[b, t]), qo[b, t, h] = rope(q[b, t, h]) for every head h.
    q [B, T, H, R], kv [B, T, C], kpe [B, T, R] (strided views, last dim contiguous; one dtype);
    w [C]; rope [B, T, R/2, 2] float32 (cos, sin), contiguous in its last two dims; pos int64
    [B, T]; caches [>=B, S, C] and [>=B, S, R]; qo [B, T, H, R]. Float32 math, one rounding.
    Grid: (B * T,)."""
    _wait_for_prior()
    n = tl.program_id(0)
    b, t = n // T, n % T
    p = tl.load(pos_ptr + b * s_posb + t * s_post)
    c = tl.arange(0, BLOCK_C)
    kv = tl.load(kv_ptr + b * s_kvb + t * s_kvt + c, mask=c < C, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    normed = kv / tl.sqrt(tl.sum(kv * kv, 0) / C + eps) * w
    tl.store(kv_cache_ptr + b * s_cb + p * s_cs + c, normed.to(kv_cache_ptr.dtype.element_ty),
             mask=c < C)
    r = tl.arange(0, 2 * BLOCK_R2)
    one = tl.zeros([1], tl.int32)   # _rotated takes rows: k_pe is one row
    pe = _rotated(kpe_ptr + b * s_kpb + t * s_kpt + one, rope_ptr + b * s_rb + t * s_rt + one,
                  one == 0, R,
                  BLOCK_R2)  # [1, 2 * BLOCK_R2]
    tl.store(pe_cache_ptr + b * s_pb + p * s_ps + one[:, None] + r[None, :],
             pe.to(pe_cache_ptr.dtype.element_ty), mask=(r < R)[None, :])
    h = tl.arange(0, BLOCK_H)
    q = _rotated(q_ptr + b * s_qb + t * s_qt + h * s_qh, rope_ptr + b * s_rb + t * s_rt + 0 * h,
                 h < H, R,
                 BLOCK_R2)  # [BLOCK_H, 2 * BLOCK_R2]
    tl.store(qo_ptr + b * s_ob + t * s_ot + h[:, None] * s_oh + r[None, :],
             q.to(qo_ptr.dtype.element_ty),
             mask=(h < H)[:, None] & (r < R)[None, :])


def mla_rope_cache_write(q_pe, kv, k_pe, norm_weight, eps, rope, positions, kv_cache, pe_cache):
    """Writes kv_cache[b, positions[b, t]] = RMSNorm(kv[b, t]) and pe_cache[b, positions[b, t]] =
    rope(k_pe[b, t]); returns rope(q_pe) [B, T, H, R]. q_pe [B, T, H, R], kv [B, T, C], k_pe
    [B, T, R] (views with a contiguous last dim), rope [B, T, R/2, 2] float32 (cos, sin) at each
    token's position, positions int64 [B, T], caches [>=B, S, C] / [>=B, S, R]."""
    B, T, H, R = q_pe.shape
    C = kv.shape[-1]
    if kv.shape != (B, T, C) or k_pe.shape != (B, T, R) or rope.shape != (B, T, R // 2, 2) or R % 2:
        raise ValueError(f"mla_rope_cache_write: q_pe {list(q_pe.shape)}, kv {list(kv.shape)}, "
                         f"k_pe {list(k_pe.shape)}, rope {list(rope.shape)} do not fit "
                         "[B, T, H, R], [B, T, C], [B, T, R], [B, T, R/2, 2] with R even")
    if q_pe.dtype not in MLA_BLOCK_N or len({q_pe.dtype, kv.dtype, k_pe.dtype, kv_cache.dtype,
                                             pe_cache.dtype}) != 1:
        raise ValueError("mla_rope_cache_write: needs one dtype of "
                         f"{sorted(map(str, MLA_BLOCK_N))} for the inputs and the caches, got "
                         f"{q_pe.dtype}, {kv.dtype}, {k_pe.dtype}, {kv_cache.dtype}, "
                         f"{pe_cache.dtype} (float64: use the plain path)")
    if positions.shape != (B, T) or positions.dtype != torch.int64 or rope.dtype != torch.float32:
        raise ValueError("mla_rope_cache_write: needs int64 positions [B, T] and a float32 rope "
                         "table")
    _check_norm_weight("mla_rope_cache_write", norm_weight, kv)
    if kv_cache.shape[0] < B or kv_cache.shape[2] != C or pe_cache.shape[2] != R:
        raise ValueError(f"mla_rope_cache_write: caches {list(kv_cache.shape)}, "
                         f"{list(pe_cache.shape)} do not hold [{B}, S, {C}] and [{B}, S, {R}]")
    for name, x in dict(q_pe=q_pe, kv=kv, k_pe=k_pe, kv_cache=kv_cache, pe_cache=pe_cache).items():
        if x.stride(-1) != 1:
            raise ValueError(f"mla_rope_cache_write: {name}'s last dim must be contiguous")
    rope = rope if rope.stride(-1) == 1 and rope.stride(-2) == 2 else rope.contiguous()
    out = torch.empty(B, T, H, R, device=q_pe.device, dtype=q_pe.dtype)
    _rope_cache_kernel[(B * T,)](
        q_pe, kv, k_pe, norm_weight, rope, positions, kv_cache, pe_cache, out, T, H, float(eps),
        q_pe.stride(0), q_pe.stride(1), q_pe.stride(2), kv.stride(0), kv.stride(1), k_pe.stride(0),
        k_pe.stride(1),
        rope.stride(0), rope.stride(1), positions.stride(0), positions.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), pe_cache.stride(0), pe_cache.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        C=C, R=R, BLOCK_C=_pow2(C), BLOCK_H=_pow2(H, 1), BLOCK_R2=_pow2(R // 2, 1),
        launch_pdl=common.PDL, num_warps=4)
    return out


launch.mla_rope_cache_write = mla_rope_cache_write
launch.mla_decode_attention = mla_decode_attention
launch.mla_merge_absorb = mla_merge_absorb

class DecodeAttentionKernel(model.MLA):
    """"attention": decode mode's RoPE, cache write and latent attention in one kernel and a
    merge (mla_decode_attention) between the projections, which stay model.MLA's methods (and
    their swaps'); the steps around them are model.MLA.attend's. merges_in_w_uv (the combinations
    with "norm_gemv", declared in swaps.py): at most MLA_MERGE_ABSORB_MAX_ROWS rows, W_uv's launch
    merges the parts (mla_merge_absorb) in place of the merge launch and absorb_output. The kernel
    masks by position (slots <= position, slot = position, a row's tokens at consecutive positions:
    a decode step, a chain's verify); a draft tree's nodes (slots given) are not, and extend mode
    expands the cache: both take model.MLA.attend."""

    merges_in_w_uv = False

    def attend(self, q, kv_a, positions, rope, future, mode, slots=None):
        if mode != "decode" or slots is not None:
            return super().attend(q, kv_a, positions, rope, future, mode, slots)
        a, h, norm = self.args, self.n_local_heads, self.kv_a_layernorm
        (B, T, _), kv_len = kv_a.shape, future.shape[-1]
        q_nope, q_pe = q.view(B, T, h,
                              a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        kv, k_pe = kv_a.split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        w_uk, w_uv = self.kv_b_halves()
        in_w_uv = self.merges_in_w_uv and B * T <= MLA_MERGE_ABSORB_MAX_ROWS   # W_uv's GEMV merges
        o = launch.mla_decode_attention(self.absorb_query(q_nope, w_uk), q_pe, kv, k_pe,
                                        norm.weight, norm.eps,
                                        rope, positions, self.kv_cache[:B, :kv_len],
                                        self.pe_cache[:B, :kv_len],
                                        a.softmax_scale, merge=not in_w_uv)
        out = self.merge_absorb_output(o, positions,
                                       w_uv) if in_w_uv else self.absorb_output(o, w_uv)
        return self.o_proj(out.flatten(2))

    def merge_absorb_output(self, parts, positions, w_uv):
        """absorb_output of the merge of the attention's parts (MLAParts), in W_uv's launch."""
        return launch.mla_merge_absorb(parts, positions, w_uv)


class RopeCacheKernel(model.MLA):
    """"rope_cache": RoPE, the latent norm and both cache writes of write_cache in one kernel
    (writing at the slots it is given: a tree's are not its positions)."""

    def write_cache(self, q_pe, kv_a, slots, rope):
        a, norm = self.args, self.kv_a_layernorm
        kv, k_pe = kv_a.split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        return launch.mla_rope_cache_write(q_pe, kv, k_pe, norm.weight, norm.eps, rope, slots,
                                           self.kv_cache, self.pe_cache)

