"""The Kimi-K2 / DeepSeek-V3 target: MLA attention, sigmoid noaux_tc MoE, tensor parallel.

Numerics follow Hugging Face transformers' DeepseekV3 (fp32 router logits, correction bias for
selection only, YaRN with the mscale^2 softmax factor, RoPE on interleaved pairs). References:
DeepSeek-V2 (MLA, arXiv:2405.04434), DeepSeek-V3 (noaux_tc routing, arXiv:2412.19437), YaRN
(arXiv:2309.00071).

The KV cache is static: per layer the normalized latent [B, S, kv_lora_rank] and the rotated
k_pe [B, S, qk_rope_head_dim], written at `positions` (slot = position). A query at position p
attends to slots <= p, so rejected speculative tokens cost nothing: their slots are overwritten
before anyone reads them. Two attention paths read that one cache:
  extend: expand the latent to per-head keys/values with kv_b_proj, then ordinary attention;
  decode: absorb kv_b_proj into the query and the output, attend in the latent space.
Nothing in `forward` reads a device value on the host, so every shape can be CUDA-graph captured.

This is the plain reference and the only path written here. The fast paths (Triton kernels,
stacked GEMMs, the fused MoE) are subclasses of these modules in kernels/, put in place from
outside by kernels.accelerate(model, names); this file imports nothing of them.

Shape legend: B batch, T new tokens, S cache slots read, D hidden, H local heads, E routed
experts, K experts per token, I local expert intermediate, C kv_lora_rank, R qk_rope_head_dim,
N = B*T tokens.
"""
import math
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from tp import (TP, ColumnParallelLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear,
                VocabParallelEmbedding, _param)


def eos_union(*values):
    """The ids in values (each an id, a list of ids or None), in order, each once."""
    ids = [i for v in values for i in ([] if v is None else [v] if isinstance(v, int) else v)]
    return list(dict.fromkeys(ids))


