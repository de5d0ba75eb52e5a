"""The norm + GEMV family: RMSNorm (and a residual add) inside the GEMV that reads it
(norm_gemv), the per-head GEMV of MLA's absorbed products (head_gemv), and their swaps."""
import math

import torch

import model
import tp

from . import common
from .common import (_counters, _jit, _last_program, _pow2, _prefetch_matrix_rows,
                     _wait_for_prior, launch, rows, tl, triton)
from .stacked import StackedQKVA


# RMSNorm fused into the GEMV that reads it (decode and verify: at most NORM_GEMV_MAX_ROWS rows)
#
# out = RMSNorm(x) @ W^T for a few rows x [M, K] and a weight W [N, K]: a GEMV, memory-bound
# on W. A GEMV is fast only with many bytes in flight. Every program loads its next step's tile
# before it multiplies the one it holds (Triton pipelines only loads that feed tl.dot). The norm
# factors out of the sum, out[m, n] = rstd[m] * sum_k x[m, k] g[k] W[n, k], so each program also
# sums the squares of its part of x and rstd is applied at the end: the norm costs no pass or
# launch of its own. The products run on the CUDA cores in float32 (tl.dot would pad M to 16 rows:
# 16x the activation in registers, several times slower at one row).
# - A program holds BLOCK_N rows of W and all M rows of x, a step of BLOCK_K columns of each, and
#   adds their elementwise products into a float32 [BLOCK_M, BLOCK_N, BLOCK_K] accumulator, summed
#   over k once at the end: no reduction inside the loop, one code path for every row count. The
#   accumulator lives in registers, so the step shrinks as the rows grow (NORM_GEMV_ACC_REGS).
# - K is whole in a program where the row blocks fill the GPU (N / BLOCK_N > 132 programs at
#   Kimi-K2's attention shapes, one wave), at any row count. With fewer row blocks K is split, a
#   program per (BLOCK_N rows, slice of K): each stores its float32 partial sums and the last
#   program of a row block to finish (an atomic counter, reset by that program) adds the slices in
#   slice order, scales and stores.
# One launch, no float atomics: deterministic, so a graph replay equals the eager call.
# Rounding: the normed row is not rounded (the plain path rounds it to W's dtype), so bf16 results
# differ from the plain path's by the order of one rounding. From NORM_GEMV_DOT_MIN_ROWS rows the
# products run on the tensor cores instead (_norm_gemv_dot_kernel), x * g rounded to bf16 there.
# With a residual r (a layer's input norm, InputNormInQKVA) the kernel reads x and r and normalizes
# their sum, rounded to the dtype as the plain add rounds it; the programs of row block 0 also store
# that sum (the residual stream), each for its own slice of K: the add + norm launch in front of the
# GEMV goes.

NORM_GEMV_MAX_ROWS = 16     # decode and verify; prefill goes to the plain RMSNorm and cuBLAS
# (BLOCK_N, bytes of a W row a step, warps) by (one row or several, K long or short), the step cut
# to fit NORM_GEMV_ACC_REGS: at one row 8 warps and short steps (o_proj, K 1024: 4 steps of 256 beat
# one of 1024); at several rows 4 warps, and 4 W rows a program at long K (python -m kernels.bench
# --small --sweep)
NORM_GEMV_BLOCKS = {(1, "long"): (8, 2048, 8), (1, "short"): (16, 512, 8),
                    ("several", "long"): (4, 2048, 4), ("several", "short"): (16, 512, 4)}
