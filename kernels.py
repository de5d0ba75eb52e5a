"""The fast path: Triton kernels for the hot paths of a decode or verify step, and the module swaps
that put them in place of model.py's plain code, which stays the readable specification.

  Routed experts         fused_moe              swap: FusedExperts (twin: model.Experts)
  MLA decode step        mla_decode_attention   swap: DecodeAttentionKernel (twins: model.MLA.write_cache,
                         mla_merge_absorb       model.absorbed_attention; with NormGemvMLA at one row,
                                                the merge inside W_uv's GEMV launch)
  RoPE + cache write     mla_rope_cache_write   swap: RopeCacheKernel (twin: model.MLA.write_cache; extend
                                                mode and draft trees)
  Router                 router_topk            swap: RouterKernel (twin: model.Router)
  Residual add + RMSNorm add_rmsnorm            swap: AddRMSNorm (twin: model.RMSNorm with a residual)
  SwiGLU activation      silu_mul               swap: SiluMulKernel (twin: model.MLP.act)
  RMSNorm + GEMV         norm_gemv              swap: NormGemvMLA (twin: model.MLA.query; with
                                                StackedQKVA, its q_kv_a), GemvRowParallel (twin:
                                                tp.RowParallelLinear, MLA's o_proj), with fused_proj
                                                and add_rmsnorm InputNormInQKVA (twin: model.Block's
                                                input add + norm and MLA.project, in one launch)
  GEMV per head          head_gemv              swap: NormGemvMLA (twin: model.MLA.absorb_query,
                                                absorb_output)
  EAGLE-3 head: input    draft_input_norms      swap: DraftNormsKernel (twin: draft.MidLayer's two norms
  norms, attention,      draft_attention        and concat), DraftAttentionKernel (twin:
  draft token            draft_top1             draft.DraftAttention), DraftTop1Kernel (twin:
                                                draft.Eagle3Draft.to_target_ids)

A swap is a subclass of a model.py (or tp.py) module that overrides only the methods that differ
and keeps the parameter names, so one state dict loads into both and each test compares a module
with its swap on the same weights. Torch-only swaps live here too: GroupedExperts
(torch._grouped_mm), StackedQKVA / StackedGateUp (one GEMM over stacked weights, "fused_proj"),
SharedExpertInLaunch (the shared expert inside the fused launch), StackedQKV (the
head's q/k/v). accelerate(model, names, moe=...) puts them in place, re-classing the modules of a
built model (run.py --kernels, --moe-impl); accelerate_draft(head, names) does the same for the
EAGLE-3 head; compile_layers(model) is run.py --compile's regional torch.compile.

Triton is imported only where it exists: without it this module still imports (HAVE_TRITON is
False) and the plain paths run. On a CPU the kernels run only under the Triton interpreter
(TRITON_INTERPRET=1, set before import; slow, for tests). This module imports model.py, draft.py
and tp.py, never the reverse; the kernels' micro-benchmarks are kernels_bench.py.

Shape legend: B batch rows, T query tokens per row, H local heads, M = T*H query rows of one
batch row, C kv_lora_rank (latent width), R qk_rope_head_dim, S cache slots, N tokens, D hidden,
E routed experts, G expert groups, K experts per token, I expert intermediate (this rank's
slice), P = N*K token-expert pairs. Every kernel keeps a fixed launch shape for given input
shapes and reads no device value on the host, so all of them can be captured in CUDA graphs.
Every kernel begins with _wait_for_prior() and every launch passes launch_pdl=PDL: on Hopper a
kernel starts while the one before it finishes (programmatic dependent launch, below _jit).
"""
import functools
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import draft
import model
import tp

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


# Programmatic dependent launch (PDL; sm_90 and later). A decode step runs ~800 kernels of a few us,
# and a kernel normally starts only once the one before it on the stream has finished (chained tiny
# kernels in a CUDA graph: ~0.9 us a launch on the H200). Every Triton kernel here is launched with
# launch_pdl=PDL, so the GPU may start it while its predecessor still runs, and its first statement
# is _wait_for_prior(): griddepcontrol.wait returns once the prerequisite grid (the kernel before it)
# has completed and its memory writes are visible (PTX ISA, griddepcontrol). The rule every kernel
# follows: nothing before the wait reads memory an earlier kernel writes, or writes memory an earlier
# kernel reads or writes. Every kernel waits, so its predecessor had waited for its own: all earlier
# kernels have completed too. Right after the wait, griddepcontrol.launch_dependents lets the next
# kernel launch: its programs take the SM slots this one leaves free and sit in their own wait, so its
# launch and start overlap this kernel's tail. A kernel launched without PDL (cuBLAS, torch's) starts
# after whole kernels as always, and in a kernel launched without PDL both instructions return at once.
# GDC: the kernels hold the instructions (sm_90 on; Triton's CPU interpreter has neither); PDL: the
# launches ask for it (kernels_bench.py --pdl turns it off to time the phases without, in one process).
# Measured so (H200, 2026-12-01, benchmarks/h200_issue25_pdl_bench_*.json, ms, off -> on): bf16 decode
# step 5.481 -> 5.143, verify of 4 10.593 -> 10.266; INT4 decode 4.761 -> 4.410, verify of 3 7.476 ->
# 7.288; outputs equal bit for bit. Loading the first weight tile before the wait (norm_gemv, head_gemv,
# the router) took 0.045 / 0.026 ms more off bf16 and 0.002 / 0.027 off INT4: not done, so that the
# wait stays every kernel's first statement and no caller must promise its weights are not being written.
PDL = HAVE_TRITON and not interpreting() and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
GDC = tl.constexpr(PDL) if HAVE_TRITON else PDL