@dataclass
class ModelArgs:
    """Fields are the keys of a DeepseekV3 / Kimi-K2 config.json; checkpoint.target_args reads
    one, refusing what this model does not implement (quantization layouts: quant_scheme)."""
    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.827
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    hidden_act: str = "silu"
    rope_theta: float = 50000.0
    rope_scaling: dict | None = field(default_factory=lambda: dict(
        type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | list | None = 163585  # one id or a list (several end-of-sequence ids)
    quantization_config: dict | None = None  # as shipped: FP8 blocks or INT4 experts

    @property
    def fp8_block(self):
        """The FP8 (rows, cols) block when the routed experts are kept in FP8, else None."""
        q = self.quantization_config or {}
        return tuple(q["weight_block_size"]) if q.get("quant_method") == "fp8" else None

    @property
    def int4_group_size(self):
        """The INT4 group size when the routed experts are kept packed, else None."""
        q = self.quantization_config or {}
        if q.get("quant_method") != "compressed-tensors":
            return None
        (group,) = q["config_groups"].values()
        return group["weights"]["group_size"]

    @property
    def eos_token_ids(self):
        """Every id generation stops at, as a list."""
        return eos_union(self.eos_token_id)

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_yarn(self):
        return bool(self.rope_scaling) and self.rope_scaling.get("type") == "yarn"

    @property
    def softmax_scale(self):
        # DeepseekV3: qk_head_dim^-0.5, times mscale^2 whenever rope_scaling is yarn (rope_tables)
        scale = self.qk_head_dim ** -0.5
        if self.is_yarn:
            rs = self.rope_scaling
            mscale = yarn_mscale(rs["factor"], rs.get("mscale_all_dim", 0))
            scale *= mscale * mscale
        return scale

    def default_aux_layer_ids(self):
        """EAGLE-3's default: outputs of layers 1, L//2 - 1 and L - 4 (SGLang, SpecForge), kept
        inside [0, L) for toy depths (where two ids may name one layer: it is read twice)."""
        n = self.num_hidden_layers
        return [min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4)]


# ---------------------------------------------------------------------------------------------
# RoPE (YaRN, interleaved pairs as in DeepseekV3)

def at_least_f32(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def yarn_mscale(factor, mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def slots_read(kv_len, capacity):
    """The cache slots a forward reads: the first kv_len of the cache's `capacity` (None: all).
    A host int, checked on the host; that kv_len exceeds every position written (each query must
    see its own key) is the caller's to size (verify.kv_bucket): checking it would read the
    positions off the device."""
    if kv_len is None:
        return capacity
    if isinstance(kv_len, bool) or not isinstance(kv_len, int) or not 1 <= kv_len <= capacity:
        raise ValueError(f"kv_len must be an int from 1 to the cache's {capacity} slots (None: "
                         f"all), not {kv_len!r}")
    return kv_len


def rope_tables(dim, theta, rope_scaling, max_seq_len, device):
    """cos, sin [S, dim/2] in float32, YaRN-scaled when rope_scaling says so (HF's formulas). YaRN
    applies at every cache length here, as in HF transformers and SGLang. DeepSeek's own
    inference/model.py ramps the frequencies (and multiplies the softmax scale by mscale^2) only
    when its max_seq_len exceeds original_max_position_embeddings, so with a cache of at most
    4096 slots its logits differ from these and from the engines'."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    attention_factor = 1.0
    if rope_scaling and rope_scaling.get("type") == "yarn":
        rs = rope_scaling
        factor, orig = rs["factor"], rs["original_max_position_embeddings"]

        def correction_dim(rotations):
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(correction_dim(rs.get("beta_fast") or 32)), 0)
        high = min(math.ceil(correction_dim(rs.get("beta_slow") or 1)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        ramp = ramp.clamp(0, 1)
        keep = 1 - ramp  # 1: keep the original frequency (extrapolate), 0: divide by factor
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
        attention_factor = rs.get("attention_factor")  # as HF: an explicit factor wins, else
        if attention_factor is None:                    # DeepSeek's mscale ratio, else YaRN's own
            if rs.get("mscale") and rs.get("mscale_all_dim"):
                attention_factor = (yarn_mscale(factor, rs["mscale"])
                                    / yarn_mscale(factor, rs["mscale_all_dim"]))
            else:
                attention_factor = yarn_mscale(factor)
    elif rope_scaling:
        raise NotImplementedError(f"rope_scaling type {rope_scaling.get('type')!r} "
                                  "is not implemented")
    if torch.device(device).type == "meta":  # sizes only: nothing computed for S positions
        shape = (max_seq_len, len(inv_freq))
        return (torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device))
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return (freqs.cos() * attention_factor).to(device), (freqs.sin() * attention_factor).to(device)


def rope_table(args, max_seq_len, device):
    """rope_tables' cos and sin stacked, [S, R/2, 2]. On the meta device (sizes only: run.py's
    memory estimate) only allocated: a stack of meta tensors imports torch._dynamo (seconds)."""
    cos, sin = rope_tables(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling,
                           max_seq_len, device)
    if cos.is_meta:
        return torch.empty(*cos.shape, 2, dtype=cos.dtype, device=device)
    return torch.stack((cos, sin), -1)


def apply_rope(x, rope):
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last dim by the angles whose (cos, sin)
    are rope [B, T, R/2, 2] (a head dim is inserted for x [B, T, H, R]). Eager: one complex
    multiply. Under torch.compile the same rotation in real arithmetic, because inductor does
    not generate code for complex numbers and would leave the multiply unfused."""
    if x.dim() == 4:
        rope = rope.unsqueeze(2)
    xf = at_least_f32(x).unflatten(-1, (-1, 2))
    if torch.compiler.is_compiling():
        (x0, x1), (cos, sin) = xf.unbind(-1), rope.unbind(-1)
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1)
    else:
        out = torch.view_as_complex(xf.contiguous()) * torch.view_as_complex(rope)
        out = torch.view_as_real(out)
    return out.flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), None, device, dtype)

    def forward(self, x, residual=None):
        """RMSNorm(x); with a residual, (RMSNorm(x + residual), x + residual): the residual
        stream's add travels with the norm that reads the sum (as nano-vllm's), so one module
        holds both and a fused add + norm can replace it alone."""
        if residual is not None:
            x = x + residual
        # x * rsqrt(mean(x^2) + eps) * weight, computed in at least float32; in bf16 the weight is
        # applied before the one rounding (HF rounds, then multiplies: up to 1 ulp apart)
        normed = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return normed if residual is None else (normed, x)


# ---------------------------------------------------------------------------------------------
# MLA

