"""The EAGLE-3 head (draft.py): its decoder layer at a chain step or an extend in fewer launches,
and its swaps."""
import math

import torch
import torch.nn.functional as F

import draft
from model import slots_read

from . import common
from .common import (AttachAgain, _counters, _jit, _last_program, _pow2, _wait_for_prior, launch,
                     tl, triton)
from .mla import _load_rows, _online_softmax_step, _softmax_new_tokens, _store_partial, _store_rows
from .stacked import stack_rows, training


# The EAGLE-3 head (draft.py): its decoder layer at a chain step or an extend, in fewer launches
#
# One head step at Kimi-K2's TP-8 shapes reads ~260 MB of weights (q/k/v 88, o 15, MLP 99, lm_head
# 57): a 61 us floor on the H200, but the plain step is 70 launches, most of them small ones around
# the GEMMs (RoPE by table gathers, repeat_interleave of the kv heads, an einsum over every slot,
# masks, four norms, a concat, argmax). The swaps below keep the
# GEMMs (cuBLAS, q/k/v and gate/up stacked, as the target's fused_proj) and put the rest into a few
# launches: both input norms and their concatenation (draft_input_norms), RoPE + cache write +
# attention + the merge of its splits (draft_attention), each residual add inside the norm that
# reads it (add_rmsnorm: the post-attention norm, the final norm), SwiGLU (silu_mul), and the draft
# token's argmax with its d2t map (draft_top1). A tree (slots and masks given) and training (past)
# take the plain forward. `python -m kernels.bench --draft` times the step and the extend, plain and
# with these swaps, against their floor.


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
    """torch.cat([RMSNorm(emb), RMSNorm(hidden)], -1) for emb, hidden [..., D] of one dtype: one
    launch."""
    D = emb.shape[-1]
    if hidden.shape != emb.shape or hidden.dtype != emb.dtype or emb_weight.shape != (D,) \
            or hidden_weight.shape != (D,):
        raise ValueError(f"draft_input_norms: emb {emb.dtype} {list(emb.shape)}, hidden "
                         f"{hidden.dtype} {list(hidden.shape)}, weights {list(emb_weight.shape)} "
                         f"{list(hidden_weight.shape)} do not fit")
    common.check_unit_stride("draft_input_norms", "emb_weight", emb_weight)
    common.check_unit_stride("draft_input_norms", "hidden_weight", hidden_weight)
    e2, h2 = emb.reshape(-1, D), hidden.reshape(-1, D)
    e2, h2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (e2, h2))
    out = torch.empty(e2.shape[0], 2 * D, device=emb.device, dtype=emb.dtype)
    if e2.shape[0]:
        _draft_norms_kernel[(e2.shape[0], 2)](
            e2, h2, emb_weight, hidden_weight, out, D, float(emb_eps), float(hidden_eps),
            e2.stride(0), h2.stride(0), out.stride(0), BLOCK_D=_pow2(D), launch_pdl=common.PDL,
            num_warps=8 if D >= 4096 else 4)
    return out.view(*emb.shape[:-1], 2 * D)


# The head's attention (Llama's: H query heads over G kv heads of Hd, rotate-half RoPE, K and V
# cached by slot = position) for a chain step or an extend of a few tokens, one launch. As MLA's
# decode kernel (mla.py): program (part, b, g) takes kv head g of batch row b and its
# GROUP = H / G query heads for all T tokens, M = T * GROUP query rows against each tile of keys,
# with its helpers (the online-softmax step, part 0's causal tile, the partial store). Part 0 is
# the T new tokens: it rotates their keys, writes keys and values to their slots and attends to
# them in registers (causally). Parts 1, 2, ... split the cached slots before the row's first new
# position, which no program writes. Each program stores its partial output and log-sum-exp; the
# last of a (b, g) to finish (an atomic counter, as norm_gemv's) merges them in part order: one
# launch, no float atomics, a graph replay equal to the eager call. Queries are rotated in every
# program (rotate-half: x * cos + sign * x[(i + Hd/2) % Hd] * sin, both loads from the row in
# L1/L2). Block sizes as the MLA kernel's (mla.py), its tiles smaller (Hd 128: 16 KB bf16 K and V
# tiles); `python -m kernels.bench --draft` times the kernel at each split length.
DRAFT_ATTN_BLOCK_N = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
DRAFT_ATTN_STAGES = {torch.bfloat16: 3, torch.float16: 3, torch.float32: 2}
DRAFT_ATTN_MAX_ROWS = 32    # M = T * GROUP query rows a program (the fp32 accumulator's registers);
#                             more (prefill chunks) take the plain forward
DRAFT_ATTN_MIN_SPLIT = 64   # cached slots a split at least: one bf16 tile


