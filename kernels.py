"""Triton kernels for the hot paths of a decode or verify step, each the fast twin of plain
PyTorch code in model.py that stays the readable specification.

  Routed experts         fused_moe              twin: model.Experts, impl "gather"
  MLA decode attention   mla_decode_attention   twin: model.absorbed_attention
  RoPE + cache write     mla_rope_cache_write   twin: the plain lines of model.MLA.forward it replaces
  Router                 router_topk            twin: model.Router.forward (plain)
  Residual add + RMSNorm add_rmsnorm            twin: x + y, then model.RMSNorm
  SwiGLU activation      silu_mul               twin: F.silu(gate) * up in model.MLP
  RMSNorm + GEMV         norm_gemv              twin: model.norm_linear (plain add, RMSNorm, F.linear)
  GEMV per head          head_gemv              twin: the absorbed einsums of model.MLA.attend_absorbed

The fused MoE is switched on by model.Transformer(moe_impl="fused") (run.py --moe-impl; "auto"
picks it on a GPU with Triton), the others by name (model.Transformer(..., kernels=...), run.py
--kernels); each is tested
against its twin in test_equivalence.py. Triton is imported only where it exists: without it
this module still imports (HAVE_TRITON is False) and the plain paths run. On a CPU the kernels
run only under the Triton interpreter (TRITON_INTERPRET=1, set before import; slow, for tests).
This module must not import model.py (model.py imports it).

Shape legend: B batch rows, T query tokens per row, H local heads, M = T*H query rows of one
batch row, C kv_lora_rank (latent width), R qk_rope_head_dim, S cache slots, N tokens, D hidden,
E routed experts, G expert groups, K experts per token, I expert intermediate (this rank's
slice), P = N*K token-expert pairs. Every kernel keeps a fixed launch shape for given input
shapes and reads no device value on the host, so all of them can be captured in CUDA graphs.

    python kernels.py [--moe] [--sweep] [--variants dot,gemv] [--json OUT]   # on a GPU: each kernel
                      # against its plain twin and its floor (--moe: the fused MoE only)
"""
import math
import os
from dataclasses import dataclass
from functools import partial

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU / CI machines without triton: the plain paths run
    triton = None
    HAVE_TRITON = False

    class tl:  # lets the kernel signatures below evaluate; no kernel runs without triton
        constexpr = None


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_available(device):
    """A clear error where the kernels cannot run on `device`."""
    device = torch.device(device)
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kernels need the triton package, which is not installed "
                           "(pip install triton; or leave the kernels off)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the Triton kernels run on CUDA devices; on {device} only under the Triton "
                           "interpreter (TRITON_INTERPRET=1 before import; slow, for tests)")


def _jit(fn):
    """triton.jit where triton exists; else the function stays a plain (uncallable-as-kernel) def."""
    return triton.jit(fn) if HAVE_TRITON else fn


def _pow2(n, least=16):
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


# ---------------------------------------------------------------------------------------------
# Routed experts (fused MoE)
#
# y[n] = sum_k w[n, k] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, k]
#
# The tile variant (k3; the GEMV variant of the next section serves a few tokens, GEMV_MAX_TOKENS).
# Four launches, each of a fixed grid for given (N, K, E): align (sort the P pairs by expert on the
# device, each expert's pairs padded to whole BLOCK_M tiles), gate_up (a program per (tile of
# pairs of one expert, BLOCK_N rows of I): both projections, SiLU and the product), down (a program
# per (tile, BLOCK_N rows of D): routing weight applied, one fp32 row per pair) and combine (the K
# rows of a token summed). A tile holds pairs of one expert only, and every tile of an expert reads
# that expert's weights, so an expert picked by up to BLOCK_M tokens is read exactly once. At most
# min(E, P) + P // BLOCK_M tiles exist (sum over experts of ceil(count / BLOCK_M)); that bound sizes
# the buffers and the grids, and tiles left unused exit at once. Weights are read as stored (bf16 /
# fp32, FP8 e4m3 with block scales, INT4 packed words with group scales), dequantized in registers;
# products accumulate in fp32. Deterministic: no atomics, so a graph replay equals the eager call.

BLOCK_M = 16       # pairs per tile: tl.dot's smallest M. With N <= a few hundred and 384 experts most
                   # experts get 1-4 tokens, so a larger tile would only add padding rows.
ALIGN_CHUNK = 32   # pairs per step of the align kernel (a [ALIGN_CHUNK, E] one-hot per step)
COMBINE_BLOCK = 1024

# Block sizes (BLOCK_N, BLOCK_K, num_warps, num_stages) for gate_up and down, by weight format and
# number of token-expert pairs P, from `python kernels.py --sweep` on an H200 (2026-11-29,
# BENCHMARKS.md):
#  - gate_up BLOCK_N: a decode step (P = 8) has 8 expert tiles; BLOCK_N 16 makes 16 programs of
#    each (128 for 132 SMs) and beat 32 by 1.1x. From 4 tokens on there are 32+ tiles, and 32 rows
#    a program beat 16 by 1.3x (bf16) to 1.5x (FP8): half the activation loads and loop overhead
#    per weight byte. Splitting the k range 4 ways at decode (256 programs, partial sums added
#    in the down kernel) was ~1.6x slower (86.8 against 55.6 us a layer, bf16): not done.
#  - BLOCK_K 128 for bf16 and FP8 (= the checkpoint's scale block: one scale per row and k-step,
#    applied after the dot); 256 for INT4 (32 packed words a row per k-step, 8 sub-dots of 32).
#  - down BLOCK_N 64: D = 7168 gives 112 programs per expert tile; its block sizes moved times
#    by under 5%.
def _configs(fmt, P, on_gpu):
    if not on_gpu:  # Triton's CPU interpreter runs programs one by one, ~0.1 ms an op: fewest, largest
        return dict(gate_up=(64, 128, 4, 1), down=(64, 128, 4, 1))
    if fmt == "int4":
        return dict(gate_up=(16, 256, 4, 3) if P <= 16 else (32, 256, 8, 3), down=(64, 256, 8, 3))
    return dict(gate_up=(16, 128, 4, 4) if P <= 16 else (32, 128, 4, 4), down=(64, 128, 4, 3))


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