def absorbed_attention(q_lat, q_pe, kv_c, pe_c, future, scale):
    """Attention in the latent space: with kv_b_proj's key half absorbed into the query (q_lat =
    q_nope W_uk), a slot's normalized latent is both its key and its value, so q_lat [B, T, H, C]
    and the rotated q_pe [B, T, H, R] meet kv_c [B, S, C] and pe_c [B, S, R] directly; future
    [B, T, S] masks slots past each query's position. Returns the latent output [B, T, H, C]
    (W_uv still to apply)."""
    scores = (torch.einsum("bthc,bsc->bths", q_lat, kv_c)
              + torch.einsum("bthr,bsr->bths", q_pe, pe_c))
    scores = (scores * scale).masked_fill(future.unsqueeze(2), float("-inf"))
    p = scores.softmax(-1, dtype=torch.promote_types(q_lat.dtype, torch.float32)).to(q_lat.dtype)
    return torch.einsum("bths,bsc->bthc", p, kv_c)                           # p [B, T, H, S]


class MLA(nn.Module):
    """Multi-head latent attention: the queries through a low-rank q_a / q_b pair, the keys and
    values compressed to one latent row per token (kv_a), which the cache holds, normalized,
    beside its rotated rope key. caches: the (latent, rope key) caches [max_batch_size,
    max_seq_len, C] and [..., R] to hold (Transformer's: views of its stacked caches); None: its
    own."""

    def __init__(self, args, tp, max_batch_size, max_seq_len, device, dtype, caches=None):
        super().__init__()
        self.args = a = args
        H, heads = a.num_attention_heads, "num_attention_heads"
        self.n_local_heads = tp.split(H, heads)
        if a.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(a.hidden_size, a.q_lora_rank, device, dtype)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, a.rms_norm_eps, device, dtype)
            self.q_b_proj = ColumnParallelLinear(a.q_lora_rank, H * a.qk_head_dim, tp, heads,
                                                 device, dtype)
        else:
            self.q_proj = ColumnParallelLinear(a.hidden_size, H * a.qk_head_dim, tp, heads,
                                               device, dtype)
        C, R = a.kv_lora_rank, a.qk_rope_head_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(a.hidden_size, C + R, device, dtype)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, a.rms_norm_eps, device, dtype)
        self.kv_b_proj = ColumnParallelLinear(C, H * (a.qk_nope_head_dim + a.v_head_dim), tp, heads,
                                              device, dtype)
        self.o_proj = RowParallelLinear(H * a.v_head_dim, a.hidden_size, tp, heads, device=device,
                                        dtype=dtype)
        caches = caches or [torch.zeros(max_batch_size, max_seq_len, width, device=device,
                                        dtype=dtype) for width in (C, R)]
        for name, cache in zip(("kv_cache", "pe_cache"), caches):
            self.register_buffer(name, cache, persistent=False)

    def forward(self, x, positions, rope, future, mode, slots=None):
        """future [B, T, S]: True where a query must not see one of the S slots read (past its
        position: not written yet, or a rejected draft's); mode "extend" or "decode" picks
        attend_extend or attend_absorbed. The latents go to slot = position, or to a tree's
        slots [B, T] (Transformer.forward), where only the mask decides what a query sees."""
        q, kv_a = self.project(x)                          # [B, T, h*(d+R)], [B, T, C+R]
        return self.attend(q, kv_a, positions, rope, future, mode, slots)

    def attend(self, q, kv_a, positions, rope, future, mode, slots=None):
        """forward after the projections: the cache write, the attention over the cache and o_proj
        for the queries q and the compressed key-values kv_a of project(x)."""
        a, h = self.args, self.n_local_heads
        (B, T, _), kv_len = kv_a.shape, future.shape[-1]
        q = q.view(B, T, h, a.qk_head_dim)
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        q_pe = self.write_cache(q_pe, kv_a, positions if slots is None else slots, rope)
        kv_c, pe_c = self.kv_cache[:B, :kv_len], self.pe_cache[:B, :kv_len]   # [B, S, C], [B, S, R]
        path = self.attend_extend if mode == "extend" else self.attend_absorbed
        o = path(q_nope, q_pe, kv_c, pe_c, future)                             # [B, T, H, d]
        return self.o_proj(o.flatten(2))                                       # [B, T, D]

    def project(self, x):
        """The queries and the compressed key-values of x: q [B, T, h*(d+R)], kv_a [B, T, C+R]."""
        q = self.query(self.q_a_proj(x)) if self.args.q_lora_rank else self.q_proj(x)
        return q, self.kv_a_proj_with_mqa(x)

    def query(self, q_a):                              # [B, T, q_lora_rank] -> [B, T, h*(d+R)]
        return self.q_b_proj(self.q_a_layernorm(q_a))

    def write_cache(self, q_pe, kv_a, slots, rope):
        """Write the new tokens' normalized latents and rotated rope keys (rope: at their
        positions) at `slots`, slot = position but for a tree's nodes; returns the rotated q_pe."""
        a, B = self.args, kv_a.shape[0]
        kv, k_pe = kv_a.split([a.kv_lora_rank, a.qk_rope_head_dim], -1)     # [B, T, C], [B, T, R]
        rows = torch.arange(B, device=kv_a.device).unsqueeze(1)
        self.kv_cache[rows, slots] = self.kv_a_layernorm(kv)
        self.pe_cache[rows, slots] = apply_rope(k_pe, rope)
        return apply_rope(q_pe, rope)

    def kv_b_halves(self):
        """kv_b_proj's weight as its key and value halves per local head: w_uk, w_uv [H, d, C]."""
        a = self.args
        w_kv_b = self.kv_b_proj.weight.view(self.n_local_heads, -1, a.kv_lora_rank)
        return w_kv_b.split([a.qk_nope_head_dim, a.v_head_dim], 1)

    def attend_extend(self, q_nope, q_pe, kv_c, pe_c, future):
        """Prefill-style: every cached latent expanded by kv_b_proj to per-head keys and values."""
        a, (B, S, _) = self.args, kv_c.shape
        k_nope, v = self.kv_b_proj(kv_c).view(B, S, self.n_local_heads, -1).split(
            [a.qk_nope_head_dim, a.v_head_dim], -1)                            # [B, S, H, d]
        scores = (torch.einsum("bthd,bshd->bths", q_nope, k_nope)
                  + torch.einsum("bthr,bsr->bths", q_pe, pe_c))
        scores = (scores * a.softmax_scale).masked_fill(future.unsqueeze(2), float("-inf"))
        p = scores.softmax(-1, dtype=torch.promote_types(q_nope.dtype, torch.float32))
        return torch.einsum("bths,bshd->bthd", p.to(q_nope.dtype), v)          # p [B, T, H, S]

    def attend_absorbed(self, q_nope, q_pe, kv_c, pe_c, future):
        """Decode-style (absorbed MLA): a key is k = W_uk c for a cached latent c, so q . k =
        (W_uk^T q) . c: W_uk moves onto the T queries instead of onto all S cached latents; likewise
        o = sum_s p_s (W_uv c_s) = W_uv (sum_s p_s c_s): attend over latents, then W_uv once."""
        w_uk, w_uv = self.kv_b_halves()
        q_lat = self.absorb_query(q_nope, w_uk)                                # [B, T, H, C]
        o_lat = absorbed_attention(q_lat, q_pe, kv_c, pe_c, future,
                                   self.args.softmax_scale)                    # [B, T, H, C]
        return self.absorb_output(o_lat, w_uv)                                 # [B, T, H, d]

    def absorb_query(self, q_nope, w_uk):                             # kv_b_proj's key half
        return torch.einsum("bthd,hdc->bthc", q_nope, w_uk)

    def absorb_output(self, o_lat, w_uv):                             # kv_b_proj's value half
        return torch.einsum("bthc,hdc->bthd", o_lat, w_uv)