@_jit
def _rope_rows(x_rows, rope_rows, cos_ptr, sin_ptr, ok, HD: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate-half RoPE of rows of HD values (draft.rotate_half_rope): x_rows [N] pointers to each
    row, rope_rows [N] offsets of its cos / sin rows [HD / 2] float32. Returns [N, BLOCK_D]
    float32."""
    i = tl.arange(0, BLOCK_D)
    m = ok[:, None] & (i < HD)[None, :]
    half = HD // 2
    x = tl.load(x_rows[:, None] + i[None, :], mask=m, other=0.0).to(tl.float32)
    x_other = tl.load(x_rows[:, None] + ((i + half) % HD)[None, :], mask=m,
                      other=0.0).to(tl.float32)
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
        # [BLOCK_M, BLOCK_N]
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * scale_log2
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, offs_n < hi, vt, DOT_PRECISION)
    return m_i, l_i, acc


@_jit
def _merge_parts(po_ptr, lse_ptr, first, parts, offs_m, row_ok, M, HD: tl.constexpr,
                 BLOCK_D: tl.constexpr):
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
        lse_j = tl.load(lse_ptr + (first + j) * M + offs_m, mask=row_ok, other=float("-inf"),
                        cache_modifier=".cg")
        o_j = tl.load(po_ptr + ((first + j) * M + offs_m[:, None]) * HD + d[None, :], mask=rd,
                      other=0.0,
                      cache_modifier=".cg")
        top_new = tl.maximum(top, lse_j)
        alpha, w = tl.exp2(top - top_new), tl.exp2(lse_j - top_new)
        out = out * alpha[:, None] + w[:, None] * o_j
        wsum = wsum * alpha + w
        top = top_new
    return out / tl.where(wsum > 0, wsum, 1.0)[:, None]


@_jit
def _draft_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, o_ptr,
                            po_ptr, lse_ptr,
                            count_ptr, T, M, kv_len, split_len, scale_log2,
                            s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_rb, s_rt,
                            s_posb, s_post,
                            s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_ob, s_ot, s_oh,
                            HD: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_M: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    """See the section's head. q [B, T, H, HD], k and v [B, T, G, HD] (not rotated), cos and sin [B,
    T, HD / 2] float32 at pos int64 [B, T] (consecutive in a row), caches kc, vc [B, >= kv_len, G,
    HD], o [B, T, H, HD]: last dims contiguous. po [B, G, parts, M, HD] and lse [B, G, parts, M]
    float32 scratch, count [B * G] int32 zeros (left zero). Grid: (parts, B, G)."""
    _wait_for_prior()
    part, b, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    parts, G = tl.num_programs(0), tl.num_programs(2)
    dt = kc_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    t_m, head = offs_m // GROUP, g * GROUP + offs_m % GROUP
    q = _rope_rows(q_ptr + b * s_qb + t_m * s_qt + head * s_qh, b * s_rb + t_m * s_rt, cos_ptr,
                   sin_ptr, row_ok,
                   HD, BLOCK_D).to(dt)  # [BLOCK_M, BLOCK_D]
    if part == 0:   # the new tokens, in registers
        offs_t = tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        pos_t = tl.load(pos_ptr + b * s_posb + offs_t * s_post, mask=t_ok, other=0)  # their slots
        pos = tl.load(pos_ptr + b * s_posb + t_m * s_post, mask=row_ok, other=-1)  # [BLOCK_M]
        k_new = _rope_rows(k_ptr + b * s_kb + offs_t * s_kt + g * s_kh, b * s_rb + offs_t * s_rt,
                           cos_ptr, sin_ptr,
                           t_ok, HD, BLOCK_D).to(dt)  # [BLOCK_T, BLOCK_D]
        # [BLOCK_T, BLOCK_D]
        v_new = _load_rows(v_ptr + b * s_vb + offs_t * s_vt + g * s_vh, t_ok, HD, BLOCK_D)
        _store_rows(kc_ptr + b * s_kcb + pos_t * s_kcs + g * s_kch, k_new, t_ok, HD)
        _store_rows(vc_ptr + b * s_vcb + pos_t * s_vcs + g * s_vch, v_new, t_ok, HD)
        # [BLOCK_M, BLOCK_T]
        s = tl.dot(q, tl.trans(k_new), input_precision=DOT_PRECISION) * scale_log2
        m_i, l_i, acc = _softmax_new_tokens(s, pos, pos_t, t_ok, v_new, DOT_PRECISION)
    else:           # cached slots [lo, hi): this split's, before the row's first new position
        lo = (part - 1) * split_len
        hi = tl.minimum(tl.minimum(tl.load(pos_ptr + b * s_posb), kv_len), lo + split_len)
        m_i, l_i, acc = _draft_attend_cached(q, kc_ptr + b * s_kcb + g * s_kch, s_kcs,
                                             vc_ptr + b * s_vcb + g * s_vch,
                                             s_vcs, lo, hi, scale_log2, HD, BLOCK_N, DOT_PRECISION)
    bg = b * G + g  # every part stores, one holding no slot too (lse -inf): the merge reads all
    _store_partial(po_ptr + ((bg * parts + part) * M + offs_m) * HD,
                   lse_ptr + (bg * parts + part) * M + offs_m,
                   m_i, l_i, acc, row_ok, HD)
    if _last_program(count_ptr, bg, parts):  # the other parts are stored: merge, in part order
        out = _merge_parts(po_ptr, lse_ptr, bg * parts, parts, offs_m, row_ok, M, HD, BLOCK_D)
        _store_rows(o_ptr + b * s_ob + t_m * s_ot + head * s_oh, out.to(o_ptr.dtype.element_ty),
                    row_ok, HD)


def draft_split_len(kv_len, programs_per_part, block_n, device):
    """Slots per split: about two programs an SM over a full cache, each split at least
    DRAFT_ATTN_MIN_SPLIT slots and whole tiles. Host ints only."""
    want = max(1, 2 * common.sm_count(device) // programs_per_part - 1)
    split = max(DRAFT_ATTN_MIN_SPLIT, math.ceil(kv_len / want))
    return math.ceil(split / block_n) * block_n


def _check_draft_inputs(q, k, v, cos, sin, positions, k_cache, v_cache):
    """draft_attention's inputs, or a ValueError that names what does not fit."""
    B, T, H, HD = q.shape
    G, S = k.shape[2], k_cache.shape[1]
    if (k.shape != (B, T, G, HD) or v.shape != k.shape or H % G or HD % 2
            or cos.shape != (B, T, HD // 2) or sin.shape != cos.shape
            or k_cache.shape != (B, S, G, HD) or v_cache.shape != k_cache.shape):
        raise ValueError(f"draft_attention: shapes q {list(q.shape)}, k {list(k.shape)}, "
                         f"v {list(v.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}, "
                         f"caches {list(k_cache.shape)} {list(v_cache.shape)} do not fit "
                         "[B, T, H, Hd], [B, T, G, Hd] twice, [B, T, Hd/2] twice, "
                         "[B, S, G, Hd] twice, with G dividing H and Hd even")
    if positions.shape != (B, T) or positions.dtype != torch.int64 or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32:
        raise ValueError(f"draft_attention: positions must be int64 [{B}, {T}] and cos, sin "
                         f"float32, got {positions.dtype} {list(positions.shape)}, {cos.dtype}, "
                         f"{sin.dtype}")
    dtypes = {x.dtype for x in (q, k, v, k_cache, v_cache)}
    if len(dtypes) != 1 or q.dtype not in DRAFT_ATTN_BLOCK_N:
        raise ValueError("draft_attention: needs one dtype of "
                         f"{sorted(map(str, DRAFT_ATTN_BLOCK_N))} for q, k, v and the caches, got "
                         f"{sorted(map(str, dtypes))} (float64: use the plain path)")
    M = T * (H // G)
    if M > DRAFT_ATTN_MAX_ROWS or B * G > common.COUNTERS:
        raise ValueError(f"draft_attention: {M} query rows a kv head (at most "
                         f"{DRAFT_ATTN_MAX_ROWS}) or {B * G} batch rows x kv heads (at most "
                         f"{common.COUNTERS}): use the plain path")
    for name, x in dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache).items():
        if x.stride(-1) != 1:
            raise ValueError(f"draft_attention: {name}'s last dim must be contiguous")


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
    _check_draft_inputs(q, k, v, cos, sin, positions, k_cache, v_cache)
    M = T * (H // G)
    cos = cos if cos.stride(-1) == 1 and cos.stride() == sin.stride() else cos.contiguous()
    sin = sin if sin.stride() == cos.stride() else sin.contiguous()
    block_n = DRAFT_ATTN_BLOCK_N[q.dtype]
    split_len = split_len or draft_split_len(S, B * G, block_n, q.device)
    parts = 1 + triton.cdiv(S, split_len)
    po = torch.empty(B, G, parts, M, HD, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, G, parts, M, device=q.device, dtype=torch.float32)
    out = torch.empty(B, T, H, HD, device=q.device, dtype=q.dtype)
    _draft_attention_kernel[(parts, B, G)](
        q, k, v, cos, sin, positions, k_cache, v_cache, out, po, lse, _counters(q.device), T, M, S,
        split_len,
        scale * math.log2(math.e), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(1), positions.stride(0),
        positions.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        HD=HD, GROUP=H // G, BLOCK_D=_pow2(HD), BLOCK_M=_pow2(M), BLOCK_T=_pow2(T), BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", launch_pdl=common.PDL,
        num_warps=4,
        num_stages=DRAFT_ATTN_STAGES[q.dtype])
    return out


@_jit
def _draft_top1_kernel(x_ptr, d2t_ptr, out_ptr, V, s_x, BLOCK: tl.constexpr):
    """out[n] = i + d2t[i] for i the first index of the largest x[n, :V] (torch.argmax's; NaN
    aside). Each lane keeps its first maximum over the row's blocks; the smallest index among the
    lanes holding the row's maximum is then the first. Grid: (N,)."""
    _wait_for_prior()
    n = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_ptr + n * s_x + start + offs, mask=start + offs < V,
                    other=float("-inf")).to(tl.float32)
        take = x > best                                 # strictly: a lane keeps its first maximum
        best = tl.where(take, x, best)
        best_i = tl.where(take, start + offs, best_i)
    i = tl.min(tl.where(best == tl.max(best, 0), best_i, V), 0)
    tl.store(out_ptr + n, i + tl.load(d2t_ptr + i))


# logits a step: 8 steps over Kimi-K2's 32000-token draft vocabulary, one program (faster than
# torch's argmax reduce and the d2t gather: python -m kernels.bench --draft)
DRAFT_TOP1_BLOCK = 4096


def draft_top1(logits, d2t):
    """logits.argmax(-1) mapped to target ids (i + d2t[i]), one launch: logits [..., Vd] float, d2t
    int64 [Vd]. Returns int64 [...]."""
    V = logits.shape[-1]
    if d2t.shape != (V,) or d2t.dtype != torch.int64 or not logits.is_floating_point():
        raise ValueError(f"draft_top1: logits {logits.dtype} {list(logits.shape)} and d2t "
                         f"{d2t.dtype} {list(d2t.shape)} do not fit [..., Vd] float and int64 [Vd]")
    common.check_unit_stride("draft_top1", "d2t", d2t)
    x = logits.reshape(-1, V)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], device=logits.device, dtype=torch.int64)
    if x.shape[0]:
        _draft_top1_kernel[(x.shape[0],)](x, d2t, out, V, x.stride(0),
                                          BLOCK=min(DRAFT_TOP1_BLOCK, _pow2(V)),
                                          launch_pdl=common.PDL, num_warps=4)
    return out.view(logits.shape[:-1])