NORM_GEMV_LONG_K = 1536     # columns from which a row is "long": q_a + kv_a and q_b (K 7168, 1536)
# float32 products a thread accumulates, BLOCK_M x BLOCK_N x BLOCK_K <= 64 x 32 x warps: more spills
# (python -m kernels.bench --small --sweep)
NORM_GEMV_ACC_REGS = 64
# columns: the accumulator's limit cuts the step no shorter (a 128-byte row)
NORM_GEMV_MIN_STEP = 64
# K is cut into this // row blocks slices (at most one a step): two waves of the H200's 132 SMs; K
# whole from 133 row blocks up, as at all of Kimi-K2's attention projections (--small --sweep)
NORM_GEMV_PROGRAMS = 264
# From this many rows, in bf16, the products run on the tensor cores (_norm_gemv_dot_kernel): x's
# rows padded to 16, the accumulator [16, BLOCK_N] however long the step, where the CUDA cores'
# [rows, BLOCK_N, step] cuts the step as the rows grow. Alone, µs a call in a graph at 1 to 16
# rows (python -m kernels.bench --small; the CUDA cores' form, cuBLAS): q_a + kv_a 11.0-11.2 flat
# (9.9 at 1-2, 12.7-12.9 at 3-4, 25.4-51.7 from 5; cuBLAS 13.2-13.9); q_b with its norm 5.5-5.7
# (3.7-5.0 at 1-4, 7.9 at 5-8; cuBLAS 8.8-9.9); o_proj 6.0 (5.7-6.1 at 1-2, 8.1 at 3-4; cuBLAS
# 6.4-6.6). In run.py's verify the form paid only from 5 rows (at 3-4 q_a + kv_a no time saved;
# BENCHMARKS.md: Verify sweep, its Kept table; Tried and not kept). NORM_GEMV_DOT: (BLOCK_N,
# BLOCK_K, warps, stages), the best of 16-64 x 128-512 x 2-4 stages at q_a + kv_a and q_b.
NORM_GEMV_DOT_MIN_ROWS = 5
NORM_GEMV_DOT = (32, 128, 4, 4)
# x's rows may be cut into groups (group_rows, a power of 2), a program a group, the groups of a W
# tile side by side (all but the first reading it from L2), so that a program's accumulator and
# step stay those of a group's rows. head_gemv takes groups (HEAD_GEMV_GROUP_ROWS); norm_gemv's
# projections keep every row in one program: in groups they are no faster than cuBLAS past the
# limits below, nor than one program at q_b's 5 to 8 rows (kernels.bench --small)