# ---------------------------------------------------------------------------------------------
# MLP and MoE

class MLP(nn.Module):
    """SwiGLU; gate/up column parallel, down row parallel (reduce=False: the caller all-reduces
    the sum of several partial sums)."""

    def __init__(self, dim, inter, tp, what, reduce=True, device=None, dtype=None):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, inter, tp, what, device, dtype)
        self.up_proj = ColumnParallelLinear(dim, inter, tp, what, device, dtype)
        self.down_proj = RowParallelLinear(inter, dim, tp, what, reduce, device, dtype)

    def forward(self, x):
        return self.down_proj(self.act(*self.gate_up(x)))

    def gate_up(self, x):
        return self.gate_proj(x), self.up_proj(x)

    def act(self, gate, up):
        return F.silu(gate) * up


def check_groups(args):
    """The router's groups can give num_experts_per_tok experts: E splits into n_group groups of at
    least 2 (a group's score is its best two), topk_group of them kept hold K experts or more."""
    E, G, kept, K = (args.n_routed_experts, args.n_group, args.topk_group,
                     args.num_experts_per_tok)
    if not 1 <= K <= E:
        raise ValueError(f"num_experts_per_tok = {K} outside [1, n_routed_experts = {E}]")
    if G > 1 and (E % G or E // G < 2 or not 1 <= kept <= G or kept * (E // G) < K):
        raise ValueError(f"router groups: {E} experts in n_group = {G} groups of at least 2, "
                         f"topk_group = {kept} of them kept, must hold num_experts_per_tok = {K}")


class Router(nn.Module):
    """Sigmoid scores; the correction bias picks groups and experts, the unbiased scores weigh them.
    For timing random weights (whose router picks unlike a trained one; run.py --routing), the
    choice is replaced on the device after the scores and the selection, whose cost stays
    (set_routing): "uniform" (SIMULATED) by uniform_choice, K distinct experts a token (K <= E),
    used evenly, weighed by the model's scores of those experts, normalized and scaled as usual;
    "distinct" (SIMULATED) or "trace" (TRACE) by `choice`, ids [N, K] -> ids [N, K], which
    replaces which experts run and nothing else: column j keeps the weight of the router's own
    j-th pick (the weights scale the experts' outputs, not their cost; a routing kernel then
    copies the choice over its ids, no launch more)."""

    def __init__(self, args, device, dtype, routing="model"):
        super().__init__()
        self.args, self.routing, self.choice = args, routing, None
        check_groups(args)
        # as the checkpoints store it (bf16), or wider where the model's dtype is (fp16 widens to
        # fp32: bf16's range); the logits in fp32 from its exact fp32 values, as transformers does
        wide = torch.promote_types(dtype or torch.get_default_dtype(), torch.bfloat16)
        self.weight = _param((args.n_routed_experts, args.hidden_size), None, device, wide)
        self.e_score_correction_bias = _param((args.n_routed_experts,), None, device, torch.float32)

    def forward(self, x):                                          # [N, D] -> [N, K] ids, weights
        a = self.args
        scores = F.linear(at_least_f32(x), at_least_f32(self.weight)).sigmoid()  # [N, E] fp32
        biased = scores + self.e_score_correction_bias
        if a.n_group > 1:
            grouped = biased.unflatten(-1, (a.n_group, -1))                    # [N, G, E/G]
            group_score = grouped.topk(2, dim=-1).values.sum(-1)              # [N, G]
            top = group_score.topk(a.topk_group, -1).indices
            keep = torch.zeros_like(group_score).scatter_(1, top, 1)
            # dropped groups get -inf, as in DeepSeek's reference and SGLang. transformers v4 fills
            # 0.0, and a biased score (sigmoid + bias) can be negative: there a dropped group's
            # expert can outrank a kept one. Both agree when the K-th best kept score is positive.
            biased = grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).flatten(1)
        ids = biased.topk(a.num_experts_per_tok, dim=-1).indices
        if self.routing == "uniform":
            ids = self.uniform_choice(ids)
        weights = self.normalize(scores.gather(1, ids))
        if self.choice is not None:
            ids = self.choice(ids)
        return ids, weights

    def uniform_choice(self, ids):
        """SIMULATED balanced routing: pair j of the forward's N*K pairs goes to expert j mod E."""
        pair = torch.arange(ids.numel(), device=ids.device).view(ids.shape)
        return pair % self.args.n_routed_experts

    def normalize(self, weights):                           # [N, K] the chosen experts' scores
        a = self.args
        if a.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.routed_scaling_factor


