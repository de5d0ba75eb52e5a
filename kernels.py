"""Triton kernels for the hot paths of the target. Each is optional, chosen by one switch, and has a
plain twin in model.py that stays the readable reference and the specification its test checks.

model.py imports this file only where Triton is installed and can run (CUDA, or Triton's CPU
interpreter under TRITON_INTERPRET=1, which the CPU tests use); CPU machines and CI without Triton
never import it. Every kernel keeps a fixed launch shape for given input shapes and reads no device
value on the host, so all of them can be captured in CUDA graphs.

Shape legend: N tokens, D hidden, K experts per token, E routed experts, I expert intermediate
(this rank's slice), P = N*K token-expert pairs.

    python kernels.py        # on a GPU: fused MoE time against its floor at Kimi-K2 TP 8 rank shapes
"""
from dataclasses import dataclass

import torch
import triton  # model.fused_moe_available() checks that Triton is installed before importing this file
import triton.language as tl


# ---------------------------------------------------------------------------------------------
# Routed experts (fused MoE)
#
# y[n] = sum_k w[n, k] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, k]
#
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


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
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


def fused_moe(x, ids, route_w, gate, up, down, configs=None):
    """Routed experts in one pass over each distinct expert's weights:
    y[n] = sum_k route_w[n, k] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, k].

    x [N, D] (bf16, fp16 or fp32: the compute dtype; dequantized weights are rounded to it),
    ids int [N, K] in [0, E) (not checked: that would read the device), route_w [N, K] (any float;
    used in fp32), gate / up / down: ExpertWeights of [E, I, D], [E, I, D], [E, D, I]. Returns
    [N, D] in x's dtype. configs: override _configs() (the benchmark's sweep)."""
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
    cfg = {**_configs(fmt, P, x.is_cuda), **(configs or {})}
    x, ids, route_w = x.contiguous(), ids.reshape(-1).contiguous(), route_w.reshape(-1).float().contiguous()
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
# Benchmark (python kernels.py [--sweep] [--json PATH]): the fused MoE of one layer at the shapes of
# one Kimi-K2 rank at TP 8 (D 7168, I 256, 384 experts, K 8), each format, against its floor (the
# distinct experts' stored bytes over the copy bandwidth measured in the same run). Each time is the
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


def benchmark(sweep=False, D=7168, I=256, E=384, K=8, LAYERS=6, tokens=(1, 4, 8, 32)):
    import statistics
    dev, g = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    a, b = torch.empty(1 << 30, dtype=torch.uint8, device=dev), torch.empty(1 << 30, dtype=torch.uint8, device=dev)

    def eager_ms(fn, reps=10):   # as run.py measures the copy: a captured copy goes to the copy engine (~2.7 TB/s)
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def timed(fn, reps=30):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    bandwidth = 2 * a.numel() / eager_ms(lambda: b.copy_(a)) / 1e6                       # GB/s, read + write
    rows = []
    for fmt in ("plain", "fp8", "int4"):
        layers = [[_random_experts(fmt, E, o, i, dev, g) for o, i in ((I, D), (I, D), (D, I))] for _ in range(LAYERS)]
        per_expert = sum(_expert_bytes(w) for w in layers[0])
        for N in tokens:
            x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(N)])
            route_w = torch.rand(N, K, device=dev, generator=g)
            floor_ms = ids.unique().numel() * per_expert / bandwidth / 1e6

            def run(configs=None):
                return lambda: [fused_moe(x, ids, route_w, *w, configs=configs) for w in layers]
            configs = [None]
            if sweep and N in (1, 4):
                gu = [(16, 128, 4, 4), (32, 128, 4, 4), (16, 128, 4, 5), (32, 128, 4, 5), (64, 128, 4, 4),
                      (16, 256, 4, 3), (32, 256, 8, 3), (16, 64, 4, 6)]
                dn = [(64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 4, 3), (64, 256, 8, 3)]
                configs += [dict(gate_up=c) for c in gu if (fmt != "fp8" or c[1] <= 128) and (fmt != "int4" or c[1] >= 128)]
                configs += [dict(down=c) for c in dn if (fmt != "fp8" or c[1] <= 128) and (fmt != "int4" or c[1] >= 128)]
            for cfg in configs:
                try:
                    ms = timed(run(cfg)) / LAYERS
                except Exception as e:  # a sweep point that does not compile: say so, go on
                    print(f"{fmt} N={N} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                kernel_ms, by_kernel = _kernel_ms(run(cfg)) if cfg is None else (None, {})
                kernel_ms = kernel_ms / LAYERS if kernel_ms else None
                by_kernel = {name[:40]: v / LAYERS for name, v in by_kernel.items()}   # ms a layer, per kernel
                rows.append(dict(fmt=fmt, tokens=N, config=cfg, ms=ms, kernel_ms=kernel_ms, by_kernel=by_kernel,
                                 floor_ms=floor_ms, x_floor=ms / floor_ms, GBps=floor_ms * bandwidth / ms))
                print(f"{fmt:5s} N={N:3d} {str(cfg or 'default'):42s} {ms * 1e3:8.1f} us  floor {floor_ms * 1e3:7.1f} us"
                      f"  {ms / floor_ms:5.2f}x  {floor_ms * bandwidth / ms:6.0f} GB/s"
                      + (f"  kernels alone {kernel_ms * 1e3:.1f} us ({kernel_ms / floor_ms:.2f}x): "
                         + ", ".join(f"{k.replace('_moe_', '').split('_kernel')[0]} {v * 1e3:.1f}" for k, v in by_kernel.items())
                         if kernel_ms else ""), flush=True)
        del layers
    return dict(bandwidth_GBps=bandwidth, shapes=dict(D=D, I=I, E=E, K=K, layers=LAYERS), rows=rows,
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)


if __name__ == "__main__":
    import json
    import sys
    result = benchmark(sweep="--sweep" in sys.argv)
    print(f"copy bandwidth {result['bandwidth_GBps']:.0f} GB/s")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(result, f)