@_jit
def _norm_gemv_slice_sum(acc, ss, part_ptr, ss_ptr, count_ptr, q, s, rows, n, M, N,
                         SPLITS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store slice s's sums acc [BLOCK_M, BLOCK_N] and sums of squares ss [BLOCK_M] of block q (a
    row block of W and a group of x's rows); the last of q's programs to finish returns (the sums
    over all slices in slice order, True), the others False."""
    ok = (rows < M)[:, None] & (n < N)[None, :]
    tl.store(part_ptr + (s * M + rows[:, None]) * N + n[None, :], acc, mask=ok)
    mine = ss_ptr + (q * SPLITS + s) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(mine, ss)
    last = _last_program(count_ptr, q, SPLITS)
    if last:  # the block's other slices are stored: add them
        acc = tl.zeros_like(acc)
        ss = tl.zeros_like(ss)
        for t in range(SPLITS):  # in slice order (.cg: from L2, never a stale L1 line)
            acc += tl.load(part_ptr + (t * M + rows[:, None]) * N + n[None, :], mask=ok, other=0.0,
                           cache_modifier=".cg")
            ss += tl.load(mine + (t - s) * BLOCK_M, cache_modifier=".cg")
    return acc, ss, last


@_jit
def _residual_sum(x_ptrs, r_ptrs, ok):
    """x + r at the pointers (where ok), rounded to x's dtype as the plain add (model.RMSNorm's)
    rounds it."""
    x = tl.load(x_ptrs, mask=ok, other=0.0)
    return (x.to(tl.float32) + tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)


@_jit
def _store_residual_sum(x_rows, r_rows, sum_rows, rows, kb, lo, hi, M, K, BLOCK_K: tl.constexpr):
    """_norm_gemv_kernel's sum x + r over columns [lo, hi) stored into sum's rows, after the
    products: a store inside the product loop holds back the next step's loads, so the sum is read
    and added again here."""
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + kb
        ok = (rows < M)[:, None] & (k < K)[None, :]
        tl.store(sum_rows + k[None, :], _residual_sum(x_rows + k[None, :], r_rows + k[None, :], ok),
                 mask=ok)


@_jit
def _norm_gemv_input(x_rows, r_rows, g_ptr, rows, k, M, K, ss2, ADD: tl.constexpr,
                     NORM: tl.constexpr):
    """A step's input at columns k, float32 [len(rows), len(k)]: x (ADD: x + r, rounded to x's
    dtype), times g (NORM); and ss2 with the step's squares of x added (NORM)."""
    ok = (rows < M)[:, None] & (k < K)[None, :]
    if ADD:
        h = _residual_sum(x_rows + k[None, :], r_rows + k[None, :], ok).to(tl.float32)
    else:
        h = tl.load(x_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        ss2 += h * h
        h = h * tl.load(g_ptr + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
    return h, ss2


@_jit
def _norm_gemv_finish(acc, ss, out_ptr, part_ptr, ss_ptr, count_ptr, q, s, rows, n, M, N, K, eps,
                      s_om, SPLITS: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's sums acc [BLOCK_M, BLOCK_N] and sums of squares ss [BLOCK_M] of slice s: with
    SPLITS > 1 stored, and the last program of block q adds every slice's; that program (or each,
    with one slice) scales the rows by their rstd (NORM) and stores them into out."""
    last = q >= 0  # one slice: every program
    if SPLITS > 1:
        acc, ss, last = _norm_gemv_slice_sum(acc, ss, part_ptr, ss_ptr, count_ptr, q, s, rows, n,
                                             M, N, SPLITS, BLOCK_M)
    if NORM:
        acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    tl.store(out_ptr + rows[:, None] * s_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (n < N)[None, :] & last)


@_jit
def _norm_gemv_kernel(x_ptr, r_ptr, sum_ptr, g_ptr, w_ptr, out_ptr, part_ptr, ss_ptr, count_ptr,
                      M, N, K, k_split, eps, s_xm, s_rm, s_sm, s_xh, s_wh, s_wn, s_wk, s_om, s_oh,
                      groups, SPLITS: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREFETCH: tl.constexpr, PREFETCH_COLS: tl.constexpr):
    """out[m, n] = sum_k h[m, k] * W[n, k] with h = x (NORM: RMSNorm(x), x * rsqrt(mean(x^2) + eps)
    * g). ADD: x is the sum x + r of x and a residual r [M, K], rounded to x's dtype, which the
    programs of W's row block 0 (each for its own rows and slice of K, after its products) store
    into sum [M, K] (rows strided, last dim contiguous).
    x [M, K], out [M, N] (rows strided, last dim contiguous), W [N, K] (any strides), g [K]; x, out
    and W of one dtype; float32 products on the CUDA cores, added up elementwise over the steps and
    summed over k at the end. Each step loads the next step's W tile before it uses its own. Slice
    s of K is [s * k_split, (s + 1) * k_split); with SPLITS > 1, part [SPLITS, M, N] and ss
    [cdiv(N, BLOCK_N) x groups, SPLITS, BLOCK_M] float32 hold the slices' sums and sums of squares,
    count [cdiv(N, BLOCK_N) x groups] int32 zeros. With heads (grid axis 1, head_gemv, SPLITS 1):
    x, W and out of head j start s_xh, s_wh, s_oh elements further. x's rows in `groups` groups of
    BLOCK_M (M <= groups x BLOCK_M), a program a group: program q of axis 0 takes W's row block
    q // groups and group q % groups, so the groups of one row block run side by side and all but
    the first read W's tile from L2. PREFETCH: the bytes of each of its W rows a program asks the
    L2 for before its wait (common._prefetch_matrix_rows; W's rows contiguous); with
    PREFETCH_COLS > 0 (W's columns contiguous instead, head_gemv's W_uk^T) the bytes of each of its
    first PREFETCH_COLS columns' segments of BLOCK_N rows, a column's segment as its row.
    Grid: (cdiv(N, BLOCK_N) * groups, heads, SPLITS)."""
    q, j, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid = q // groups
    rows = (q % groups) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = s * k_split
    hi = tl.minimum(lo + k_split, K)
    if PREFETCH_COLS > 0:  # the columns lo .. as the rows, rows pid * BLOCK_N .. N as the columns
        _prefetch_matrix_rows(w_ptr + j * s_wh, lo + tl.arange(0, PREFETCH_COLS), hi, s_wk,
                              pid * BLOCK_N, N, PREFETCH)
    else:
        _prefetch_matrix_rows(w_ptr + j * s_wh, n, N, s_wn, lo, hi, PREFETCH)
    _wait_for_prior()
    n3 = n[None, :, None]  # W's tile [1, BLOCK_N, BLOCK_K]
    kb = tl.arange(0, BLOCK_K)
    k3 = kb[None, None, :]
    x_rows = x_ptr + j * s_xh + rows[:, None] * s_xm
    r_rows, sum_rows = r_ptr + rows[:, None] * s_rm, sum_ptr + rows[:, None] * s_sm
    w_rows = w_ptr + j * s_wh + n3 * s_wn
    last_k = lo + (tl.cdiv(hi - lo, BLOCK_K) - 1) * BLOCK_K                  # the slice's last step
    # the products, summed over k at the end
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    # the squares, summed over k at the end (a sum a step would be a cross-warp reduction, two
    # barriers, a step)
    ss2 = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    w = tl.load(w_rows + (lo + k3) * s_wk, mask=(n3 < N) & (lo + k3 < K), other=0.0)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + kb
        k1 = tl.minimum(k0 + BLOCK_K, last_k) + k3  # the next step's (the last: its own)
        w1 = tl.load(w_rows + k1 * s_wk, mask=(n3 < N) & (k1 < K), other=0.0)
        h, ss2 = _norm_gemv_input(x_rows, r_rows, g_ptr, rows, k, M, K, ss2, ADD, NORM)
        acc3 += w.to(tl.float32) * h[:, None, :]
        w = w1
    if ADD:
        if pid == 0:
            _store_residual_sum(x_rows, r_rows, sum_rows, rows, kb, lo, hi, M, K, BLOCK_K)
    _norm_gemv_finish(tl.sum(acc3, 2), tl.sum(ss2, 1), out_ptr + j * s_oh, part_ptr, ss_ptr,
                      count_ptr, q, s, rows, n, M, N, K, eps, s_om, SPLITS, NORM, BLOCK_M)


@_jit
def _norm_gemv_dot_kernel(x_ptr, r_ptr, sum_ptr, g_ptr, w_ptr, out_ptr, part_ptr, ss_ptr,
                          count_ptr, M, N, K, k_split, eps, s_xm, s_rm, s_sm, s_wn, s_om,
                          SPLITS: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr,
                          IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """_norm_gemv_kernel's out, sum and slices (one group of rows, no heads) with the products on
    the tensor cores: each step the input h [BLOCK_M, BLOCK_K] (BLOCK_M 16, tl.dot's least; rows
    from M on are zeros) times W's tile [BLOCK_N, BLOCK_K] transposed, by tl.dot into a float32
    [BLOCK_M, BLOCK_N] accumulator, W's tiles loaded ahead into shared memory by Triton's
    pipelining (num_stages). bf16 W: h rounded to bf16, which is x (or x + r) exactly; with NORM
    x * g, one rounding as the plain path's RMSNorm rounds its output (here before rstd, which
    scales the sums); the products exact, added in float32. IEEE (float32 W): float32 products.
    PREFETCH: as _norm_gemv_kernel's. Grid: (cdiv(N, BLOCK_N), 1, SPLITS)."""
    q, s = tl.program_id(0), tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    n = q * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = s * k_split
    hi = tl.minimum(lo + k_split, K)
    _prefetch_matrix_rows(w_ptr, n, N, s_wn, lo, hi, PREFETCH)
    _wait_for_prior()
    kb = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * s_xm
    r_rows, sum_rows = r_ptr + rows[:, None] * s_rm, sum_ptr + rows[:, None] * s_sm
    w_rows = w_ptr + n[:, None] * s_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss2 = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)  # the squares, summed over k at the end
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + kb
        w = tl.load(w_rows + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        h, ss2 = _norm_gemv_input(x_rows, r_rows, g_ptr, rows, k, M, K, ss2, ADD, NORM)
        if IEEE:
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(h.to(w.dtype), tl.trans(w), acc)
    if ADD:
        if q == 0:
            _store_residual_sum(x_rows, r_rows, sum_rows, rows, kb, lo, hi, M, K, BLOCK_K)
    _norm_gemv_finish(acc, tl.sum(ss2, 1), out_ptr, part_ptr, ss_ptr, count_ptr, q, s, rows, n, M,
                      N, K, eps, s_om, SPLITS, NORM, BLOCK_M)


def _k_slices(blocks, K, block_k, programs):
    """(slices, k_split): K cut into whole steps of block_k until about `programs` programs run,
    `blocks` of them a slice."""
    steps = triton.cdiv(K, block_k)
    slices = min(steps, max(1, programs // blocks))
    k_split = triton.cdiv(steps, slices) * block_k
    return triton.cdiv(K, k_split), k_split


def _norm_gemv_step(rows, block_n, step_bytes, warps, K, elem):
    """Columns a step: step_bytes of a W row, at most K rounded up to a power of 2, and at most what
    keeps the float32 accumulator [rows, block_n, step] within NORM_GEMV_ACC_REGS a thread, but no
    fewer than NORM_GEMV_MIN_STEP."""
    fit = NORM_GEMV_ACC_REGS * 32 * warps // (_pow2(rows, 1) * block_n)
    return min(step_bytes // elem, _pow2(K),
               max(NORM_GEMV_MIN_STEP, 1 << (max(fit, 1).bit_length() - 1)))


def _groups(rows, group_rows):
    """(groups, BLOCK_M): x's rows cut into groups of at most group_rows (a power of 2)."""
    if group_rows < 1 or group_rows & (group_rows - 1):
        raise ValueError(f"group_rows {group_rows}: a power of 2 rows a program is needed")
    block_m = min(_pow2(rows, 1), group_rows)
    return triton.cdiv(rows, block_m), block_m


def norm_gemv(x, weight, norm_weight=None, eps=0.0, residual=None, block_n=None, block_k=None,
              programs=None, group_rows=None, dot=None):
    """RMSNorm(x) @ weight^T in one kernel: x [..., K] of weight's dtype (bf16, fp16 or float32),
    weight [N, K] (rows may be a strided view), norm_weight [K] (None: no norm, a plain GEMV), at
    most NORM_GEMV_MAX_ROWS rows. Returns [..., N]. With a residual (x's shape and dtype) the input
    is x + residual, rounded to x's dtype as model.RMSNorm's add: returns ([..., N], x + residual).
    dot: the products on the tensor cores (_norm_gemv_dot_kernel; bf16 and float32); None: from
    NORM_GEMV_DOT_MIN_ROWS rows in bf16 (every row in one program), else on the CUDA cores.
    The block arguments and group_rows (default: every row in one program; not with dot) override
    the defaults above (benchmarks; tests force several slices of a small K and several groups of
    rows)."""
    K = x.shape[-1]
    N = weight.shape[0]
    rows = x.numel() // K if K else 0
    _check_norm_gemv(x, weight, norm_weight, residual, rows)
    if dot is None:
        dot = (rows >= NORM_GEMV_DOT_MIN_ROWS and x.dtype == torch.bfloat16
               and group_rows is None)
    elif dot and (x.dtype == torch.float16 or group_rows is not None):
        raise ValueError(f"norm_gemv: the tensor cores' form runs bf16 or float32, every row in "
                         f"one program, got {x.dtype} and group_rows {group_rows}")
    x2, r2 = (t.reshape(rows, K) for t in (x, x if residual is None else residual))
    x2, r2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, r2))
    out = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    # x2: not written
    summed = x2 if residual is None else torch.empty(rows, K, device=x.device, dtype=x.dtype)
    if rows and N:
        args = (x2, r2, summed, x2 if norm_weight is None else norm_weight, weight, out, float(eps),
                residual is not None, norm_weight is not None, block_n, block_k,
                programs or NORM_GEMV_PROGRAMS)
        if dot:
            _launch_norm_gemv_dot(*args)
        else:
            _launch_norm_gemv(*args, group_rows)
    return out if residual is None else (out, summed.view(x.shape))


def _check_norm_gemv(x, weight, norm_weight, residual, rows):
    """norm_gemv's arguments, or a ValueError that names what does not fit."""
    K = x.shape[-1]
    if (weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1
            or x.dtype != weight.dtype):
        raise ValueError(f"norm_gemv: x {x.dtype} {list(x.shape)} and weight {weight.dtype} "
                         f"{list(weight.shape)} do not fit [..., K] and [N, K] (last dim "
                         "contiguous) of one dtype")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or rows > NORM_GEMV_MAX_ROWS:
        raise ValueError(f"norm_gemv: runs bf16, fp16 or float32 and at most {NORM_GEMV_MAX_ROWS} "
                         f"rows, got {x.dtype} and {rows} rows (use the plain path)")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_gemv: norm weight {list(norm_weight.shape)} is not [{K}]")
    if norm_weight is not None:
        common.check_unit_stride("norm_gemv", "norm_weight", norm_weight)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"norm_gemv: residual {residual.dtype} {list(residual.shape)} is not of "
                         f"x's shape and dtype, {x.dtype} {list(x.shape)}")


def _slice_buffers(out, blocks, block_m, K, block_k, programs):
    """(slices, k_split, part, ss) of a norm_gemv launch of `blocks` blocks: K's slices, and the
    buffers of their partial sums and sums of squares (part is out with one slice)."""
    rows, N = out.numel() // out.shape[-1], out.shape[-1]
    slices, k_split = _k_slices(blocks, K, block_k, programs)
    if slices > 1 and blocks > common.COUNTERS:       # a counter a block of a split K
        raise ValueError(f"norm_gemv: K in {slices} slices for {blocks} blocks ({N} rows of W), "
                         f"more than {common.COUNTERS}")
    part = torch.empty(slices, rows, N, device=out.device,
                       dtype=torch.float32) if slices > 1 else out
    ss = torch.empty(blocks * slices * block_m, device=out.device, dtype=torch.float32)
    return slices, k_split, part, ss


def _launch_norm_gemv(x2, r2, summed, g, weight, out, eps, add, norm, block_n, block_k,
                      programs, group_rows):
    """norm_gemv's products on the CUDA cores (_norm_gemv_kernel)."""
    (rows, K), N = x2.shape, weight.shape[0]
    groups, block_m = _groups(rows, group_rows or NORM_GEMV_MAX_ROWS)
    bn, step_bytes, warps = NORM_GEMV_BLOCKS[1 if block_m == 1 else "several",
                                             "long" if K >= NORM_GEMV_LONG_K else "short"]
    block_n = block_n or bn
    blocks = triton.cdiv(N, block_n) * groups
    block_k = block_k or _norm_gemv_step(block_m, block_n, step_bytes, warps, K, x2.element_size())
    slices, k_split, part, ss = _slice_buffers(out, blocks, block_m, K, block_k, programs)
    _norm_gemv_kernel[(blocks, 1, slices)](
        x2, r2, summed, g, weight, out, part, ss, _counters(x2.device),
        rows, N, K, k_split, eps, x2.stride(0), r2.stride(0), summed.stride(0), 0, 0,
        weight.stride(0), 1, N, 0, groups,
        SPLITS=slices, ADD=add, NORM=norm, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH=common.prefetch_bytes(k_split * x2.element_size()), PREFETCH_COLS=0,
        launch_pdl=common.PDL, num_stages=1, num_warps=warps)


def _launch_norm_gemv_dot(x2, r2, summed, g, weight, out, eps, add, norm, block_n, block_k,
                          programs):
    """norm_gemv's products on the tensor cores (_norm_gemv_dot_kernel), x's rows padded to 16,
    W's rows at least 16 a block (tl.dot's least)."""
    (rows, K), N = x2.shape, weight.shape[0]
    bn, bk, warps, stages = NORM_GEMV_DOT
    block_n, block_k = max(16, block_n or bn), block_k or min(bk, max(16, _pow2(K)))
    blocks, block_m = triton.cdiv(N, block_n), 16
    slices, k_split, part, ss = _slice_buffers(out, blocks, block_m, K, block_k, programs)
    _norm_gemv_dot_kernel[(blocks, 1, slices)](
        x2, r2, summed, g, weight, out, part, ss, _counters(x2.device), rows, N, K, k_split, eps,
        x2.stride(0), r2.stride(0), summed.stride(0), weight.stride(0), N,
        SPLITS=slices, ADD=add, NORM=norm, IEEE=x2.dtype == torch.float32, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH=common.prefetch_bytes(k_split * x2.element_size()), launch_pdl=common.PDL,
        num_stages=stages, num_warps=warps)


# head_gemv's blocks at Kimi-K2's 8 heads (python -m kernels.bench --small, head_gemv against the
# einsums with the copies the model makes of their permuted inputs and outputs)
# W rows a program where W's rows, not its K, are contiguous (absorbed W_uk): 32 bf16 rows,
# 64-byte segments a K step
HEAD_GEMV_BLOCK_N_STRIDED = 32
HEAD_GEMV_BLOCK_N = 8            # contiguous K (W_uv, K = 512): 8 heads x 16 row blocks of 128 rows
# K whole in one step at Kimi-K2's 128 and 512 (not swept); more rows: the step cut to fit
# NORM_GEMV_ACC_REGS
HEAD_GEMV_STEP_BYTES = 1024
HEAD_GEMV_WARPS = 4
# x's rows a program at most (the groups: beside NORM_GEMV_PROGRAMS): from 5 rows, groups of 4 with
# the accumulator and step of 4 rows; one program of 16 rows lost to the einsums at 9 to 16
HEAD_GEMV_GROUP_ROWS = 4


def _head_gemv_blocks(rows, block_n, K, elem, group_rows=None):
    """head_gemv's (groups, BLOCK_M, BLOCK_K) at `rows` rows: its groups of rows and its K step,
    which mla_merge_absorb takes too so that its sums are head_gemv's, bit for bit."""
    groups, block_m = _groups(rows, group_rows or HEAD_GEMV_GROUP_ROWS)
    return groups, block_m, _norm_gemv_step(block_m, block_n, HEAD_GEMV_STEP_BYTES,
                                            HEAD_GEMV_WARPS, K, elem)


def head_gemv(x, weight, group_rows=None):
    """out[..., j, n] = sum_k x[..., j, k] * weight[j, n, k], for each of H heads j: x [..., H, K]
    (last dim contiguous, the leading dims flattening to at most NORM_GEMV_MAX_ROWS rows of one
    stride), weight [H, N, K] of x's dtype, any strides (MLA's absorbed W_uk^T and W_uv are views
    of kv_b_proj's weight). One launch of norm_gemv's kernel, no norm, K whole (short rows, and
    H x N / BLOCK_N programs already); out [..., H, N] contiguous. group_rows overrides
    HEAD_GEMV_GROUP_ROWS."""
    *lead, H, K = x.shape
    rows = math.prod(lead)
    if weight.dim() != 3 or weight.shape[0] != H or weight.shape[2] != K or weight.dtype != x.dtype:
        raise ValueError(f"head_gemv: x {x.dtype} {list(x.shape)} and weight {weight.dtype} "
                         f"{list(weight.shape)} do not fit [..., H, K] and [H, N, K] of one dtype")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or rows > NORM_GEMV_MAX_ROWS:
        raise ValueError(f"head_gemv: runs bf16, fp16 or float32 and at most {NORM_GEMV_MAX_ROWS} "
                         f"rows, got {x.dtype} and {rows} rows (use the plain path)")
    N = weight.shape[1]
    x2 = x.reshape(rows, H, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(*lead, H, N, device=x.device, dtype=x.dtype)
    if rows and N and H:
        block_n = HEAD_GEMV_BLOCK_N if weight.stride(2) == 1 else HEAD_GEMV_BLOCK_N_STRIDED
        groups, block_m, block_k = _head_gemv_blocks(rows, block_n, K, x.element_size(),
                                                     group_rows)
        _norm_gemv_kernel[(triton.cdiv(N, block_n) * groups, H, 1)](
            x2, x2, x2, x2, weight, out, out, out, out, rows, N, K, K, 0.0, x2.stride(0), 0, 0,
            x2.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), H * N, N, groups,
            SPLITS=1, ADD=False, NORM=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            **_head_prefetch(weight, block_n),
            num_warps=HEAD_GEMV_WARPS, num_stages=1, launch_pdl=common.PDL)
    return out


def _head_prefetch(weight, block_n):
    """head_gemv's prefetch before the wait: W [H, N, K] with K contiguous, the first bytes of
    each row; with N contiguous (W_uk^T), each column's segment of block_n rows in up to as many
    columns as keep the bytes a program asks for within common.PREFETCH_ROW_BYTES a row."""
    H, N, K = weight.shape
    if weight.stride(2) == 1:
        return dict(PREFETCH=common.prefetch_bytes(K * weight.element_size()), PREFETCH_COLS=0)
    segment = common.prefetch_bytes(block_n * weight.element_size(), weight.stride(1) == 1)
    if not segment:
        return dict(PREFETCH=0, PREFETCH_COLS=0)
    most = max(1, min(K, common.PREFETCH_ROW_BYTES * block_n // segment))
    return dict(PREFETCH=segment, PREFETCH_COLS=1 << (most.bit_length() - 1))


def head_bmm(x, weight):
    """head_gemv's product past its rows, by cuBLAS's batched GEMM over the heads, written straight
    into out [..., H, N] contiguous (the GEMM's output rows H * N apart): MLA's absorbed W_uv as
    the plain einsum leaves it is stored head-major, and o_proj's flatten of it is a copy."""
    *lead, H, K = x.shape
    x2 = x.reshape(-1, H, K).transpose(0, 1)                  # [H, rows, K]
    out = torch.empty(*lead, H, weight.shape[1], device=x.device, dtype=x.dtype)
    torch.bmm(x2, weight.transpose(1, 2), out=out.view(-1, H, weight.shape[1]).transpose(0, 1))
    return out


launch.norm_gemv = norm_gemv
launch.head_gemv = head_gemv

# Rows (B * T) up to which the GEMV swaps run their kernel instead of cuBLAS (and model.RMSNorm),
# at Kimi-K2's TP-8 shapes, from the kernel's time against its twin's (python -m kernels.bench
# --small --tokens 1,2,3,4,5,6,8,12,16; µs, kernel against twin) and from run.py's verify; where
# the two disagree the limit follows the verify (head_gemv's W_uk, below).
# - The stacked q_a + kv_a (cuBLAS: a split-K GEMV and a reduce): up to 16 (the CUDA cores' form
#   12.7 against 12.9 at 4; from 5 rows the tensor cores', 11.0-11.2 against 13.2-13.9).
# - With the input add + norm inside (InputNormInQKVA): one row; from 2 rows add_rmsnorm and the
#   GEMV are faster.
# - o_proj: up to 2 (6.2 against 6.6 at 2, 8.1 against 6.4 at 3). Its tensor cores' form, 6.0
#   against 6.4-6.5 alone at 3-16, made the INT4 verify 0.17 ms slower at 3-4 tokens and saved
#   nothing at 5-16 (BENCHMARKS.md, Tried and not kept).
# - q_b with its norm: up to 16 (the CUDA cores' form to 4, then the tensor cores', 5.5-5.7
#   against cuBLAS's 8.8-9.7).
# - The absorbed W_uk, W_uv (head_gemv): up to 16, in groups of 4 rows from 5 (HEAD_GEMV_GROUP_ROWS;
#   at 10 to 16 rows 5.5-5.7 and 3.2-3.8 against the einsums' 5.2-5.3 and 5.3-6.2; in one program
#   of 16 rows 7.5 and 4.1 at 12). Alone W_uk is slower there; the 16-row limit rests on the INT4
#   verify with both to 16 rows: 0.26, 0.21 and 0.19 ms less at 10, 12 and 16 tokens (51f1c09;
#   BENCHMARKS.md, Verify sweep, Kept).
# Re-checked in the step (run.py's INT4 verify sweep, each limit raised alone): o_proj to 4 rows
# and the input norm inside to 4 made the verify slower where they moved it (BENCHMARKS.md, Tried
# and not kept).
QKVA_GEMV_MAX_ROWS = 16
INPUT_NORM_QKVA_MAX_ROWS = 1
O_PROJ_GEMV_MAX_ROWS = 2
Q_B_GEMV_MAX_ROWS = 16
HEAD_GEMV_MAX_ROWS = 16


class NormGemvMLA(model.MLA):
    """"norm_gemv": q_b_proj as a GEMV kernel with q_a_layernorm computed inside it (at most
    Q_B_GEMV_MAX_ROWS rows: decode, verify) and decode mode's absorbed W_uk / W_uv products as GEMV
    kernels over the heads (at most HEAD_GEMV_MAX_ROWS rows); more rows: the plain code, but W_uv
    by head_bmm, its output row-major for o_proj."""

    def query(self, q_a):
        if rows(q_a) > Q_B_GEMV_MAX_ROWS:
            return super().query(q_a)
        norm = self.q_a_layernorm
        return launch.norm_gemv(q_a, self.q_b_proj.weight, norm.weight, norm.eps)

    def absorb_query(self, q_nope, w_uk):
        if math.prod(q_nope.shape[:2]) > HEAD_GEMV_MAX_ROWS:                # B * T
            return super().absorb_query(q_nope, w_uk)
        return launch.head_gemv(q_nope, w_uk.transpose(1, 2))

    def absorb_output(self, o_lat, w_uv):
        if math.prod(o_lat.shape[:2]) > HEAD_GEMV_MAX_ROWS:
            return head_bmm(o_lat, w_uv)
        return launch.head_gemv(o_lat, w_uv)


class NormGemvQKVA(NormGemvMLA, StackedQKVA):
    """"norm_gemv" with "fused_proj" (MLA with q_lora_rank): NormGemvMLA, and the stacked q_a + kv_a
    (StackedQKVA's weight) as the GEMV kernel at up to QKVA_GEMV_MAX_ROWS rows; project_sum, the
    same GEMV with the layer's input add and norm inside, is InputNormInQKVA's."""

    def q_kv_a(self, x):
        if rows(x) > QKVA_GEMV_MAX_ROWS:
            return super().q_kv_a(x)
        return launch.norm_gemv(x, self.q_kv_a_weight)

    def project_sum(self, x, residual, norm):
        """(q, kv_a) = project(norm(x + residual)) and x + residual, at most NORM_GEMV_MAX_ROWS rows
        (InputNormInQKVA calls it at INPUT_NORM_QKVA_MAX_ROWS), the add and the norm (the layer's
        input_layernorm) inside q_a + kv_a's GEMV. residual None: project(norm(x)) and x."""
        w, g = self.q_kv_a_weight, norm.weight
        if residual is None:
            q_kv_a, summed = launch.norm_gemv(x, w, g, norm.eps), x
        else:
            q_kv_a, summed = launch.norm_gemv(x, w, g, norm.eps, residual=residual)
        return *self.split_q_kv_a(q_kv_a), summed


class InputNormInQKVA(model.Block):
    """"norm_gemv" with "fused_proj" and "add_rmsnorm" (MLA with q_lora_rank): at most
    INPUT_NORM_QKVA_MAX_ROWS rows, the layer's input residual add and input_layernorm run inside the
    stacked q_a + kv_a GEMV (NormGemvQKVA.project_sum), so no add_rmsnorm launch runs in front of
    the attention; the attention takes the projected inputs (model.MLA.attend). More rows:
    model.Block. MLA's own call does not run here, so run.py's component table scopes project_sum
    and attend themselves (components.MLA_METHODS)."""

    def forward(self, x, residual, positions, rope, future, mode, slots=None):
        if rows(x) > INPUT_NORM_QKVA_MAX_ROWS:
            return super().forward(x, residual, positions, rope, future, mode, slots)
        attn = self.self_attn
        q, kv_a, residual = attn.project_sum(x, residual, self.input_layernorm)
        h = attn.attend(q, kv_a, positions, rope, future, mode, slots)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class GemvRowParallel(tp.RowParallelLinear):
    """"norm_gemv" on MLA's o_proj: at most O_PROJ_GEMV_MAX_ROWS rows through the GEMV kernel (no
    norm) instead of cuBLAS, then tp.RowParallelLinear's all-reduce."""

    def forward(self, x):
        if rows(x) > O_PROJ_GEMV_MAX_ROWS:
            return super().forward(x)
        y = launch.norm_gemv(x, self.weight)
        return self.tp.all_reduce(y) if self.reduce else y