@_jit
def _wait_for_prior():
    """Every kernel's first statement: wait for the kernels before it, then let the next one launch."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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
# number of token-expert pairs P, from `python kernels_bench.py --sweep` on an H200 (2026-11-29,
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
    _wait_for_prior()
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
    _wait_for_prior()
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
    _wait_for_prior()
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
    _wait_for_prior()
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


def gemv_rule(fmt, N, K):
    """fused_moe's variant when none is named: "gemv" up to GEMV_MAX_TOKENS[fmt] tokens (and
    GEMV_MAX_PAIRS pairs), else "dot". A rule on shapes only, so a captured graph keeps its variant."""
    return "gemv" if N <= GEMV_MAX_TOKENS[fmt] and N * K <= GEMV_MAX_PAIRS else "dot"


def _check_shared(shared, fmt, variant, I, D, dtype):
    """fused_moe's shared expert: it rides in the INT4 and FP8 GEMV launches only, as contiguous
    [I, D], [I, D], [D, I] tensors in the compute dtype."""
    if fmt not in SHARED_SPLIT or variant != "gemv":
        raise ValueError(f"fused_moe: a shared expert rides in the INT4 and FP8 GEMV launches only, not {fmt} "
                         f"{variant} (plain experts: make it expert E, as SharedExpertInLaunch does)")
    if ([list(t.shape) for t in shared] != [[I, D], [I, D], [D, I]] or any(t.dtype != dtype for t in shared)
            or any(not t.is_contiguous() for t in shared)):
        raise ValueError(f"fused_moe: shared expert {[list(t.shape) for t in shared]}: expected contiguous "
                         f"[{I}, {D}], [{I}, {D}], [{D}, {I}] in x's dtype {dtype}")


def fused_moe(x, ids, route_w, gate, up, down, configs=None, variant=None, shared=None, planes=None):
    """Routed experts in one pass over each distinct expert's weights:
    y[n] = sum_k route_w[n, k] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, k].

    x [N, D] (bf16, fp16 or fp32: the compute dtype; the tile variant rounds dequantized weights to
    it, the GEMV variant multiplies them in fp32), ids int [N, K] in [0, E) (not checked: that would
    read the device), route_w [N, K] (any float; used in fp32), gate / up / down: ExpertWeights of
    [E, I, D], [E, I, D], [E, D, I]. Returns [N, D] in x's dtype. variant: "gemv" (CUDA-core
    products, for a few tokens), "dot" (tiles of BLOCK_M pairs through tl.dot) or None (gemv_rule).
    configs: override the variant's block sizes (the benchmark's sweep). shared: (gate [I, D], up
    [I, D], down [D, I]) tensors in x's dtype, a shared expert added to every token with weight 1,
    in the same launches (INT4 and FP8 experts through the GEMV variant only: the bf16 shared expert of
    Kimi-K2.5, and of Kimi-K2-Instruct's FP8 checkpoint, dequantized at load). planes: x already as
    the INT4 GEMV's activation planes (nibble_planes; router_topk writes them beside its logits), read
    instead of permuting x again; the other variants and formats ignore them."""
    if x.dim() != 2 or ids.shape != route_w.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: x {list(x.shape)}, ids {list(ids.shape)}, route_w {list(route_w.shape)}: "
                         "expected [N, D], [N, K], [N, K]")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or ids.dtype.is_floating_point:
        raise ValueError(f"fused_moe: x must be bf16, fp16 or fp32 (got {x.dtype}), ids integers (got {ids.dtype})")
    (N, D), K = x.shape, ids.shape[1]
    fmt, E, I = _check_weights(gate, up, down, D)
    P, dev = N * K, x.device
    if any(t is not None and t.device != dev for t in (ids, route_w, gate.data, gate.scale, up.data, up.scale,
                                                        down.data, down.scale, *(shared or ()))):
        raise ValueError(f"fused_moe: every input must be on x's device {dev}")
    variant = variant or gemv_rule(fmt, N, K)
    if variant not in ("gemv", "dot") or (variant == "gemv" and P > GEMV_MAX_PAIRS):
        raise ValueError(f"fused_moe: variant {variant!r} for {P} token-expert pairs: 'dot', or 'gemv' up to "
                         f"{GEMV_MAX_PAIRS} pairs")
    if shared is not None:
        _check_shared(shared, fmt, variant, I, D, x.dtype)
    if planes is not None:
        _check_planes(planes, x)
    x, ids, route_w = x.contiguous(), ids.reshape(-1).contiguous(), route_w.reshape(-1).float().contiguous()
    if variant == "gemv":
        cfg = {**_gemv_configs(fmt, N, x.is_cuda), **(configs or {})}
        return _fused_moe_gemv(x, ids, route_w, gate, up, down, fmt, cfg, shared, planes)
    cfg = {**_configs(fmt, P, x.is_cuda), **(configs or {})}
    max_tiles = min(E, P) + P // BLOCK_M                                    # see the section comment
    sorted_pair = torch.empty(max_tiles * BLOCK_M, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](ids, sorted_pair, tile_expert, P, E, max_tiles, triton.cdiv(P, BLOCK_M),
                            BLOCK_M=BLOCK_M, E_PAD=triton.next_power_of_2(E), CHUNK=ALIGN_CHUNK, num_warps=8,
                            launch_pdl=PDL)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: exact products, not tf32; else unused
    bn, bk, warps, stages = cfg["gate_up"]
    h = torch.empty(max_tiles * BLOCK_M, I, dtype=x.dtype, device=dev)          # [rows, I]
    gs, strides, quant, per_row = _weight_args(gate, bk)
    _moe_gate_up_kernel[(triton.cdiv(I, bn), max_tiles)](
        x, h, sorted_pair, tile_expert, gate.data, gs, up.data, _weight_args(up, bk)[0], P, K, D, I, *strides, *quant,
        FMT=FORMATS[fmt], BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, SCALE_PER_ROW=per_row, PRECISION=precision,
        launch_pdl=PDL, num_warps=warps, num_stages=stages)
    bn, bk, warps, stages = cfg["down"]
    y = torch.empty(P, D, dtype=torch.float32, device=dev)                      # [P, D], weighted
    ds, strides, quant, per_row = _weight_args(down, bk)
    _moe_down_kernel[(triton.cdiv(D, bn), max_tiles)](
        h, y, sorted_pair, tile_expert, route_w, down.data, ds, P, D, I, *strides, *quant,
        FMT=FORMATS[fmt], BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, SCALE_PER_ROW=per_row, PRECISION=precision,
        launch_pdl=PDL, num_warps=warps, num_stages=stages)
    out = torch.empty(N, D, dtype=x.dtype, device=dev)
    _moe_combine_kernel[(N, triton.cdiv(D, COMBINE_BLOCK))](y, out, D, K, BLOCK_D=COMBINE_BLOCK, num_warps=4,
                                                            launch_pdl=PDL)
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
# A bf16 shared expert beside quantized experts (INT4 and FP8: fused_moe's shared) rides in the same
# two launches: SHARED_SPLIT more programs a row block of gate_up compute its gate and up over slices
# of D for every token (_shared_gate_up); the last of them to finish (an atomic counter a row block,
# as norm_gemv's) adds the splits in split order and stores h = silu(g) * u once, fp32 [N, I]
# (_shared_h), and each down program adds its rows from that one vector a token (_shared_down).
# INT4 without unpacking to natural order: nibble j of word w is element 8w + j, so the activation
# comes as 8 planes (plane j = elements 8w + j, contiguous in w: x is permuted once per call, or
# the router kernel wrote them beside its logits; h is written that way by gate_up) and each plane
# meets nibble j of the same words. A nibble becomes a float by the exponent trick (_nibble), and
# the group scale multiplies each word's 8 products once.
# The INT4 kernels are their own (see above _nibble): whole 16-byte words a thread, unmasked where
# the shapes divide, the next step's words in flight, down's K experts in one tile.

# Block sizes by format and token count: (small, large) up to / above GEMV_SMALL_TOKENS, each
# dict(gate_up=(BLOCK_N, BLOCK_K, UNROLL, num_warps, SUB), down=(BLOCK_N, BLOCK_K, num_warps, SUB));
# INT4: dict(gate_up=(BLOCK_N, BLOCK_W words a step, num_warps), down=(BLOCK_N, BLOCK_C words a step
# over the K experts side by side, num_warps)). A program's tile has BLOCK_N * SUB rows of
# BLOCK_K: SUB > 1 (FP8 only) lays SUB consecutive 128-column scale blocks of a weight row out as
# rows of their own, so a step is one scale per tile row and still 32 threads a weight row (at
# decode only 2048 gate/up rows exist: 8 threads a row, as a one-block step gives, made 512 warps
# for 132 SMs, issue-bound at 1 TB/s on the H200). From `python kernels_bench.py --moe --sweep gemv` on an
# H200 (2026-11-29, BENCHMARKS.md, k4): bf16 gate_up 8 rows at decode (30.1 against 33.2 us with 4; see below),
# 4 rows of 256 from 4 tokens (99.1 against 114.3 us); FP8 down 16 rows (23.5 against 27.9 us at
# decode, 69.5 against 79.7 at 4 tokens). INT4 (2026-12-01, issue 25, us a layer at 1 / 3 tokens):
# gate_up 1 row of 128 words (21.3 / 41.2 against 22.0 / 44.2 with 2 rows, 26.0 / 50.7 with steps of
# 256 words); down 4 rows of 128 (23.2 / 51.2 against 23.5 / 50.1 with 8 rows of 256 on 2 warps, which
# with the shared expert in the launch shuffles its tiles through shared memory). bf16 at decode with the
# shared expert as a 9th pair (2026-12-01, benchmarks/h200_s8_sweep2.log, us): gate_up 4 rows, one step
# of 512 in flight (19.0 against 28.0 with 8 rows and two; likely: with two its registers let fewer of
# its 288 programs share an SM; 8 pairs 17.8 against 18.3), down 8 rows (9.8 against 10.4).
GEMV_CONFIGS = {
    "plain": (dict(gate_up=(4, 512, 1, 4, 1), down=(8, 256, 4, 1)),
              dict(gate_up=(4, 256, 4, 4, 1), down=(16, 256, 4, 1))),
    "fp8": (dict(gate_up=(4, 128, 2, 4, 4), down=(16, 128, 4, 2)),) * 2,
    "int4": (dict(gate_up=(1, 128, 1), down=(4, 128, 1)),) * 2}
GEMV_SMALL_TOKENS = 2   # in tokens, not pairs: a shared expert's extra slot a token moves no boundary
# The GEMV variant up to this many tokens (the rule of fused_moe's variant=None; in tokens, not pairs,
# so a shared expert routed as one more slot a token moves no boundary), from the same run at K = 8
# (us a layer, GEMV against tiles): bf16 30 / 46 at N = 1, 98 / 97 at 4, 177 / 188 at 8, 630 / 527 at
# 32; FP8 28 / 75 at 1, 80 / 82 at 4, 148 / 144 at 8; INT4 faster at every N up to 32 (629 / 836).
# In the model (run.py, bf16, 2026-11-29) the rule at 8 lost from 3 tokens on: with the shared expert
# folded in (SharedExpertInLaunch) every token picks expert E, so E's leader program runs
# N passes one after another while the others run one; the tiles (k3) measured 10.02 -> 9.91,
# 11.84 -> 11.14, 14.19 -> 13.50 ms for verify of 3, 4, 5 tokens, and tied at 2. Hence 2 for bf16.
GEMV_MAX_TOKENS = {"plain": 2, "fp8": 4, "int4": 32}
GEMV_MAX_PAIRS = 1024   # the leader test holds all N*K expert ids of a call in one vector


def _gemv_configs(fmt, N, on_gpu):
    if not on_gpu:  # the CPU interpreter: few, large programs
        if fmt == "int4":
            return dict(gate_up=(32, 8, 4), down=(64, 32, 4))
        return dict(gate_up=(32, 64, 1, 4, 1), down=(64, 64, 4, 1))
    return GEMV_CONFIGS[fmt][N > GEMV_SMALL_TOKENS]


@_jit
def _gemv_step(acc, v_ptr, k0, K_IN, w_ptr, s_ptr, n, kb, n_ok, stride_wn, stride_sr, stride_sc, off_r, off_c,
               FMT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               SCALE_PER_ROW: tl.constexpr):
    """acc [R, BLOCK_K] fp32 += W[n, k] * v[k] elementwise for tile row r: n[r], k = k0 + kb[r] + [0, BLOCK_K)
    (summed over k by the caller). kb: [R] column offsets (FP8 sub-blocks) or 0. Plain and FP8 (INT4 has
    kernels of its own below).

    v_ptr: the activation row [K_IN]. w_ptr, s_ptr: one expert's weight and scale (ExpertWeights layouts)."""
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
def _expert_pairs(ids_ptr, p, P, P_PAD: tl.constexpr):
    """The pairs of pair p's expert: (same [P_PAD] bool, rank [P_PAD]: each one's place among them,
    leader: p is the first of them)."""
    q = tl.arange(0, P_PAD)
    same = tl.load(ids_ptr + q, mask=q < P, other=-1) == tl.load(ids_ptr + p)
    return same, tl.cumsum(same.to(tl.int32), 0) - 1, tl.min(tl.where(same, q, P_PAD), 0) == p


@_jit
def _shared_gate_up(x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, p, pid_n, D: tl.constexpr,
                    I: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN: tl.constexpr):
    """The bf16 shared expert's gate and up rows of row block pid_n (BLOCK_N rows of I) over split
    s = p + SPLIT of D, for every token: raw sums into part [2, SPLIT, N, I] fp32; the row block's last
    split to finish makes h = silu(g) * u of them into hs [N, I] fp32 (_shared_h; count_ptr: the
    counters, one a row block). D / SPLIT columns a split (SHARED_SPLIT makes it about as many bytes a
    program as a routed expert's quantized rows). x_ptr: the activations [N, D]; sg_ptr, su_ptr: the
    shared gate and up weights [I, D]. The GEMV kernels run it in SPLIT programs of their own for each
    row block, numbered first (pair numbers p in [-SPLIT, 0)) and so launched first, since each runs
    its N tokens one after another."""
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
def _shared_h(part_ptr, hs_ptr, count_ptr, N, pid_n, n, n_ok, I: tl.constexpr, SPLIT: tl.constexpr):
    """Once this split's partial sums are stored: the last of row block pid_n's SPLIT programs to finish
    adds every split's g and u (part [2, SPLIT, N, I]) in split order and stores h = silu(g) * u into
    hs [N, I] at rows n, for every token; it resets the row block's counter count_ptr[pid_n] to 0."""
    tl.debug_barrier()                                  # every thread's stores before the counter's release
    if tl.atomic_add(count_ptr + pid_n, 1) == SPLIT - 1:   # the other splits are stored: add them
        tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")
        for t in range(N):
            g = tl.zeros(n.shape, tl.float32)
            u = tl.zeros(n.shape, tl.float32)
            for s in tl.static_range(SPLIT):            # in split order (.cg: from L2, never a stale L1 line)
                g += tl.load(part_ptr + (s * N + t) * I + n, mask=n_ok, other=0.0, cache_modifier=".cg")
                u += tl.load(part_ptr + ((SPLIT + s) * N + t) * I + n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(hs_ptr + t * I + n, g / (1.0 + tl.exp(-g)) * u, mask=n_ok)


@_jit
def _shared_down(hs_ptr, sd_ptr, token, n, n_ok, I: tl.constexpr, I_PAD: tl.constexpr):
    """The bf16 shared expert's down rows n for one token, fp32 [BLOCK_N]: its down weights sd_ptr
    [D, I] times the token's h = silu(g) * u, row `token` of gate_up's hs [N, I] fp32 (_shared_h;
    I_PAD: a power of two >= I)."""
    i = tl.arange(0, I_PAD)[None, :]
    h = tl.load(hs_ptr + token * I + i, mask=i < I, other=0.0)
    wt = tl.load(sd_ptr + n[:, None] * I + i, mask=n_ok[:, None] & (i < I), other=0.0).to(tl.float32)
    return tl.sum(wt * h, 1)


@_jit
def _moe_gemv_gate_up_kernel(v_ptr, h_ptr, ids_ptr, route_w_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, P,
                             stride_we, stride_wn, stride_se, stride_sr, stride_sc, off_r, off_c,
                             TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                             P_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                             UNROLL: tl.constexpr, SCALE_PER_ROW: tl.constexpr, part_ptr, hs_ptr, count_ptr,
                             sg_ptr, su_ptr, N, SPLIT: tl.constexpr, SHARED_K: tl.constexpr,
                             EVEN_SHARED: tl.constexpr):
    """h[p, i] = silu(gate[e] @ x[n]) * (up[e] @ x[n]) * route_w[p] for pair p = n*K + k, e = ids[p]
    (plain and FP8 weights).

    v_ptr: the activations [N, D] (x's dtype). h_ptr: fp32 [P, I] out. ids_ptr: int [P]; route_w_ptr:
    fp32 [P]. g_ptr / u_ptr, gs_ptr / us_ptr: gate and up weights and scales, [E, I, D] as
    ExpertWeights (same strides). P_PAD: a power of two >= P. Grid: (cdiv(I, BLOCK_N), SPLIT + P);
    pair p is program SPLIT + p, and only a leader program works. SPLIT > 0: the first SPLIT programs
    of each row block take a bf16 shared expert (_shared_gate_up; part_ptr, hs_ptr, count_ptr, sg_ptr,
    su_ptr, N: its arguments; SHARED_K columns a step)."""
    _wait_for_prior()
    pid_n, p = tl.program_id(0), tl.program_id(1) - SPLIT
    if SPLIT > 0:
        if p < 0:
            _shared_gate_up(v_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, p, pid_n, D, I, SPLIT, BLOCK_N,
                            SHARED_K, EVEN_SHARED)
            return
    same, rank, leader = _expert_pairs(ids_ptr, p, P, P_PAD)
    if not leader:
        return                                                              # not the expert's first pair
    q = tl.arange(0, P_PAD)
    e = tl.load(ids_ptr + p).to(tl.int64)
    g_ptr, u_ptr = g_ptr + e * stride_we, u_ptr + e * stride_we
    gs_ptr, us_ptr = gs_ptr + e * stride_se, us_ptr + e * stride_se
    r = tl.arange(0, BLOCK_N * SUB)                                         # tile rows: (row of I, sub-block)
    n, kb = pid_n * BLOCK_N + r // SUB, (r % SUB) * BLOCK_K
    n_ok = n < I
    for c in range(tl.sum(same.to(tl.int32), 0)):                          # each pair of the expert
        pair = tl.sum(tl.where(same & (rank == c), q, 0), 0)
        v = v_ptr + (pair // TOPK).to(tl.int64) * D
        acc_g = tl.zeros([BLOCK_N * SUB, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N * SUB, BLOCK_K], tl.float32)
        for k0 in range(0, D, BLOCK_K * SUB * UNROLL):
            for s in tl.static_range(UNROLL):                               # independent loads in flight
                k1 = k0 + s * BLOCK_K * SUB
                acc_g = _gemv_step(acc_g, v, k1, D, g_ptr, gs_ptr, n, kb, n_ok, stride_wn, stride_sr, stride_sc,
                                   off_r, off_c, FMT, BLOCK_K, BLOCK_R, BLOCK_C, SCALE_PER_ROW)
                acc_u = _gemv_step(acc_u, v, k1, D, u_ptr, us_ptr, n, kb, n_ok, stride_wn, stride_sr, stride_sc,
                                   off_r, off_c, FMT, BLOCK_K, BLOCK_R, BLOCK_C, SCALE_PER_ROW)
        g, u = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
        if SUB > 1:                                                         # the sub-blocks of each row
            g, u = tl.sum(tl.reshape(g, [BLOCK_N, SUB]), 1), tl.sum(tl.reshape(u, [BLOCK_N, SUB]), 1)
        h = g / (1.0 + tl.exp(-g)) * u * tl.load(route_w_ptr + pair)
        i = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(h_ptr + pair.to(tl.int64) * I + i, h, mask=i < I)


@_jit
def _moe_gemv_down_kernel(h_ptr, out_ptr, ids_ptr, w_ptr, s_ptr,
                          stride_we, stride_wn, stride_se, stride_sr, stride_sc, off_r, off_c,
                          TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                          SCALE_PER_ROW: tl.constexpr, hs_ptr, sd_ptr, SHARED: tl.constexpr, I_PAD: tl.constexpr):
    """out[n, d] = sum_k (down[e] @ h[n*K + k])[d], e = ids[n*K + k] (route weights are in h; plain and FP8).

    h_ptr: fp32 [P, I] from gate_up. out_ptr: [N, D], x's dtype. w_ptr / s_ptr: down weights and
    scales, [E, D, I] as ExpertWeights. SHARED: a bf16 shared expert too, weight 1 (_shared_down; hs_ptr,
    sd_ptr: its arguments).
    Grid: (N, cdiv(D, BLOCK_N))."""
    _wait_for_prior()
    token, pid_n = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BLOCK_N * SUB)
    n, kb = pid_n * BLOCK_N + r // SUB, (r % SUB) * BLOCK_K
    n_ok = n < D
    acc = tl.zeros([BLOCK_N * SUB, BLOCK_K], tl.float32)
    for k in tl.static_range(TOPK):                                         # the token's K experts
        pair = token * TOPK + k
        e = tl.load(ids_ptr + pair).to(tl.int64)
        for k0 in tl.static_range(0, I, BLOCK_K * SUB):
            acc = _gemv_step(acc, h_ptr + pair.to(tl.int64) * I, k0, I, w_ptr + e * stride_we, s_ptr + e * stride_se,
                             n, kb, n_ok, stride_wn, stride_sr, stride_sc, off_r, off_c,
                             FMT, BLOCK_K, BLOCK_R, BLOCK_C, SCALE_PER_ROW)
    y = tl.sum(acc, 1)
    if SUB > 1:
        y = tl.sum(tl.reshape(y, [BLOCK_N, SUB]), 1)
    d = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SHARED:
        y += _shared_down(hs_ptr, sd_ptr, token, d, d < D, I, I_PAD)
    tl.store(out_ptr + token.to(tl.int64) * D + d, y.to(out_ptr.dtype.element_ty), mask=d < D)


# INT4 GEMV kernels. A weight tile is [rows, words] (word w holds elements 8w..8w+7); with one warp a
# program and 128 words a step (the defaults) each thread holds the same 4 words (a 16-byte load) of
# every row of the tile, so the activation planes loaded for its words serve all of its rows, gate's
# and up's, in the tile's own layout (sm_90 code checked: no shuffle through shared memory in a step).
# Where the shapes divide the blocks (EVEN, Kimi-K2's) no load is masked: a masked load zeroes its
# destination registers first, one move a word. gate_up issues the next step's words before it
# unpacks this step's (Triton pipelines only loads that feed tl.dot). down lays the token's K experts
# side by side as columns of one tile, so all of their words are in flight at once instead of one
# expert after another.

@_jit
def _nibble(words, high, J: tl.constexpr, magic):
    """(nibble J of each word) - 8 in fp32, exactly: the nibble ORed into the mantissa of 2^23 is the
    float 2^23 + nib * 2^b (b its bit position), and one FMA scales and subtracts. A float's mantissa
    has 23 bits: nibbles 5-7 come from high = words >> 12 (bits 8-19). magic: 0x4B000000, the bits of
    2^23, passed at run time so that the AND and the OR compile to one instruction (LOP3 takes one
    immediate: with both constants known, the sm_90 code had two a nibble)."""
    if J < 5:
        f = ((words & (15 << (4 * J))) | magic).to(tl.float32, bitcast=True)
        return f * (1.0 / (1 << (4 * J))) - (8388608.0 / (1 << (4 * J)) + 8.0)
    else:
        f = ((high & (15 << (4 * J - 12))) | magic).to(tl.float32, bitcast=True)
        return f * (1.0 / (1 << (4 * J - 12))) - (8388608.0 / (1 << (4 * J - 12)) + 8.0)


@_jit
def _int4_tile(w_ptr, s_ptr, rows_ok, w, W: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """One step of one INT4 matrix: words [R, BW] and their group scales (fp32), read at word columns
    w [BW] of the rows whose pointers are w_ptr, s_ptr [R, 1]."""
    g = (w * 8 // GROUP)[None, :]
    if EVEN:
        return tl.load(w_ptr + w[None, :]), tl.load(s_ptr + g).to(tl.float32)
    ok = rows_ok[:, None] & (w < W)[None, :]
    return tl.load(w_ptr + w[None, :], mask=ok, other=0), tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)


@_jit
def _plane(ptrs, J: tl.constexpr, PLANE: tl.constexpr, ok, EVEN: tl.constexpr):
    """Activation plane J (elements 8w + J) at words w as [1, BW] fp32; ptrs [BW]: plane 0's words, PLANE
    words apart. Loaded 2-d, so it comes in the weight tile's own layout (a 1-d load took another and
    a shuffle through shared memory a plane, seen in the compiled code)."""
    if EVEN:
        return tl.load((ptrs + J * PLANE)[None, :])
    return tl.load((ptrs + J * PLANE)[None, :], mask=ok[None, :], other=0.0)


@_jit
def _gate_up_words(g_rows, gs_rows, u_rows, us_rows, n_ok, start, W: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_W: tl.constexpr, EVEN: tl.constexpr):
    """Gate's and up's words and scales of the BLOCK_W words at `start` (masked unless EVEN)."""
    w = start + tl.arange(0, BLOCK_W)
    gw, gs = _int4_tile(g_rows, gs_rows, n_ok, w, W, GROUP, EVEN)
    uw, us = _int4_tile(u_rows, us_rows, n_ok, w, W, GROUP, EVEN)
    return gw, gs, uw, us


@_jit
def _gate_up_products(gw, gs, uw, us, v, start, magic, W: tl.constexpr, BLOCK_W: tl.constexpr, EVEN: tl.constexpr):
    """One step's scaled products [R, BLOCK_W] of gate and up (each word's 8 summed), v: the planes."""
    w = start + tl.arange(0, BLOCK_W)
    g_high, u_high = gw >> 12, uw >> 12
    t_g = tl.zeros(gw.shape, tl.float32)
    t_u = tl.zeros(uw.shape, tl.float32)
    for j in tl.static_range(8):
        x = _plane(v + w, j, W, w < W, EVEN)
        t_g += _nibble(gw, g_high, j, magic) * x
        t_u += _nibble(uw, u_high, j, magic) * x
    return t_g * gs, t_u * us


@_jit
def _moe_gemv_int4_gate_up_kernel(v_ptr, h_ptr, ids_ptr, route_w_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, P,
                                  stride_we, stride_wn, stride_se, stride_sr, magic, x_ptr, part_ptr, hs_ptr,
                                  count_ptr, sg_ptr, su_ptr, N,
                                  TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, GROUP: tl.constexpr,
                                  P_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                                  EVEN: tl.constexpr, SPLIT: tl.constexpr, SHARED_K: tl.constexpr,
                                  EVEN_SHARED: tl.constexpr):
    """_moe_gemv_gate_up_kernel for INT4 weights: v_ptr the activations as fp32 planes [N, 8, D/8]
    (plane j = elements 8w + j), h written in plane order (element i of row p at (i % 8) * I/8 + i // 8),
    the planes down reads. BLOCK_W words (8 BLOCK_W elements) a step; EVEN: the blocks divide I and D/8,
    so no load is masked. Grid: (cdiv(I, BLOCK_N), SPLIT + P): the first SPLIT programs of each row block take
    the bf16 shared expert (_shared_gate_up; x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N: its
    arguments; SPLIT 0: none; SHARED_K bf16 columns a step), launched first since each runs its N tokens
    one after another; pair p is program SPLIT + p."""
    _wait_for_prior()
    pid_n, p = tl.program_id(0), tl.program_id(1) - SPLIT
    if SPLIT > 0:
        if p < 0:
            _shared_gate_up(x_ptr, part_ptr, hs_ptr, count_ptr, sg_ptr, su_ptr, N, p, pid_n, D, I, SPLIT, BLOCK_N,
                            SHARED_K, EVEN_SHARED)
            return
    same, rank, leader = _expert_pairs(ids_ptr, p, P, P_PAD)
    if not leader:
        return
    q = tl.arange(0, P_PAD)
    W: tl.constexpr = D // 8
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    g_rows, u_rows = g_ptr + e * stride_we + n[:, None] * stride_wn, u_ptr + e * stride_we + n[:, None] * stride_wn
    gs_rows, us_rows = gs_ptr + e * stride_se + n[:, None] * stride_sr, us_ptr + e * stride_se + n[:, None] * stride_sr
    for c in range(tl.sum(same.to(tl.int32), 0)):                          # each pair of the expert
        pair = tl.sum(tl.where(same & (rank == c), q, 0), 0)
        v = v_ptr + (pair // TOPK).to(tl.int64) * D
        acc_g = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
        gw, gs, uw, us = _gate_up_words(g_rows, gs_rows, u_rows, us_rows, n_ok, 0, W, GROUP, BLOCK_W, EVEN)
        for w0 in range(0, W, BLOCK_W):
            # the next step's words, in flight while this one is unpacked (EVEN: the last step reloads its
            # own, so no load needs a mask or a branch; two steps ahead measured slower, 23.5 against 21.3 us)
            start = w0 + BLOCK_W
            if EVEN:
                start = tl.minimum(start, W - BLOCK_W)
            gw1, gs1, uw1, us1 = _gate_up_words(g_rows, gs_rows, u_rows, us_rows, n_ok, start, W, GROUP, BLOCK_W,
                                                EVEN)
            pg, pu = _gate_up_products(gw, gs, uw, us, v, w0, magic, W, BLOCK_W, EVEN)
            acc_g += pg
            acc_u += pu
            gw, gs, uw, us = gw1, gs1, uw1, us1
        g, u = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
        h = g / (1.0 + tl.exp(-g)) * u * tl.load(route_w_ptr + pair)
        tl.store(h_ptr + pair.to(tl.int64) * I + (n % 8) * (I // 8) + n // 8, h, mask=n_ok)


@_jit
def _moe_gemv_int4_down_kernel(h_ptr, out_ptr, ids_ptr, w_ptr, s_ptr, stride_we, stride_wn, stride_se, stride_sr, magic,
                               hs_ptr, sd_ptr,
                               TOPK: tl.constexpr, D: tl.constexpr, I: tl.constexpr, GROUP: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr,
                               SHARED: tl.constexpr, I_PAD: tl.constexpr):
    """_moe_gemv_down_kernel for INT4 weights, h in plane order (gate_up's). A tile's columns are the
    token's K experts' words side by side (column c: expert slot c // (I/8), word c % (I/8)), BLOCK_C
    columns a step. SHARED: the bf16 shared expert too, weight 1 (_shared_down: gate_up's h = silu(g) * u
    hs [N, I] fp32 times its down weights sd_ptr [D, I]; I_PAD: a power of two >= I).
    Grid: (N, cdiv(D, BLOCK_N))."""
    _wait_for_prior()
    token, pid_n = tl.program_id(0), tl.program_id(1)
    W: tl.constexpr = I // 8
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    acc = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    for c0 in tl.static_range(0, TOPK * W, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        pair = token * TOPK + c // W
        w = c % W
        if EVEN:
            e = tl.load(ids_ptr + pair).to(tl.int64)
            words = tl.load(w_ptr + e[None, :] * stride_we + n[:, None] * stride_wn + w[None, :])
            s = tl.load(s_ptr + e[None, :] * stride_se + n[:, None] * stride_sr + (w * 8 // GROUP)[None, :])
        else:
            c_ok = c < TOPK * W
            ok = n_ok[:, None] & c_ok[None, :]
            e = tl.load(ids_ptr + pair, mask=c_ok, other=0).to(tl.int64)
            words = tl.load(w_ptr + e[None, :] * stride_we + n[:, None] * stride_wn + w[None, :], mask=ok, other=0)
            s = tl.load(s_ptr + e[None, :] * stride_se + n[:, None] * stride_sr + (w * 8 // GROUP)[None, :],
                        mask=ok, other=0.0)
        high = words >> 12
        h_row = h_ptr + pair.to(tl.int64) * I + w                          # plane j at + j * W
        t = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
        for j in tl.static_range(8):
            t += _nibble(words, high, j, magic) * _plane(h_row, j, W, c < TOPK * W, EVEN)
        acc += t * s.to(tl.float32)
    y = tl.sum(acc, 1)
    if SHARED:
        y += _shared_down(hs_ptr, sd_ptr, token, n, n_ok, I, I_PAD)
    tl.store(out_ptr + token.to(tl.int64) * D + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def _gemv_args(w, block_k, sub):
    """_weight_args for the GEMV kernels: strides, row/column offsets, and the constexprs (block
    sizes, per-row scale, SUB: 1 where the scale is not one per row and step)."""
    scale, strides, (br, bc, off_r, off_c, group), per_row = _weight_args(w, block_k)
    # one scale per row and step only where every step is whole: the FP8 graph test (128x128 blocks over
    # a 64 x 32 matrix, steps mostly masked) read NaN on the H200 through that path, not through this
    # fallback (one scale an element, tested on the GPU with masked steps); not reproduced on the CPU
    per_row = per_row and w.shape[2] % (block_k * sub) == 0
    return scale, strides, (off_r, off_c), dict(BLOCK_R=br, BLOCK_C=bc, SCALE_PER_ROW=per_row,
                                                SUB=sub if per_row else 1)


MAGIC = 0x4B000000   # the bits of the float 2^23 (_nibble)
SHARED_SPLIT = {"int4": 4, "fp8": 2}   # a bf16 shared expert's gate and up split over D in this many programs a
#                                        row block: bf16 is 4x INT4's bytes, 2x FP8's


def _shared_args(shared, fmt, N, I, D, block_n, warps, placeholder):
    """The GEMV launches' keyword arguments for fused_moe's shared expert: (gate_up's, down's); none
    there: SPLIT 0, SHARED False and `placeholder` for the pointers (never read). block_n, warps:
    gate_up's; each of its row blocks takes one of the shared counters."""
    dev = placeholder.device
    if shared and triton.cdiv(I, block_n) > COUNTERS:
        raise ValueError(f"fused_moe: the shared expert's {I} rows make more than {COUNTERS} row blocks of {block_n}")
    split = SHARED_SPLIT[fmt] if shared else 0
    part = torch.empty(2, split, N, I, dtype=torch.float32, device=dev) if shared else placeholder
    hs = torch.empty(N, I, dtype=torch.float32, device=dev) if shared else placeholder    # silu(g) * u
    sg, su, sd = shared or (placeholder,) * 3
    count = _counters(dev) if shared else placeholder
    step = max(16, 256 * warps // block_n)                   # columns a step: 16 bytes of bf16 a thread
    even = bool(split) and I % block_n == 0 and D % (split * step) == 0
    gate_up = dict(part_ptr=part, hs_ptr=hs, count_ptr=count, sg_ptr=sg, su_ptr=su, N=N, SPLIT=split, SHARED_K=step,
                   EVEN_SHARED=even)
    return gate_up, dict(hs_ptr=hs, sd_ptr=sd, SHARED=bool(shared), I_PAD=triton.next_power_of_2(I))


def nibble_planes(x, out=None):
    """x [N, D] as the INT4 GEMV kernels read an activation: 8 fp32 planes [N, 8, D/8], plane j =
    elements 8w + j (a torch copy, one launch), into `out` where given."""
    N, D = x.shape
    out = torch.empty(N, 8, D // 8, dtype=torch.float32, device=x.device) if out is None else out
    return out.copy_(x.reshape(N, D // 8, 8).transpose(1, 2))


def _check_planes(planes, x):
    """fused_moe's and router_topk's planes: an fp32 [N, 8, D/8] contiguous tensor on x's device."""
    N, D = x.shape
    if (D % 8 or planes.shape != (N, 8, D // 8) or planes.dtype != torch.float32 or not planes.is_contiguous()
            or planes.device != x.device):
        raise ValueError(f"planes must be a contiguous float32 [{N}, 8, {D // 8}] tensor on {x.device} for x "
                         f"{list(x.shape)} (D a multiple of 8), got {planes.dtype} {list(planes.shape)} on "
                         f"{planes.device}")


def _fused_moe_gemv_int4(x, ids, route_w, gate, up, down, cfg, shared=None, planes=None):
    """The GEMV variant for INT4 weights (see _fused_moe_gemv); shared, planes: fused_moe's."""
    (N, D), P, I, dev = x.shape, ids.numel(), gate.shape[1], x.device
    K = P // N
    v = nibble_planes(x) if planes is None else planes
    h = torch.empty(P, I, dtype=torch.float32, device=dev)                  # [P, I], route weight in
    bn, bw, warps = cfg["gate_up"]
    sh_gate_up, sh_down = _shared_args(shared, "int4", N, I, D, bn, warps, h)
    s = gate.data.stride(), gate.scale.stride()
    _moe_gemv_int4_gate_up_kernel[(triton.cdiv(I, bn), sh_gate_up["SPLIT"] + P)](
        v, h, ids, route_w, gate.data, gate.scale, up.data, up.scale, P, s[0][0], s[0][1], s[1][0], s[1][1], MAGIC,
        x, TOPK=K, D=D, I=I, GROUP=gate.group, P_PAD=max(16, triton.next_power_of_2(P)),
        BLOCK_N=bn, BLOCK_W=bw, EVEN=I % bn == 0 and D % (8 * bw) == 0, **sh_gate_up, launch_pdl=PDL, num_warps=warps)
    bn, bc, warps = cfg["down"]
    out = torch.empty(N, D, dtype=x.dtype, device=dev)
    s = down.data.stride(), down.scale.stride()
    _moe_gemv_int4_down_kernel[(N, triton.cdiv(D, bn))](
        h, out, ids, down.data, down.scale, s[0][0], s[0][1], s[1][0], s[1][1], MAGIC,
        TOPK=K, D=D, I=I, GROUP=down.group, BLOCK_N=bn, BLOCK_C=bc, EVEN=D % bn == 0 and K * I // 8 % bc == 0,
        **sh_down, launch_pdl=PDL, num_warps=warps)
    return out


def _fused_moe_gemv(x, ids, route_w, gate, up, down, fmt, cfg, shared=None, planes=None):
    """The GEMV variant (see its section); arguments as fused_moe's, already checked and flattened."""
    if fmt == "int4":
        return _fused_moe_gemv_int4(x, ids, route_w, gate, up, down, cfg, shared, planes)
    (N, D), P, I, dev = x.shape, ids.numel(), gate.shape[1], x.device
    K = P // N
    bn, bk, unroll, warps, sub = cfg["gate_up"]
    h = torch.empty(P, I, dtype=torch.float32, device=dev)                  # [P, I], route weight in
    gs, strides, offs, const = _gemv_args(gate, bk, sub)
    sh_gate_up, sh_down = _shared_args(shared, fmt, N, I, D, bn, warps, h)
    _moe_gemv_gate_up_kernel[(triton.cdiv(I, bn), sh_gate_up["SPLIT"] + P)](
        x, h, ids, route_w, gate.data, gs, up.data, _weight_args(up, bk)[0], P, *strides, *offs,
        TOPK=K, D=D, I=I, FMT=FORMATS[fmt], P_PAD=max(16, triton.next_power_of_2(P)), BLOCK_N=bn, BLOCK_K=bk,
        UNROLL=unroll, **const, **sh_gate_up, launch_pdl=PDL, num_warps=warps)
    bn, bk, warps, sub = cfg["down"]
    out = torch.empty(N, D, dtype=x.dtype, device=dev)
    ds, strides, offs, const = _gemv_args(down, bk, sub)
    _moe_gemv_down_kernel[(N, triton.cdiv(D, bn))](
        h, out, ids, down.data, ds, *strides, *offs, TOPK=K, D=D, I=I, FMT=FORMATS[fmt], BLOCK_N=bn, BLOCK_K=bk,
        **const, **sh_down, launch_pdl=PDL, num_warps=warps)
    return out


# ---------------------------------------------------------------------------------------------
# MLA decode step: RoPE, cache write and the absorbed attention, split over slots, then a merge
#
# The absorbed path of MLA attends in the latent space: every head's query q_lat[h] (q_nope
# times W_uk[h]) meets the one latent row per slot, which is the key and the value at once, plus
# the rotary parts:  o_lat[t, h] = sum_s softmax_s(scale * (q_lat[t,h].kv[s] + q_pe[t,h].pe[s])) kv[s]
# over slots s <= positions[t]. All H heads (and T tokens) of a batch row share the slots, so
# one program loads a tile of slots once and uses it for its whole block of M = T*H query rows
# (two small matrix products per tile). Flash-decoding: one program per (part, batch row, block
# of query rows) writes a partial output and its log-sum-exp, and a second kernel merges them, or
# (mla_merge_absorb) the launch of the W_uv product that follows does: each of its programs merges its
# head's rows itself before its product, so the merge costs no launch of its own.
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

# Block sizes, from sweeps on the H200 (BENCHMARKS.md, "MLA decode attention kernel"). BLOCK_N
# slots per tile: 64 latent rows of 512 bf16 are 64 KB; three of them in flight (num_stages 3)
# fill most of the H200's 228 KB of shared memory, so one program runs per SM at a time and the
# split rule below aims at one wave of programs. float32 (tests): half the rows, two stages.
# Query rows per program: up to 32 (T = 4 tokens x 8 heads at TP 8) keep the fp32 accumulator
# [32, 512] at 64 registers a thread over 8 warps; 8 warps also for 16 rows (28.4 against 30.3 us
# with 4 at 32768 slots, in this kernel's first form; 2026-12-01).
MLA_BLOCK_N = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
MLA_NUM_STAGES = {torch.bfloat16: 3, torch.float16: 3, torch.float32: 2}
MLA_NUM_WARPS = 8
MLA_MAX_BLOCK_M = 32
MLA_MIN_SPLIT = 64       # slots per split at least (one bf16 tile)
MLA_COMBINE_BLOCK_C = 32  # columns a merge program: 128 programs for 8 query rows. With all parts in one load (and
#                           tl.sum) the merge of 129 parts (32768 slots, B 1) took 2.7 us, the earlier two-pass
#                           combine of 128 columns (32 programs) 8.4 (2026-12-01)
MLA_COMBINE_WARPS = 1     # a merge program's tile in order is one row of 32 columns: a float a thread of one warp
#                           (with 4 warps each would hold a copy); all parts in one load: 4 warps
MLA_MERGE_IN_ORDER_PARTS = 16  # up to 16 parts the combine adds them one after another as mla_merge_absorb does
#                                (which runs only there); more, all in one load: 129 parts unrolled took ~40 s to
#                                compile (run.py at 32768 slots, 2026-12-01)
MLA_MERGE_ABSORB_REGS = 64  # float32 partials a thread of mla_merge_absorb has in flight (a K step's parts of all
#                             its rows); more parts: the combine and head_gemv, two launches. bf16 at Kimi-K2's
#                             C = 512: up to 16 parts at 1 row, 8 at 2-4 rows (960 and 448 cached slots in
#                             splits of 64). There sm_90 code takes up to 255 registers without spilling
#                             (compiled offline)
MLA_MERGE_ABSORB_MAX_ROWS = 1  # where DecodeAttentionKernel merges in W_uv's launch: the attention + merge + W_uv
#                                at 256 slots took 8.0 against 8.4 us at B 1 T 1, but 13.4 against 12.4 at T 4
#                                and 9.9 against 9.5 at B 4 (kernels_bench.py, H200, 2026-12-01)


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
    return tl.reshape(tl.join(xe * cos - xo * sin, xe * sin + xo * cos), [x_rows.shape[0], 2 * BLOCK_R2])


@_jit
def _load_rows(rows, ok, N: tl.constexpr, BLOCK: tl.constexpr):
    """Rows of N values: rows [R] pointers to each row's start, ok [R] which rows exist.
    Returns [R, BLOCK] in the pointers' dtype (padding 0)."""
    i = tl.arange(0, BLOCK)
    return tl.load(rows[:, None] + i[None, :], mask=ok[:, None] & (i < N)[None, :], other=0.0)


@_jit
def _store_rows(rows, x, ok, N: tl.constexpr):
    """Stores the first N columns of x [R, BLOCK] at rows [R] (pointers to each row's start) where ok [R]."""
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
    tl.store(lse_rows, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=ok)


@_jit
def _mla_scores(q, qpe, kv, pe, scale_log2, DOT_PRECISION: tl.constexpr):
    """The absorbed scores q [BLOCK_M, BLOCK_C] . kv [BLOCK_N, BLOCK_C] + qpe . pe (rope parts,
    [*, 2 * BLOCK_R2]), times scale_log2 (base 2): [BLOCK_M, BLOCK_N] float32."""
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
    return tl.dot(qpe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION) * scale_log2


@_jit
def _mla_new_latents(kv_rows, kpe_rows, rope_rows, w_ptr, eps, ok, C: tl.constexpr, R: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_R2: tl.constexpr):
    """The new tokens' cache rows, as model.MLA.write_cache computes them: kv_rows, kpe_rows [BLOCK_T]
    pointers to each token's latent (C values) and rope key (R), rope_rows [BLOCK_T] to its (cos,
    sin) pairs, ok [BLOCK_T] the tokens that exist. Returns the latents RMS-normalized (weight w,
    eps; [BLOCK_T, BLOCK_C]) and the keys rotated ([BLOCK_T, 2 * BLOCK_R2]), in kv's dtype."""
    dt = kv_rows.dtype.element_ty
    offs_c = tl.arange(0, BLOCK_C)
    x = _load_rows(kv_rows, ok, C, BLOCK_C).to(tl.float32)
    w = tl.load(w_ptr + offs_c, mask=offs_c < C, other=0.0).to(tl.float32)
    kv = (x / tl.sqrt(tl.sum(x * x, 1) / C + eps)[:, None] * w[None, :]).to(dt)
    return kv, _rotated(kpe_rows, rope_rows, ok, R, BLOCK_R2).to(dt)


@_jit
def _attend_cached(q, qpe, kvc_row, s_cs, pec_row, s_ps, lo, hi, scale_log2, C: tl.constexpr, R: tl.constexpr,
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
                     mask=n_ok[:, None] & c_ok[None, :], other=0.0)                     # [BLOCK_N, BLOCK_C]
        pe = tl.load(pec_row + offs_n[:, None] * s_ps + offs_r[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0)                     # [BLOCK_N, 2 * BLOCK_R2]
        s = _mla_scores(q, qpe, kv, pe, scale_log2, DOT_PRECISION)                       # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, n_ok, kv, DOT_PRECISION)
    return m_i, l_i, acc


@_jit
def _mla_decode_kernel(q_ptr, qpe_ptr, kv_ptr, kpe_ptr, w_ptr, rope_ptr, pos_ptr, kvc_ptr, pec_ptr, po_ptr, lse_ptr,
                       T, H, M, kv_len, split_len, eps, scale_log2,
                       s_qb, s_qm, s_qpb, s_qpm, s_kvb, s_kvt, s_kpb, s_kpt, s_rb, s_rt, s_posb, s_post,
                       s_cb, s_cs, s_pb, s_ps, s_pob, s_pom, s_pos, s_lb, s_lm,
                       C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R2: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """One part (see the section's head) for a block of query rows of one batch row.

    Query row m = t*H + h of row b sees the slots s < kv_len with s <= pos[b, t]; a row's T
    positions are consecutive (a decode step, a chain's verify). The new tokens come from kv
    [B, T, C] (normalized here: RMSNorm with weight w and eps) and kpe [B, T, R] (rotated here),
    the slots before pos[b, 0] from the caches kvc [B, >=kv_len, C] and pec [B, >=kv_len, R], where
    part 0's m-block 0 writes the new ones. q [B, M, C] and qpe [B, M, R] (not rotated): last
    dim contiguous, one dtype with kv, kpe and the caches; rope [B, T, R/2, 2] float32 (cos, sin);
    pos int64 [B, T]. po [B, M, parts, C] and lse [B, M, parts] float32 get the part's partial
    output and log2 of its sum (with the max; -inf where no slot), where the part holds a slot.
    Grid: (parts, B, cdiv(M, BLOCK_M))."""
    _wait_for_prior()
    part, b, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    t_m = offs_m // H
    q = _load_rows(q_ptr + b * s_qb + offs_m * s_qm, row_ok, C, BLOCK_C)                   # [BLOCK_M, BLOCK_C]
    qpe = _rotated(qpe_ptr + b * s_qpb + offs_m * s_qpm, rope_ptr + b * s_rb + t_m * s_rt, row_ok,
                   R, BLOCK_R2).to(q.dtype)                                             # [BLOCK_M, 2 * BLOCK_R2]
    if part == 0:   # the new tokens, in registers
        offs_t = tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        pos_t = tl.load(pos_ptr + b * s_posb + offs_t * s_post, mask=t_ok, other=0)            # their slots
        pos = tl.load(pos_ptr + b * s_posb + t_m * s_post, mask=row_ok, other=-1)              # [BLOCK_M]
        kv_new, pe_new = _mla_new_latents(kv_ptr + b * s_kvb + offs_t * s_kvt, kpe_ptr + b * s_kpb + offs_t * s_kpt,
                                          rope_ptr + b * s_rb + offs_t * s_rt, w_ptr, eps, t_ok,
                                          C, R, BLOCK_C, BLOCK_R2)      # [BLOCK_T, BLOCK_C], [BLOCK_T, 2 * BLOCK_R2]
        if mb == 0:     # one block of query rows writes them to their slots
            _store_rows(kvc_ptr + b * s_cb + pos_t * s_cs, kv_new, t_ok, C)
            _store_rows(pec_ptr + b * s_pb + pos_t * s_ps, pe_new, t_ok, R)
        s = _mla_scores(q, qpe, kv_new, pe_new, scale_log2, DOT_PRECISION)                     # [BLOCK_M, BLOCK_T]
        m_i, l_i, acc = _softmax_new_tokens(s, pos, pos_t, t_ok, kv_new, DOT_PRECISION)
        holds = part == 0
    else:           # cached slots [lo, hi): this split's, before the row's first new position
        lo = (part - 1) * split_len
        hi = tl.minimum(tl.minimum(tl.load(pos_ptr + b * s_posb), kv_len), lo + split_len)
        m_i, l_i, acc = _attend_cached(q, qpe, kvc_ptr + b * s_cb, s_cs, pec_ptr + b * s_pb, s_ps, lo, hi,
                                       scale_log2, C, R, BLOCK_N, DOT_PRECISION)
        holds = lo < hi
    _store_partial(po_ptr + b * s_pob + offs_m * s_pom + part * s_pos, lse_ptr + b * s_lb + offs_m * s_lm + part,
                   m_i, l_i, acc, row_ok & holds, C)


@_jit
def _parts_used(pos_first, kv_len, split_len):
    """The parts that hold a slot for a batch row whose first new position is at pos_first (a
    pointer, or a block of them): part 0 (the new tokens) and the splits of the slots before it."""
    return 1 + tl.cdiv(tl.minimum(tl.load(pos_first), kv_len), split_len)


@_jit
def _merge_latents(po_rows, lse_rows, s_pos, cols, col_ok, n_used, PARTS: tl.constexpr):
    """Flash-decoding's merge of the parts j < n_used: sum_j 2^(lse_j - L) o_j / sum_j 2^(lse_j - L),
    L = max_j lse_j, for R rows. po_rows [R, 1] point at each row's part 0 (part j is j * s_pos
    further), lse_rows [R, 1] at its log2 sum of part 0 (part j: j further); cols [1, BLOCK] the
    columns wanted (col_ok: those that exist); n_used [R, 1] <= PARTS (part 0 always holds).
    Returns [R, BLOCK] float32. The parts are added in order, j = 0, 1, ..., one explicit fma each:
    the bits follow neither the layouts the compiler picks (tl.sum's order does) nor where it
    would contract a multiply and an add, so every kernel that merges with this gets the same o.
    The loops are unrolled, all parts' loads in flight at once, and every value is [R, BLOCK] (a
    row's lse loaded in each of its columns), so no step changes layout."""
    po = po_rows + cols                                                                     # [R, BLOCK]
    lse_at = lse_rows + tl.zeros_like(cols)
    n_used = n_used + tl.zeros_like(cols)
    top = tl.full(po.shape, float("-inf"), tl.float32)
    for j in tl.static_range(PARTS):
        top = tl.maximum(top, tl.load(lse_at + j, mask=j < n_used, other=float("-inf")))
    acc = tl.zeros(po.shape, tl.float32)
    total = tl.zeros(po.shape, tl.float32)
    for j in tl.static_range(PARTS):
        w = tl.exp2(tl.load(lse_at + j, mask=j < n_used, other=float("-inf")) - top)        # 0 where unused
        acc = tl.fma(tl.load(po + j * s_pos, mask=(j < n_used) & col_ok, other=0.0), w, acc)
        total += w
    return acc / total


@_jit
def _mla_combine_kernel(po_ptr, lse_ptr, pos_ptr, o_ptr, M, kv_len, split_len,
                        s_pob, s_pom, s_pos, s_lb, s_lm, s_posb, s_ob, s_om,
                        C: tl.constexpr, BLOCK_C: tl.constexpr, PARTS: tl.constexpr, BLOCK_S: tl.constexpr,
                        IN_ORDER: tl.constexpr):
    """o[b, m] = the merge of the parts that hold a slot (part 0, the new tokens, and the splits of
    the slots before the row's first position). IN_ORDER: one part after another (_merge_latents),
    as mla_merge_absorb adds them; else all parts in one load (BLOCK_S >= PARTS) and tl.sum.
    po [B, M, PARTS, C] and lse [B, M, PARTS] float32 from _mla_decode_kernel (last dims
    contiguous); pos int64 [B, T]; o [B, M, C] (any float dtype). Grid: (B * M, cdiv(C, BLOCK_C))."""
    _wait_for_prior()
    row, cb = tl.program_id(0), tl.program_id(1)
    b, m = row // M, row % M
    if IN_ORDER:
        one = tl.zeros([1, 1], tl.int32)                                    # the program's one row, as a block
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]              # [1, BLOCK_C]
        out = _merge_latents(po_ptr + b * s_pob + m * s_pom + one, lse_ptr + b * s_lb + m * s_lm + one, s_pos,
                             offs_c, offs_c < C, _parts_used(pos_ptr + b * s_posb + one, kv_len, split_len), PARTS)
    else:
        n_used = _parts_used(pos_ptr + b * s_posb, kv_len, split_len)
        j = tl.arange(0, BLOCK_S)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        lse = tl.load(lse_ptr + b * s_lb + m * s_lm + j, mask=j < n_used, other=float("-inf"))  # [BLOCK_S]
        w = tl.exp2(lse - tl.max(lse, 0))
        part = tl.load(po_ptr + b * s_pob + m * s_pom + j[:, None] * s_pos + offs_c[None, :],
                       mask=(j < n_used)[:, None] & (offs_c < C)[None, :], other=0.0)  # [BLOCK_S, BLOCK_C]
        out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(o_ptr + b * s_ob + m * s_om + offs_c, out.to(o_ptr.dtype.element_ty), mask=offs_c < C)


@_jit
def _mla_merge_absorb_kernel(po_ptr, lse_ptr, pos_ptr, w_ptr, out_ptr, rows, T, H, N, K, kv_len, split_len,
                             s_pob, s_pom, s_pos, s_lb, s_lm, s_posb, s_wh, s_wn, s_or, s_oh,
                             PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """out[r, h, n] = sum_k o[r, h, k] * W[h, n, k] for the rows r = b*T + t, with o[r, h] the merge
    of query row m = t*H + h of batch row b, as _mla_combine_kernel stores it (rounded to W's dtype):
    the combine and head_gemv's product in one launch. Each program merges its head's rows for
    itself, from the partials in L2, a K step at a time (_merge_latents), and multiplies them by
    its BLOCK_N rows of W[h] as _norm_gemv_kernel does for head_gemv (the same steps of BLOCK_K, the
    next W tile in flight, the products added elementwise and summed over k at the end: on sm_90
    the same layouts, so the same order), so out equals head_gemv of the combine's o bit for bit.
    po [B, M, PARTS, K] and lse [B, M, PARTS] float32 from _mla_decode_kernel (last dims
    contiguous); pos int64 [B, T]; W [H, N, K] (K contiguous); out [rows, H, N] (rows strided, N
    contiguous) of W's dtype; rows <= BLOCK_M. Grid: (cdiv(N, BLOCK_N), H)."""
    _wait_for_prior()
    pid, h = tl.program_id(0), tl.program_id(1)
    r = tl.minimum(tl.arange(0, BLOCK_M), rows - 1)     # padding rows repeat the last one, not stored
    b, m = r // T, (r % T) * H + h
    po_rows = (po_ptr + b * s_pob + m * s_pom)[:, None]                                  # [BLOCK_M, 1]
    lse_rows = (lse_ptr + b * s_lb + m * s_lm)[:, None]
    n_used = _parts_used(pos_ptr + b * s_posb, kv_len, split_len)[:, None]
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n[None, :, None]                                                   # W's tile [1, BLOCK_N, BLOCK_K]
    kb = tl.arange(0, BLOCK_K)
    k3 = kb[None, None, :]
    w_rows = w_ptr + h * s_wh + n3 * s_wn
    last_k = (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K                            # the last step
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)                 # the products, summed over k at the end
    w = tl.load(w_rows + k3, mask=(n3 < N) & (k3 < K), other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kb
        k1 = tl.minimum(k0 + BLOCK_K, last_k) + k3                          # the next step's (the last: its own)
        w1 = tl.load(w_rows + k1, mask=(n3 < N) & (k1 < K), other=0.0)
        o = _merge_latents(po_rows, lse_rows, s_pos, k[None, :], (k < K)[None, :], n_used, PARTS)
        o = o.to(w_ptr.dtype.element_ty).to(tl.float32)      # [BLOCK_M, BLOCK_K]: o_lat as the combine stores it
        acc3 += w.to(tl.float32) * o[:, None, :]
        w = w1
    acc = tl.sum(acc3, 2)                                                   # [m, n]
    tl.store(out_ptr + r[:, None] * s_or + h * s_oh + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(tl.arange(0, BLOCK_M) < rows)[:, None] & (n < N)[None, :])


def mla_split_len(kv_len, batch, m_blocks, block_n, device):
    """Slots per split: enough splits that a full cache and the new tokens' part give one
    program per SM (one wave), each split at least MLA_MIN_SPLIT slots and a whole number of
    tiles. Host ints only."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, sms // (batch * m_blocks) - 1)
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


def mla_decode_attention(q_lat, q_pe, kv, k_pe, norm_weight, eps, rope, positions, kv_cache, pe_cache,
                         softmax_scale, split_len=None, merge=True):
    """MLA's decode-mode step after the projections, in two launches (the parts, the merge):
    writes each new token's normalized latent and rotated rope key at slot = its position, as
    model.MLA.write_cache does, and returns the absorbed attention of the rotated queries over
    the slots <= their positions, o_lat [B, T, H, C] in q_lat's dtype. q_lat [B, T, H, C], q_pe
    [B, T, H, R] (not rotated), kv [B, T, C] and k_pe [B, T, R] (kv_a's halves), norm_weight [C]
    with eps (kv_a_layernorm), rope [B, T, R/2, 2] float32 (cos, sin) at the positions, positions
    int64 [B, T] on the device, consecutive in a row, kv_cache [B, S, C] and pe_cache [B, S, R]
    (views of the caches, strided over B and S; last dims contiguous, as for every input). No
    host read: S, not the positions, sets the launch. merge=False: one launch, and the parts
    (MLAParts) come back unmerged, for mla_merge_absorb."""
    B, T, H, C = q_lat.shape
    R, S = q_pe.shape[-1], kv_cache.shape[1]
    if (q_pe.shape[:3] != (B, T, H) or kv.shape != (B, T, C) or k_pe.shape != (B, T, R) or R % 2
            or rope.shape != (B, T, R // 2, 2) or kv_cache.shape != (B, S, C) or pe_cache.shape != (B, S, R)):
        raise ValueError(f"mla_decode_attention: shapes q_lat {list(q_lat.shape)}, q_pe {list(q_pe.shape)}, kv "
                         f"{list(kv.shape)}, k_pe {list(k_pe.shape)}, rope {list(rope.shape)}, kv_cache "
                         f"{list(kv_cache.shape)}, pe_cache {list(pe_cache.shape)} do not fit [B, T, H, C], "
                         "[B, T, H, R], [B, T, C], [B, T, R], [B, T, R/2, 2], [B, S, C], [B, S, R] with R even")
    if positions.shape != (B, T) or positions.dtype != torch.int64 or rope.dtype != torch.float32:
        raise ValueError(f"mla_decode_attention: positions must be int64 [{B}, {T}] and rope float32, got "
                         f"{positions.dtype} {list(positions.shape)} and {rope.dtype}")
    dtypes = {x.dtype for x in (q_lat, q_pe, kv, k_pe, kv_cache, pe_cache)}
    if len(dtypes) != 1 or q_lat.dtype not in MLA_BLOCK_N:
        raise ValueError(f"mla_decode_attention: needs one dtype of {sorted(map(str, MLA_BLOCK_N))} for the "
                         f"queries, the new latents and the cache, got {sorted(map(str, dtypes))} (float64: use "
                         "the plain path)")
    for name, x in dict(q_pe=q_pe, kv=kv, k_pe=k_pe, kv_cache=kv_cache, pe_cache=pe_cache).items():
        if x.stride(-1) != 1:
            raise ValueError(f"mla_decode_attention: {name}'s last dim must be contiguous")
    M = T * H
    q = q_lat.reshape(B, M, C)        # a copy only when q_lat is not already [B, M, C]-strided
    qpe = q_pe.reshape(B, M, R)
    rope = rope if rope.stride(-1) == 1 and rope.stride(-2) == 2 else rope.contiguous()
    block_n = MLA_BLOCK_N[q_lat.dtype]
    block_m = min(MLA_MAX_BLOCK_M, _pow2(M))
    m_blocks = triton.cdiv(M, block_m)
    split_len = split_len or mla_split_len(S, B, m_blocks, block_n, q_lat.device)
    parts = 1 + triton.cdiv(S, split_len)
    partial = torch.empty(B, M, parts, C, device=q_lat.device, dtype=torch.float32)
    lse = torch.empty(B, M, parts, device=q_lat.device, dtype=torch.float32)
    _mla_decode_kernel[(parts, B, m_blocks)](
        q, qpe, kv, k_pe, norm_weight, rope, positions, kv_cache, pe_cache, partial, lse,
        T, H, M, S, split_len, float(eps), softmax_scale * math.log2(math.e),
        q.stride(0), q.stride(1), qpe.stride(0), qpe.stride(1), kv.stride(0), kv.stride(1),
        k_pe.stride(0), k_pe.stride(1), rope.stride(0), rope.stride(1), positions.stride(0), positions.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), pe_cache.stride(0), pe_cache.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        C=C, R=R, BLOCK_C=_pow2(C), BLOCK_R2=_pow2(R // 2, 8), BLOCK_T=_pow2(T), BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        launch_pdl=PDL, num_warps=MLA_NUM_WARPS, num_stages=MLA_NUM_STAGES[q_lat.dtype])
    unmerged = MLAParts(partial, lse, split_len, S)
    return mla_combine(unmerged, positions, q_lat.dtype).view(B, T, H, C) if merge else unmerged


def mla_combine(unmerged, positions, dtype):
    """The merge of mla_decode_attention's parts (MLAParts) into o_lat [B, M, C] of `dtype`: one launch."""
    partial, lse, split_len, kv_len = unmerged
    B, M, parts, C = partial.shape
    out = torch.empty(B, M, C, device=partial.device, dtype=dtype)
    block_c = MLA_COMBINE_BLOCK_C if partial.is_cuda else _pow2(C)   # the CPU interpreter: fewest programs
    in_order = parts <= MLA_MERGE_IN_ORDER_PARTS
    _mla_combine_kernel[(B * M, triton.cdiv(C, block_c))](
        partial, lse, positions, out, M, kv_len, split_len,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        positions.stride(0), out.stride(0), out.stride(1),
        C=C, BLOCK_C=block_c, PARTS=parts, BLOCK_S=_pow2(parts), IN_ORDER=in_order, launch_pdl=PDL,
        num_warps=MLA_COMBINE_WARPS if in_order else 4)
    return out


def mla_merge_absorb(unmerged, positions, w_uv):
    """head_gemv(o_lat, w_uv) with o_lat the merge of mla_decode_attention's parts (merge=False),
    in one launch instead of two, and equal bit for bit: out[b, t, h] = W_uv[h] @ o_lat[b, t, h],
    [B, T, H, N] in w_uv's dtype. Each of the H x N / HEAD_GEMV_BLOCK_N programs merges its head's
    B*T rows itself (the parts in use from L2; at Kimi-K2's N = 128, 16 programs a head redo that
    small merge side by side) before its product. w_uv [H, N, C] (K = C contiguous; a view of
    kv_b_proj's weight) of the model's dtype, positions int64 [B, T] as given to the attention; at
    most NORM_GEMV_MAX_ROWS rows B*T, as head_gemv. Past MLA_MERGE_IN_ORDER_PARTS parts, or where a
    K step's parts of all rows do not fit MLA_MERGE_ABSORB_REGS a thread: the combine, then head_gemv."""
    partial, lse, split_len, kv_len = unmerged
    B, M, parts, C = partial.shape
    H = w_uv.shape[0]
    T = M // H
    if w_uv.dim() != 3 or w_uv.shape[2] != C or w_uv.stride(2) != 1 or positions.shape != (B, T) or M != T * H:
        raise ValueError(f"mla_merge_absorb: partial {list(partial.shape)}, positions {list(positions.shape)} and "
                         f"w_uv {list(w_uv.shape)} do not fit [B, T*H, parts, C], [B, T] and [H, N, C] (C contiguous)")
    rows, N = B * T, w_uv.shape[1]
    if w_uv.dtype not in (torch.bfloat16, torch.float16, torch.float32) or rows > NORM_GEMV_MAX_ROWS:
        raise ValueError(f"mla_merge_absorb: runs bf16, fp16 or float32 and at most {NORM_GEMV_MAX_ROWS} rows, got "
                         f"{w_uv.dtype} and {rows} rows (use the plain path)")
    block_m = _pow2(rows, 1)
    block_k = _norm_gemv_step(rows, HEAD_GEMV_BLOCK_N, HEAD_GEMV_STEP_BYTES, HEAD_GEMV_WARPS, C,
                              w_uv.element_size())                         # head_gemv's steps: the same sums
    if parts > MLA_MERGE_IN_ORDER_PARTS or parts * block_m * block_k > MLA_MERGE_ABSORB_REGS * 32 * HEAD_GEMV_WARPS:
        return head_gemv(mla_combine(unmerged, positions, w_uv.dtype).view(B, T, H, C), w_uv)
    out = torch.empty(B, T, H, N, device=partial.device, dtype=w_uv.dtype)
    if rows and N and H:
        _mla_merge_absorb_kernel[(triton.cdiv(N, HEAD_GEMV_BLOCK_N), H)](
            partial, lse, positions, w_uv, out, rows, T, H, N, C, kv_len, split_len,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            positions.stride(0), w_uv.stride(0), w_uv.stride(1), H * N, N,
            PARTS=parts, BLOCK_M=block_m, BLOCK_N=HEAD_GEMV_BLOCK_N, BLOCK_K=block_k,
            num_warps=HEAD_GEMV_WARPS, num_stages=1, launch_pdl=PDL)
    return out


# ---------------------------------------------------------------------------------------------
# Router
#
# DeepSeek-V3's noaux_tc routing in one kernel for few tokens (decode, verify). The logits x @ W^T
# in float32: W is [E, D] float32 (11 MB at Kimi-K2's 384 x 7168) and must be read by many SMs at
# once, so programs take a block of experts and one of ROUTER_SPLIT_D slices of D each and store
# partial sums. The last program to finish (an atomic counter, as norm_gemv's) then selects for
# every token at once: the partial sums added, sigmoid scores, the correction bias added for
# selection only, groups kept by the sum of their two best biased scores (n_group > 1), the top K
# experts of the kept groups, their unbiased scores normalized and scaled. Past
# ROUTER_GEMV_MAX_TOKENS tokens cuBLAS computes the logits and a second kernel, a program a token,
# selects with the same code. With UNIFORM (SIMULATED balanced routing, model.Router's routing
# "uniform") the choice is fixed instead: pair j = n*K + i of the N*K token-expert pairs goes to
# expert j mod E, weighed by that expert's unbiased score, normalized and scaled as usual; the
# logits are computed as always (their cost stays), only the top-k rounds are skipped.
# Every token meets the program's one weight tile in turn, so the tile (ROUTER_TILE elements, the
# bytes a program has in flight) does not shrink with the tokens: a verify's router is one step a
# program, as a decode's. Beside INT4 experts the kernel also writes x as the INT4 GEMV's activation
# planes (router_topk's planes; SharedExpertInLaunch), which saves fused_moe its permute launch.
# Measured (H200, graphs, weights past the L2, 2026-12-01, benchmarks/h200_issue25_small_ab.json),
# us at 1 / 4 tokens against the two kernels before (logits, then a select program a token): 128
# experts 7.4 / 10.8 against 9.2 / 17.0; 384 experts 9.7 / 22.0 against 12.0 / 21.0 (there one
# program selecting for 4 tokens costs more than the launch it saves). Floors 0.9 and 2.6 us. With
# the one-step tile (2026-12-01, benchmarks/h200_s10_router_small_*.json), 384 experts at 4 tokens:
# 13.1 us (8.4 with SIMULATED uniform routing) against 23.8 (11.9) with a tile cut by the tokens.

ROUTER_GEMV_MAX_TOKENS = 16
ROUTER_SPLIT_D = 8          # D slices, at most: one step of ROUTER_TILE a program (7 slices of 1024: 112
#                             programs for 128 experts, 336 for 384; 4 slices left 64 programs at 128)
ROUTER_BLOCK_E = 8
ROUTER_TILE = 8192          # elements of the [experts, D] weight tile a program holds (64 fp32 a thread on 4 warps)
COUNTERS = 4096             # the shared counters of the kernels that end in a last program (router, norm_gemv,
#                             the GEMV MoE's shared expert, the draft attention kernel)


@functools.cache
def _counters(device):
    """Zeroed int32 counters that every call of the kernels above (COUNTERS) on `device` shares: the
    calls run one after another on a stream, and each call's last programs leave them zero again.
    The last program's counter add is acquire-release (it must see the others' partial sums); its
    reset is relaxed: only a later launch reads the counter, after the kernel boundary (with
    programmatic dependent launch, after its wait for this grid), so no fence is needed there."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


@_jit
def _router_kernel(x_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, ids_ptr, wout_ptr, v_ptr, N, E, D, d_per_split,
                   s_xn, s_we, s_ps, s_pn, s_idn, s_wn, E_PER_G, G, scale,
                   SPLITS: tl.constexpr, PLANES: tl.constexpr, K: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   NORM: tl.constexpr, GROUPED: tl.constexpr, UNIFORM: tl.constexpr, SHARED: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    """part[j, n, e] = sum over d in slice j of x[n, d] * W[e, d] in float32, then, in the last
    program, _router_select over all N (<= BLOCK_N) tokens. x [N, D] (any float dtype), W [E, D]
    float32, part [SPLITS, N, E] float32 (last dims contiguous), count one int32 zero. PLANES: the
    programs of expert block 0 also write their slice of x as fp32 nibble planes v [N, 8, D/8]
    (plane j = elements 8w + j: the INT4 GEMV's activation, fused_moe's planes). Grid:
    (cdiv(E, BLOCK_E), SPLITS)."""
    _wait_for_prior()
    eb, j = tl.program_id(0), tl.program_id(1)
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    d_end = tl.minimum((j + 1) * d_per_split, D)
    for d0 in range(j * d_per_split, d_end, BLOCK_D):   # one step a program up to ROUTER_GEMV_MAX_TOKENS tokens
        d = d0 + tl.arange(0, BLOCK_D)
        w = tl.load(w_ptr + e[:, None] * s_we + d[None, :], mask=(e < E)[:, None] & (d < d_end)[None, :], other=0.0)
        for i in tl.static_range(BLOCK_N):              # each token against the same weight tile
            ok = (i < N) & (d < d_end)[None, :]
            x = tl.load(x_ptr + i * s_xn + d[None, :], mask=ok, other=0.0).to(tl.float32)          # [1, BLOCK_D]
            acc = tl.where(n[:, None] == i, acc + tl.sum(x * w, 1)[None, :], acc)          # [BLOCK_N, BLOCK_E]
            if PLANES:
                if eb == 0:
                    tl.store(v_ptr + i * D + (d % 8 * (D // 8) + d // 8)[None, :], x, mask=ok)
    tl.store(part_ptr + j * s_ps + n[:, None] * s_pn + e[None, :], acc, mask=(n < N)[:, None] & (e < E)[None, :])
    tl.debug_barrier()                                  # every thread's stores before the counter's release
    if tl.atomic_add(count_ptr, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")     # the last program: every partial sum is stored
        _router_select(part_ptr, bias_ptr, ids_ptr, wout_ptr, 0, N, s_ps, s_pn, s_idn, s_wn, E_PER_G, G, scale,
                       SPLITS, K, TOPK_GROUP, NORM, GROUPED, UNIFORM, SHARED, BLOCK_N, BLOCK_G, BLOCK_EG, BLOCK_K)


@_jit
def _router_select_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, N, s_ln, s_idn, s_wn, E_PER_G, G, scale,
                          K: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, GROUPED: tl.constexpr,
                          UNIFORM: tl.constexpr, SHARED: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    """_router_select for token n = program_id(0) from whole logits [N, E] float32 (cuBLAS's, many
    tokens). Grid: (N,)."""
    _wait_for_prior()
    _router_select(logits_ptr, bias_ptr, ids_ptr, w_ptr, tl.program_id(0), N, 0, s_ln, s_idn, s_wn, E_PER_G, G,
                   scale, 1, K, TOPK_GROUP, NORM, GROUPED, UNIFORM, SHARED, 1, BLOCK_G, BLOCK_EG, BLOCK_K)


@_jit
def _router_select(part_ptr, bias_ptr, ids_ptr, w_ptr, n0, N, s_ps, s_pn, s_idn, s_wn, E_PER_G, G, scale,
                   SPLITS: tl.constexpr, K: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                   GROUPED: tl.constexpr, UNIFORM: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    """ids[n], w[n] = the K experts of tokens n = n0 .. n0 + BLOCK_N - 1 (those < N) and their
    weights, best first (UNIFORM: experts (n*K + i) mod E, i < K), then with SHARED expert E and
    weight 1 in column K. part [SPLITS, N, E] float32 partial sums of the logits (E = G * E_PER_G,
    expert e = g * E_PER_G + j; read from L2: another program stored them), bias [E] float32; ids
    [N, K (+1)] int64, w [N, K (+1)] float32."""
    n = n0 + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    if UNIFORM:   # the fixed choice; the chosen experts' logits gathered from the partial sums
        ids = (n[:, None] * K + k[None, :]) % (G * E_PER_G)                      # [BLOCK_N, BLOCK_K]
        logit = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for s in tl.static_range(SPLITS):
            logit += tl.load(part_ptr + s * s_ps + n[:, None] * s_pn + ids, mask=(n < N)[:, None], other=0.0,
                             cache_modifier=".cg")
        w = tl.sigmoid(logit)
    else:
        g = tl.arange(0, BLOCK_G)[None, :, None]
        j = tl.arange(0, BLOCK_EG)[None, None, :]
        e = g * E_PER_G + j                                               # [1, BLOCK_G, BLOCK_EG] expert ids
        ok = (n < N)[:, None, None] & (g < G) & (j < E_PER_G)             # [BLOCK_N, BLOCK_G, BLOCK_EG]
        logit = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_EG], tl.float32)
        for s in tl.static_range(SPLITS):
            logit += tl.load(part_ptr + s * s_ps + n[:, None, None] * s_pn + e, mask=ok, other=0.0,
                             cache_modifier=".cg")
        ids, w = _top_k(tl.sigmoid(logit), bias_ptr, e, ok, j, G, E_PER_G, k, K, TOPK_GROUP, GROUPED, BLOCK_N,
                        BLOCK_G, BLOCK_EG, BLOCK_K)
    w = tl.where(k[None, :] < K, w, 0.0)
    if NORM:
        w = w / (tl.sum(w, 1) + 1e-20)[:, None]
    out = (n < N)[:, None] & (k < K)[None, :]
    tl.store(ids_ptr + n[:, None] * s_idn + k[None, :], ids.to(tl.int64), mask=out)
    tl.store(w_ptr + n[:, None] * s_wn + k[None, :], w * scale, mask=out)
    if SHARED:  # the shared expert as expert E of the fused MoE launch, weight 1
        tl.store(ids_ptr + n * s_idn + K, tl.zeros([BLOCK_N], tl.int64) + G * E_PER_G, mask=n < N)
        tl.store(w_ptr + n * s_wn + K, tl.full([BLOCK_N], 1.0, tl.float32), mask=n < N)


@_jit
def _top_k(score, bias_ptr, e, ok, j, G, E_PER_G, k, K: tl.constexpr, TOPK_GROUP: tl.constexpr,
           GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
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
    flat = tl.reshape(biased, [BLOCK_N, BLOCK_G * BLOCK_EG])
    flat_score = tl.reshape(score, [BLOCK_N, BLOCK_G * BLOCK_EG])
    idx = tl.arange(0, BLOCK_G * BLOCK_EG)[None, :]
    ids = tl.zeros([BLOCK_N, BLOCK_K], tl.int32)
    w = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in tl.static_range(K):  # K rounds of argmax: the top K, best first
        top = tl.argmax(flat, 1)[:, None]                                  # flat index g * BLOCK_EG + j
        hit = idx == top
        ids = tl.where(k[None, :] == i, top // BLOCK_EG * E_PER_G + top % BLOCK_EG, ids)
        w = tl.where(k[None, :] == i, tl.sum(tl.where(hit, flat_score, 0.0), 1)[:, None], w)
        flat = tl.where(hit, float("-inf"), flat)
    return ids, w


def router_topk(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling, uniform=False,
                shared_slot=False, planes=None):
    """model.Router.forward in one kernel (past ROUTER_GEMV_MAX_TOKENS tokens: cuBLAS's logits and
    a selection kernel): x [N, D], weight [E, D] float32, bias [E] float32 -> ids int64 [N, K],
    weights float32 [N, K]. uniform: SIMULATED balanced routing (pair j = n*K + i to expert j mod
    E), as model.Router's routing "uniform"; shared_slot: a column K more, expert E with weight 1
    (the shared expert in the fused MoE launch); both in the same kernels. planes: an fp32 [N, 8,
    D/8] tensor that receives x as the INT4 GEMV's activation planes (fused_moe's planes), written by
    the same kernel (past ROUTER_GEMV_MAX_TOKENS: a copy)."""
    N, D = x.shape
    E = weight.shape[0]
    if weight.dtype != torch.float32 or bias.dtype != torch.float32 or weight.shape != (E, D) or bias.shape != (E,):
        raise ValueError(f"router_topk: needs float32 weight [E, {D}] and bias [E], got {weight.dtype} "
                         f"{list(weight.shape)} and {bias.dtype} {list(bias.shape)} (float64: use the plain path)")
    if E % n_group or not 1 <= topk_group <= n_group or top_k > E // n_group * topk_group:
        raise ValueError(f"router_topk: {E} experts in {n_group} groups, {topk_group} kept, cannot give top {top_k}")
    if planes is not None:
        _check_planes(planes, x)
    ids = torch.empty(N, top_k + bool(shared_slot), device=x.device, dtype=torch.int64)
    weights = torch.empty(N, top_k + bool(shared_slot), device=x.device, dtype=torch.float32)
    if N == 0:
        return ids, weights
    select = dict(K=top_k, TOPK_GROUP=topk_group, NORM=bool(norm_topk_prob), GROUPED=n_group > 1 and not uniform,
                  UNIFORM=bool(uniform), SHARED=bool(shared_slot), BLOCK_G=_pow2(n_group, 1),
                  BLOCK_EG=_pow2(E // n_group, 1), BLOCK_K=_pow2(top_k, 1))
    if N > ROUTER_GEMV_MAX_TOKENS:
        logits = torch.nn.functional.linear(x.float(), weight)
        _router_select_kernel[(N,)](logits, bias, ids, weights, N, logits.stride(0), ids.stride(0), weights.stride(0),
                                    E // n_group, n_group, float(scaling), **select, launch_pdl=PDL, num_warps=4)
        if planes is not None:
            nibble_planes(x, planes)
        return ids, weights
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_n = _pow2(N, 1)
    block_d = ROUTER_TILE // ROUTER_BLOCK_E
    d_per_split = triton.cdiv(triton.cdiv(D, ROUTER_SPLIT_D), block_d) * block_d
    splits = triton.cdiv(D, d_per_split)
    part = torch.empty(splits, N, E, device=x.device, dtype=torch.float32)
    _router_kernel[(triton.cdiv(E, ROUTER_BLOCK_E), splits)](
        x, weight, part, _counters(x.device), bias, ids, weights, part if planes is None else planes, N, E, D,
        d_per_split, x.stride(0), weight.stride(0), part.stride(0), part.stride(1), ids.stride(0), weights.stride(0),
        E // n_group, n_group, float(scaling), SPLITS=splits, PLANES=planes is not None, BLOCK_N=block_n,
        BLOCK_E=ROUTER_BLOCK_E, BLOCK_D=block_d, **select, launch_pdl=PDL,
        num_warps=4 if N <= 8 else 8)   # 16 tokens' selection on 4 warps spills (ptxas: 255 registers)
    return ids, weights


# ---------------------------------------------------------------------------------------------
# Fused residual + RMSNorm: the residual add and the norm that reads its result, one pass.


@_jit
def _add_rmsnorm_kernel(x_ptr, y_ptr, w_ptr, h_ptr, out_ptr, D, eps, s_x, s_y, s_h, s_out,
                        BLOCK_D: tl.constexpr):
    """h = x + y (rounded to x's dtype, as the plain add), out = h * rsqrt(mean(h^2) + eps) * w,
    computed in float32 and rounded once. x, y, h, out [N, D] (last dim contiguous), w [D].
    Grid: (N,)."""
    _wait_for_prior()
    n = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + n * s_x + d, mask=ok, other=0.0)
    y = tl.load(y_ptr + n * s_y + d, mask=ok, other=0.0)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)   # with x and y: its latency not after the sum
    h = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
    tl.store(h_ptr + n * s_h + d, h, mask=ok)
    hf = h.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / D + eps)
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
                                            launch_pdl=PDL, num_warps=8 if D >= 4096 else 4)
    return h.view(x.shape), out.view(x.shape)


# ---------------------------------------------------------------------------------------------
# SwiGLU activation: silu(gate) * up in one pass (the dense MLP's and the shared expert's).


@_jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, s_g, s_u, s_out, BLOCK: tl.constexpr):
    """out[n] = silu(g[n]) * u[n], in float32, rounded once. g, u, out [N, I] (rows strided, the
    last dim contiguous; g and u may be the two halves of one [N, 2I] GEMM output).
    Grid: (N, cdiv(I, BLOCK))."""
    _wait_for_prior()
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
            launch_pdl=PDL, num_warps=4)
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
    _wait_for_prior()
    n = tl.program_id(0)
    b, t = n // T, n % T
    p = tl.load(pos_ptr + b * s_posb + t * s_post)
    c = tl.arange(0, BLOCK_C)
    kv = tl.load(kv_ptr + b * s_kvb + t * s_kvt + c, mask=c < C, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    normed = kv / tl.sqrt(tl.sum(kv * kv, 0) / C + eps) * w
    tl.store(kv_cache_ptr + b * s_cb + p * s_cs + c, normed.to(kv_cache_ptr.dtype.element_ty), mask=c < C)
    r = tl.arange(0, 2 * BLOCK_R2)
    one = tl.zeros([1], tl.int32)   # _rotated takes rows: k_pe is one row
    pe = _rotated(kpe_ptr + b * s_kpb + t * s_kpt + one, rope_ptr + b * s_rb + t * s_rt + one, one == 0, R,
                  BLOCK_R2)                                                               # [1, 2 * BLOCK_R2]
    tl.store(pe_cache_ptr + b * s_pb + p * s_ps + one[:, None] + r[None, :],
             pe.to(pe_cache_ptr.dtype.element_ty), mask=(r < R)[None, :])
    h = tl.arange(0, BLOCK_H)
    q = _rotated(q_ptr + b * s_qb + t * s_qt + h * s_qh, rope_ptr + b * s_rb + t * s_rt + 0 * h, h < H, R,
                 BLOCK_R2)                                                                # [BLOCK_H, 2 * BLOCK_R2]
    tl.store(qo_ptr + b * s_ob + t * s_ot + h[:, None] * s_oh + r[None, :], q.to(qo_ptr.dtype.element_ty),
             mask=(h < H)[:, None] & (r < R)[None, :])


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
        C=C, R=R, BLOCK_C=_pow2(C), BLOCK_H=_pow2(H, 1), BLOCK_R2=_pow2(R // 2, 1), launch_pdl=PDL, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# RMSNorm fused into the GEMV that reads it (decode and verify: at most NORM_GEMV_MAX_ROWS rows)
#
# out = RMSNorm(x) @ W^T for a few rows x [M, K] and a weight W [N, K]: a GEMV, memory-bound
# on W. A GEMV is fast only with many bytes in flight. Every program loads its next step's tile
# before it multiplies the one it holds (Triton pipelines only loads that feed tl.dot). The norm
# factors out of the sum, out[m, n] = rstd[m] * sum_k x[m, k] g[k] W[n, k], so each program also
# sums the squares of its part of x and rstd is applied at the end: the norm costs no pass or
# launch of its own. The products run on the CUDA cores in float32 (tl.dot pads M to 16 rows, 16x
# the activation in registers: 63 / 11.7 us for q_a + kv_a / q_b at 1 row against 15.9 / 5.9 in an
# earlier form of this kernel).
# - A program holds BLOCK_N rows of W and all M rows of x, a step of BLOCK_K columns of each, and
#   adds their elementwise products into a float32 [BLOCK_M, BLOCK_N, BLOCK_K] accumulator, summed
#   over k once at the end: no reduction inside the loop, one code path for every row count. The
#   accumulator lives in registers, so the step shrinks as the rows grow (NORM_GEMV_ACC_REGS).
# - K is whole in a program where the row blocks fill the GPU (N / BLOCK_N > 132 programs at
#   Kimi-K2's attention shapes, one wave), at any row count. With fewer row blocks K is split, a
#   program per (BLOCK_N rows, slice of K): each stores its float32 partial sums and the last
#   program of a row block to finish (an atomic counter, reset by that program) adds the slices in
#   slice order, scales and stores.
# Measured on the H200 (2026-12-01, benchmarks/h200_s9_sweep_gemv.log, bf16, graphs, weights past
# the L2), us for q_a + kv_a (30 MB) / q_b with its norm / o_proj, this form with the blocks below
# against cuBLAS (q_b: model.RMSNorm + cuBLAS) and the form before it (which at several rows reduced
# over k at every step for each row in turn, K split into ~1024 programs):
#   1 row   9.9 / 4.1 / 5.9,    cuBLAS 12.6 / 10.0 / 6.6,  before 9.9 / 4.1 / 5.8
#   2 rows  10.1 / 4.3 / 6.1,   cuBLAS 13.4 / 9.8 / 6.6,   before 18.5 / 6.2 / 11.9
#   4 rows  13.1 / 5.5 / 8.1,   cuBLAS 13.3 / 10.1 / 6.5,  before 25.7 / 7.8 / 15.2
#   8 rows  25.3 / 7.7 / 14.3,  cuBLAS 13.3 / 8.8 / 6.4,   before 52.4 / 16.2 / 26.4
# One launch, no float atomics: deterministic, so a graph replay equals the eager call.
# Rounding: the normed row is not rounded (the plain path rounds it to W's dtype), so bf16 results
# differ from the plain path's by the order of one rounding.
# With a residual r (a layer's input norm, InputNormInQKVA) the kernel reads x and r and normalizes their
# sum, rounded to the dtype as the plain add rounds it; the programs of row block 0 also store that sum
# (the residual stream), each for its own slice of K: the add + norm launch in front of the GEMV goes.

NORM_GEMV_MAX_ROWS = 16     # decode and verify; prefill goes to the plain RMSNorm and cuBLAS
# (BLOCK_N, bytes of a W row a step, warps) by (one row or several, K long or short), the step cut to fit
# NORM_GEMV_ACC_REGS, from the sweeps above: at one row 8 warps (session 8; o_proj, K 1024: 4 steps of 256
# columns 5.7 us, one step of 1024 8.1); at several rows 4 warps, and 4 W rows a program at long K (q_b at 4
# rows 5.5 us against 8.4 with one row's blocks; q_a + kv_a 13.1 either way)
NORM_GEMV_BLOCKS = {(1, "long"): (8, 2048, 8), (1, "short"): (16, 512, 8),
                    ("several", "long"): (4, 2048, 4), ("several", "short"): (16, 512, 4)}
NORM_GEMV_LONG_K = 1536     # columns from which a row is "long"
NORM_GEMV_ACC_REGS = 64     # float32 products a thread accumulates: BLOCK_M x BLOCK_N x BLOCK_K <= 64 x 32 x warps
NORM_GEMV_MIN_STEP = 64     # columns: the accumulator's limit cuts the step no shorter
NORM_GEMV_PROGRAMS = 264    # K is cut into this // row blocks slices (at most one a step): whole from 133 row
#                             blocks up, as at all of Kimi-K2's attention projections


@_jit
def _norm_gemv_slice_sum(acc, ss, part_ptr, ss_ptr, count_ptr, pid, s, rows, n, M, N,
                         SPLITS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store slice s's sums acc [BLOCK_M, BLOCK_N] and sums of squares ss [BLOCK_M]; the last program of
    row block pid to finish returns (the sums over all slices in slice order, True), the others False."""
    ok = (rows < M)[:, None] & (n < N)[None, :]
    tl.store(part_ptr + (s * M + rows[:, None]) * N + n[None, :], acc, mask=ok)
    tl.store(ss_ptr + (pid * SPLITS + s) * BLOCK_M + rows, ss)
    tl.debug_barrier()                                  # every thread's stores before the counter's release
    last = tl.atomic_add(count_ptr + pid, 1) == SPLITS - 1
    if last:                                            # the row block's other slices are stored: add them
        tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed")
        acc = tl.zeros_like(acc)
        ss = tl.zeros_like(ss)
        for t in range(SPLITS):                         # in slice order (.cg: from L2, never a stale L1 line)
            acc += tl.load(part_ptr + (t * M + rows[:, None]) * N + n[None, :], mask=ok, other=0.0,
                           cache_modifier=".cg")
            ss += tl.load(ss_ptr + (pid * SPLITS + t) * BLOCK_M + rows, cache_modifier=".cg")
    return acc, ss, last


@_jit
def _residual_sum(x_ptrs, r_ptrs, ok):
    """x + r at the pointers (where ok), rounded to x's dtype as the plain add (model.RMSNorm's) rounds it."""
    x = tl.load(x_ptrs, mask=ok, other=0.0)
    return (x.to(tl.float32) + tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)


@_jit
def _store_residual_sum(x_rows, r_rows, sum_rows, rows, kb, lo, hi, M, K, BLOCK_K: tl.constexpr):
    """_norm_gemv_kernel's sum x + r over columns [lo, hi) stored into sum's rows, after the products: a
    store inside the product loop holds back the next step's loads (1 row: 10.1 against 11.7 us,
    benchmarks/h200_s12_var.log), so the sum is read and added again here."""
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + kb
        ok = (rows < M)[:, None] & (k < K)[None, :]
        tl.store(sum_rows + k[None, :], _residual_sum(x_rows + k[None, :], r_rows + k[None, :], ok), mask=ok)


@_jit
def _norm_gemv_kernel(x_ptr, r_ptr, sum_ptr, g_ptr, w_ptr, out_ptr, part_ptr, ss_ptr, count_ptr,
                      M, N, K, k_split, eps, s_xm, s_rm, s_sm, s_xh, s_wh, s_wn, s_wk, s_om, s_oh,
                      SPLITS: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_k h[m, k] * W[n, k] with h = x (NORM: RMSNorm(x), x * rsqrt(mean(x^2) + eps) * g).
    ADD: x is the sum x + r of x and a residual r [M, K], rounded to x's dtype, which the programs of
    row block 0 (each for its own slice of K, after its products) store into sum [M, K] (rows strided,
    last dim contiguous).
    x [M, K], out [M, N] (rows strided, last dim contiguous), W [N, K] (any strides), g [K]; x, out
    and W of one dtype; M <= BLOCK_M; float32 products on the CUDA cores, added up elementwise over
    the steps and summed over k at the end. Each step loads the next step's W tile before it uses its
    own. Slice s of K is [s * k_split, (s + 1) * k_split); with SPLITS > 1, part [SPLITS, M, N] and
    ss [N / BLOCK_N, SPLITS, BLOCK_M] float32 hold the slices' sums and sums of squares, count
    [N / BLOCK_N] int32 zeros. With heads (grid axis 1, head_gemv, SPLITS 1): x, W and out of head j
    start s_xh, s_wh, s_oh elements further. Grid: (cdiv(N, BLOCK_N), heads, SPLITS)."""
    _wait_for_prior()
    pid, j, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n[None, :, None]                                                   # W's tile [1, BLOCK_N, BLOCK_K]
    kb = tl.arange(0, BLOCK_K)
    k3 = kb[None, None, :]
    x_rows = x_ptr + j * s_xh + rows[:, None] * s_xm
    r_rows, sum_rows = r_ptr + rows[:, None] * s_rm, sum_ptr + rows[:, None] * s_sm
    w_rows = w_ptr + j * s_wh + n3 * s_wn
    lo = s * k_split
    hi = tl.minimum(lo + k_split, K)
    last_k = lo + (tl.cdiv(hi - lo, BLOCK_K) - 1) * BLOCK_K                  # the slice's last step
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)                 # the products, summed over k at the end
    ss2 = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)       # the squares, summed over k at the end (a sum a step
    #                                                      would be a cross-warp reduction, two barriers, a step)
    w = tl.load(w_rows + (lo + k3) * s_wk, mask=(n3 < N) & (lo + k3 < K), other=0.0)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + kb
        k1 = tl.minimum(k0 + BLOCK_K, last_k) + k3                          # the next step's (the last: its own)
        w1 = tl.load(w_rows + k1 * s_wk, mask=(n3 < N) & (k1 < K), other=0.0)
        ok = (rows < M)[:, None] & (k < K)[None, :]
        if ADD:
            h = _residual_sum(x_rows + k[None, :], r_rows + k[None, :], ok).to(tl.float32)
        else:
            h = tl.load(x_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)
        if NORM:
            ss2 += h * h
            h = h * tl.load(g_ptr + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
        acc3 += w.to(tl.float32) * h[:, None, :]
        w = w1
    acc = tl.sum(acc3, 2)                                                   # [m, n]
    ss = tl.sum(ss2, 1)
    if ADD:
        if pid == 0:
            _store_residual_sum(x_rows, r_rows, sum_rows, rows, kb, lo, hi, M, K, BLOCK_K)
    last = pid >= 0                                                         # one slice: every program
    if SPLITS > 1:
        acc, ss, last = _norm_gemv_slice_sum(acc, ss, part_ptr, ss_ptr, count_ptr, pid, s, rows, n, M, N,
                                             SPLITS, BLOCK_M)
    if NORM:
        acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    tl.store(out_ptr + j * s_oh + rows[:, None] * s_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (n < N)[None, :] & last)


def _k_slices(N, K, block_n, block_k, programs):
    """(slices, k_split): K cut into whole steps of block_k until about `programs` programs run."""
    steps = triton.cdiv(K, block_k)
    slices = min(steps, max(1, programs // triton.cdiv(N, block_n)))
    k_split = triton.cdiv(steps, slices) * block_k
    return triton.cdiv(K, k_split), k_split


def _norm_gemv_step(rows, block_n, step_bytes, warps, K, elem):
    """Columns a step: step_bytes of a W row, at most K rounded up to a power of 2, and at most what keeps the
    float32 accumulator [rows, block_n, step] within NORM_GEMV_ACC_REGS a thread, but no fewer than
    NORM_GEMV_MIN_STEP."""
    fit = NORM_GEMV_ACC_REGS * 32 * warps // (_pow2(rows, 1) * block_n)
    return min(step_bytes // elem, _pow2(K), max(NORM_GEMV_MIN_STEP, 1 << (max(fit, 1).bit_length() - 1)))


def norm_gemv(x, weight, norm_weight=None, eps=0.0, residual=None, block_n=None, block_k=None, programs=None,
              warps=None):
    """RMSNorm(x) @ weight^T in one kernel: x [..., K] of weight's dtype (bf16, fp16 or float32),
    weight [N, K] (rows may be a strided view), norm_weight [K] (None: no norm, a plain GEMV), at
    most NORM_GEMV_MAX_ROWS rows. Returns [..., N]. With a residual (x's shape and dtype) the input is
    x + residual, rounded to x's dtype as model.RMSNorm's add: returns ([..., N], x + residual). The
    block arguments override the defaults above (benchmarks; tests force several slices of a small K)."""
    K = x.shape[-1]
    N = weight.shape[0]
    rows = x.numel() // K if K else 0
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"norm_gemv: x {x.dtype} {list(x.shape)} and weight {weight.dtype} {list(weight.shape)} "
                         "do not fit [..., K] and [N, K] (last dim contiguous) of one dtype")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or rows > NORM_GEMV_MAX_ROWS:
        raise ValueError(f"norm_gemv: runs bf16, fp16 or float32 and at most {NORM_GEMV_MAX_ROWS} rows, got "
                         f"{x.dtype} and {rows} rows (use the plain path)")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_gemv: norm weight {list(norm_weight.shape)} is not [{K}]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"norm_gemv: residual {residual.dtype} {list(residual.shape)} is not of x's shape and "
                         f"dtype, {x.dtype} {list(x.shape)}")
    bn, step_bytes, bw = NORM_GEMV_BLOCKS[1 if rows == 1 else "several",
                                          "long" if K >= NORM_GEMV_LONG_K else "short"]
    block_n, warps = block_n or bn, warps or bw
    if triton.cdiv(N, block_n) > COUNTERS:
        raise ValueError(f"norm_gemv: {N} rows of W make more than {COUNTERS} row blocks of {block_n}")
    x2, r2 = (t.reshape(rows, K) for t in (x, x if residual is None else residual))
    x2, r2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, r2))
    out = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    summed = x2 if residual is None else torch.empty(rows, K, device=x.device, dtype=x.dtype)  # x2: not written
    if rows and N:
        block_k = block_k or _norm_gemv_step(rows, block_n, step_bytes, warps, K, x.element_size())
        slices, k_split = _k_slices(N, K, block_n, block_k, programs or NORM_GEMV_PROGRAMS)
        blocks = triton.cdiv(N, block_n)
        part = torch.empty(slices, rows, N, device=x.device, dtype=torch.float32) if slices > 1 else out
        ss = torch.empty(blocks * slices * _pow2(rows, 1), device=x.device, dtype=torch.float32)
        _norm_gemv_kernel[(blocks, 1, slices)](
            x2, r2, summed, x2 if norm_weight is None else norm_weight, weight, out, part, ss, _counters(x.device),
            rows, N, K, k_split, float(eps), x2.stride(0), r2.stride(0), summed.stride(0), 0, 0, weight.stride(0), 1,
            N, 0, SPLITS=slices, ADD=residual is not None, NORM=norm_weight is not None, BLOCK_M=_pow2(rows, 1),
            BLOCK_N=block_n, BLOCK_K=block_k, launch_pdl=PDL, num_stages=1, num_warps=warps)
    return out if residual is None else (out, summed.view(x.shape))


# head_gemv's blocks, swept on the H200 at Kimi-K2's 8 heads (2026-12-01, benchmarks/h200_s8_sweep2.log) with the
# kernel's form before the elementwise accumulator, us at 1 / 4 rows: W_uk 1.96 / 4.01, W_uv 2.14 / 3.55, against
# 3.2 / 5.2 and 4.8 / 6.7 for the einsums with the copies the model makes of their permuted inputs and outputs
HEAD_GEMV_BLOCK_N_STRIDED = 32   # W rows a program where W's rows, not its K, are contiguous (absorbed W_uk):
#                                  32 bf16 rows = 64-byte segments a K step
HEAD_GEMV_BLOCK_N = 8            # contiguous K (W_uv, K = 512): 8 heads x 16 row blocks of Kimi-K2's 128 rows
HEAD_GEMV_STEP_BYTES = 1024      # K whole in one step at Kimi-K2's 128 and 512 (measured so, not swept); more
#                                  rows: the step cut to fit NORM_GEMV_ACC_REGS
HEAD_GEMV_WARPS = 4


def head_gemv(x, weight):
    """out[..., j, n] = sum_k x[..., j, k] * weight[j, n, k], for each of H heads j: x [..., H, K]
    (last dim contiguous, the leading dims flattening to at most NORM_GEMV_MAX_ROWS rows of one
    stride), weight [H, N, K] of x's dtype, any strides (MLA's absorbed W_uk^T and W_uv are views
    of kv_b_proj's weight). One launch of norm_gemv's kernel, no norm, K whole (short rows, and
    H x N / BLOCK_N programs already); out [..., H, N] contiguous."""
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
        block_n = HEAD_GEMV_BLOCK_N if weight.stride(2) == 1 else HEAD_GEMV_BLOCK_N_STRIDED
        block_k = _norm_gemv_step(rows, block_n, HEAD_GEMV_STEP_BYTES, HEAD_GEMV_WARPS, K, x.element_size())
        _norm_gemv_kernel[(triton.cdiv(N, block_n), H, 1)](
            x2, x2, x2, x2, weight, out, out, out, out, rows, N, K, K, 0.0, x2.stride(0), 0, 0, x2.stride(1),
            weight.stride(0), weight.stride(1), weight.stride(2), H * N, N, SPLITS=1, ADD=False, NORM=False,
            BLOCK_M=_pow2(rows, 1), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=HEAD_GEMV_WARPS, num_stages=1,
            launch_pdl=PDL)
    return out


# ---------------------------------------------------------------------------------------------
# Swaps: model.py's modules with the kernels above (or torch-only fast paths) in place of the
# plain code. Each subclass overrides only what differs; a module gets several by re-classing it
# as a class made of them (swap()), so each swap's super() is the next one's method and, at the
# end, model.py's. Size limits live here: past them a swap calls super(), the plain code.

# The kernels as the swaps call them: torch.compile (run.py --compile) does not trace into them
# (a graph break), so their Triton launches run as written between the compiled parts.
launch = SimpleNamespace(**{name: torch.compiler.disable(globals()[name]) for name in (
    "mla_rope_cache_write", "mla_decode_attention", "mla_merge_absorb", "router_topk", "add_rmsnorm",
    "silu_mul", "norm_gemv", "head_gemv")})


def rows(x):
    """The rows of x [..., K] (the product of its leading dims)."""
    return math.prod(x.shape[:-1])


class AddRMSNorm(model.RMSNorm):
    """"add_rmsnorm": the residual add and the norm of the sum in one kernel."""

    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        summed, normed = launch.add_rmsnorm(residual, x, self.weight, self.eps)
        return normed, summed


class DecodeAttentionKernel(model.MLA):
    """"attention": decode mode's RoPE, cache write and latent attention in one kernel and a
    merge (mla_decode_attention) between the projections, which stay model.MLA's methods (and
    their swaps'); the steps around them are model.MLA.attend's. With "norm_gemv" too (a
    NormGemvMLA) and at most MLA_MERGE_ABSORB_MAX_ROWS rows, W_uv's launch merges the parts
    (mla_merge_absorb) in place of the merge launch and absorb_output. The kernel masks by position
    (slots <= position, slot = position, a row's tokens at consecutive positions: a decode step,
    a chain's verify); a draft tree's nodes (slots given) are not, and extend mode expands the
    cache: both take model.MLA.attend."""

    def attend(self, q, kv_a, positions, rope, future, mode, slots=None):
        if mode != "decode" or slots is not None:
            return super().attend(q, kv_a, positions, rope, future, mode, slots)
        a, h, norm = self.args, self.n_local_heads, self.kv_a_layernorm
        (B, T, _), kv_len = kv_a.shape, future.shape[-1]
        q_nope, q_pe = q.view(B, T, h, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        kv, k_pe = kv_a.split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        w_uk, w_uv = self.kv_b_halves()
        in_w_uv = isinstance(self, NormGemvMLA) and B * T <= MLA_MERGE_ABSORB_MAX_ROWS   # W_uv's GEMV merges
        o = launch.mla_decode_attention(self.absorb_query(q_nope, w_uk), q_pe, kv, k_pe, norm.weight, norm.eps,
                                        rope, positions, self.kv_cache[:B, :kv_len], self.pe_cache[:B, :kv_len],
                                        a.softmax_scale, merge=not in_w_uv)
        out = self.merge_absorb_output(o, positions, w_uv) if in_w_uv else self.absorb_output(o, w_uv)
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


# Where the GEMV kernels replace cuBLAS, by rows (B * T), from one H200 sweep (2026-12-01, bf16, Kimi-K2
# TP-8 shapes, graphs, weights past the L2; benchmarks/h200_s9_sweep_gemv.log), us at 1 / 2 / 3 / 4 / 8 rows:
#   q_b with q_a_layernorm: kernel 4.1 / 4.3 / 5.4 / 5.5 / 7.7, model.RMSNorm + cuBLAS 10.0 / 9.8 / 9.7 /
#     10.1 / 8.8: up to NORM_GEMV_MAX_ROWS.
#   q_a + kv_a (stacked, fused_proj's weight): kernel 9.9 / 10.1 / 12.6 / 13.1 / 25.3, cuBLAS 12.6 / 13.4 /
#     13.5 / 13.3 / 13.3 (two launches, its split-K GEMV and a reduce): up to 4 rows.
#   o_proj: kernel 5.9 / 6.1 / 8.1 / 8.1 / 14.3, cuBLAS 6.6 / 6.6 / 6.4 / 6.5 / 6.4: up to 2 rows.
#   absorbed W_uk, W_uv: kernel 2.1 + 2.2 / 2.5 + 2.2 / 3.0 + 2.5 / 2.7 + 2.3, the einsums with the copies
#     the model makes of their permuted inputs and outputs 3.1 + 4.6 / 5.0 + 6.4 / 5.2 + 6.5 / 5.1 + 6.7:
#     up to 4 rows (more were not measured).
#   q_a + kv_a with the input add + norm inside (2026-12-01, benchmarks/h200_s12_*): kernel 10.0 / 20.3 /
#     30.7 / 31.1, add_rmsnorm + the GEMV 11.7 / 12.0 / 14.0 / 14.0: InputNormInQKVA at one row only.
QKVA_GEMV_MAX_ROWS = 4
INPUT_NORM_QKVA_MAX_ROWS = 1
O_PROJ_GEMV_MAX_ROWS = 2
HEAD_GEMV_MAX_ROWS = 4


class NormGemvMLA(model.MLA):
    """"norm_gemv": q_b_proj as a GEMV kernel with q_a_layernorm computed inside it (at most
    NORM_GEMV_MAX_ROWS rows: decode, verify), decode mode's absorbed W_uk / W_uv products as GEMV
    kernels over the heads (at most HEAD_GEMV_MAX_ROWS rows), and, with fused_proj (StackedQKVA
    behind this swap), the stacked q_a + kv_a at up to QKVA_GEMV_MAX_ROWS (project_sum: with the
    layer's input add and norm inside, for InputNormInQKVA); more rows: the plain code."""

    def q_kv_a(self, x):
        if rows(x) > QKVA_GEMV_MAX_ROWS:
            return super().q_kv_a(x)
        return launch.norm_gemv(x, self.q_kv_a_weight)

    def project_sum(self, x, residual, norm):
        """(q, kv_a) = project(norm(x + residual)) and x + residual, at most NORM_GEMV_MAX_ROWS rows (InputNormInQKVA
        calls it at INPUT_NORM_QKVA_MAX_ROWS), the add and the norm (the layer's input_layernorm) inside q_a +
        kv_a's GEMV (with StackedQKVA behind this swap). residual None: project(norm(x)) and x."""
        w, g = self.q_kv_a_weight, norm.weight
        if residual is None:
            q_kv_a, summed = launch.norm_gemv(x, w, g, norm.eps), x
        else:
            q_kv_a, summed = launch.norm_gemv(x, w, g, norm.eps, residual=residual)
        return *self.split_q_kv_a(q_kv_a), summed

    def query(self, q_a):
        if rows(q_a) > NORM_GEMV_MAX_ROWS:
            return super().query(q_a)
        norm = self.q_a_layernorm
        return launch.norm_gemv(q_a, self.q_b_proj.weight, norm.weight, norm.eps)

    def absorb_query(self, q_nope, w_uk):
        if math.prod(q_nope.shape[:2]) > HEAD_GEMV_MAX_ROWS:                # B * T
            return super().absorb_query(q_nope, w_uk)
        return launch.head_gemv(q_nope, w_uk.transpose(1, 2))

    def absorb_output(self, o_lat, w_uv):
        if math.prod(o_lat.shape[:2]) > HEAD_GEMV_MAX_ROWS:
            return super().absorb_output(o_lat, w_uv)
        return launch.head_gemv(o_lat, w_uv)


class InputNormInQKVA(model.Block):
    """"norm_gemv" with "fused_proj" and "add_rmsnorm" (MLA with q_lora_rank): at most INPUT_NORM_QKVA_MAX_ROWS
    rows, the layer's input residual add and input_layernorm run inside the stacked q_a + kv_a GEMV
    (NormGemvMLA.project_sum), so no add_rmsnorm launch runs in front of the attention; the attention
    takes the projected inputs (model.MLA.attend). More rows: model.Block. MLA's own call does not run
    here, so run.py's component table scopes project_sum and attend themselves (its MLA_METHODS)."""

    def forward(self, x, residual, positions, rope, future, mode, slots=None):
        if rows(x) > INPUT_NORM_QKVA_MAX_ROWS:
            return super().forward(x, residual, positions, rope, future, mode, slots)
        attn = self.self_attn
        q, kv_a, residual = attn.project_sum(x, residual, self.input_layernorm)
        h = attn.attend(q, kv_a, positions, rope, future, mode, slots)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class GemvRowParallel(tp.RowParallelLinear):
    """"norm_gemv" on MLA's o_proj: at most O_PROJ_GEMV_MAX_ROWS rows through the GEMV kernel (no norm)
    instead of cuBLAS; the all-reduce as before."""

    def forward(self, x):
        if rows(x) > O_PROJ_GEMV_MAX_ROWS:
            return super().forward(x)
        y = launch.norm_gemv(x, self.weight)
        return self.tp.all_reduce(y) if self.reduce else y


def stack_rows(*linears):
    """Make the linears' weights [out_i, in] row blocks of one new buffer [sum out_i, in] and return
    it: each weight becomes a view of its block (no second copy), so a checkpoint still loads, and
    random init still writes, by each linear's own name, while one GEMM over the buffer reads the
    linears' shared input once."""
    buf = torch.cat([linear.weight.detach() for linear in linears])
    for linear, block in zip(linears, buf.split([linear.weight.shape[0] for linear in linears])):
        view = nn.Parameter(block, requires_grad=False)
        view.shard_dim = linear.weight.shard_dim
        linear.weight = view
    return buf


class AttachAgain:
    """For a swap that keeps tensors built from its weights (stacked views, attach()): .to() and
    the like move each parameter and buffer on its own, so build them again afterwards."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.attach()
        return self


class StackedQKVA(AttachAgain, model.MLA):
    """"fused_proj" (plain torch; MLA with q_lora_rank): q_a_proj and kv_a_proj_with_mqa, which
    both read x, as one GEMM over their weights stacked (stack_rows)."""

    def attach(self):
        self.q_kv_a_weight = stack_rows(self.q_a_proj, self.kv_a_proj_with_mqa)

    def q_kv_a(self, x):                                   # [..., q_lora_rank + kv_lora_rank + rope dim]
        return F.linear(x, self.q_kv_a_weight)

    def project(self, x):
        return self.split_q_kv_a(self.q_kv_a(x))

    def split_q_kv_a(self, q_kv_a):
        """project's outputs from the stacked product: the queries of its q_a part, and kv_a."""
        a = self.args
        q_a, kv_a = q_kv_a.split([a.q_lora_rank, a.kv_lora_rank + a.qk_rope_head_dim], -1)
        return self.query(q_a), kv_a


class SiluMulKernel(model.MLP):
    """"silu_mul": SwiGLU's silu(gate) * up in one kernel."""

    def act(self, gate, up):
        return launch.silu_mul(gate, up)


class StackedGateUp(AttachAgain, model.MLP):
    """"fused_proj": gate_proj and up_proj as one GEMM over their stacked weights (stack_rows).
    add_to (a shared expert, reduce=False): a tensor [N, dim], the MoE's routed output, that the
    down GEMM adds its product into, in place, instead of an add after it."""

    def attach(self):
        self.gate_up_weight = stack_rows(self.gate_proj, self.up_proj)

    def gate_up(self, x):                                         # one GEMM: [..., 2 I] = [gate | up]
        return F.linear(x, self.gate_up_weight).chunk(2, -1)

    def forward(self, x, add_to=None):
        if add_to is None:
            return super().forward(x)
        assert not self.down_proj.reduce, "add_to needs reduce=False: the sum is reduced by the caller"
        gate, up = self.gate_up(x)
        return add_to.addmm_(self.act(gate, up), self.down_proj.weight.t())


class RouterKernel(model.Router):
    """"router": logits, selection and weights in one kernel (SIMULATED uniform routing too).
    shared_slot: one more column, expert E with weight 1 for every token ([N, K + 1]), made in the
    same kernel (SharedExpertInLaunch)."""

    def forward(self, x, shared_slot=False, planes=None):
        a = self.args
        return launch.router_topk(x, self.weight, self.e_score_correction_bias, a.num_experts_per_tok,
                                  a.n_group, a.topk_group, a.norm_topk_prob, a.routed_scaling_factor,
                                  uniform=self.routing == "uniform", shared_slot=shared_slot, planes=planes)


def with_shared_slot(ids, weights, E):
    """The plain router's choice with the shared expert as expert E, weight 1: [N, K + 1]."""
    return F.pad(ids, (0, 1), value=E), F.pad(weights, (0, 1), value=1.0)


class SharedDownAddsRouted(model.MoE):
    """"fused_proj" on an MoE: the shared expert's down GEMM (StackedGateUp) adds onto the routed
    output; one kernel less a layer."""

    def partial_sum(self, x):
        ids, weights = self.gate(x)
        return self.shared_experts(x, add_to=self.experts(x, ids, weights))


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
        h = F.silu(torch._grouped_mm(xs, gate.mT, offs=offs)) * torch._grouped_mm(xs, up.mT, offs=offs)
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
        """stacked: SharedExpertInLaunch's [E + 1, ...] tensors, for ids that may name expert E; shared:
        its bf16 shared expert's weights beside INT4 or FP8 experts, planes: x as the router kernel
        wrote it for INT4 experts (fused_moe's shared and planes)."""
        if self.runs_fused(x):
            # torch.compile (run.py --compile) leaves the Triton launches alone: a graph break here
            # (around the whole of fused, which also builds the kernel's weight descriptors)
            return torch.compiler.disable(self.fused)(x, ids, weights, stacked, shared=shared, planes=planes)
        return super().forward(x, ids, weights)

    def fused(self, x, ids, weights, stacked=None, variant=None, shared=None, planes=None):  # variant: fused_moe's
        projs = stacked or [getattr(self, p) for p in ("gate_proj", "up_proj", "down_proj")]
        return fused_moe(x, ids, weights, *map(expert_weights, projs), variant=variant, shared=shared, planes=planes)


class SharedExpertInLaunch(AttachAgain, model.MoE):
    """"shared_expert": the shared expert inside the fused launch. Plain routed experts: it is expert E,
    chosen by every token with weight 1 (K + 1 pairs a token); its weights move in as the last rows of
    [E + 1, ...] tensors, both modules' parameters becoming views of them, so a checkpoint loaded
    afterwards lands there under the same names. INT4 or FP8 routed experts (Kimi-K2.5; Kimi-K2-Instruct's
    FP8 checkpoint, whose shared expert is dequantized to bf16 at load): the GEMV launches take its
    weights beside theirs (fused_moe's shared), where the rule picks the GEMV variant; beside INT4 ones the
    router kernel, where it is swapped in, also writes the activation planes they read (fused_moe's
    planes), so the launch that permutes x goes. Elsewhere (past
    FusedExperts' token limit, quantized tiles) the plain sum runs, the shared expert alone."""

    def attach(self):
        ex, sh = self.experts, self.shared_experts
        self.stacked = None
        if ex.quantized:
            return
        self.stacked = []
        for routed, shared in ((ex.gate_proj, sh.gate_proj.weight), (ex.up_proj, sh.up_proj.weight),
                               (ex.down_proj, sh.down_proj.weight)):
            both = torch.cat([routed.data, shared.data.unsqueeze(0)])    # [E + 1, out, in]
            routed.data, shared.data = both[:-1], both[-1]
            self.stacked.append(both)

    def partial_sum(self, x):
        ex, sh = self.experts, self.shared_experts
        K = self.gate.args.num_experts_per_tok
        if not ex.runs_fused(x) or (ex.quantized and gemv_rule(self.fmt(), x.shape[0], K) != "gemv"):
            return super().partial_sum(x)
        if self.stacked is None:
            # INT4 experts read x as nibble planes: the router kernel writes them, one launch less
            planes = None
            if isinstance(self.gate, RouterKernel) and self.fmt() == "int4":
                planes = torch.empty(x.shape[0], 8, x.shape[1] // 8, dtype=torch.float32, device=x.device)
            ids, weights = self.gate(x) if planes is None else self.gate(x, planes=planes)
            return ex(x, ids, weights, shared=[sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight],
                      planes=planes)
        if isinstance(self.gate, RouterKernel):
            ids, weights = self.gate(x, shared_slot=True)
        else:
            ids, weights = with_shared_slot(*self.gate(x), self.experts.n_experts)
        return self.experts(x, ids, weights, self.stacked)

    def fmt(self):
        return expert_weights(self.experts.gate_proj).fmt

    @staticmethod
    def applies(moe):
        """One plain shared expert of a routed expert's shape (Kimi-K2, DeepSeek-V3: n_shared_experts
        1) beside the fused routed experts: plain ones of its dtype, or INT4 or FP8 ones (it in the
        model's dtype)."""
        ex, sh = moe.experts, moe.shared_experts
        if not isinstance(ex, FusedExperts):
            return False
        w = ex.gate_proj
        if isinstance(w, model.PackedExperts):
            dtype, shape = w.weight_scale.dtype, [w.weight_packed.shape[1], w.weight_packed.shape[2] * 8]
        elif isinstance(w, model.Fp8Experts):
            dtype, shape = w.dtype, list(w.weight.shape[1:])
        else:
            dtype, shape = w.dtype, list(w.shape[1:])
        return sh.gate_proj.weight.dtype == dtype and list(sh.gate_proj.weight.shape) == shape


# ---------------------------------------------------------------------------------------------
# Putting the swaps in place

# The names of run.py --kernels; all but "fused_proj" (GEMMs over stacked weights) are Triton
KERNELS = ("attention", "rope_cache", "router", "add_rmsnorm", "silu_mul", "shared_expert", "fused_proj",
           "norm_gemv")
MOE_IMPLS = ("gather", "grouped", "fused")   # run.py --moe-impl, with "auto"


def swap(module, *swaps):
    """Re-class `module` in place as a subclass of its class with `swaps` (subclasses of its
    model.py class) in front, then let each new swap attach() what it keeps beside the weights.
    Parameters, buffers and their names stay as they are. Returns the module."""
    plain = next(c for c in type(module).__mro__ if c.__module__ != __name__)
    new = tuple(s for s in swaps if not isinstance(module, s))
    for s in new:
        if not issubclass(s, plain):
            raise TypeError(f"{s.__name__} is no swap for a {plain.__name__}")
    if new:
        module.__class__ = _combined(new + (type(module),))
        for s in new:
            if "attach" in vars(s):
                s.attach(module)
    return module


@functools.cache
def _combined(bases):
    return type("+".join(b.__name__ for b in bases), bases, {})


def kernel_names(names):
    """names: an iterable of KERNELS, one name, "all", "none" or None -> a set; unknown refused."""
    names = set(KERNELS if names == "all" else () if names in (None, "none") else
                [names] if isinstance(names, str) else names)
    if names - set(KERNELS):
        raise ValueError(f"unknown kernels {sorted(names - set(KERNELS))}; choose from {list(KERNELS)} or 'all'")
    return names


def pick_moe(moe, device, dtype):
    """moe "auto" (on a GPU: fused where Triton is installed, else grouped where torch._grouped_mm
    runs; on the CPU: gather), or a named one, refused where it cannot run."""
    device = torch.device(device)
    if moe == "auto":
        moe = ("gather" if device.type != "cuda" else "fused" if fused_moe_available(device, dtype)
               else "grouped" if grouped_mm_available(device, dtype) else "gather")
    if moe not in MOE_IMPLS:
        raise ValueError(f"moe must be 'auto', 'gather', 'grouped' or 'fused', not {moe!r}")
    if moe == "grouped" and not grouped_mm_available(device, dtype):
        raise ValueError(f"moe='grouped' needs torch._grouped_mm for {dtype} on {device}")
    if moe == "fused" and not fused_moe_available(device, dtype):
        raise ValueError(f"moe='fused' needs Triton and a bf16, fp16 or float32 model on CUDA (or Triton's "
                         f"CPU interpreter, TRITON_INTERPRET=1); here: {dtype} on {device}, Triton "
                         f"{'installed' if HAVE_TRITON else 'not installed'}")
    return moe


def accelerate(target, names=(), moe="auto"):
    """Swap the fast paths into a plain model.Transformer, in place, and return the names of
    KERNELS swapped in. names: "attention" (decode-mode MLA attention), "rope_cache" (RoPE +
    latent norm + cache writes), "router" (SIMULATED uniform routing included), "add_rmsnorm"
    (every residual add with the norm that reads the sum), "silu_mul" (the MLPs' SwiGLU),
    "norm_gemv" (GEMV kernels: for <= 16 rows q_b_proj with q_a_layernorm inside; for <= 4 rows
    decode mode's absorbed products over the heads and, with fused_proj, the stacked q_a + kv_a,
    with add_rmsnorm too, at one row, the layer's input add and norm inside it: InputNormInQKVA;
    for <= 2 rows o_proj), "shared_expert" (the shared expert inside the fused MoE launch, where
    SharedExpertInLaunch.applies; else left off and not listed), "fused_proj" (plain torch: q_a +
    kv_a and each unfolded MLP's gate + up as one GEMM, the shared expert's down GEMM adding onto
    the routed output); an iterable, "all" or "none". moe: the routed experts' path
    (pick_moe). The state dict keeps its keys and values. What was done is recorded as
    target.kernels and target.moe_impl (run.py prints them)."""
    names = kernel_names(names)
    if hasattr(target, "kernels"):
        raise ValueError(f"accelerate: this model is accelerated already (kernels {target.kernels}); "
                         "build a plain one")
    device, dtype = target.device, target.dtype
    moe = pick_moe(moe, device, dtype)
    if names - {"fused_proj"}:
        check_available(device)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"the Triton kernels run bf16, fp16 or fp32 models, not {dtype}")
    for layer in target.layers:
        accelerate_layer(layer, names, moe)
    if "add_rmsnorm" in names:
        swap(target.norm, AddRMSNorm)
    folded = any(isinstance(m, SharedExpertInLaunch) for m in target.modules())
    target.kernels = tuple(k for k in KERNELS if k in names and (k != "shared_expert" or folded))
    target.moe_impl = moe
    return target.kernels


def accelerate_layer(layer, names, moe):
    """accelerate's swaps for one model.Block."""
    attn = layer.self_attn
    if "fused_proj" in names and attn.args.q_lora_rank:
        swap(attn, StackedQKVA)                 # first: NormGemvMLA, in front of it, takes over its q_kv_a
    swap(attn, *[cls for name, cls in (("attention", DecodeAttentionKernel), ("rope_cache", RopeCacheKernel),
                                       ("norm_gemv", NormGemvMLA)) if name in names])
    if "norm_gemv" in names:
        swap(attn.o_proj, GemvRowParallel)
    if "add_rmsnorm" in names:
        swap(layer.input_layernorm, AddRMSNorm)
        swap(layer.post_attention_layernorm, AddRMSNorm)
    if {"norm_gemv", "fused_proj", "add_rmsnorm"} <= names and attn.args.q_lora_rank:
        swap(layer, InputNormInQKVA)
    mlp = layer.mlp
    if isinstance(mlp, model.MoE):
        swap(mlp.experts, *{"gather": (), "grouped": (GroupedExperts,), "fused": (FusedExperts,)}[moe])
        if "router" in names:
            swap(mlp.gate, RouterKernel)
        if "shared_expert" in names and SharedExpertInLaunch.applies(mlp):
            swap(mlp, SharedExpertInLaunch)   # its gate and up rows live in the [E + 1] tensors now
        elif "fused_proj" in names:
            swap(mlp, SharedDownAddsRouted)
            swap(mlp.shared_experts, StackedGateUp)
        mlp = mlp.shared_experts
    elif "fused_proj" in names:
        swap(mlp, StackedGateUp)
    if "silu_mul" in names:
        swap(mlp, SiluMulKernel)


def compile_layers(target):
    """run.py --compile: let torch.compile fuse each decoder layer's small kernels (regional
    compilation: the layers of a kind share one compiled code, one per shape and mode), the
    Triton launches left between the compiled parts. Tested equal to the plain layers; CUDA
    graphs stay explicit (graphs.py captures these)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in target.layers:
        layer.compile(dynamic=False)   # Block.forward, through the module's call
    return target


# ---------------------------------------------------------------------------------------------
# The EAGLE-3 head (draft.py): its decoder layer at a chain step or an extend, in fewer launches
#
# One head step at Kimi-K2's TP-8 shapes reads ~260 MB of weights (q/k/v 88, o 15, MLP 99, lm_head
# 57): a 61 us floor on the H200, but the plain step is 70 launches, most of them small ones around
# the GEMMs (RoPE by table gathers, repeat_interleave of the kv heads, an einsum over every slot,
# masks, four norms at ~9 us each, a concat, argmax): 0.256 ms in a graph. The swaps below keep the
# GEMMs (cuBLAS, q/k/v and gate/up stacked, as the target's fused_proj) and put the rest into a few
# launches: both input norms and their concatenation (draft_input_norms), RoPE + cache write +
# attention + the merge of its splits (draft_attention), each residual add inside the norm that
# reads it (add_rmsnorm: the post-attention norm, the final norm), SwiGLU (silu_mul), and the draft
# token's argmax with its d2t map (draft_top1). A tree (slots and masks given) and training (past)
# take the plain forward. Measured (H200, 2026-12-01, kernels_bench.py --draft, graphs; benchmarks/
# h200_issue25_draft_final.json): the step 0.259 -> 0.133 ms (2.16x its floor, 24 launches) at 256
# cached tokens, 0.410 -> 0.171 ms at 32768; the extend of 4 rows 0.348 -> 0.219 ms (1.63x). Left:
# cuBLAS GEMVs 81 us of the step with their split-K reduces (3.2 TB/s of 259 MB), draft_top1 8.2 us
# (one program, 8 dependent steps).


@_jit
def _draft_norms_kernel(e_ptr, h_ptr, we_ptr, wh_ptr, out_ptr, D, eps_e, eps_h, s_e, s_h, s_out,
                        BLOCK_D: tl.constexpr):
    """out[n] = [RMSNorm(e[n]) * we, RMSNorm(h[n]) * wh]: program (n, 0) the first half, (n, 1) the
    second; float32, rounded once (as F.rms_norm). e, h [N, D], out [N, 2D] (last dims contiguous).
    Grid: (N, 2)."""
    _wait_for_prior()
    n, half = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    if half == 0:
        x = tl.load(e_ptr + n * s_e + d, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(we_ptr + d, mask=ok, other=0.0).to(tl.float32)
        eps = eps_e
    else:
        x = tl.load(h_ptr + n * s_h + d, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(wh_ptr + d, mask=ok, other=0.0).to(tl.float32)
        eps = eps_h
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    tl.store(out_ptr + n * s_out + half * D + d, (x * r * w).to(out_ptr.dtype.element_ty), mask=ok)


def draft_input_norms(emb, hidden, emb_weight, emb_eps, hidden_weight, hidden_eps):
    """torch.cat([RMSNorm(emb), RMSNorm(hidden)], -1) for emb, hidden [..., D] of one dtype: one launch."""
    D = emb.shape[-1]
    if hidden.shape != emb.shape or hidden.dtype != emb.dtype or emb_weight.shape != (D,) \
            or hidden_weight.shape != (D,):
        raise ValueError(f"draft_input_norms: emb {emb.dtype} {list(emb.shape)}, hidden {hidden.dtype} "
                         f"{list(hidden.shape)}, weights {list(emb_weight.shape)} {list(hidden_weight.shape)} do "
                         "not fit")
    e2, h2 = emb.reshape(-1, D), hidden.reshape(-1, D)
    e2, h2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (e2, h2))
    out = torch.empty(e2.shape[0], 2 * D, device=emb.device, dtype=emb.dtype)
    if e2.shape[0]:
        _draft_norms_kernel[(e2.shape[0], 2)](e2, h2, emb_weight, hidden_weight, out, D, float(emb_eps),
                                              float(hidden_eps), e2.stride(0), h2.stride(0), out.stride(0),
                                              BLOCK_D=_pow2(D), launch_pdl=PDL, num_warps=8 if D >= 4096 else 4)
    return out.view(*emb.shape[:-1], 2 * D)


# The head's attention (Llama's: H query heads over G kv heads of Hd, rotate-half RoPE, K and V
# cached by slot = position) for a chain step or an extend of a few tokens, one launch. As the MLA
# kernel above: program (part, b, g) takes kv head g of batch row b and its GROUP = H / G query
# heads for all T tokens, M = T * GROUP query rows against each tile of keys, with its helpers (the
# online-softmax step, part 0's causal tile, the partial store). Part 0 is the T new tokens: it
# rotates their keys, writes keys and values to their slots and attends to them in registers
# (causally). Parts 1, 2, ... split the cached slots before the row's first new position, which
# no program writes. Each program stores its partial output and log-sum-exp; the last of a
# (b, g) to finish (an atomic counter, as norm_gemv's) merges them in part order: one launch, no
# float atomics, a graph replay equal to the eager call. Queries are rotated in every program
# (rotate-half: x * cos + sign * x[(i + Hd/2) % Hd] * sin, both loads from the row in L1/L2).
DRAFT_ATTN_BLOCK_N = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}   # 16 KB bf16 K (and V) tiles
DRAFT_ATTN_STAGES = {torch.bfloat16: 3, torch.float16: 3, torch.float32: 2}
DRAFT_ATTN_MAX_ROWS = 32    # M = T * GROUP query rows a program; more (prefill chunks) take the plain forward
DRAFT_ATTN_MIN_SPLIT = 64   # cached slots a split at least


@_jit
def _rope_rows(x_rows, rope_rows, cos_ptr, sin_ptr, ok, HD: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate-half RoPE of rows of HD values (draft.rotate_half_rope): x_rows [N] pointers to each
    row, rope_rows [N] offsets of its cos / sin rows [HD / 2] float32. Returns [N, BLOCK_D] float32."""
    i = tl.arange(0, BLOCK_D)
    m = ok[:, None] & (i < HD)[None, :]
    half = HD // 2
    x = tl.load(x_rows[:, None] + i[None, :], mask=m, other=0.0).to(tl.float32)
    x_other = tl.load(x_rows[:, None] + ((i + half) % HD)[None, :], mask=m, other=0.0).to(tl.float32)
    j = rope_rows[:, None] + (i % half)[None, :]
    cos = tl.load(cos_ptr + j, mask=m, other=0.0)
    sin = tl.load(sin_ptr + j, mask=m, other=0.0)
    return x * cos + tl.where(i < half, -1.0, 1.0)[None, :] * x_other * sin


@_jit
def _draft_attend_cached(q, kc_row, s_kcs, vc_row, s_vcs, lo, hi, scale_log2, HD: tl.constexpr,
                         BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Flash attention of rotated query rows q [BLOCK_M, BLOCK_D] over the cached slots [lo, hi) of
    one kv head (kc_row, vc_row: its key and value at slot 0; s_kcs, s_vcs: the slot strides),
    BLOCK_N slots a tile. Returns m_i, l_i, acc [BLOCK_M, BLOCK_D] as _attend_cached."""
    d = tl.arange(0, q.shape[1])
    d_ok = d < HD
    m_i = tl.full([q.shape[0]], -1e30, tl.float32)
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros([q.shape[0], q.shape[1]], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nd = (offs_n < hi)[:, None] & d_ok[None, :]
        kt = tl.load(kc_row + offs_n[:, None] * s_kcs + d[None, :], mask=nd, other=0.0)
        vt = tl.load(vc_row + offs_n[:, None] * s_vcs + d[None, :], mask=nd, other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * scale_log2            # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, offs_n < hi, vt, DOT_PRECISION)
    return m_i, l_i, acc


@_jit
def _merge_parts(po_ptr, lse_ptr, first, parts, offs_m, row_ok, M, HD: tl.constexpr, BLOCK_D: tl.constexpr):
    """The output of rows offs_m [BLOCK_M] (row_ok: those that exist) from parts first, ...,
    first + parts - 1 of po [.., M, HD] and lse [.., M] (float32, as _store_partial stored them), in
    part order: sum_j 2^lse_j o_j / sum_j 2^lse_j. Returns [BLOCK_M, BLOCK_D] float32, 0 where no
    part saw a slot."""
    d = tl.arange(0, BLOCK_D)
    rd = row_ok[:, None] & (d < HD)[None, :]
    top = tl.full([offs_m.shape[0]], -1e30, tl.float32)
    wsum = tl.zeros([offs_m.shape[0]], tl.float32)
    out = tl.zeros([offs_m.shape[0], BLOCK_D], tl.float32)
    for j in range(parts):                          # .cg: from L2, never a stale L1 line
        lse_j = tl.load(lse_ptr + (first + j) * M + offs_m, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        o_j = tl.load(po_ptr + ((first + j) * M + offs_m[:, None]) * HD + d[None, :], mask=rd, other=0.0,
                      cache_modifier=".cg")
        top_new = tl.maximum(top, lse_j)
        alpha, w = tl.exp2(top - top_new), tl.exp2(lse_j - top_new)
        out = out * alpha[:, None] + w[:, None] * o_j
        wsum = wsum * alpha + w
        top = top_new
    return out / tl.where(wsum > 0, wsum, 1.0)[:, None]


@_jit
def _draft_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, o_ptr, po_ptr, lse_ptr,
                            count_ptr, T, M, kv_len, split_len, scale_log2,
                            s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_rb, s_rt, s_posb, s_post,
                            s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_ob, s_ot, s_oh,
                            HD: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """See the section's head. q [B, T, H, HD], k and v [B, T, G, HD] (not rotated), cos and sin [B, T, HD / 2]
    float32 at pos int64 [B, T] (consecutive in a row), caches kc, vc [B, >= kv_len, G, HD], o [B, T, H, HD]:
    last dims contiguous. po [B, G, parts, M, HD] and lse [B, G, parts, M] float32 scratch, count [B * G]
    int32 zeros (left zero). Grid: (parts, B, G)."""
    _wait_for_prior()
    part, b, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    parts, G = tl.num_programs(0), tl.num_programs(2)
    dt = kc_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    t_m, head = offs_m // GROUP, g * GROUP + offs_m % GROUP
    q = _rope_rows(q_ptr + b * s_qb + t_m * s_qt + head * s_qh, b * s_rb + t_m * s_rt, cos_ptr, sin_ptr, row_ok,
                   HD, BLOCK_D).to(dt)                                                   # [BLOCK_M, BLOCK_D]
    if part == 0:   # the new tokens, in registers
        offs_t = tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        pos_t = tl.load(pos_ptr + b * s_posb + offs_t * s_post, mask=t_ok, other=0)              # their slots
        pos = tl.load(pos_ptr + b * s_posb + t_m * s_post, mask=row_ok, other=-1)                # [BLOCK_M]
        k_new = _rope_rows(k_ptr + b * s_kb + offs_t * s_kt + g * s_kh, b * s_rb + offs_t * s_rt, cos_ptr, sin_ptr,
                           t_ok, HD, BLOCK_D).to(dt)                                     # [BLOCK_T, BLOCK_D]
        v_new = _load_rows(v_ptr + b * s_vb + offs_t * s_vt + g * s_vh, t_ok, HD, BLOCK_D)       # [BLOCK_T, BLOCK_D]
        _store_rows(kc_ptr + b * s_kcb + pos_t * s_kcs + g * s_kch, k_new, t_ok, HD)
        _store_rows(vc_ptr + b * s_vcb + pos_t * s_vcs + g * s_vch, v_new, t_ok, HD)
        s = tl.dot(q, tl.trans(k_new), input_precision=DOT_PRECISION) * scale_log2              # [BLOCK_M, BLOCK_T]
        m_i, l_i, acc = _softmax_new_tokens(s, pos, pos_t, t_ok, v_new, DOT_PRECISION)
    else:           # cached slots [lo, hi): this split's, before the row's first new position
        lo = (part - 1) * split_len
        hi = tl.minimum(tl.minimum(tl.load(pos_ptr + b * s_posb), kv_len), lo + split_len)
        m_i, l_i, acc = _draft_attend_cached(q, kc_ptr + b * s_kcb + g * s_kch, s_kcs, vc_ptr + b * s_vcb + g * s_vch,
                                             s_vcs, lo, hi, scale_log2, HD, BLOCK_N, DOT_PRECISION)
    bg = b * G + g          # every part stores, one holding no slot too (lse -inf): the merge reads all
    _store_partial(po_ptr + ((bg * parts + part) * M + offs_m) * HD, lse_ptr + (bg * parts + part) * M + offs_m,
                   m_i, l_i, acc, row_ok, HD)
    tl.debug_barrier()                                  # every thread's stores before the counter's release
    if tl.atomic_add(count_ptr + bg, 1) == parts - 1:   # the other parts are stored: merge, in part order
        tl.atomic_xchg(count_ptr + bg, 0, sem="relaxed")
        out = _merge_parts(po_ptr, lse_ptr, bg * parts, parts, offs_m, row_ok, M, HD, BLOCK_D)
        _store_rows(o_ptr + b * s_ob + t_m * s_ot + head * s_oh, out.to(o_ptr.dtype.element_ty), row_ok, HD)


def draft_split_len(kv_len, programs_per_part, block_n, device):
    """Slots per split: about two programs an SM over a full cache, each split at least
    DRAFT_ATTN_MIN_SPLIT slots and whole tiles. Host ints only."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, 2 * sms // programs_per_part - 1)
    split = max(DRAFT_ATTN_MIN_SPLIT, math.ceil(kv_len / want))
    return math.ceil(split / block_n) * block_n


def draft_attention(q, k, v, cos, sin, positions, k_cache, v_cache, scale, split_len=None):
    """The head's attention after the projections (draft.DraftAttention.forward with past, slots
    and visible None), one launch: rotates q and k (rotate-half, cos and sin [B, T, Hd/2] float32
    at the positions), writes k and v at slot = position into k_cache, v_cache [B, S, G, Hd] (views,
    strided over B and S) and returns softmax(scale q k^T) v over the slots <= each token's
    position, o [B, T, H, Hd] in q's dtype. q [B, T, H, Hd], k and v [B, T, G, Hd] (last dims
    contiguous, one dtype with the caches); positions int64 [B, T] on the device, consecutive in a
    row and below S. No host read: S, not the positions, sets the launch."""
    B, T, H, HD = q.shape
    G, S = k.shape[2], k_cache.shape[1]
    if (k.shape != (B, T, G, HD) or v.shape != k.shape or H % G or HD % 2 or cos.shape != (B, T, HD // 2)
            or sin.shape != cos.shape or k_cache.shape != (B, S, G, HD) or v_cache.shape != k_cache.shape):
        raise ValueError(f"draft_attention: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, cos "
                         f"{list(cos.shape)}, sin {list(sin.shape)}, caches {list(k_cache.shape)} "
                         f"{list(v_cache.shape)} do not fit [B, T, H, Hd], [B, T, G, Hd] twice, [B, T, Hd/2] twice, "
                         "[B, S, G, Hd] twice, with G dividing H and Hd even")
    if positions.shape != (B, T) or positions.dtype != torch.int64 or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32:
        raise ValueError(f"draft_attention: positions must be int64 [{B}, {T}] and cos, sin float32, got "
                         f"{positions.dtype} {list(positions.shape)}, {cos.dtype}, {sin.dtype}")
    dtypes = {x.dtype for x in (q, k, v, k_cache, v_cache)}
    if len(dtypes) != 1 or q.dtype not in DRAFT_ATTN_BLOCK_N:
        raise ValueError(f"draft_attention: needs one dtype of {sorted(map(str, DRAFT_ATTN_BLOCK_N))} for q, k, v "
                         f"and the caches, got {sorted(map(str, dtypes))} (float64: use the plain path)")
    M = T * (H // G)
    if M > DRAFT_ATTN_MAX_ROWS or B * G > COUNTERS:
        raise ValueError(f"draft_attention: {M} query rows a kv head (at most {DRAFT_ATTN_MAX_ROWS}) or {B * G} "
                         f"batch rows x kv heads (at most {COUNTERS}): use the plain path")
    for name, x in dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache).items():
        if x.stride(-1) != 1:
            raise ValueError(f"draft_attention: {name}'s last dim must be contiguous")
    cos = cos if cos.stride(-1) == 1 and cos.stride() == sin.stride() else cos.contiguous()
    sin = sin if sin.stride() == cos.stride() else sin.contiguous()
    block_n = DRAFT_ATTN_BLOCK_N[q.dtype]
    split_len = split_len or draft_split_len(S, B * G, block_n, q.device)
    parts = 1 + triton.cdiv(S, split_len)
    po = torch.empty(B, G, parts, M, HD, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, G, parts, M, device=q.device, dtype=torch.float32)
    out = torch.empty(B, T, H, HD, device=q.device, dtype=q.dtype)
    _draft_attention_kernel[(parts, B, G)](
        q, k, v, cos, sin, positions, k_cache, v_cache, out, po, lse, _counters(q.device), T, M, S, split_len,
        scale * math.log2(math.e), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(1), positions.stride(0), positions.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        HD=HD, GROUP=H // G, BLOCK_D=_pow2(HD), BLOCK_M=_pow2(M), BLOCK_T=_pow2(T), BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", launch_pdl=PDL, num_warps=4,
        num_stages=DRAFT_ATTN_STAGES[q.dtype])
    return out


@_jit
def _draft_top1_kernel(x_ptr, d2t_ptr, out_ptr, V, s_x, BLOCK: tl.constexpr):
    """out[n] = i + d2t[i] for i the first index of the largest x[n, :V] (torch.argmax's; NaN aside).
    Each lane keeps its first maximum over the row's blocks; the smallest index among the lanes
    holding the row's maximum is then the first. Grid: (N,)."""
    _wait_for_prior()
    n = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_ptr + n * s_x + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        take = x > best                                 # strictly: a lane keeps its first maximum
        best = tl.where(take, x, best)
        best_i = tl.where(take, start + offs, best_i)
    i = tl.min(tl.where(best == tl.max(best, 0), best_i, V), 0)
    tl.store(out_ptr + n, i + tl.load(d2t_ptr + i))


DRAFT_TOP1_BLOCK = 4096   # logits a step: 8 steps over Kimi-K2's 32000 (torch's argmax reduce took 9.8 us)


def draft_top1(logits, d2t):
    """logits.argmax(-1) mapped to target ids (i + d2t[i]), one launch: logits [..., Vd] float, d2t
    int64 [Vd]. Returns int64 [...]."""
    V = logits.shape[-1]
    if d2t.shape != (V,) or d2t.dtype != torch.int64 or not logits.is_floating_point():
        raise ValueError(f"draft_top1: logits {logits.dtype} {list(logits.shape)} and d2t {d2t.dtype} "
                         f"{list(d2t.shape)} do not fit [..., Vd] float and int64 [Vd]")
    x = logits.reshape(-1, V)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], device=logits.device, dtype=torch.int64)
    if x.shape[0]:
        _draft_top1_kernel[(x.shape[0],)](x, d2t, out, V, x.stride(0), BLOCK=min(DRAFT_TOP1_BLOCK, _pow2(V)),
                                          launch_pdl=PDL, num_warps=4)
    return out.view(logits.shape[:-1])


launch.draft_top1 = torch.compiler.disable(draft_top1)
launch.draft_input_norms = torch.compiler.disable(draft_input_norms)
launch.draft_attention = torch.compiler.disable(draft_attention)


class DraftAttentionKernel(draft.DraftAttention):
    """"attention" on the head: RoPE, the cache write and the attention in one launch
    (draft_attention) for a chain step or an extend of up to DRAFT_ATTN_MAX_ROWS query rows a kv
    head; a tree (slots, visible), training (past) and prefill chunks take the plain forward."""

    def forward(self, x, positions, cos, sin, kv_len=None, past=None, slots=None, visible=None):
        B, T, _ = x.shape
        if (past is not None or slots is not None or visible is not None
                or T * self.n_local_heads // self.n_local_kv_heads > DRAFT_ATTN_MAX_ROWS):
            return super().forward(x, positions, cos, sin, kv_len, past, slots, visible)
        q, k, v = self.project(x)
        S = kv_len or self.k_cache.shape[1]
        o = launch.draft_attention(q, k, v, cos, sin, positions, self.k_cache[:B, :S], self.v_cache[:B, :S],
                                   self.scale)
        return self.o_proj(o.flatten(2))


class StackedQKV(AttachAgain, draft.DraftAttention):
    """"fused_proj" on the head: q_proj, k_proj and v_proj, which all read x, as one GEMM over their
    weights stacked (stack_rows)."""

    def attach(self):
        self.qkv_weight = stack_rows(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x):
        B, T, _ = x.shape
        H, G, HD = self.n_local_heads, self.n_local_kv_heads, self.head_dim
        q, k, v = F.linear(x, self.qkv_weight).split([H * HD, G * HD, G * HD], -1)
        return q.view(B, T, H, HD), k.view(B, T, G, HD), v.view(B, T, G, HD)


class DraftNormsKernel(draft.MidLayer):
    """"add_rmsnorm" on the head's midlayer: both input norms and their concatenation in one launch
    (draft_input_norms), the residual add inside post_attention_layernorm (add_rmsnorm). Training
    (past) takes the plain forward: the kernels have no backward."""

    def forward(self, emb, hidden, positions, cos, sin, kv_len=None, past=None, slots=None, visible=None):
        if past is not None:
            return super().forward(emb, hidden, positions, cos, sin, kv_len, past, slots, visible)
        h, mlp_out = self.residual_parts(emb, hidden, positions, cos, sin, kv_len, slots, visible)
        return h + mlp_out

    def residual_parts(self, emb, hidden, positions, cos, sin, kv_len=None, slots=None, visible=None):
        """The output g = h + mlp_out as its two terms, for DraftHeadNorm to add inside the final norm."""
        e_norm, h_norm, post = self.input_layernorm, self.hidden_norm, self.post_attention_layernorm
        x = launch.draft_input_norms(emb, hidden, e_norm.weight, e_norm.eps, h_norm.weight, h_norm.eps)
        attn = self.self_attn(x, positions, cos, sin, kv_len, None, slots, visible)
        h, normed = launch.add_rmsnorm(hidden, attn, post.weight, post.eps)          # h = hidden + attn
        return h, self.mlp(normed)


class DraftHeadNorm(draft.Eagle3Draft):
    """"add_rmsnorm" on the head (with DraftNormsKernel on its midlayer): the midlayer's last residual
    add inside the final norm, one launch (add_rmsnorm; torch's norm alone took 8.8 us for one row of
    7168 on the H200). Training (past) takes the plain forward."""

    def forward(self, tokens, positions, hidden, kv_len=None, past=None, slots=None, visible=None):
        if past is not None:
            return super().forward(tokens, positions, hidden, kv_len, past, slots, visible)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h, mlp_out = self.midlayer.residual_parts(self.embed_tokens(tokens), hidden, positions, cos, sin, kv_len,
                                                  slots, visible)
        g, normed = launch.add_rmsnorm(h, mlp_out, self.norm.weight, self.norm.eps)
        return self.lm_head(normed), g


class DraftTop1Kernel(draft.Eagle3Draft):
    """"router" on the head (its selection: the draft token from the logits, as the target's router
    selects experts): argmax and the d2t map in one launch (draft_top1)."""

    def to_target_ids(self, logits):
        return launch.draft_top1(logits, self.d2t)


DRAFT_KERNELS = ("attention", "router", "add_rmsnorm", "silu_mul", "fused_proj")   # KERNELS names the head takes


def accelerate_draft(head, names=()):
    """Swap the fast paths into a plain draft.Eagle3Draft, in place, and return the names swapped in
    (of KERNELS; those of DRAFT_KERNELS): "attention" (RoPE, cache write and attention of a chain step
    or an extend), "router" (the draft token's argmax and d2t map), "add_rmsnorm" (the input norms in
    one launch, each residual add in the norm that reads the sum), "silu_mul" (the MLP's SwiGLU),
    "fused_proj" (plain torch: q/k/v and gate/up as one GEMM each); an iterable, "all" or "none", as
    accelerate. The state dict keeps its keys and values; head.kernels records what was done (run.py
    prints it)."""
    names = kernel_names(names) & set(DRAFT_KERNELS)
    if hasattr(head, "kernels"):
        raise ValueError(f"accelerate_draft: this head is accelerated already (kernels {head.kernels}); build a "
                         "plain one")
    device, dtype = head.norm.weight.device, head.norm.weight.dtype
    if names - {"fused_proj"}:
        check_available(device)
        if dtype not in DRAFT_ATTN_BLOCK_N:
            raise ValueError(f"the Triton kernels run bf16, fp16 or fp32 heads, not {dtype}")
    mid = head.midlayer
    if "attention" in names:
        swap(mid.self_attn, DraftAttentionKernel)
    if "fused_proj" in names:
        swap(mid.self_attn, StackedQKV)
        swap(mid.mlp, StackedGateUp)
    if "add_rmsnorm" in names:
        swap(mid, DraftNormsKernel)
        swap(head, DraftHeadNorm)
    if "silu_mul" in names:
        swap(mid.mlp, SiluMulKernel)
    if "router" in names:
        swap(head, DraftTop1Kernel)
    head.kernels = tuple(k for k in DRAFT_KERNELS if k in names)
    return head.kernels


def compile_head(head, backend="inductor"):
    """run.py --compile for the EAGLE-3 head: torch.compile over its decoder layer, where the head
    calls it. With DraftNormsKernel / DraftHeadNorm ("add_rmsnorm") the head calls the midlayer's
    residual_parts, not its forward, so that method is compiled; else the module's forward.
    backend: torch.compile's (tests use "eager" on the CPU)."""
    mid = head.midlayer
    if isinstance(mid, DraftNormsKernel):
        mid.residual_parts = torch.compile(mid.residual_parts, dynamic=False, backend=backend)
    else:
        mid.compile(dynamic=False, backend=backend)
    return head