launch.draft_top1 = draft_top1
launch.draft_input_norms = draft_input_norms
launch.draft_attention = draft_attention


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
        S = slots_read(kv_len, self.k_cache.shape[1])
        o = launch.draft_attention(q, k, v, cos, sin, positions, self.k_cache[:B, :S],
                                   self.v_cache[:B, :S],
                                   self.scale)
        return self.o_proj(o.flatten(2))


class StackedQKV(AttachAgain, draft.DraftAttention):
    """"fused_proj" on the head: q_proj, k_proj and v_proj, which all read x, as one GEMM over their
    weights stacked (stack_rows)."""

    def attach(self):
        self.qkv_weight = stack_rows(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x):
        if training(self.q_proj, self.k_proj, self.v_proj):
            return super().project(x)
        B, T, _ = x.shape
        H, G, HD = self.n_local_heads, self.n_local_kv_heads, self.head_dim
        q, k, v = F.linear(x, self.qkv_weight).split([H * HD, G * HD, G * HD], -1)
        return q.view(B, T, H, HD), k.view(B, T, G, HD), v.view(B, T, G, HD)


class DraftNormsKernel(draft.MidLayer):
    """"add_rmsnorm" on the head's midlayer: both input norms and their concatenation in one launch
    (draft_input_norms), the residual add inside post_attention_layernorm (add_rmsnorm). Training
    (past) takes the plain forward: the kernels have no backward."""

    def forward(self, emb, hidden, positions, cos, sin, kv_len=None, past=None, slots=None,
                visible=None):
        if past is not None:
            return super().forward(emb, hidden, positions, cos, sin, kv_len, past, slots, visible)
        h, mlp_out = self.residual_parts(emb, hidden, positions, cos, sin, kv_len, slots, visible)
        return h + mlp_out

    def residual_parts(self, emb, hidden, positions, cos, sin, kv_len=None, slots=None,
                       visible=None):
        """The output g = h + mlp_out as its two terms, for DraftHeadNorm to add inside the final
        norm."""
        e_norm, h_norm, post = self.input_layernorm, self.hidden_norm, self.post_attention_layernorm
        x = launch.draft_input_norms(emb, hidden, e_norm.weight, e_norm.eps, h_norm.weight,
                                     h_norm.eps)
        attn = self.self_attn(x, positions, cos, sin, kv_len, None, slots, visible)
        h, normed = launch.add_rmsnorm(hidden, attn, post.weight, post.eps)  # h = hidden + attn
        return h, self.mlp(normed)