def unpack_int4(packed):
    """int32 [..., n/8] -> int8 [..., n] in [-8, 7]. Element c sits in word c//8 at bits
    4*(c%8)..+3, stored as q + 8; read as little-endian bytes, byte j holds elements 2j (low
    nibble) and 2j+1 (high). Byte-wide, so each pass moves a quarter of what int32 ones would."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), -1).flatten(-2).view(torch.int8) - 8


def dequantize_int4(packed, scale, group):
    """W[r, c] = q[r, c] * scale[r, c // group], in scale's dtype: [..., out, in/8] ->
    [..., out, in]."""
    q = unpack_int4(packed).unflatten(-1, (-1, group))
    return (q * scale.unsqueeze(-1)).flatten(-2)       # int8 times the scale's dtype: one kernel


class PackedExperts(nn.Module):
    """One projection of E experts as INT4 pack-quantized [E, out, in] (compressed-tensors' format;
    checkpoint.py reads and writes it): `weight_packed` int32 [E, out, in/8] and `weight_scale`
    [E, out, in/group] (the compute dtype; bf16 as shipped)."""

    def __init__(self, E, out, inp, group, shard_dim, device, dtype):
        super().__init__()
        self.group = group
        self.weight_packed = _param((E, out, inp // 8), shard_dim, device, torch.int32)
        self.weight_scale = _param((E, out, inp // group), shard_dim, device, dtype)

    def dequantize(self, ids=None):
        """The weights of experts `ids` (any shape; all when None): [*ids.shape, out, in]."""
        if ids is None:
            return dequantize_int4(self.weight_packed, self.weight_scale, self.group)
        return dequantize_int4(self.weight_packed[ids], self.weight_scale[ids], self.group)


class Fp8Experts(nn.Module):
    """One projection of E experts kept in FP8 as shipped: `weight` float8_e4m3fn [E, out, in]
    (this rank's slice) and `weight_scale_inv` float32 [E, row blocks, col blocks], the
    checkpoint's block scales over that slice, which may start inside a block: element (r, c)
    uses block ((r + offset[0]) // br, (c + offset[1]) // bc)."""

    def __init__(self, E, out, inp, block, shard_dim, tp, device, dtype):
        super().__init__()
        self.block, self.dtype = tuple(block), dtype   # dtype: what dequantize() returns
        self.weight = _param((E, out, inp), shard_dim, device, torch.float8_e4m3fn)
        local = [out, inp]
        start, full = [0, 0], list(local)          # this rank's slice of one expert's [out, in]
        start[shard_dim - 1] = tp.rank * local[shard_dim - 1]
        full[shard_dim - 1] *= tp.world_size
        self.offset = tuple(s % b for s, b in zip(start, block))
        index = tuple(slice(s // b, -(-(s + n) // b)) for s, n, b in zip(start, local, block))
        blocks = (i.stop - i.start for i in index)
        self.weight_scale_inv = _param((E, *blocks), None, device, torch.float32)
        self.weight_scale_inv.block_index = index                    # the loader's and init's slice
        self.weight_scale_inv.global_shape = [E] + [-(-n // b) for n, b in zip(full, block)]

    def dequantize(self, ids=None):
        """The weights of experts `ids` (any shape; all when None) in the compute dtype: the FP8
        values times their block scales in float32, rounded once (as the loader does)."""
        w = self.weight if ids is None else self.weight[ids]
        s = self.weight_scale_inv if ids is None else self.weight_scale_inv[ids]
        (br, bc), (r0, c0), (out, inp) = self.block, self.offset, w.shape[-2:]
        s = s.repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., r0:r0 + out, c0:c0 + inp]
        return (w.float() * s).to(self.dtype)


class Experts(nn.Module):
    """All routed experts of a layer, stacked, each sliced along its intermediate dim across ranks.
    The reference gathers each token's K experts' weights; quantized ones (INT4, int4_group_size;
    FP8, fp8_block) stay as stored, and only the routed ones are dequantized, by gathering."""

    def __init__(self, args, tp, device, dtype):
        super().__init__()
        E, D = args.n_routed_experts, args.hidden_size
        inter = tp.split(args.moe_intermediate_size, "moe_intermediate_size")
        self.group, fp8, self.n_experts = args.int4_group_size, args.fp8_block, E
        self.quantized = self.group is not None or fp8 is not None
        for name, size, why in (("hidden_size", D, "gate_proj and up_proj's input"),
                                ("moe_intermediate_size per rank", inter,
                                 f"down_proj's input, split across {tp.world_size} ranks")):
            if self.group is not None and size % self.group:
                raise ValueError(f"INT4 experts: {name} = {size} does not fall on whole "
                                 f"{self.group}-element groups ({why})")
        # [E, out, in] each; gate and up split along their output, down along its input
        for proj, (out, inp, dim) in dict(gate_proj=(inter, D, 1), up_proj=(inter, D, 1),
                                          down_proj=(D, inter, 2)).items():
            if fp8 is not None:
                setattr(self, proj, Fp8Experts(E, out, inp, fp8, dim, tp, device, dtype))
            elif self.group is not None:
                setattr(self, proj, PackedExperts(E, out, inp, self.group, dim, device, dtype))
            else:
                setattr(self, proj, _param((E, out, inp), dim, device, dtype))

    def weights(self, proj, ids=None):
        """Projection `proj` of experts `ids` (all when None), compute dtype: [..., out, in]."""
        w = getattr(self, proj)
        if self.quantized:
            return w.dequantize(ids)
        return w if ids is None else w[ids]

    def expert_bytes(self):
        """Bytes of one expert's three projections as stored (INT4: packed words and scales; FP8:
        values and block scales)."""
        return sum(t[0].numel() * t.element_size() for t in self.parameters())

    def forward(self, x, ids, weights):            # x [N, D], ids / weights [N, K] -> [N, D]
        gate, up = self.weights("gate_proj", ids), self.weights("up_proj", ids)   # [N, K, I, D]
        h = F.silu(torch.einsum("nd,nkid->nki", x, gate)) * torch.einsum("nd,nkid->nki", x, up)
        y = torch.einsum("nki,nkdi->nkd", h, self.weights("down_proj", ids))      # [N, K, D]
        return (at_least_f32(y) * weights.unsqueeze(-1)).sum(1).to(x.dtype)


class MoE(nn.Module):
    """Routed experts plus the shared one; each rank's partial sums, added, are all-reduced once."""

    def __init__(self, args, tp, device, dtype):
        super().__init__()
        self.tp = tp
        self.gate = Router(args, device, dtype)
        self.experts = Experts(args, tp, device, dtype)
        inter = args.n_shared_experts * args.moe_intermediate_size
        self.shared_experts = MLP(args.hidden_size, inter, tp, "moe_intermediate_size",
                                  reduce=False, device=device, dtype=dtype)

    def forward(self, x):
        shape = x.shape
        y = self.partial_sum(x.view(-1, shape[-1]))
        return self.tp.all_reduce(y).view(shape)  # routed + shared partial sums: one all-reduce

    def partial_sum(self, x):                                       # [N, D] -> this rank's [N, D]
        ids, weights = self.gate(x)
        return self.experts(x, ids, weights) + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, layer_id, args, tp, max_batch_size, max_seq_len, device, dtype,
                 caches=None):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, device, dtype)
        self.self_attn = MLA(args, tp, max_batch_size, max_seq_len, device, dtype, caches)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, device, dtype)
        if layer_id < args.first_k_dense_replace:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, tp, "intermediate_size",
                           device=device, dtype=dtype)
        else:
            self.mlp = MoE(args, tp, device, dtype)

    def forward(self, x, residual, positions, rope, future, mode, slots=None):
        """One pre-norm layer on the residual stream x + residual (residual None: x alone), each
        add done by the norm that reads the sum (RMSNorm.forward). Returns (this layer's MLP
        output, the stream after its attention): their sum is the stream after the layer."""
        h, residual = ((self.input_layernorm(x), x) if residual is None
                       else self.input_layernorm(x, residual))
        h = self.self_attn(h, positions, rope, future, mode, slots)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# ---------------------------------------------------------------------------------------------
# The model

class TargetOutput(NamedTuple):
    """What Transformer.forward returns, with or without capture_aux."""
    logits: torch.Tensor        # [B, T, V] float32 (float64 for a float64 model), all of V
    aux: torch.Tensor | None    # [B, T, 3*D] the EAGLE-3 states with capture_aux, else None


ROUTINGS = ("model", "uniform", "distinct", "trace")


class Transformer(nn.Module):
    """This rank's shard of the target. `tp` defaults to the torch.distributed world (or 1).
    aux_layer_ids: decoder layers whose outputs EAGLE-3 reads (default 1, L//2 - 1, L - 4).
    routing: "model" (the router's own choice) or "uniform" (Router); see set_routing."""

    def __init__(self, args, max_batch_size=1, max_seq_len=4096, device=None, dtype=None, tp=None,
                 aux_layer_ids=None, routing="model"):
        super().__init__()
        device = torch.device(device or "cpu")
        dtype = dtype or torch.get_default_dtype()
        self.args, self.tp = args, tp or TP.from_env()
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        L = args.num_hidden_layers
        aux = aux_layer_ids if aux_layer_ids is not None else args.default_aux_layer_ids()
        self.aux_layer_ids = sorted(aux)
        if len(self.aux_layer_ids) != 3 or any(not 0 <= i < L for i in self.aux_layer_ids):
            raise ValueError(f"aux layer ids {self.aux_layer_ids}: EAGLE-3 reads 3 layers, each in "
                             f"[0, {L})")
        D, V = args.hidden_size, args.vocab_size
        self.embed_tokens = VocabParallelEmbedding(V, D, self.tp, device, dtype)
        # every layer's latent and rope-key cache, [L, B, S, C] and [L, B, S, R]: each layer holds
        # its views, so move_cache moves all layers' slots in one copy each
        for name, width in (("kv_caches", args.kv_lora_rank), ("pe_caches", args.qk_rope_head_dim)):
            self.register_buffer(name, torch.zeros(L, max_batch_size, max_seq_len, width,
                                                   device=device, dtype=dtype), persistent=False)
        self.layers = nn.ModuleList(
            Block(i, args, self.tp, max_batch_size, max_seq_len, device, dtype,
                  (self.kv_caches[i], self.pe_caches[i])) for i in range(L))
        self.norm = RMSNorm(D, args.rms_norm_eps, device, dtype)
        self.lm_head = ParallelLMHead(D, V, self.tp, device=device, dtype=dtype)
        self.register_buffer("rope", rope_table(args, max_seq_len, device), persistent=False)
        self.set_routing(routing)

    def set_routing(self, routing, choice=None):
        """routing "model" or "uniform" (Router); or "distinct" (SIMULATED) or "trace" (TRACE) with
        `choice`, a callable (layer, ids) -> ids [N, K] that replaces the router's choice in MoE
        layer `layer` (0, 1, ... over the MoE layers; routing.py makes them)."""
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
        if (choice is None) != (routing in ("model", "uniform")):
            raise ValueError(f"routing {routing!r}: 'distinct' and 'trace' take a choice, "
                             "'model' and 'uniform' none")
        self.routing = routing
        routers = [m for m in self.modules() if isinstance(m, Router)]
        for layer, m in enumerate(routers):
            m.routing, m.choice = routing, None if choice is None else partial(choice, layer)

    @property
    def device(self):
        return self.rope.device

    @property
    def dtype(self):
        return self.norm.weight.dtype

    def forward(self, tokens, positions, mode="extend", capture_aux=False, kv_len=None, slots=None,
                visible=None):
        """tokens, positions: int64 [B, T]. Writes the KV cache at `positions`, then attends to
        slots <= position over the first kv_len slots (default: all). Returns a TargetOutput (with
        capture_aux, aux holds the chosen layers' outputs, low to high).
        A draft tree (verify.tree_cycle) passes both of: slots [B, T], where to write instead
        (its nodes share positions), and visible [B, T, kv_len] bool, the slots each token sees
        instead (verify.tree_visible: the prefix, its ancestors and itself)."""
        if mode not in ("extend", "decode"):
            raise ValueError(f"mode must be 'extend' or 'decode', not {mode!r}")
        if (slots is None) != (visible is None):
            raise ValueError("slots and visible go together: a tree's cache slots and its mask")
        kv_len = slots_read(kv_len, self.max_seq_len)
        x, residual = self.embed_tokens(tokens), None                         # [B, T, D]
        rope = self.rope[positions]                                           # [B, T, R/2, 2]
        if visible is None:
            future = torch.arange(kv_len, device=x.device) > positions.unsqueeze(-1)   # [B, T, S]
        else:
            future = ~visible
        captured = []
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, rope, future, mode, slots)
            if capture_aux and i in self.aux_layer_ids:
                # an EAGLE-3 state: the stream after layer i (twice where two ids name it); the
                # next norm adds x and residual again, as it does without the capture
                captured += [x + residual] * self.aux_layer_ids.count(i)
        aux = torch.cat(captured, dim=-1) if capture_aux else None
        h = self.norm(x) if residual is None else self.norm(x, residual)[0]
        return TargetOutput(self.lm_head(h), aux)

    def move_cache(self, src, dst):
        """Copy every layer's cached latents at slots src [B, J] to slots dst [B, J], all reads
        before any write: a tree's accepted path, verified at slots after the prefix in node
        order, moved to slot = position (verify.tree_cycle)."""
        rows = torch.arange(src.shape[0], device=src.device).unsqueeze(1)
        for caches in (self.kv_caches, self.pe_caches):   # [L, B, S, width]: all layers at once
            caches[:, rows, dst] = caches[:, rows, src]