@_jit
def _moe_align_kernel(ids_ptr, sorted_pair_ptr, tile_expert_ptr, P, E, max_tiles, max_tiles_per_expert,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Sort the P token-expert pairs by expert, each expert's run padded to whole BLOCK_M tiles.

    ids_ptr: int [P] expert of pair p = n*K + k (ids [N, K] flattened), values in [0, E).
    sorted_pair_ptr: int32 [max_tiles * BLOCK_M] out: the pair in each tile row, P in padding rows.
    tile_expert_ptr: int32 [max_tiles] out: each tile's expert, -1 for tiles left unused.
    Pairs of one expert keep their order (stable). Grid: (1,): one program, O(P * E / threads)."""
    experts = tl.arange(0, E_PAD)
    count = tl.zeros([E_PAD], tl.int32)
    for start in range(0, P, CHUNK):                                      # pairs per expert
        p = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        count += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tiles = (count + BLOCK_M - 1) // BLOCK_M
    first_tile = tl.cumsum(tiles, 0) - tiles                               # [E_PAD], exclusive
    for start in range(0, max_tiles * BLOCK_M, CHUNK):                     # empty tiles, padding rows
        r = start + tl.arange(0, CHUNK)
        tl.store(sorted_pair_ptr + r, tl.full([CHUNK], 0, tl.int32) + P, mask=r < max_tiles * BLOCK_M)
        tl.store(tile_expert_ptr + r, tl.full([CHUNK], -1, tl.int32), mask=r < max_tiles)
    tl.debug_barrier()                                                     # before overwriting them
    for j in range(0, max_tiles_per_expert):                               # tile -> expert
        tl.store(tile_expert_ptr + first_tile + j, experts, mask=(j < tiles) & (experts < E))
    seen = tl.zeros([E_PAD], tl.int32)
    for start in range(0, P, CHUNK):                                       # pair -> row
        p = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)             # [CHUNK, E_PAD]
        before = tl.cumsum(hit, 0) - hit + seen[None, :]                   # earlier pairs, same expert
        row = tl.sum(hit * (first_tile[None, :] * BLOCK_M + before), axis=1)
        tl.store(sorted_pair_ptr + row, p.to(tl.int32), mask=p < P)
        seen += tl.sum(hit, axis=0)


@_jit
def _accumulate(acc, xt, x_ptr, x_row, row_ok, k0, K_IN, w_ptr, s_ptr, n, n_ok, stride_wn, stride_sr, stride_sc,
                block_r, block_c, off_r, off_c, GROUP,
                FMT: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_PER_ROW: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BM, BN] += X[rows, k0:k0+BK] @ W[n, k0:k0+BK]^T, W of one expert read as stored.

    xt [BM, BK]: that activation tile (plain, FP8); INT4 reads its own strided pieces of it at
    x_ptr + x_row[m] + c (element c of tile row m's activation row). w_ptr, s_ptr: the expert's
    weight and scale (ExpertWeights layouts); n: [BN] output rows. FMT 0 plain, 1 FP8 blocks, 2
    INT4 packed. SCALE_PER_ROW (FP8): the k-step lies inside one column block, so the scale is one
    per row, applied to the dot's result."""
    if FMT == 2:
        # INT4: the k-step's words [BK/8, BN]; nibble j of word w is element 8w + j, so the step is
        # 8 dots over the elements {8w + j}, with no unpacking into the natural order (which costs
        # a layout change through shared memory: 1.5-2.4x slower on the H200, and out of shared
        # memory for the down projection).
        w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w_ok = w < K_IN // 8
        words = tl.load(w_ptr + n[None, :] * stride_wn + w[:, None], mask=w_ok[:, None] & n_ok[None, :], other=0)
        scale = tl.load(s_ptr + n[None, :] * stride_sr + (w * 8 // GROUP)[:, None],
                        mask=w_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_ptr + x_row[:, None] + (w * 8 + j)[None, :], mask=row_ok[:, None] & w_ok[None, :], other=0.0)
            q = ((words >> (4 * j)) & 0xF) - 8
            acc = tl.dot(xj, (q.to(tl.float32) * scale).to(xj.dtype), acc, input_precision=PRECISION)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K_IN
        wt = tl.load(w_ptr + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FMT == 0:     # the load feeds the dot directly (Triton pipelines it through shared memory)
            acc = tl.dot(xt, wt.to(xt.dtype), acc, input_precision=PRECISION)
        elif SCALE_PER_ROW:
            s = tl.load(s_ptr + ((n + off_r) // block_r) * stride_sr + ((k0 + off_c) // block_c) * stride_sc,
                        mask=n_ok, other=0.0)
            acc += tl.dot(xt, wt.to(xt.dtype), input_precision=PRECISION) * s[None, :]
        else:
            s = tl.load(s_ptr + ((n + off_r) // block_r)[None, :] * stride_sr + ((k + off_c) // block_c)[:, None]
                        * stride_sc, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(xt, (wt.to(tl.float32) * s).to(xt.dtype), acc, input_precision=PRECISION)
    return acc


@_jit
def _moe_gate_up_kernel(x_ptr, h_ptr, sorted_pair_ptr, tile_expert_ptr, g_ptr, gs_ptr, u_ptr, us_ptr,
                        P, TOPK, D, I, stride_we, stride_wn, stride_se, stride_sr, stride_sc,
                        block_r, block_c, off_r, off_c, GROUP,
                        FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SCALE_PER_ROW: tl.constexpr, PRECISION: tl.constexpr):
    """h[row, i] = silu(gate[e] @ x[n]) * (up[e] @ x[n]) for the pair in each tile row (n = pair // K).

    x_ptr: [N, D] contiguous, the compute dtype. h_ptr: [max_tiles * BLOCK_M, I] out, x's dtype,
    rows in tile order (padding rows get 0). g_ptr / u_ptr and gs_ptr / us_ptr: gate and up weights
    and scales, [E, I, D]-shaped as ExpertWeights (same strides for both). sorted_pair_ptr,
    tile_expert_ptr: from the align kernel. Grid: (cdiv(I, BLOCK_N), max_tiles)."""
    pid_n, tile = tl.program_id(0), tl.program_id(1)
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
    for k0 in range(0, D, BLOCK_K):
        xt = tl.zeros([BLOCK_M, BLOCK_K], x_ptr.dtype.element_ty)       # INT4 loads its own pieces
        if FMT != 2:                                                       # one load for gate and up
            k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + x_row[:, None] + k[None, :], mask=row_ok[:, None] & (k < D)[None, :], other=0.0)
        acc_g = _accumulate(acc_g, xt, x_ptr, x_row, row_ok, k0, D, g_ptr + e * stride_we, gs_ptr + e * stride_se, n,
                            n_ok, stride_wn, stride_sr, stride_sc, block_r, block_c, off_r, off_c, GROUP,
                            FMT, BLOCK_K, SCALE_PER_ROW, PRECISION)
        acc_u = _accumulate(acc_u, xt, x_ptr, x_row, row_ok, k0, D, u_ptr + e * stride_we, us_ptr + e * stride_se, n,
                            n_ok, stride_wn, stride_sr, stride_sc, block_r, block_c, off_r, off_c, GROUP,
                            FMT, BLOCK_K, SCALE_PER_ROW, PRECISION)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n[None, :], h.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@_jit
def _moe_down_kernel(h_ptr, y_ptr, sorted_pair_ptr, tile_expert_ptr, route_w_ptr, w_ptr, s_ptr,
                     P, D, I, stride_we, stride_wn, stride_se, stride_sr, stride_sc,
                     block_r, block_c, off_r, off_c, GROUP,
                     FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALE_PER_ROW: tl.constexpr, PRECISION: tl.constexpr):
    """y[pair, d] = route_w[pair] * (down[e] @ h[row])[d] for the pair in each tile row.

    h_ptr: [max_tiles * BLOCK_M, I] from gate_up. y_ptr: fp32 [P, D] out, one row per pair (every
    pair's row is written once). route_w_ptr: fp32 [P], the routing weights flattened. w_ptr / s_ptr:
    down weights and scales, [E, D, I]-shaped as ExpertWeights. Grid: (cdiv(D, BLOCK_N), max_tiles)."""
    pid_n, tile = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + rows)
    row_ok = pair < P
    h_row = rows.to(tl.int64) * I
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ht = tl.zeros([BLOCK_M, BLOCK_K], h_ptr.dtype.element_ty)
        if FMT != 2:
            k = k0 + tl.arange(0, BLOCK_K)
            ht = tl.load(h_ptr + h_row[:, None] + k[None, :], mask=row_ok[:, None] & (k < I)[None, :], other=0.0)
        acc = _accumulate(acc, ht, h_ptr, h_row, row_ok, k0, I, w_ptr + e * stride_we, s_ptr + e * stride_se, n, n_ok,
                          stride_wn, stride_sr, stride_sc, block_r, block_c, off_r, off_c, GROUP,
                          FMT, BLOCK_K, SCALE_PER_ROW, PRECISION)
    route_w = tl.load(route_w_ptr + pair, mask=row_ok, other=0)
    tl.store(y_ptr + pair[:, None].to(tl.int64) * D + n[None, :], acc * route_w[:, None],
             mask=row_ok[:, None] & n_ok[None, :])


@_jit
def _moe_combine_kernel(y_ptr, out_ptr, D, TOPK, BLOCK_D: tl.constexpr):
    """out[n, d] = sum_k y[n*K + k, d], summed in fp32 in k order, stored in out's dtype.

    y_ptr: fp32 [N*K, D]; out_ptr: [N, D]. Grid: (N, cdiv(D, BLOCK_D))."""
    token, pid_d = tl.program_id(0), tl.program_id(1)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k in range(0, TOPK):
        acc += tl.load(y_ptr + (token * TOPK + k).to(tl.int64) * D + d, mask=d < D, other=0)
    tl.store(out_ptr + token.to(tl.int64) * D + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


FORMATS = {"plain": 0, "fp8": 1, "int4": 2}


def _weight_args(w, block_k):
    """Pointers, strides and quantization constants of one ExpertWeights, in the kernels' order."""
    scale = w.scale if w.scale is not None else w.data   # plain: never read
    strides = (w.data.stride(0), w.data.stride(1), scale.stride(0), scale.stride(1),
               scale.stride(2) if scale.dim() == 3 else 0)
    per_row = w.fmt == "fp8" and w.block[1] % block_k == 0 and w.offset[1] % block_k == 0
    return scale, strides, (*w.block, *w.offset, w.group), per_row


def _check_weights(gate, up, down, D):
    fmt = gate.fmt
    if fmt not in FORMATS or up.fmt != fmt or down.fmt != fmt:
        raise ValueError(f"fused_moe: weight formats {gate.fmt}, {up.fmt}, {down.fmt}; all three must be one "
                         f"of {sorted(FORMATS)}")
    E, I, D_in = gate.shape
    if up.shape != gate.shape or down.shape != (E, D, I) or D_in != D:
        raise ValueError(f"fused_moe: gate {list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)} do not "
                         f"fit hidden {D}: expected [E, I, D], [E, I, D], [E, D, I]")
    layout = [(w.data.stride(), w.scale is None or w.scale.stride(), w.block, w.offset, w.group) for w in (gate, up)]
    if layout[0] != layout[1]:
        raise ValueError("fused_moe: gate and up must be stored alike (strides, scales, blocks): one kernel reads both")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if w.data.stride(-1) != 1 or (w.scale is not None and w.scale.stride(-1) != 1):
            raise ValueError(f"fused_moe: {name} weights and scales must be contiguous along their last dim")
        if fmt == "int4" and (w.data.dtype != torch.int32 or w.group % 8 or w.shape[2] % w.group):
            raise ValueError(f"fused_moe: {name} INT4 needs int32 words and a group ({w.group}) that is a multiple "
                             f"of 8 and divides the input dim {w.shape[2]}")
        if fmt == "fp8" and (w.data.dtype != torch.float8_e4m3fn or w.scale is None):
            raise ValueError(f"fused_moe: {name} FP8 needs float8_e4m3fn weights and block scales")
    return fmt, E, I


def fused_moe(x, ids, route_w, gate, up, down, configs=None, variant=None):
    """Routed experts in one pass over each distinct expert's weights:
    y[n] = sum_k route_w[n, k] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, k].

    x [N, D] (bf16, fp16 or fp32: the compute dtype; the tile variant rounds dequantized weights to
    it, the GEMV variant multiplies them in fp32), ids int [N, K] in [0, E) (not checked: that would
    read the device), route_w [N, K] (any float; used in fp32), gate / up / down: ExpertWeights of
    [E, I, D], [E, I, D], [E, D, I]. Returns [N, D] in x's dtype. variant: "gemv" (CUDA-core
    products, for a few tokens), "dot" (tiles of BLOCK_M pairs through tl.dot) or None: "gemv" while
    N <= GEMV_MAX_TOKENS[format], a rule on shapes only, so a captured graph keeps its variant.
    configs: override the variant's block sizes (the benchmark's sweep)."""
    if x.dim() != 2 or ids.shape != route_w.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: x {list(x.shape)}, ids {list(ids.shape)}, route_w {list(route_w.shape)}: "
                         "expected [N, D], [N, K], [N, K]")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or ids.dtype.is_floating_point:
        raise ValueError(f"fused_moe: x must be bf16, fp16 or fp32 (got {x.dtype}), ids integers (got {ids.dtype})")
    (N, D), K = x.shape, ids.shape[1]
    fmt, E, I = _check_weights(gate, up, down, D)
    P, dev = N * K, x.device
    if any(t is not None and t.device != dev for t in (ids, route_w, gate.data, gate.scale, up.data, up.scale,
                                                        down.data, down.scale)):
        raise ValueError(f"fused_moe: every input must be on x's device {dev}")
    variant = variant or ("gemv" if N <= GEMV_MAX_TOKENS[fmt] and P <= GEMV_MAX_PAIRS else "dot")
    if variant not in ("gemv", "dot") or (variant == "gemv" and P > GEMV_MAX_PAIRS):
        raise ValueError(f"fused_moe: variant {variant!r} for {P} token-expert pairs: 'dot', or 'gemv' up to "
                         f"{GEMV_MAX_PAIRS} pairs")
    x, ids, route_w = x.contiguous(), ids.reshape(-1).contiguous(), route_w.reshape(-1).float().contiguous()
    if variant == "gemv":
        cfg = {**_gemv_configs(fmt, N, x.is_cuda), **(configs or {})}
        return _fused_moe_gemv(x, ids, route_w, gate, up, down, fmt, cfg)
    cfg = {**_configs(fmt, P, x.is_cuda), **(configs or {})}
    max_tiles = min(E, P) + P // BLOCK_M                                    # see the section comment
    sorted_pair = torch.empty(max_tiles * BLOCK_M, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](ids, sorted_pair, tile_expert, P, E, max_tiles, triton.cdiv(P, BLOCK_M),
                            BLOCK_M=BLOCK_M, E_PAD=triton.next_power_of_2(E), CHUNK=ALIGN_CHUNK, num_warps=8)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: exact products, not tf32; else unused
    bn, bk, warps, stages = cfg["gate_up"]
    h = torch.empty(max_tiles * BLOCK_M, I, dtype=x.dtype, device=dev)          # [rows, I]
    gs, strides, quant, per_row = _weight_args(gate, bk)
    _moe_gate_up_kernel[(triton.cdiv(I, bn), max_tiles)](
        x, h, sorted_pair, tile_expert, gate.data, gs, up.data, _weight_args(up, bk)[0], P, K, D, I, *strides, *quant,
        FMT=FORMATS[fmt], BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, SCALE_PER_ROW=per_row, PRECISION=precision,
        num_warps=warps, num_stages=stages)
    bn, bk, warps, stages = cfg["down"]
    y = torch.empty(P, D, dtype=torch.float32, device=dev)                      # [P, D], weighted
    ds, strides, quant, per_row = _weight_args(down, bk)
    _moe_down_kernel[(triton.cdiv(D, bn), max_tiles)](
        h, y, sorted_pair, tile_expert, route_w, down.data, ds, P, D, I, *strides, *quant,
        FMT=FORMATS[fmt], BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, SCALE_PER_ROW=per_row, PRECISION=precision,
        num_warps=warps, num_stages=stages)
    out = torch.empty(N, D, dtype=x.dtype, device=dev)
    _moe_combine_kernel[(N, triton.cdiv(D, COMBINE_BLOCK))](y, out, D, K, BLOCK_D=COMBINE_BLOCK, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# Routed experts, GEMV-shaped (decode and verify: a few tokens)
#
# With 1-4 tokens most experts serve one token, and k3's tiles of 16 pairs ran tl.dot on 15 padding
# rows with too few programs to keep HBM busy (8 experts x 256 rows at decode). Here the products
# run on the CUDA cores instead (dequantized weights times the activation, broadcast-multiply into an
# fp32 [BLOCK_N, BLOCK_K] accumulator, one tl.sum per program), with no align and no combine launch:
#   gate_up: a program per (BLOCK_N rows of I, pair). The first pair of each expert (the "leader")
#     does the work for every pair of that expert, one after another, so the expert's weights come
#     from HBM once (a later pair re-reads the same rows from L1/L2); other pairs' programs exit.
#     Writes h = silu(g) * u * route_w per pair, fp32 [P, I] (INT4: in the nibble-plane order below).
#   down: a program per (token, BLOCK_N rows of D), token-major so no combine is needed: the K
#     experts of the token, each [BLOCK_N, I], times that pair's h, summed in registers, stored once.
#     Programs of one row block for all tokens are adjacent in launch order, so an expert shared by
#     tokens is fetched from HBM about once and read from L2 by the others.
# INT4 without unpacking to natural order: nibble j of word w is element 8w + j, so the activation
# comes as 8 planes (plane j = elements 8w + j, contiguous in w: x is permuted once per call, h is
# written that way by gate_up) and each plane meets nibble j of the same words. A nibble becomes a
# float by the exponent trick: (word & (15 << 4j)) | 0x4B000000 is the float 2^23 + nib * 16^j, and
# one FMA (times 16^-j, minus 2^23 * 16^-j + 8) gives nib - 8 exactly; the words' top three nibbles
# use the word shifted right by 20. The group scale multiplies each word's 8 products once.

# Block sizes by format and token count: (small, large) up to / above GEMV_SMALL_TOKENS, each
# dict(gate_up=(BLOCK_N, BLOCK_K, UNROLL, num_warps, SUB), down=(BLOCK_N, BLOCK_K, num_warps, SUB)).
# BLOCK_K counts elements (INT4: BLOCK_K / 8 words); a program's tile has BLOCK_N * SUB rows of
# BLOCK_K: SUB > 1 (FP8 only) lays SUB consecutive 128-column scale blocks of a weight row out as
# rows of their own, so a step is one scale per tile row and still 32 threads a weight row (at
# decode only 2048 gate/up rows exist: 8 threads a row, as a one-block step gives, made 512 warps
# for 132 SMs, issue-bound at 1 TB/s on the H200). From `python kernels.py --moe --sweep gemv` on an
# H200 (2026-11-29, BENCHMARKS.md, k4): bf16 gate_up 8 rows at decode (30.1 against 33.2 us with 4),
# 4 rows of 256 from 4 tokens (99.1 against 114.3 us); FP8 down 16 rows (23.5 against 27.9 us at
# decode, 69.5 against 79.7 at 4 tokens); INT4 gate_up 2 rows of 2048 (33.8 against 43.7 us at
# decode, 83.9 against 102.7 at 4 tokens).
GEMV_CONFIGS = {
    "plain": (dict(gate_up=(8, 512, 2, 4, 1), down=(16, 256, 4, 1)),
              dict(gate_up=(4, 256, 4, 4, 1), down=(16, 256, 4, 1))),
    "fp8": (dict(gate_up=(4, 128, 2, 4, 4), down=(16, 128, 4, 2)),) * 2,
    "int4": (dict(gate_up=(2, 2048, 1, 4, 1), down=(32, 256, 4, 1)),) * 2}
GEMV_SMALL_TOKENS = 2   # in tokens, not pairs: a shared expert's extra slot a token moves no boundary
# The GEMV variant up to this many tokens (the rule of fused_moe's variant=None; in tokens, not pairs,
# so a shared expert routed as one more slot a token moves no boundary), from the same run at K = 8
# (us a layer, GEMV against tiles): bf16 30 / 46 at N = 1, 98 / 97 at 4, 177 / 188 at 8, 630 / 527 at
# 32; FP8 28 / 75 at 1, 80 / 82 at 4, 148 / 144 at 8; INT4 faster at every N up to 32 (629 / 836).
# In the model (run.py, bf16, 2026-11-29) the rule at 8 lost from 3 tokens on: with the shared expert
# folded in (model.MoE.fold_shared_expert) every token picks expert E, so E's leader program runs
# N passes one after another while the others run one; the tiles (k3) measured 10.02 -> 9.91,
# 11.84 -> 11.14, 14.19 -> 13.50 ms for verify of 3, 4, 5 tokens, and tied at 2. Hence 2 for bf16.
GEMV_MAX_TOKENS = {"plain": 2, "fp8": 4, "int4": 32}
GEMV_MAX_PAIRS = 1024   # the leader test holds all N*K expert ids of a call in one vector


def _gemv_configs(fmt, N, on_gpu):
    if not on_gpu:  # the CPU interpreter: few, large programs
        return dict(gate_up=(32, 64, 1, 4, 1), down=(64, 64, 4, 1))
    return GEMV_CONFIGS[fmt][N > GEMV_SMALL_TOKENS]


@_jit
def _gemv_step(acc, v_ptr, k0, K_IN, w_ptr, s_ptr, n, kb, n_ok, stride_wn, stride_sr, stride_sc, off_r, off_c,
               FMT: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr, SCALE_PER_ROW: tl.constexpr):
    """acc [R, ACC_K] fp32 += W[n, k] * v[k] elementwise for tile row r: n[r], k = k0 + kb[r] + [0, BLOCK_K)
    (summed over k by the caller). kb: [R] column offsets (FP8 sub-blocks) or 0.

    v_ptr: the activation row (plain, FP8: [K_IN] in order; INT4: 8 planes [8, K_IN/8], plane j
    holding elements 8w + j). w_ptr, s_ptr: one expert's weight and scale (ExpertWeights layouts).
    ACC_K = BLOCK_K (plain, FP8) or BLOCK_K / 8 (INT4: one column per word)."""
    if FMT == 2:
        w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w_ok = w < K_IN // 8
        ok = n_ok[:, None] & w_ok[None, :]
        words = tl.load(w_ptr + n[:, None] * stride_wn + w[None, :], mask=ok, other=0)
        scale = tl.load(s_ptr + n[:, None] * stride_sr + (w * 8 // GROUP)[None, :], mask=ok, other=0.0)
        high = words >> 20                                   # nibbles 5, 6, 7 at bits 0..11
        t = tl.zeros(words.shape, tl.float32)
        for j in tl.static_range(8):                         # (nibble - 8) * v, q exact in fp32
            # plane j over the whole tile (every row the same addresses): the tile's own layout, no shuffle
            v = tl.load(v_ptr + j * (K_IN // 8) + (w[None, :] + 0 * n[:, None]), mask=ok, other=0.0).to(tl.float32)
            if j < 5:
                f = ((words & (15 << (4 * j))) | 0x4B000000).to(tl.float32, bitcast=True)
                t += (f * (1.0 / (1 << (4 * j))) - (8388608.0 / (1 << (4 * j)) + 8.0)) * v
            else:
                f = ((high & (15 << (4 * (j - 5)))) | 0x4B000000).to(tl.float32, bitcast=True)
                t += (f * (1.0 / (1 << (4 * (j - 5)))) - (8388608.0 / (1 << (4 * (j - 5))) + 8.0)) * v
        acc += t * scale.to(tl.float32)
    else:
        if FMT == 0:                                         # the activation broadcast over the rows
            k = k0 + tl.arange(0, BLOCK_K)
            wt = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & (k < K_IN)[None, :],
                         other=0.0)
            acc += wt.to(tl.float32) * tl.load(v_ptr + k, mask=k < K_IN, other=0.0).to(tl.float32)[None, :]
        else:
            k = k0 + kb[:, None] + tl.arange(0, BLOCK_K)[None, :]              # [R, BLOCK_K]
            k_ok = k < K_IN
            ok = n_ok[:, None] & k_ok
            wt = tl.load(w_ptr + n[:, None] * stride_wn + k, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + k, mask=k_ok, other=0.0).to(tl.float32)        # per tile row (sub-blocks)
            if SCALE_PER_ROW:
                s = tl.load(s_ptr + ((n + off_r) // BLOCK_R) * stride_sr + ((k0 + kb + off_c) // BLOCK_C) * stride_sc,
                            mask=n_ok & (k0 + kb < K_IN), other=0.0)
                acc += wt * s[:, None] * v
            else:
                acc += wt * tl.load(s_ptr + ((n + off_r) // BLOCK_R)[:, None] * stride_sr
                                    + ((k + off_c) // BLOCK_C) * stride_sc, mask=ok, other=0.0) * v
    return acc


@_jit
def _moe_gemv_gate_up_kernel(v_ptr, h_ptr, ids_ptr, route_w_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, P,
                             stride_we, stride_wn, stride_se, stride_sr, stride_sc, off_r, off_c,
                             TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr,
                             GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                             P_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                             ACC_K: tl.constexpr, UNROLL: tl.constexpr, SCALE_PER_ROW: tl.constexpr):
    """h[p, i] = silu(gate[e] @ x[n]) * (up[e] @ x[n]) * route_w[p] for pair p = n*K + k, e = ids[p].

    v_ptr: the activations [N, D] (x's dtype) or, INT4, fp32 planes [N, 8, D/8]. h_ptr: fp32 [P, I]
    out (INT4: row p in plane order, element i at (i % 8) * I/8 + i // 8). ids_ptr: int [P];
    route_w_ptr: fp32 [P]. g_ptr / u_ptr, gs_ptr / us_ptr: gate and up weights and scales, [E, I, D]
    as ExpertWeights (same strides). P_PAD: a power of two >= P. Grid: (cdiv(I, BLOCK_N), P); only a
    leader program works."""
    pid_n, p = tl.program_id(0), tl.program_id(1)
    q = tl.arange(0, P_PAD)
    same = tl.load(ids_ptr + q, mask=q < P, other=-1) == tl.load(ids_ptr + p)   # pairs of this expert
    if tl.min(tl.where(same, q, P_PAD), 0) != p:
        return                                                              # not the expert's first pair
    rank = tl.cumsum(same.to(tl.int32), 0) - 1
    e = tl.load(ids_ptr + p).to(tl.int64)
    g_ptr, u_ptr = g_ptr + e * stride_we, u_ptr + e * stride_we
    gs_ptr, us_ptr = gs_ptr + e * stride_se, us_ptr + e * stride_se
    r = tl.arange(0, BLOCK_N * SUB)                                         # tile rows: (row of I, sub-block)
    n, kb = pid_n * BLOCK_N + r // SUB, (r % SUB) * BLOCK_K
    n_ok = n < I
    for c in range(tl.sum(same.to(tl.int32), 0)):                          # each pair of the expert
        pair = tl.sum(tl.where(same & (rank == c), q, 0), 0)
        v = v_ptr + (pair // TOPK).to(tl.int64) * D
        acc_g = tl.zeros([BLOCK_N * SUB, ACC_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N * SUB, ACC_K], tl.float32)
        for k0 in range(0, D, BLOCK_K * SUB * UNROLL):
            for s in tl.static_range(UNROLL):                               # independent loads in flight
                k1 = k0 + s * BLOCK_K * SUB
                acc_g = _gemv_step(acc_g, v, k1, D, g_ptr, gs_ptr, n, kb, n_ok, stride_wn, stride_sr, stride_sc,
                                   off_r, off_c, FMT, BLOCK_K, GROUP, BLOCK_R, BLOCK_C, SCALE_PER_ROW)
                acc_u = _gemv_step(acc_u, v, k1, D, u_ptr, us_ptr, n, kb, n_ok, stride_wn, stride_sr, stride_sc,
                                   off_r, off_c, FMT, BLOCK_K, GROUP, BLOCK_R, BLOCK_C, SCALE_PER_ROW)
        g, u = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
        if SUB > 1:                                                         # the sub-blocks of each row
            g, u = tl.sum(tl.reshape(g, [BLOCK_N, SUB]), 1), tl.sum(tl.reshape(u, [BLOCK_N, SUB]), 1)
        h = g / (1.0 + tl.exp(-g)) * u * tl.load(route_w_ptr + pair)
        i = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col = i
        if FMT == 2:
            col = (i % 8) * (I // 8) + i // 8
        tl.store(h_ptr + pair.to(tl.int64) * I + col, h, mask=i < I)


@_jit
def _moe_gemv_down_kernel(h_ptr, out_ptr, ids_ptr, w_ptr, s_ptr,
                          stride_we, stride_wn, stride_se, stride_sr, stride_sc, off_r, off_c,
                          TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, ACC_K: tl.constexpr,
                          SCALE_PER_ROW: tl.constexpr):
    """out[n, d] = sum_k (down[e] @ h[n*K + k])[d], e = ids[n*K + k] (route weights are in h).

    h_ptr: fp32 [P, I] from gate_up. out_ptr: [N, D], x's dtype. w_ptr / s_ptr: down weights and
    scales, [E, D, I] as ExpertWeights. Grid: (N, cdiv(D, BLOCK_N))."""
    token, pid_n = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BLOCK_N * SUB)
    n, kb = pid_n * BLOCK_N + r // SUB, (r % SUB) * BLOCK_K
    n_ok = n < D
    acc = tl.zeros([BLOCK_N * SUB, ACC_K], tl.float32)
    for k in tl.static_range(TOPK):                                         # the token's K experts
        pair = token * TOPK + k
        e = tl.load(ids_ptr + pair).to(tl.int64)
        for k0 in tl.static_range(0, I, BLOCK_K * SUB):
            acc = _gemv_step(acc, h_ptr + pair.to(tl.int64) * I, k0, I, w_ptr + e * stride_we, s_ptr + e * stride_se,
                             n, kb, n_ok, stride_wn, stride_sr, stride_sc, off_r, off_c,
                             FMT, BLOCK_K, GROUP, BLOCK_R, BLOCK_C, SCALE_PER_ROW)
    y = tl.sum(acc, 1)
    if SUB > 1:
        y = tl.sum(tl.reshape(y, [BLOCK_N, SUB]), 1)
    d = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + token.to(tl.int64) * D + d, y.to(out_ptr.dtype.element_ty), mask=d < D)


def _gemv_args(w, block_k, sub):
    """_weight_args for the GEMV kernels: strides, row/column offsets, and the constexprs (group,
    block sizes, per-row scale, SUB: 1 where the scale is not one per row and step)."""
    scale, strides, (br, bc, off_r, off_c, group), per_row = _weight_args(w, block_k)
    # one scale per row and step only where every step is whole: the FP8 graph test (128x128 blocks over
    # a 64 x 32 matrix, steps mostly masked) read NaN on the H200 through that path, not through this
    # fallback (one scale an element, tested on the GPU with masked steps); not reproduced on the CPU
    per_row = per_row and w.shape[2] % (block_k * sub) == 0
    return scale, strides, (off_r, off_c), dict(GROUP=group, BLOCK_R=br, BLOCK_C=bc, SCALE_PER_ROW=per_row,
                                                SUB=sub if per_row else 1)


def _fused_moe_gemv(x, ids, route_w, gate, up, down, fmt, cfg):
    """The GEMV variant (see its section); arguments as fused_moe's, already checked and flattened."""
    (N, D), P, I, dev = x.shape, ids.numel(), gate.shape[1], x.device
    K = P // N
    if fmt == "int4":   # the activation as 8 planes, plane j = elements 8w + j: [N, 8, D/8] fp32
        v = torch.empty(N, 8, D // 8, dtype=torch.float32, device=dev).copy_(x.view(N, D // 8, 8).transpose(1, 2))
    else:
        v = x
    bn, bk, unroll, warps, sub = cfg["gate_up"]
    h = torch.empty(P, I, dtype=torch.float32, device=dev)                  # [P, I], route weight in
    gs, strides, offs, const = _gemv_args(gate, bk, sub)
    _moe_gemv_gate_up_kernel[(triton.cdiv(I, bn), P)](
        v, h, ids, route_w, gate.data, gs, up.data, _weight_args(up, bk)[0], P, *strides, *offs,
        TOPK=K, D=D, I=I, FMT=FORMATS[fmt], P_PAD=max(16, triton.next_power_of_2(P)), BLOCK_N=bn, BLOCK_K=bk,
        ACC_K=bk // 8 if fmt == "int4" else bk, UNROLL=unroll, num_warps=warps, **const)
    bn, bk, warps, sub = cfg["down"]
    out = torch.empty(N, D, dtype=x.dtype, device=dev)
    ds, strides, offs, const = _gemv_args(down, bk, sub)
    _moe_gemv_down_kernel[(N, triton.cdiv(D, bn))](
        h, out, ids, down.data, ds, *strides, *offs, TOPK=K, D=D, I=I, FMT=FORMATS[fmt], BLOCK_N=bn, BLOCK_K=bk,
        ACC_K=bk // 8 if fmt == "int4" else bk, num_warps=warps, **const)
    return out


# ---------------------------------------------------------------------------------------------
# Benchmark (python kernels.py [--moe] [--sweep] [--variants dot,gemv] [--json PATH]): the fused MoE
# of one layer at the shapes of one Kimi-K2 rank at TP 8 (D 7168, I 256, 384 experts, K 8), each
# format and variant, against its floor (the distinct experts' stored bytes over the copy bandwidth
# measured in the same run). Each time is the
# median over replays of a CUDA graph of LAYERS calls on different weights (as in a captured step,
# launch gaps included; the weights of LAYERS layers are larger than the 60 MB L2), divided by LAYERS.

def _random_experts(fmt, E, out, inp, device, g):
    if fmt == "plain":
        return ExpertWeights("plain", torch.randn(E, out, inp, device=device, generator=g, dtype=torch.bfloat16) / inp ** 0.5)
    if fmt == "fp8":
        w = torch.randn(E, out, inp, device=device, generator=g).to(torch.float8_e4m3fn)
        s = torch.rand(E, triton.cdiv(out, 128), triton.cdiv(inp, 128), device=device, generator=g) / inp ** 0.5
        return ExpertWeights("fp8", w, s, (128, 128))
    words = torch.randint(-2**31, 2**31 - 1, (E, out, inp // 8), device=device, generator=g, dtype=torch.int32)
    s = (torch.rand(E, out, inp // 32, device=device, generator=g) / (4.6 * inp ** 0.5)).to(torch.bfloat16)
    return ExpertWeights("int4", words, s, group=32)


def _expert_bytes(w):
    return sum(t[0].numel() * t.element_size() for t in (w.data, w.scale) if t is not None)


def _kernel_ms(fn):
    """Device time of the kernels of one eager fn() (torch.profiler), in ms: no launch gaps."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA}
    return sum(kernels.values()), kernels


# Sweep points (N = 1 and 4 only), each beside the default: k3's tiles ("dot") and the GEMV variant.
DOT_SWEEP = dict(gate_up=[(16, 128, 4, 4), (32, 128, 4, 4), (16, 128, 4, 5), (32, 128, 4, 5), (64, 128, 4, 4),
                          (16, 256, 4, 3), (32, 256, 8, 3), (16, 64, 4, 6)],
                 down=[(64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 4, 3), (64, 256, 8, 3)])
GEMV_SWEEP = {"plain": dict(gate_up=[], down=[(32, 256, 4, 1)]),
              "fp8": dict(gate_up=[(8, 128, 2, 4, 4), (2, 128, 2, 2, 4), (4, 128, 1, 4, 4), (4, 128, 2, 8, 8)],
                          down=[(16, 128, 4, 2), (4, 128, 2, 2)]),
              "int4": dict(gate_up=[(8, 1024, 2, 4, 1), (4, 512, 4, 4, 1), (2, 2048, 1, 4, 1)],
                           down=[(16, 256, 4, 1), (64, 256, 8, 1), (16, 256, 2, 1)])}


def _sweep_points(fmt, variant):
    if variant == "gemv":
        return [{part: c} for part, cs in GEMV_SWEEP[fmt].items() for c in cs]
    ok = lambda c: (fmt != "fp8" or c[1] <= 128) and (fmt != "int4" or c[1] >= 128)   # noqa: E731
    return [{part: c} for part, cs in DOT_SWEEP.items() for c in cs if ok(c)]


def benchmark_moe(sweep=(), variants=("dot", "gemv"), D=7168, I=256, E=384, K=8, LAYERS=6, tokens=(1, 2, 4, 8, 32)):
    """One layer's routed experts per format, token count and variant of fused_moe ("dot": k3's
    tiles through tl.dot, "gemv": the GEMV variant) against its floor (the distinct experts' stored
    bytes over the eager copy bandwidth measured here), timed as a graph of LAYERS calls. sweep: the
    variants whose sweep points are also timed (at N = 1 and 4)."""
    dev, g = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    bandwidth = copy_bandwidth_GBps()
    print(f"fused MoE, one Kimi-K2 TP-8 rank (D {D}, I {I}, {E} experts, K {K}); copy bandwidth {bandwidth:.0f} GB/s")
    rows = []
    for fmt in ("plain", "fp8", "int4"):
        layers = [[_random_experts(fmt, E, o, i, dev, g) for o, i in ((I, D), (I, D), (D, I))] for _ in range(LAYERS)]
        per_expert = sum(_expert_bytes(w) for w in layers[0])
        for N in tokens:
            x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(N)])
            route_w = torch.rand(N, K, device=dev, generator=g)
            floor_ms = ids.unique().numel() * per_expert / bandwidth / 1e6
            for variant in variants:
                if variant == "gemv" and N * K > GEMV_MAX_PAIRS:
                    continue
                points = [None] + (_sweep_points(fmt, variant) if variant in sweep and N in (1, 4) else [])
                for cfg in points:
                    rows += _time_moe(fmt, N, variant, cfg, layers, (x, ids, route_w), floor_ms, bandwidth, LAYERS)
        del layers
    return dict(bandwidth_GBps=bandwidth, shapes=dict(D=D, I=I, E=E, K=K, layers=LAYERS), rows=rows,
                gemv_max_tokens=GEMV_MAX_TOKENS, device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__)


def _time_moe(fmt, N, variant, cfg, layers, inputs, floor_ms, bandwidth, LAYERS):
    """One benchmark row (a list of 0 or 1 dicts), printed."""
    def run():
        return lambda: [fused_moe(*inputs, *w, configs=cfg, variant=variant) for w in layers]
    try:
        ms = _graph_ms([run()]) / LAYERS
    except Exception as e:  # a sweep point that does not compile: say so, go on
        print(f"{fmt} N={N} {variant} {cfg}: {type(e).__name__}: {str(e)[:200]}")
        return []
    kernel_ms, by_kernel = _kernel_ms(run()) if cfg is None else (None, {})
    kernel_ms = kernel_ms / LAYERS if kernel_ms else None
    by_kernel = {name[:40]: v / LAYERS for name, v in by_kernel.items()}   # ms a layer, per kernel
    print(f"{fmt:5s} N={N:3d} {variant:4s} {str(cfg or 'default'):34s} {ms * 1e3:8.1f} us  floor {floor_ms * 1e3:7.1f} us"
          f"  {ms / floor_ms:5.2f}x  {floor_ms * bandwidth / ms:6.0f} GB/s"
          + (f"  kernels alone {kernel_ms * 1e3:.1f} us ({kernel_ms / floor_ms:.2f}x): "
             + ", ".join(f"{k.replace('_moe_', '').split('_kernel')[0]} {v * 1e3:.1f}" for k, v in by_kernel.items())
             if kernel_ms else ""), flush=True)
    return [dict(fmt=fmt, tokens=N, variant=variant, config=cfg, ms=ms, kernel_ms=kernel_ms, by_kernel=by_kernel,
                 floor_ms=floor_ms, x_floor=ms / floor_ms, GBps=floor_ms * bandwidth / ms)]


# ---------------------------------------------------------------------------------------------
# MLA decode attention
#
# The absorbed path of MLA attends in the latent space: every head's query q_lat[h] (q_nope
# times W_uk[h]) meets the one latent row per slot, which is the key and the value at once, plus
# the rotary parts:  o_lat[t, h] = sum_s softmax_s(scale * (q_lat[t,h].kv[s] + q_pe[t,h].pe[s])) kv[s]
# over slots s <= positions[t]. All H heads (and T tokens) of a batch row share the slots, so
# one program loads a tile of slots once and uses it for its whole block of M = T*H query rows
# (two small matrix products per tile). Flash-decoding: the slots are cut into splits of
# `split_len`, one program per (split, batch row, block of query rows); each writes its partial
# output and log-sum-exp, and a second kernel combines the splits. Programs read the positions
# on the device: a split past a row's last position reads nothing and writes nothing, and the
# combine reads only the splits a row uses, so one launch (one CUDA graph) serves any length up
# to the cache size, with no host read, at a cost that follows the length in use.

# Block sizes, from a sweep on the H200 (BENCHMARKS.md, "MLA decode attention kernel"). BLOCK_N
# slots per tile: 64 latent rows of 512 bf16 are 64 KB; three of them in flight (num_stages 3)
# fill most of the H200's 228 KB of shared memory, so one program runs per SM at a time and the
# split rule below aims at one wave of programs. float32 (tests): half the rows, two stages.
# Query rows per program: up to 32 (T = 4 tokens x 8 heads at TP 8) keep the fp32 accumulator
# [32, 512] at 64 registers a thread over 8 warps.
MLA_BLOCK_N = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
MLA_NUM_STAGES = {torch.bfloat16: 3, torch.float16: 3, torch.float32: 2}
MLA_NUM_WARPS = None     # None: 8 warps for 32 query rows, else 4
MLA_MAX_BLOCK_M = 32
MLA_MIN_SPLIT = 64       # slots per split at least (one bf16 tile)
MLA_COMBINE_BLOCK_C = 128
MLA_COMBINE_BLOCK_S = 32


@_jit
def _mla_decode_kernel(q_ptr, qpe_ptr, kv_ptr, pe_ptr, pos_ptr, o_ptr, lse_ptr,
                       M, H, kv_len, split_len, scale_log2,
                       s_qb, s_qm, s_qpb, s_qpm, s_kvb, s_kvs, s_peb, s_pes, s_posb, s_post,
                       s_ob, s_om, s_os, s_lb, s_lm,
                       C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """One split of the slots for a block of query rows of one batch row.

    o[b, m] = sum_s p[m, s] kv[b, s] / sum_s p[m, s], p = 2^(scale_log2 * (q[b,m].kv[b,s] +
    qpe[b,m].pe[b,s]) - max), over slots s in [split * split_len, +split_len) with s < kv_len and
    s <= pos[b, m // H]; lse[b, m, split] = log2 of the sum (with the max), -inf if no slot.
    q [B, M, C], qpe [B, M, R] (row m = t*H + h), kv [B, >=kv_len, C], pe [B, >=kv_len, R]: last
    dim contiguous, same dtype. pos int64 [B, T]. o [B, M, splits, C] float32 partials, or the
    final output (any float dtype) when there is one split (WRITE_LSE False, lse unused).
    Grid: (splits, B, cdiv(M, BLOCK_M))."""
    split, b, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    pos = tl.load(pos_ptr + b * s_posb + (offs_m // H) * s_post, mask=row_ok, other=-1)   # [BLOCK_M]
    lo = split * split_len
    hi = tl.minimum(tl.minimum(tl.max(pos, 0) + 1, kv_len), lo + split_len)   # this block's last slot + 1
    offs_c, offs_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    c_ok, r_ok = offs_c < C, offs_r < R
    q = tl.load(q_ptr + b * s_qb + offs_m[:, None] * s_qm + offs_c[None, :],
                mask=row_ok[:, None] & c_ok[None, :], other=0.0)                   # [BLOCK_M, BLOCK_C]
    qpe = tl.load(qpe_ptr + b * s_qpb + offs_m[:, None] * s_qpm + offs_r[None, :],
                  mask=row_ok[:, None] & r_ok[None, :], other=0.0)                 # [BLOCK_M, BLOCK_R]
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)     # running max (finite: no inf - inf)
    l_i = tl.zeros([BLOCK_M], tl.float32)           # running sum of 2^(score - max)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kv = tl.load(kv_ptr + b * s_kvb + offs_n[:, None] * s_kvs + offs_c[None, :],
                     mask=n_ok[:, None] & c_ok[None, :], other=0.0)                # [BLOCK_N, BLOCK_C]
        pe = tl.load(pe_ptr + b * s_peb + offs_n[:, None] * s_pes + offs_r[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0)                # [BLOCK_N, BLOCK_R]
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
        s = tl.dot(qpe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION) * scale_log2   # [BLOCK_M, BLOCK_N]
        s = tl.where((offs_n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    written = row_ok & (tl.zeros([BLOCK_M], tl.int32) + lo < hi)
    tl.store(o_ptr + b * s_ob + offs_m[:, None] * s_om + split * s_os + offs_c[None, :],
             out.to(o_ptr.dtype.element_ty), mask=written[:, None] & c_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * s_lb + offs_m * s_lm + split, lse, mask=written)


@_jit
def _mla_combine_kernel(po_ptr, lse_ptr, pos_ptr, o_ptr, M, H, kv_len, split_len,
                        s_pob, s_pom, s_pos, s_lb, s_lm, s_posb, s_post, s_ob, s_om,
                        C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """o[b, m] = sum_j 2^(lse_j - L) o_j over the splits j that query row m uses (those that hold
    a slot <= its position), L = log2 sum_j 2^lse_j. po [B, M, splits, C] and lse [B, M, splits]
    float32 from _mla_decode_kernel; pos int64 [B, T]; o [B, M, C] (any float dtype).
    Grid: (B * M, cdiv(C, BLOCK_C))."""
    row, cb = tl.program_id(0), tl.program_id(1)
    b, m = row // M, row % M
    pos = tl.load(pos_ptr + b * s_posb + (m // H) * s_post)
    n_used = tl.cdiv(tl.minimum(pos + 1, kv_len), split_len)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    lse_row = lse_ptr + b * s_lb + m * s_lm
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)       # first pass: the largest lse
    for j0 in range(0, n_used, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        top = tl.maximum(top, tl.load(lse_row + j, mask=j < n_used, other=float("-inf")))
    top_all = tl.max(top, 0)
    acc = tl.zeros([BLOCK_C], tl.float32)
    total = tl.zeros([BLOCK_S], tl.float32)
    for j0 in range(0, n_used, BLOCK_S):                      # second pass: weighted sum, BLOCK_S splits a load
        j = j0 + tl.arange(0, BLOCK_S)
        w = tl.exp2(tl.load(lse_row + j, mask=j < n_used, other=float("-inf")) - top_all)   # [BLOCK_S]
        part = tl.load(po_ptr + b * s_pob + m * s_pom + j[:, None] * s_pos + offs_c[None, :],
                       mask=(j < n_used)[:, None] & c_ok[None, :], other=0.0)              # [BLOCK_S, BLOCK_C]
        acc += tl.sum(w[:, None] * part, 0)
        total += w
    out = acc / tl.sum(total, 0)
    tl.store(o_ptr + b * s_ob + m * s_om + offs_c, out.to(o_ptr.dtype.element_ty), mask=c_ok)


def mla_split_len(kv_len, batch, m_blocks, block_n, device):
    """Slots per split: enough splits that a full cache gives one program per SM (one wave),
    each split at least MLA_MIN_SPLIT slots and a whole number of tiles. Host ints only."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, sms // (batch * m_blocks))
    split = max(MLA_MIN_SPLIT, math.ceil(kv_len / want))
    return math.ceil(split / block_n) * block_n


def mla_decode_attention(q_lat, q_pe, kv_cache, pe_cache, positions, softmax_scale, split_len=None):
    """The absorbed MLA attention in one pass over the used cache slots (plus a combine when the
    slots are split): q_lat [B, T, H, C], q_pe [B, T, H, R] (rotated), kv_cache [B, S, C],
    pe_cache [B, S, R] (views of the cache may be strided over B and S; the last dim must be
    contiguous), positions int64 [B, T] on the device. Query (b, t) sees slots s < S with
    s <= positions[b, t]. Returns o_lat [B, T, H, C] in q_lat's dtype. No host read."""
    B, T, H, C = q_lat.shape
    R, S = q_pe.shape[-1], kv_cache.shape[1]
    if q_pe.shape[:3] != (B, T, H) or kv_cache.shape != (B, S, C) or pe_cache.shape != (B, S, R):
        raise ValueError(f"mla_decode_attention: shapes q_lat {list(q_lat.shape)}, q_pe {list(q_pe.shape)}, "
                         f"kv_cache {list(kv_cache.shape)}, pe_cache {list(pe_cache.shape)} do not fit "
                         "[B, T, H, C], [B, T, H, R], [B, S, C], [B, S, R]")
    if positions.shape != (B, T) or positions.dtype != torch.int64:
        raise ValueError(f"mla_decode_attention: positions must be int64 [{B}, {T}], got "
                         f"{positions.dtype} {list(positions.shape)}")
    dtypes = {q_lat.dtype, q_pe.dtype, kv_cache.dtype, pe_cache.dtype}
    if len(dtypes) != 1 or q_lat.dtype not in MLA_BLOCK_N:
        raise ValueError(f"mla_decode_attention: needs one dtype of {sorted(map(str, MLA_BLOCK_N))} for the "
                         f"queries and the cache, got {sorted(map(str, dtypes))} (float64: use the plain path)")
    if kv_cache.stride(-1) != 1 or pe_cache.stride(-1) != 1:
        raise ValueError("mla_decode_attention: the cache's last dim must be contiguous")
    M = T * H
    q = q_lat.reshape(B, M, C)        # a copy only when q_lat is not already [B, M, C]-strided
    qpe = q_pe.reshape(B, M, R)
    out = torch.empty(B, M, C, device=q_lat.device, dtype=q_lat.dtype)
    block_n = MLA_BLOCK_N[q_lat.dtype]
    block_m = min(MLA_MAX_BLOCK_M, _pow2(M))
    m_blocks = triton.cdiv(M, block_m)
    split_len = split_len or mla_split_len(S, B, m_blocks, block_n, q_lat.device)
    splits = triton.cdiv(S, split_len)
    if splits == 1:
        partial, lse = out.unsqueeze(2), out      # the kernel writes the final output; lse unused
    else:
        partial = torch.empty(B, M, splits, C, device=q_lat.device, dtype=torch.float32)
        lse = torch.empty(B, M, splits, device=q_lat.device, dtype=torch.float32)
    _mla_decode_kernel[(splits, B, m_blocks)](
        q, qpe, kv_cache, pe_cache, positions, partial, lse, M, H, S, split_len, softmax_scale * math.log2(math.e),
        q.stride(0), q.stride(1), qpe.stride(0), qpe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        pe_cache.stride(0), pe_cache.stride(1), positions.stride(0), positions.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        C=C, R=R, BLOCK_C=_pow2(C), BLOCK_R=_pow2(R), BLOCK_M=block_m, BLOCK_N=block_n,
        WRITE_LSE=splits > 1, DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        num_warps=MLA_NUM_WARPS or (8 if block_m > 16 else 4), num_stages=MLA_NUM_STAGES[q_lat.dtype])
    if splits > 1:
        _mla_combine_kernel[(B * M, triton.cdiv(C, MLA_COMBINE_BLOCK_C))](
            partial, lse, positions, out, M, H, S, split_len,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            positions.stride(0), positions.stride(1), out.stride(0), out.stride(1),
            C=C, BLOCK_C=MLA_COMBINE_BLOCK_C, BLOCK_S=MLA_COMBINE_BLOCK_S, num_warps=4)
    return out.view(B, T, H, C)


# ---------------------------------------------------------------------------------------------
# Router
#
# DeepSeek-V3's noaux_tc routing in two kernels. (1) The logits x @ W^T in float32 for few tokens
# (decode, verify): W is [E, D] float32 (11 MB at Kimi-K2's 384 x 7168) and must be read by
# many SMs at once, so programs take a block of experts and one of ROUTER_SPLIT_D slices of D
# each and write partial sums; cuBLAS's GEMM takes over past ROUTER_GEMV_MAX_TOKENS tokens.
# (2) One program per token sums the partials and selects: sigmoid scores, the correction bias
# added for selection only, groups kept by the sum of their two best biased scores (n_group > 1),
# the top K experts of the kept groups, their unbiased scores normalized and scaled. With UNIFORM
# (SIMULATED balanced routing, model.Router's routing "uniform") the choice is fixed instead: pair
# j = n*K + i of the N*K token-expert pairs goes to expert j mod E, weighed by that expert's
# unbiased score, normalized and scaled as usual; the logits are computed as always (their cost
# stays), only the top-k rounds are skipped, so uniform routing costs no kernel of its own.

ROUTER_GEMV_MAX_TOKENS = 16
ROUTER_SPLIT_D = 4          # D slices: 384 experts / 8 a block x 4 slices = 192 programs on 132 SMs
ROUTER_BLOCK_E = 8
ROUTER_TILE = 8192          # elements of the [tokens, experts, D] product a program holds at once


@_jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, N, E, D, d_per_split, s_xn, s_we, s_os, s_on,
                          BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[j, n, e] = sum over d in slice j of x[n, d] * W[e, d], in float32. x [N, D] (any float
    dtype), W [E, D] float32, out [splits, N, E] float32 (last dims contiguous).
    Grid: (cdiv(E, BLOCK_E), splits, cdiv(N, BLOCK_N))."""
    eb, j, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    d_end = tl.minimum((j + 1) * d_per_split, D)
    for d0 in range(j * d_per_split, d_end, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        w = tl.load(w_ptr + e[:, None] * s_we + d[None, :], mask=(e < E)[:, None] & (d < d_end)[None, :], other=0.0)
        x = tl.load(x_ptr + n[:, None] * s_xn + d[None, :], mask=(n < N)[:, None] & (d < d_end)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], 2)                # [BLOCK_N, BLOCK_E]
    tl.store(out_ptr + j * s_os + n[:, None] * s_on + e[None, :], acc, mask=(n < N)[:, None] & (e < E)[None, :])


@_jit
def _router_select_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, s_ls, s_ln, s_idn, s_wn, E_PER_G, G, scale,
                          SPLITS: tl.constexpr, K: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                          GROUPED: tl.constexpr, UNIFORM: tl.constexpr, SHARED: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    """ids[n], w[n] = the K experts of token n and their weights, best first (UNIFORM: experts
    (n*K + i) mod E, i < K), then with SHARED expert E and weight 1 in column K. logits [SPLITS,
    N, E] float32 partial sums (E = G * E_PER_G, expert e = g * E_PER_G + j), bias [E] float32;
    ids [N, K (+1)] int64, w [N, K (+1)] float32. Grid: (N,)."""
    n = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_EG)[None, :]
    e = g * E_PER_G + j                                                   # [BLOCK_G, BLOCK_EG] expert ids
    ok = (g < G) & (j < E_PER_G)
    logit = tl.zeros([BLOCK_G, BLOCK_EG], tl.float32)
    for s in tl.static_range(SPLITS):
        logit += tl.load(logits_ptr + s * s_ls + n * s_ln + e, mask=ok, other=0.0)
    score = tl.sigmoid(logit)
    k = tl.arange(0, BLOCK_K)
    if UNIFORM:
        ids, w = _uniform_choice(score, e, ok, n, G * E_PER_G, k, K)
    else:
        ids, w = _top_k(score, bias_ptr, e, ok, j, G, k, K, TOPK_GROUP, GROUPED, BLOCK_G, BLOCK_EG, BLOCK_K)
    w = tl.where(k < K, w, 0.0)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    tl.store(ids_ptr + n * s_idn + k, ids, mask=k < K)
    tl.store(w_ptr + n * s_wn + k, w * scale, mask=k < K)
    if SHARED:  # the shared expert as expert E of the fused MoE launch, weight 1
        tl.store(ids_ptr + n * s_idn + K, (G * E_PER_G).to(tl.int64))
        tl.store(w_ptr + n * s_wn + K, 1.0)


@_jit
def _top_k(score, bias_ptr, e, ok, j, G, k, K: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr,
           BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    """noaux_tc selection from the scores [BLOCK_G, BLOCK_EG]: (ids [BLOCK_K] int64, their unbiased scores)."""
    biased = tl.where(ok, score + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
    if GROUPED:  # keep the TOPK_GROUP groups whose two best biased scores sum highest
        best = tl.argmax(biased, 1)                                       # [BLOCK_G]
        second = tl.max(tl.where(j == best[:, None], float("-inf"), biased), 1)
        gid = tl.arange(0, BLOCK_G)
        gscore = tl.where(gid < G, tl.max(biased, 1) + second, float("-inf"))
        keep = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.argmax(gscore, 0)
            keep = keep | (gid == top)
            gscore = tl.where(gid == top, float("-inf"), gscore)
        biased = tl.where(keep[:, None], biased, float("-inf"))
    flat = tl.reshape(biased, [BLOCK_G * BLOCK_EG])
    flat_score = tl.reshape(score, [BLOCK_G * BLOCK_EG])
    flat_e = tl.reshape(e, [BLOCK_G * BLOCK_EG])
    idx = tl.arange(0, BLOCK_G * BLOCK_EG)
    ids = tl.zeros([BLOCK_K], tl.int64)
    w = tl.zeros([BLOCK_K], tl.float32)
    for i in tl.static_range(K):  # K rounds of argmax: the top K, best first
        hit = idx == tl.argmax(flat, 0)
        ids = tl.where(k == i, tl.sum(tl.where(hit, flat_e, 0), 0).to(tl.int64), ids)
        w = tl.where(k == i, tl.sum(tl.where(hit, flat_score, 0.0), 0), w)
        flat = tl.where(hit, float("-inf"), flat)
    return ids, w


@_jit
def _uniform_choice(score, e, ok, n, E, k, K: tl.constexpr):
    """SIMULATED balanced routing: (ids [BLOCK_K] int64 = (n*K + k) mod E, their unbiased scores)."""
    ids = ((n * K + k) % E).to(tl.int64)
    mine = ok[None, :, :] & (e[None, :, :] == ids[:, None, None])             # [BLOCK_K, BLOCK_G, BLOCK_EG]
    w = tl.sum(tl.sum(tl.where(mine, score[None, :, :], 0.0), 2), 1)
    return ids, w


def router_logits(x, weight):
    """x [N, D] @ weight[E, D]^T in float32, as ROUTER_SPLIT_D partial sums [splits, N, E] for
    few tokens (one kernel, x in its own dtype), else cuBLAS's GEMM as [1, N, E]."""
    N, D = x.shape
    E = weight.shape[0]
    if N > ROUTER_GEMV_MAX_TOKENS:
        return torch.nn.functional.linear(x.float(), weight).unsqueeze(0)
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_n = _pow2(N, 1)
    block_d = max(64, ROUTER_TILE // (block_n * ROUTER_BLOCK_E))
    d_per_split = triton.cdiv(triton.cdiv(D, ROUTER_SPLIT_D), block_d) * block_d
    splits = triton.cdiv(D, d_per_split)
    out = torch.empty(splits, N, E, device=x.device, dtype=torch.float32)
    _router_logits_kernel[(triton.cdiv(E, ROUTER_BLOCK_E), splits, triton.cdiv(N, block_n))](
        x, weight, out, N, E, D, d_per_split, x.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        BLOCK_N=block_n, BLOCK_E=ROUTER_BLOCK_E, BLOCK_D=block_d, num_warps=4)
    return out


def router_topk(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling, uniform=False,
                shared_slot=False):
    """model.Router.forward in two kernels: x [N, D], weight [E, D] float32, bias [E] float32 ->
    ids int64 [N, K], weights float32 [N, K]. uniform: SIMULATED balanced routing (pair j = n*K + i
    to expert j mod E), as model.Router's routing "uniform"; shared_slot: a column K more, expert E
    with weight 1 (the shared expert in the fused MoE launch); both in the same two kernels."""
    N, D = x.shape
    E = weight.shape[0]
    if weight.dtype != torch.float32 or bias.dtype != torch.float32 or weight.shape != (E, D) or bias.shape != (E,):
        raise ValueError(f"router_topk: needs float32 weight [E, {D}] and bias [E], got {weight.dtype} "
                         f"{list(weight.shape)} and {bias.dtype} {list(bias.shape)} (float64: use the plain path)")
    if E % n_group or not 1 <= topk_group <= n_group or top_k > E // n_group * topk_group:
        raise ValueError(f"router_topk: {E} experts in {n_group} groups, {topk_group} kept, cannot give top {top_k}")
    ids = torch.empty(N, top_k + bool(shared_slot), device=x.device, dtype=torch.int64)
    weights = torch.empty(N, top_k + bool(shared_slot), device=x.device, dtype=torch.float32)
    if N == 0:
        return ids, weights
    logits = router_logits(x, weight)                                       # [splits, N, E]
    _router_select_kernel[(N,)](logits, bias, ids, weights, logits.stride(0), logits.stride(1), ids.stride(0),
                                weights.stride(0), E // n_group, n_group, float(scaling), SPLITS=logits.shape[0],
                                K=top_k, TOPK_GROUP=topk_group, NORM=bool(norm_topk_prob),
                                GROUPED=n_group > 1 and not uniform, UNIFORM=bool(uniform), SHARED=bool(shared_slot),
                                BLOCK_G=_pow2(n_group, 1), BLOCK_EG=_pow2(E // n_group, 1),
                                BLOCK_K=_pow2(top_k, 1), num_warps=4)
    return ids, weights


# ---------------------------------------------------------------------------------------------
# Fused residual + RMSNorm: the residual add and the norm that reads its result, one pass.


@_jit
def _add_rmsnorm_kernel(x_ptr, y_ptr, w_ptr, h_ptr, out_ptr, D, eps, s_x, s_y, s_h, s_out,
                        BLOCK_D: tl.constexpr):
    """h = x + y (rounded to x's dtype, as the plain add), out = h * rsqrt(mean(h^2) + eps) * w,
    computed in float32 and rounded once. x, y, h, out [N, D] (last dim contiguous), w [D].
    Grid: (N,)."""
    n = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + n * s_x + d, mask=ok, other=0.0)
    y = tl.load(y_ptr + n * s_y + d, mask=ok, other=0.0)
    h = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
    tl.store(h_ptr + n * s_h + d, h, mask=ok)
    hf = h.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * s_out + d, (hf * r * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rmsnorm(x, y, weight, eps):
    """(x + y, RMSNorm(x + y)) for x, y [..., D] of one dtype and weight [D]: one read of x and y."""
    D = x.shape[-1]
    if y.shape != x.shape or y.dtype != x.dtype or weight.shape != (D,):
        raise ValueError(f"add_rmsnorm: x {x.dtype} {list(x.shape)}, y {y.dtype} {list(y.shape)}, weight "
                         f"{list(weight.shape)} do not fit")
    x2, y2 = x.contiguous().view(-1, D), y.contiguous().view(-1, D)
    h, out = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _add_rmsnorm_kernel[(x2.shape[0],)](x2, y2, weight, h, out, D, float(eps), x2.stride(0), y2.stride(0),
                                            h.stride(0), out.stride(0), BLOCK_D=_pow2(D),
                                            num_warps=8 if D >= 4096 else 4)
    return h.view(x.shape), out.view(x.shape)


# ---------------------------------------------------------------------------------------------
# SwiGLU activation: silu(gate) * up in one pass (the dense MLP's and the shared expert's).


@_jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, s_g, s_u, s_out, BLOCK: tl.constexpr):
    """out[n] = silu(g[n]) * u[n], in float32, rounded once. g, u, out [N, I] (rows strided, the
    last dim contiguous; g and u may be the two halves of one [N, 2I] GEMM output).
    Grid: (N, cdiv(I, BLOCK))."""
    n, b = tl.program_id(0), tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    ok = i < I
    g = tl.load(g_ptr + n * s_g + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + n * s_u + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * s_out + i, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ok)


SILU_MUL_BLOCK = 1024   # elements a program: I = 256 (Kimi-K2's shared expert at TP 8) is one program a row


def silu_mul(gate, up):
    """silu(gate) * up for gate, up [..., I] of one dtype (views with a contiguous last dim, e.g.
    the halves of one GEMM output): one read of each, one write."""
    I = gate.shape[-1]
    if up.shape != gate.shape or up.dtype != gate.dtype or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"silu_mul: gate {gate.dtype} {list(gate.shape)} and up {up.dtype} {list(up.shape)} must "
                         "match, each with a contiguous last dim")
    g2, u2 = gate.reshape(-1, I), up.reshape(-1, I)      # views for the halves of a [..., 2I] output
    out = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    if g2.shape[0]:
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(I, SILU_MUL_BLOCK))](
            g2, u2, out, I, g2.stride(0), u2.stride(0), out.stride(0), BLOCK=min(SILU_MUL_BLOCK, _pow2(I)),
            num_warps=4)
    return out.view(gate.shape)


# ---------------------------------------------------------------------------------------------
# RoPE fused with the cache write
#
# What MLA does with each new token before attending, in one program per token: normalize the
# latent (kv_a_layernorm) and write it to its cache slot (slot = position), rotate k_pe and write
# it beside, and rotate the token's H query rotary parts. RoPE turns interleaved pairs
# (x[2i], x[2i+1]) by the angle whose (cos, sin) the table gives for the token's position.


@_jit
def _rope_cache_kernel(q_ptr, kv_ptr, kpe_ptr, w_ptr, rope_ptr, pos_ptr, kv_cache_ptr, pe_cache_ptr, qo_ptr,
                       T, H, eps, s_qb, s_qt, s_qh, s_kvb, s_kvt, s_kpb, s_kpt, s_rb, s_rt, s_posb, s_post,
                       s_cb, s_cs, s_pb, s_ps, s_ob, s_ot, s_oh,
                       C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_R2: tl.constexpr):
    """For token (b, t) at slot p = pos[b, t]: kv_cache[b, p] = RMSNorm(kv[b, t]) * w,
    pe_cache[b, p] = rope(kpe[b, t]), qo[b, t, h] = rope(q[b, t, h]) for every head h.
    q [B, T, H, R], kv [B, T, C], kpe [B, T, R] (strided views, last dim contiguous; one dtype);
    w [C]; rope [B, T, R/2, 2] float32 (cos, sin), contiguous in its last two dims; pos int64
    [B, T]; caches [>=B, S, C] and [>=B, S, R]; qo [B, T, H, R]. Float32 math, one rounding.
    Grid: (B * T,)."""
    n = tl.program_id(0)
    b, t = n // T, n % T
    p = tl.load(pos_ptr + b * s_posb + t * s_post)
    c = tl.arange(0, BLOCK_C)
    kv = tl.load(kv_ptr + b * s_kvb + t * s_kvt + c, mask=c < C, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    normed = kv / tl.sqrt(tl.sum(kv * kv, 0) / C + eps) * w
    tl.store(kv_cache_ptr + b * s_cb + p * s_cs + c, normed.to(kv_cache_ptr.dtype.element_ty), mask=c < C)
    i = tl.arange(0, BLOCK_R2)
    i_ok = 2 * i < R
    cos = tl.load(rope_ptr + b * s_rb + t * s_rt + 2 * i, mask=i_ok, other=0.0)
    sin = tl.load(rope_ptr + b * s_rb + t * s_rt + 2 * i + 1, mask=i_ok, other=0.0)
    k = kpe_ptr + b * s_kpb + t * s_kpt + 2 * i
    ke, ko = tl.load(k, mask=i_ok, other=0.0).to(tl.float32), tl.load(k + 1, mask=i_ok, other=0.0).to(tl.float32)
    pe = pe_cache_ptr + b * s_pb + p * s_ps + 2 * i
    tl.store(pe, (ke * cos - ko * sin).to(pe_cache_ptr.dtype.element_ty), mask=i_ok)
    tl.store(pe + 1, (ke * sin + ko * cos).to(pe_cache_ptr.dtype.element_ty), mask=i_ok)
    h = tl.arange(0, BLOCK_H)[:, None]
    ok = (h < H) & i_ok[None, :]
    q = q_ptr + b * s_qb + t * s_qt + h * s_qh + 2 * i[None, :]
    qe, qo = tl.load(q, mask=ok, other=0.0).to(tl.float32), tl.load(q + 1, mask=ok, other=0.0).to(tl.float32)
    out = qo_ptr + b * s_ob + t * s_ot + h * s_oh + 2 * i[None, :]
    tl.store(out, (qe * cos[None, :] - qo * sin[None, :]).to(qo_ptr.dtype.element_ty), mask=ok)
    tl.store(out + 1, (qe * sin[None, :] + qo * cos[None, :]).to(qo_ptr.dtype.element_ty), mask=ok)


def mla_rope_cache_write(q_pe, kv, k_pe, norm_weight, eps, rope, positions, kv_cache, pe_cache):
    """Writes kv_cache[b, positions[b, t]] = RMSNorm(kv[b, t]) and pe_cache[b, positions[b, t]] =
    rope(k_pe[b, t]); returns rope(q_pe) [B, T, H, R]. q_pe [B, T, H, R], kv [B, T, C], k_pe
    [B, T, R] (views with a contiguous last dim), rope [B, T, R/2, 2] float32 (cos, sin) at each
    token's position, positions int64 [B, T], caches [>=B, S, C] / [>=B, S, R]."""
    B, T, H, R = q_pe.shape
    C = kv.shape[-1]
    if kv.shape != (B, T, C) or k_pe.shape != (B, T, R) or rope.shape != (B, T, R // 2, 2) or R % 2:
        raise ValueError(f"mla_rope_cache_write: q_pe {list(q_pe.shape)}, kv {list(kv.shape)}, k_pe "
                         f"{list(k_pe.shape)}, rope {list(rope.shape)} do not fit [B, T, H, R], [B, T, C], "
                         "[B, T, R], [B, T, R/2, 2] with R even")
    if q_pe.dtype not in MLA_BLOCK_N or len({q_pe.dtype, kv.dtype, k_pe.dtype, kv_cache.dtype, pe_cache.dtype}) != 1:
        raise ValueError(f"mla_rope_cache_write: needs one dtype of {sorted(map(str, MLA_BLOCK_N))} for the inputs "
                         f"and the caches, got {q_pe.dtype}, {kv.dtype}, {k_pe.dtype}, {kv_cache.dtype}, "
                         f"{pe_cache.dtype} (float64: use the plain path)")
    if positions.shape != (B, T) or positions.dtype != torch.int64 or rope.dtype != torch.float32:
        raise ValueError("mla_rope_cache_write: needs int64 positions [B, T] and a float32 rope table")
    if kv_cache.shape[0] < B or kv_cache.shape[2] != C or pe_cache.shape[2] != R:
        raise ValueError(f"mla_rope_cache_write: caches {list(kv_cache.shape)}, {list(pe_cache.shape)} do not "
                         f"hold [{B}, S, {C}] and [{B}, S, {R}]")
    for name, x in dict(q_pe=q_pe, kv=kv, k_pe=k_pe, kv_cache=kv_cache, pe_cache=pe_cache).items():
        if x.stride(-1) != 1:
            raise ValueError(f"mla_rope_cache_write: {name}'s last dim must be contiguous")
    rope = rope if rope.stride(-1) == 1 and rope.stride(-2) == 2 else rope.contiguous()
    out = torch.empty(B, T, H, R, device=q_pe.device, dtype=q_pe.dtype)
    _rope_cache_kernel[(B * T,)](
        q_pe, kv, k_pe, norm_weight, rope, positions, kv_cache, pe_cache, out, T, H, float(eps),
        q_pe.stride(0), q_pe.stride(1), q_pe.stride(2), kv.stride(0), kv.stride(1), k_pe.stride(0), k_pe.stride(1),
        rope.stride(0), rope.stride(1), positions.stride(0), positions.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), pe_cache.stride(0), pe_cache.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        C=C, R=R, BLOCK_C=_pow2(C), BLOCK_H=_pow2(H, 1), BLOCK_R2=_pow2(R // 2, 1), num_warps=4)
    return out



# ---------------------------------------------------------------------------------------------
# RMSNorm fused into the GEMV that reads it (decode and verify: at most NORM_GEMV_MAX_ROWS rows)
#
# out = RMSNorm(x + r) @ W^T for a few rows x [M, K] and a weight W [N, K]: a GEMV, memory-bound
# on W. Each program owns BLOCK_N rows of W, streams them once over K (pipelined, tl.dot with the
# M rows padded to 16), and recomputes the M rows' sums of squares itself in a first pass over x
# (M x K elements from L2: 14 KB a row at K = 7168, against the program's 16 x K of W), so the
# norm costs no kernel and no launch of its own. With r the add is fused too, and program 0
# writes the sum x + r once. Without a norm weight it is a plain GEMV (o_proj). The normed row is
# rounded to W's dtype before the product, as the plain RMSNorm's output is.
#
# Measured on the H200 (2026-11-29, bf16, M = 1, in a graph, weights rotated past the L2): each
# K step costs about one memory latency (~1.1 us), so the kernel is latency-bound on long rows:
# q_a + kv_a with the input add + norm (K = 7168, 14 steps plus 14 of the sum-of-squares pass)
# 30.8 us = 985 GB/s against 15.3 us for add_rmsnorm + cuBLAS's split-K GEMV; q_b with its
# norm (K = 1536) 8.0 us against 10.0. The model therefore uses it for q_b (the norm fused), o_proj
# and (head_gemv) the absorbed products, whose rows are short, and leaves q_a + kv_a to cuBLAS.
# The next version for long rows: split K over more programs with one or two steps each (as the
# router's logits GEMV, which reads 11 MB at ~2.6 TB/s) and the sum of squares in the same pass.

NORM_GEMV_MAX_ROWS = 16     # decode and verify; prefill goes to the plain RMSNorm and cuBLAS
NORM_GEMV_BLOCK_M = 16      # tl.dot's smallest M: the rows, padded
NORM_GEMV_BLOCK_N = 16      # W rows a program: Kimi-K2 TP 8 q_b 1536 -> 96 programs, o_proj 7168 -> 448
#                             (q_a + kv_a 2112 -> 132: measured slower than cuBLAS, see above)
NORM_GEMV_STEP_BYTES = 1024  # bytes of one W row a loop step reads (512 bf16 / 256 fp32 columns):
#                             a 16 KB W tile a step, NORM_GEMV_STAGES of them in flight a program
NORM_GEMV_STAGES = 3
NORM_GEMV_WARPS = 4


@_jit
def _gemv_rows(x_ptr, r_ptr, m, m_ok, k, K, s_xm, s_rm, ADD: tl.constexpr):
    """Rows m, columns k of x (+ r, the sum rounded to x's dtype as the plain add), as float32."""
    ok = m_ok[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=ok, other=0.0)
    if ADD:
        r = tl.load(r_ptr + m[:, None] * s_rm + k[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@_jit
def _norm_gemv_kernel(x_ptr, r_ptr, g_ptr, w_ptr, out_ptr, sum_ptr, M, N, K, eps, s_xm, s_xh, s_rm, s_wh, s_wn,
                      s_wk, s_om, s_oh, s_sm, NORM: tl.constexpr, ADD: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_k h[m, k] * W[n, k] with h = RMSNorm(x + r) (NORM: h * rsqrt(mean(h^2) + eps) * g,
    rounded to W's dtype; ADD: r added, and sum = x + r written by program 0). x, r, sum [M, K], out
    [M, N] (rows strided, last dim contiguous), W [N, K] (any strides), g [K]; x, r, sum, out and W
    of one dtype; float32 accumulation (IEEE: exact float32 products, no TF32). With heads (grid
    axis 1, head_gemv): x, W and out of head j start s_xh, s_wh, s_oh elements further.
    Grid: (cdiv(N, BLOCK_N), heads)."""
    pid, j = tl.program_id(0), tl.program_id(1)
    x_ptr += j * s_xh
    w_ptr += j * s_wh
    out_ptr += j * s_oh
    m = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    sum_ok = m < tl.where(pid == 0, M, 0)                                   # program 0 writes the sum
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM:  # the rows' sums of squares, recomputed by every program
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = _gemv_rows(x_ptr, r_ptr, m, m_ok, k0 + tl.arange(0, BLOCK_K), K, s_xm, s_rm, ADD)
            ss += tl.sum(h * h, 1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        h = _gemv_rows(x_ptr, r_ptr, m, m_ok, k, K, s_xm, s_rm, ADD)                    # [BLOCK_M, BLOCK_K]
        if ADD:
            tl.store(sum_ptr + m[:, None] * s_sm + k[None, :], h.to(sum_ptr.dtype.element_ty),
                     mask=sum_ok[:, None] & k_ok[None, :])
        if NORM:
            g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            h = h * rstd[:, None] * g[None, :]
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :] * s_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(h.to(w.dtype), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(h.to(w.dtype), tl.trans(w))                                   # [BLOCK_M, BLOCK_N]
    tl.store(out_ptr + m[:, None] * s_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def norm_gemv(x, weight, norm_weight=None, eps=0.0, residual=None, block_n=None, block_k=None, stages=None,
              warps=None):
    """(h, RMSNorm(h) @ weight^T) for h = x + residual (x itself without one), in one kernel:
    x, residual [..., K] of weight's dtype (bf16, fp16 or float32), weight [N, K] (rows may be a
    strided view), norm_weight [K] (None: no norm, a plain GEMV), at most NORM_GEMV_MAX_ROWS rows.
    Returns h [..., K] and out [..., N]. The block arguments override the table above (benchmarks)."""
    K = x.shape[-1]
    N = weight.shape[0]
    rows = x.numel() // K if K else 0
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"norm_gemv: x {x.dtype} {list(x.shape)} and weight {weight.dtype} {list(weight.shape)} "
                         "do not fit [..., K] and [N, K] (last dim contiguous) of one dtype")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or rows > NORM_GEMV_MAX_ROWS:
        raise ValueError(f"norm_gemv: runs bf16, fp16 or float32 and at most {NORM_GEMV_MAX_ROWS} rows, got "
                         f"{x.dtype} and {rows} rows (use the plain path)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"norm_gemv: residual {residual.dtype} {list(residual.shape)} does not match x")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_gemv: norm weight {list(norm_weight.shape)} is not [{K}]")
    x2 = x.reshape(rows, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = x2 if residual is None else residual.reshape(rows, K)
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    h = x if residual is None else torch.empty(x.shape, device=x.device, dtype=x.dtype)
    out = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    if rows and N:
        block_n = block_n or NORM_GEMV_BLOCK_N
        block_k = block_k or min(NORM_GEMV_STEP_BYTES // x.element_size(), _pow2(K))
        _norm_gemv_kernel[(triton.cdiv(N, block_n), 1)](
            x2, r2, x2 if norm_weight is None else norm_weight, weight, out, h, rows, N, K, float(eps),
            x2.stride(0), 0, r2.stride(0), 0, weight.stride(0), 1, N, 0, K, NORM=norm_weight is not None,
            ADD=residual is not None, IEEE=x.dtype == torch.float32, BLOCK_M=NORM_GEMV_BLOCK_M, BLOCK_N=block_n,
            BLOCK_K=block_k, num_stages=stages or NORM_GEMV_STAGES, num_warps=warps or NORM_GEMV_WARPS)
    return h, out


HEAD_GEMV_BLOCK_N_STRIDED = 64   # W rows a program where W's rows, not its K, are contiguous (absorbed W_uk):
#                                  64 bf16 rows = 128-byte segments a K step


def head_gemv(x, weight):
    """out[..., j, n] = sum_k x[..., j, k] * weight[j, n, k], for each of H heads j: x [..., H, K]
    (last dim contiguous, the leading dims flattening to at most NORM_GEMV_MAX_ROWS rows of one
    stride), weight [H, N, K] of x's dtype, any strides (MLA's absorbed W_uk^T and W_uv are views
    of kv_b_proj's weight). One launch of norm_gemv's kernel, no norm; out [..., H, N] contiguous."""
    *lead, H, K = x.shape
    rows = math.prod(lead)
    if weight.dim() != 3 or weight.shape[0] != H or weight.shape[2] != K or weight.dtype != x.dtype:
        raise ValueError(f"head_gemv: x {x.dtype} {list(x.shape)} and weight {weight.dtype} {list(weight.shape)} "
                         "do not fit [..., H, K] and [H, N, K] of one dtype")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or rows > NORM_GEMV_MAX_ROWS:
        raise ValueError(f"head_gemv: runs bf16, fp16 or float32 and at most {NORM_GEMV_MAX_ROWS} rows, got "
                         f"{x.dtype} and {rows} rows (use the plain path)")
    N = weight.shape[1]
    x2 = x.reshape(rows, H, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(*lead, H, N, device=x.device, dtype=x.dtype)
    if rows and N and H:
        block_n = NORM_GEMV_BLOCK_N if weight.stride(2) == 1 else HEAD_GEMV_BLOCK_N_STRIDED
        block_k = min(NORM_GEMV_STEP_BYTES // x.element_size(), _pow2(K))
        _norm_gemv_kernel[(triton.cdiv(N, block_n), H)](
            x2, x2, x2, weight, out, out, rows, N, K, 0.0, x2.stride(0), x2.stride(1), 0, weight.stride(0),
            weight.stride(1), weight.stride(2), H * N, N, 0, NORM=False, ADD=False, IEEE=x.dtype == torch.float32,
            BLOCK_M=NORM_GEMV_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=NORM_GEMV_STAGES,
            num_warps=NORM_GEMV_WARPS)
    return out


# ---------------------------------------------------------------------------------------------
# Micro-benchmark on a GPU (python kernels.py): each kernel against its plain twin, both captured
# in CUDA graphs and timed by events around replays (medians), the input sets rotated so that the
# bytes of one replay exceed the L2; achieved GB/s against the measured copy bandwidth.

def _graph_ms(calls, reps=30):
    """Median ms of one call: `calls` (one per input set) captured in one graph, replayed."""
    import statistics
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    stamps = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        stamps.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in stamps) / len(calls)


def copy_bandwidth_GBps(reps=20):
    """Device-to-device copy of 1 GiB (bytes read + written), launched eagerly between events as
    run.py does: captured in a graph the copy becomes a memcpy node, which read ~2.7 TB/s on the
    H200 (2026-11-29) against ~4.2 TB/s eagerly in the same call."""
    import statistics
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(5):
        y.copy_(x)
    stamps = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        stamps.append((a, b))
    torch.cuda.synchronize()
    return 2 * x.numel() / statistics.median(a.elapsed_time(b) for a, b in stamps) / 1e6


def _mla_sets(B, T, S, used, n_sets, H=8, C=512, R=64, dtype=torch.bfloat16):
    """Input sets on the GPU: each row's T queries end at slot used - 1 of an S-slot cache."""
    sets = []
    for _ in range(n_sets):
        pos = (used - T + torch.arange(T, device="cuda")).expand(B, T)
        sets.append(dict(q=torch.randn(B, T, H, C, device="cuda", dtype=dtype),
                         qpe=torch.randn(B, T, H, R, device="cuda", dtype=dtype),
                         kv=torch.randn(B, S, C, device="cuda", dtype=dtype),
                         pe=torch.randn(B, S, R, device="cuda", dtype=dtype), pos=pos,
                         hidden=torch.arange(S, device="cuda") > pos.unsqueeze(-1)))
    return sets


def bench_mla(bw, rows):
    import model
    scale = 0.1
    print(f"\nMLA decode attention, Kimi-K2 TP 8 (H=8, C=512, R=64), bf16; copy bandwidth {bw:.0f} GB/s")
    print(f"{'B':>2} {'T':>2} {'cache':>6} {'used':>6} {'MB read':>8} {'torch us':>9} {'kernel us':>9} "
          f"{'speedup':>7} {'kernel GB/s':>11} {'of copy':>7}")
    for S, used in ((256, 256), (4096, 4096), (32768, 32768), (32768, 256), (32768, 4096)):
        for B, T in ((1, 1), (1, 4), (4, 1), (4, 4)):
            nbytes = B * used * 576 * 2 + 2 * B * T * 8 * 576 * 2      # cache slots read + queries and output
            sets = _mla_sets(B, T, S, used, max(2, min(32, math.ceil(2.5e8 / (B * S * 576 * 2)))))
            plain = _graph_ms([lambda s=s: model.absorbed_attention(s["q"], s["qpe"], s["kv"], s["pe"], s["hidden"],
                                                                    scale) for s in sets])
            fast = _graph_ms([lambda s=s: mla_decode_attention(s["q"], s["qpe"], s["kv"], s["pe"], s["pos"], scale)
                              for s in sets])
            gbps = nbytes / fast / 1e6
            print(f"{B:>2} {T:>2} {S:>6} {used:>6} {nbytes / 1e6:>8.2f} {plain * 1e3:>9.1f} {fast * 1e3:>9.1f} "
                  f"{plain / fast:>6.1f}x {gbps:>11.0f} {gbps / bw:>6.0%}")
            rows.append(dict(kernel="mla_decode", B=B, T=T, cache=S, used=used, bytes=nbytes, torch_ms=plain,
                             kernel_ms=fast, GBps=gbps))
            del sets


def bench_mla_configs(bw, rows):
    """Split length, tile and pipeline depth at 4096 and 32768 used slots (B = 1)."""
    global MLA_NUM_WARPS
    print("\nMLA kernel configurations (B=1; us; auto = the split rule)")
    splits = (None, 64, 128, 256)
    print(f"{'T':>2} {'used':>6} {'BLOCK_N':>7} {'stages':>6} {'warps':>5} " + " ".join(f"{str(s or 'auto'):>7}" for s in splits))
    default_n, default_stages = MLA_BLOCK_N[torch.bfloat16], MLA_NUM_STAGES[torch.bfloat16]
    for used in (4096, 32768):
        for T in (1, 4):
            sets = _mla_sets(1, T, used, used, max(2, min(32, math.ceil(2.5e8 / (used * 576 * 2)))))
            for block_n, stages, warps in ((64, 3, None), (64, 3, 8), (32, 4, None)):
                MLA_BLOCK_N[torch.bfloat16], MLA_NUM_STAGES[torch.bfloat16], MLA_NUM_WARPS = block_n, stages, warps
                times = []
                for split in splits:
                    try:
                        times.append(_graph_ms([lambda s=s: mla_decode_attention(s["q"], s["qpe"], s["kv"], s["pe"],
                                                                                  s["pos"], 0.1, split_len=split)
                                                for s in sets]))
                    except Exception as e:  # a configuration that does not fit (shared memory) is reported, not fatal
                        print(f"  BLOCK_N {block_n} stages {stages} split {split}: {type(e).__name__}: {str(e)[:120]}")
                        times.append(float("nan"))
                print(f"{T:>2} {used:>6} {block_n:>7} {stages:>6} {str(warps or 'auto'):>5} "
                      + " ".join(f"{t * 1e3:>7.1f}" for t in times))
                rows.append(dict(kernel="mla_config", T=T, used=used, block_n=block_n, stages=stages, warps=warps,
                                 us={str(s): t * 1e3 for s, t in zip(splits, times)}))
            del sets
    MLA_BLOCK_N[torch.bfloat16], MLA_NUM_STAGES[torch.bfloat16], MLA_NUM_WARPS = default_n, default_stages, None


def bench_small(rows):
    """Router (model and SIMULATED uniform routing), add + RMSNorm, SwiGLU, RoPE + cache write
    against their twins at Kimi-K2 TP 8 shapes."""
    import model
    print("\nsmall kernels, Kimi-K2 shapes, bf16 (us per call, in a graph; 8 input sets)")
    args = model.ModelArgs(n_routed_experts=384)
    router = model.Router(args, "cuda", torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(0, 0.01)
        router.e_score_correction_bias.normal_(0, 0.1)
    norm = model.RMSNorm(7168, 1e-6, "cuda", torch.bfloat16)
    lat_norm = model.RMSNorm(512, 1e-6, "cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.fill_(1.0)
        lat_norm.weight.fill_(1.0)
    table = torch.stack(model.rope_tables(64, 50000.0, None, 4096, "cuda"), -1)
    kv_cache = torch.randn(4, 4096, 512, device="cuda", dtype=torch.bfloat16)
    pe_cache = torch.randn(4, 4096, 64, device="cuda", dtype=torch.bfloat16)

    def router_call(x, impl, routing="model"):
        router.impl, router.routing = impl, routing
        return router(x)

    def rope_plain(q_pe, kv, k_pe, rope, pos):
        rows_ = torch.arange(q_pe.shape[0], device="cuda").unsqueeze(1)
        kv_cache[rows_, pos] = lat_norm(kv)
        pe_cache[rows_, pos] = model.apply_rope(k_pe, rope)
        return model.apply_rope(q_pe, rope)
    for N in (1, 4):
        xs = [torch.randn(N, 7168, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        ys = [torch.randn(N, 7168, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        qs = [torch.randn(1, N, 8, 192, device="cuda", dtype=torch.bfloat16)[..., 128:] for _ in range(8)]
        kvs = [torch.randn(1, N, 576, device="cuda", dtype=torch.bfloat16).split([512, 64], -1) for _ in range(8)]
        pos = (100 + torch.arange(N, device="cuda")).unsqueeze(0)
        rope = table[pos]
        gate_ups = [torch.randn(N, 512, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        pairs = {
            "router (fp32 GEMV + selection)": ([lambda x=x: router_call(x, "torch") for x in xs],
                                               [lambda x=x: router_call(x, "triton") for x in xs]),
            "router, SIMULATED uniform routing": ([lambda x=x: router_call(x, "torch", "uniform") for x in xs],
                                                  [lambda x=x: router_call(x, "triton", "uniform") for x in xs]),
            "SwiGLU silu * up, I 256": ([lambda g=g: torch.nn.functional.silu(g[:, :256]) * g[:, 256:]
                                         for g in gate_ups],
                                        [lambda g=g: silu_mul(g[:, :256], g[:, 256:]) for g in gate_ups]),
            "add + RMSNorm": ([lambda x=x, y=y: norm(x + y) for x, y in zip(xs, ys)],
                              [lambda x=x, y=y: add_rmsnorm(x, y, norm.weight, 1e-6) for x, y in zip(xs, ys)]),
            "RoPE + cache write": ([lambda q=q, kv=kv: rope_plain(q, kv[0], kv[1], rope, pos) for q, kv in zip(qs, kvs)],
                                   [lambda q=q, kv=kv: mla_rope_cache_write(q, kv[0], kv[1], lat_norm.weight, 1e-6, rope,
                                                                           pos, kv_cache, pe_cache)
                                    for q, kv in zip(qs, kvs)]),
        }
        for name, (plain_calls, fast_calls) in pairs.items():
            plain, fast = _graph_ms(plain_calls), _graph_ms(fast_calls)
            print(f"  {name:32s} N={N}: torch {plain * 1e3:7.1f}  kernel {fast * 1e3:7.1f}  ({plain / fast:.1f}x)")
            rows.append(dict(kernel=name, N=N, torch_ms=plain, kernel_ms=fast))


def bench_norm_gemv(bw, rows, sweep=False):
    """norm_gemv at Kimi-K2 TP-8 shapes against what it replaces: q_a + kv_a with the input add +
    RMSNorm (add_rmsnorm's kernel + cuBLAS), q_b with q_a_layernorm (RMSNorm + cuBLAS), o_proj
    (cuBLAS); the weight sets rotated past the L2. sweep: block configurations too."""
    import model
    print(f"\nnorm_gemv, Kimi-K2 TP 8, bf16 (us per call in a graph; GB/s of the weight; copy {bw:.0f} GB/s)")
    dt = torch.bfloat16
    configs = [(None, None, None, None)] + ([(bn, bk, st, 4) for bn in (16, 32) for bk in (256, 512)
                                             for st in (2, 4)] + [(16, 512, 3, 8)] if sweep else [])
    for name, N, K, has_norm, add in (("q_a+kv_a", 2112, 7168, True, True), ("q_b", 1536, 1536, True, False),
                                      ("o_proj", 7168, 1024, False, False)):
        sets = max(2, min(16, math.ceil(150e6 / (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for _ in range(sets)]
        norm = model.RMSNorm(K, 1e-6, "cuda", dt) if has_norm else None
        if norm is not None:
            with torch.no_grad():
                norm.weight.fill_(1.0)
        for M in (1, 4):
            xs = [torch.randn(M, K, device="cuda", dtype=dt) for _ in range(sets)]
            rs = [torch.randn(M, K, device="cuda", dtype=dt) if add else None for _ in range(sets)]

            def plain(x, w, r):
                if r is not None:
                    return torch.nn.functional.linear(add_rmsnorm(x, r, norm.weight, norm.eps)[1], w)
                return torch.nn.functional.linear(x if norm is None else norm(x), w)
            base = _graph_ms([partial(plain, x, w, r) for x, w, r in zip(xs, ws, rs)]) * 1e3
            for bn, bk, st, wp in configs:
                g = None if norm is None else norm.weight
                try:
                    us = _graph_ms([partial(norm_gemv, x, w, g, 1e-6, r, bn, bk, st, wp)
                                    for x, w, r in zip(xs, ws, rs)]) * 1e3
                except Exception as e:   # a configuration past the SM's shared memory, say
                    print(f"  {name:9s} M {M}  config {bn, bk, st, wp}: {type(e).__name__} {str(e)[:80]}")
                    continue
                print(f"  {name:9s} M {M}  config {bn, bk, st, wp}: kernel {us:6.1f} us ({N * K * 2 / us / 1e3:5.0f} "
                      f"GB/s)  twin {base:6.1f} us ({N * K * 2 / base / 1e3:5.0f} GB/s)")
                rows.append(dict(kernel="norm_gemv", proj=name, M=M, config=[bn, bk, st, wp], us=us, twin_us=base))
    kv_b = torch.randn(8, 256, 512, device="cuda", dtype=dt) / 512 ** 0.5   # W_uk, W_uv [H, 128, C] of one buffer
    w_uk, w_uv = kv_b.split([128, 128], 1)
    for M in (1, 4):
        for name, x, w, eq in (("q_lat (W_uk)", torch.randn(M, 8, 192, device="cuda", dtype=dt)[..., :128],
                                w_uk.transpose(1, 2), "mhd,hcd->mhc"),
                               ("o (W_uv)", torch.randn(M, 8, 512, device="cuda", dtype=dt), w_uv, "mhc,hdc->mhd")):
            base = _graph_ms([partial(torch.einsum, eq, x, w)] * 8) * 1e3   # 1 MB: stays in L2 either way
            us = _graph_ms([partial(head_gemv, x, w)] * 8) * 1e3
            print(f"  {name:12s} M {M}: kernel {us:6.1f} us  twin (einsum) {base:6.1f} us")
            rows.append(dict(kernel="head_gemv", proj=name, M=M, us=us, twin_us=base))


def benchmark_attention(out=None):
    import json
    rows = []
    torch.manual_seed(0)
    bw = copy_bandwidth_GBps()
    bench_small(rows)
    bench_norm_gemv(bw, rows)
    bench_mla(bw, rows)
    bench_mla_configs(bw, rows)
    line = json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           copy_GBps=bw, rows=rows))
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    import argparse
    import json
    p = argparse.ArgumentParser(description="Each Triton kernel against its plain twin and its floor, on a GPU.")
    p.add_argument("--json", metavar="PATH", help="write the results: PATH with _moe / _attention before .json")
    p.add_argument("--sweep", nargs="?", const="dot,gemv", default="", metavar="VARIANTS",
                   help="also time the fused MoE's block-size sweep points at N = 1 and 4, of these variants "
                        "(comma-separated; all without a value)")
    p.add_argument("--moe", action="store_true", help="time the fused MoE only (not attention and the small kernels)")
    p.add_argument("--variants", default="dot,gemv",
                   help="fused MoE variants to time in this run, comma-separated: dot (k3's tl.dot tiles), gemv")
    a = p.parse_args()
    variants, sweep = tuple(a.variants.split(",")), tuple(v for v in a.sweep.split(",") if v)
    if not set(variants + sweep) <= {"dot", "gemv"}:
        p.error(f"--variants {a.variants!r}, --sweep {a.sweep!r}: choose from dot, gemv")
    moe_result = benchmark_moe(sweep=sweep, variants=variants)
    if a.json:
        with open(a.json.replace(".json", "_moe.json"), "w") as f:
            json.dump(moe_result, f)
    if not a.moe:
        benchmark_attention(a.json.replace(".json", "_attention.json") if a.json else None)