class DraftHeadNorm(draft.Eagle3Draft):
    """"add_rmsnorm" on the head (with DraftNormsKernel on its midlayer): the midlayer's last
    residual add inside the final norm, one launch (add_rmsnorm). Training (past) takes the plain
    forward."""

    def forward(self, tokens, positions, hidden, kv_len=None, past=None, slots=None, visible=None):
        if past is not None:
            return super().forward(tokens, positions, hidden, kv_len, past, slots, visible)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h, mlp_out = self.midlayer.residual_parts(self.embed_tokens(tokens), hidden, positions,
                                                  cos, sin, kv_len,
                                                  slots, visible)
        g, normed = launch.add_rmsnorm(h, mlp_out, self.norm.weight, self.norm.eps)
        return self.lm_head(normed), g


class DraftTop1Kernel(draft.Eagle3Draft):
    """"router" on the head (its selection: the draft token from the logits, as the target's router
    selects experts): argmax and the d2t map in one launch (draft_top1)."""

    def to_target_ids(self, logits):
        return launch.draft_top1(logits, self.d2t)


def compile_head(head, backend="inductor"):
    """run.py --compile for the EAGLE-3 head: torch.compile over its decoder layer, where the head
    calls it. With DraftNormsKernel / DraftHeadNorm ("add_rmsnorm") the head calls the midlayer's
    residual_parts, not its forward, so that method is compiled; else the module's forward.
    backend: torch.compile's (tests use "eager" on the CPU)."""
    common.keep_out_of_compile()
    mid = head.midlayer
    if isinstance(mid, DraftNormsKernel):
        mid.residual_parts = torch.compile(mid.residual_parts, dynamic=False, backend=backend)
    else:
        mid.compile(dynamic=False, backend=backend)
    return head
