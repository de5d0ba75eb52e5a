"""The Kimi-K2 / DeepSeek-V3 target: MLA attention, sigmoid noaux_tc MoE, tensor parallel.

Numerics follow Hugging Face transformers' DeepseekV3 (fp32 router, correction bias for selection
only, YaRN with the mscale^2 softmax factor, RoPE on interleaved pairs). References: DeepSeek-V2
(MLA, arXiv:2405.04434), DeepSeek-V3 (noaux_tc routing, arXiv:2412.19437), YaRN (arXiv:2309.00071).

The KV cache is static: per layer the normalized latent [B, S, kv_lora_rank] and the rotated
k_pe [B, S, qk_rope_head_dim], written at `positions` (slot = position). A query at position p
attends to slots <= p, so rejected speculative tokens cost nothing: their slots are overwritten
before anyone reads them. Two attention paths read that one cache:
  extend: expand the latent to per-head keys/values with kv_b_proj, then ordinary attention;
  decode: absorb kv_b_proj into the query and the output, attend in the latent space.
Nothing in `forward` reads a device value on the host, so every shape can be CUDA-graph captured.

Shape legend: B batch, T new tokens, S cache slots read, D hidden, H local heads, E routed
experts, K experts per token, I local expert intermediate, C kv_lora_rank, R qk_rope_head_dim,
N = B*T tokens.
"""
import importlib.util
import json
import math
import os
import typing
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from tp import (TP, ColumnParallelLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear,
                VocabParallelEmbedding, _param)


def config_json(path_or_dict):
    """A config.json as a dict: a dict as it is, else the file (or the config.json in a folder)
    read as plain JSON. checkpoint.py reads checkpoints' configs, naming the file in its errors."""
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.fspath(path_or_dict)
    with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
        return json.load(f)


def check_config_types(cls, cfg):
    """Refuse a config value of the wrong type for a field of the dataclass `cls`, by name
    ("hidden_size": "abc" would otherwise fail deep inside a constructor). An int may stand for a
    float, a list of ints for a *token_id (several end-of-sequence ids)."""
    for f in fields(cls):
        if f.name not in cfg:
            continue
        value, allowed = cfg[f.name], typing.get_args(f.type) or (f.type,)
        ok = any(type(value) is a or a is float and type(value) is int
                 or a is dict and isinstance(value, dict) for a in allowed)
        ok = ok or (f.name.endswith("token_id") and isinstance(value, list)
                    and all(type(v) is int for v in value))
        if not ok:
            names = " or ".join("null" if a is type(None) else a.__name__ for a in allowed)
            raise ValueError(f"{f.name} = {value!r} is not {names}")


def normalize_rope_scaling(rope_scaling):
    """Both spellings of the scaling kind ("type", "rope_type") as "type"; None stays None."""
    if not rope_scaling:
        return None
    rs = dict(rope_scaling)
    rs["type"] = rs.pop("rope_type", rs.get("type"))
    return rs


def eos_union(*values):
    """The ids in values (each an id, a list of ids or None), in order, each once."""
    ids = []
    for v in values:
        for i in [] if v is None else [v] if isinstance(v, int) else v:
            if i not in ids:
                ids.append(i)
    return ids


def refuse_unimplemented(cfg):
    """NotImplementedError naming a config value this model does not implement."""
    refuse = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "hidden_act": ("silu",),
              "tie_word_embeddings": (False,), "moe_layer_freq": (1,)}
    for key, allowed in refuse.items():
        if key in cfg and cfg[key] not in allowed:
            raise NotImplementedError(f"config {key} = {cfg[key]!r} is not implemented "
                                      f"(only {', '.join(map(repr, allowed))})")
    if cfg.get("rope_scaling") and cfg["rope_scaling"]["type"] != "yarn":
        raise NotImplementedError(f"rope_scaling type {cfg['rope_scaling']['type']!r} is not "
                                  "implemented (only yarn or none)")


@dataclass
class ModelArgs:
    """Fields are the keys of a DeepseekV3 / Kimi-K2 config.json."""
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
        kind, block = quant_scheme(self.quantization_config)
        return block if kind == "fp8" else None

    @property
    def int4_group_size(self):
        """The INT4 group size when the routed experts are kept packed, else None."""
        kind, group = quant_scheme(self.quantization_config)
        return group if kind == "int4" else None

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
        # DeepseekV3: qk_head_dim^-0.5, times mscale^2 whenever rope_scaling is yarn (HF, SGLang;
        # DeepSeek's own reference only when its cache is longer than the original context)
        scale = self.qk_head_dim ** -0.5
        if self.is_yarn:
            rs = self.rope_scaling
            mscale = yarn_mscale(rs["factor"], rs.get("mscale_all_dim", 0))
            scale *= mscale * mscale
        return scale

    def default_aux_layer_ids(self):
        """EAGLE-3's default: outputs of layers 1, L//2 - 1 and L - 4 (SGLang, SpecForge), kept
        inside [0, L) for toy depths."""
        n = self.num_hidden_layers
        return [min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4)]

    @classmethod
    def from_hf_config(cls, path_or_dict):
        """A DeepseekV3 / Kimi-K2 / Kimi-K2.5 config.json as ModelArgs: a dict, or a file or its
        folder read as plain JSON (checkpoint.read_target_args reads a checkpoint's: the EOS ids
        of its generation_config.json added, errors naming the file). Kimi-K2.5 nests the text
        model under text_config; its EOS ids and those of the outer config are taken together."""
        top = config_json(path_or_dict)
        cfg = dict(top.get("text_config", top))
        eos = eos_union(cfg.get("eos_token_id"), top.get("eos_token_id"))
        if eos:
            cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        cfg["quantization_config"] = (cfg.get("quantization_config")
                                      or top.get("quantization_config"))
        quant_scheme(cfg["quantization_config"])  # refuses what is not implemented, by name
        if "rope_parameters" in cfg:  # the newer transformers spelling
            rp = dict(cfg.pop("rope_parameters"))
            cfg["rope_theta"] = rp.pop("rope_theta", cls.rope_theta)
            kind = rp.pop("rope_type", rp.pop("type", "default"))
            cfg["rope_scaling"] = None if kind == "default" else dict(rp, type=kind)
        else:
            cfg["rope_scaling"] = normalize_rope_scaling(cfg.get("rope_scaling"))
        refuse_unimplemented(cfg)
        check_config_types(cls, cfg)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})

    def to_hf_config(self):
        cfg = asdict(self)
        cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
        return cfg


PRESETS = {
    # every feature on at toy size: q_lora, YaRN (mscale != mscale_all_dim), grouped routing,
    # a shared expert, a first dense layer; vocabulary and heads divisible by 4 for TP 4
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=8, num_attention_heads=4, n_shared_experts=1,
                 n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5, n_group=4,
                 topk_group=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0,
                 rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                   beta_fast=32.0, beta_slow=1.0, mscale=0.8, mscale_all_dim=1.0),
                 rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1, eos_token_id=2),
    "kimi-k2": {},  # the dataclass defaults are Kimi-K2-Instruct
    # the same text model as shipped in Kimi-K2-Thinking / K2.5: routed experts INT4, the rest bf16
    "kimi-k2.5": dict(quantization_config="int4"),
}
QUANT_LAYOUTS = {"int4": lambda: int4_quantization_config(),
                 "fp8": lambda: fp8_quantization_config()}


def preset(name, **overrides):
    """A preset's ModelArgs; quantization_config="int4" / "fp8" stand for
    int4_quantization_config() / fp8_quantization_config()."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    kw = {**PRESETS[name], **overrides}
    if isinstance(kw.get("quantization_config"), str):
        kw["quantization_config"] = QUANT_LAYOUTS[kw["quantization_config"]]()
    return ModelArgs(**kw)


# ---------------------------------------------------------------------------------------------
# Quantized experts: what a quantization_config means for the model. FP8 (Kimi-K2-Instruct,
# DeepSeek-V3): the routed experts stay float8_e4m3fn with float32 block scales; INT4
# (Kimi-K2-Thinking, K2.5; compressed-tensors "pack-quantized", symmetric): the routed experts
# stay packed. The config picks which Experts the model builds, so it is read here (checkpoint.py
# imports model.py, never the reverse); the presets build these layouts too.

def fp8_quantization_config(block=(128, 128)):
    """The quantization_config Kimi-K2-Instruct and DeepSeek-V3 ship (FP8 e4m3, 128 x 128
    blocks)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block)}


def int4_quantization_config(group_size=32):
    """The quantization_config Kimi-K2-Thinking / K2.5 ship (routed experts INT4, group 32)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group_size, "dynamic": False, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": weights}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}


def quant_scheme(q):
    """("fp8", (block rows, block cols)), ("int4", group size) or (None, None) for a config's
    quantization_config; anything else is refused by name."""
    if not q:
        return None, None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if q.get("fmt", "e4m3") != "e4m3" or not block or len(block) != 2:
            raise NotImplementedError(f"fp8 with fmt {q.get('fmt')!r}, weight_block_size "
                                      f"{block!r} is not implemented (only e4m3 with 2-d blocks)")
        return "fp8", tuple(block)
    if method != "compressed-tensors":
        raise NotImplementedError(f"quant_method {method!r} is not implemented (only 'fp8' "
                                  "block-quantized and 'compressed-tensors' pack-quantized INT4)")
    ct = "compressed-tensors"
    if q.get("format") != "pack-quantized":
        raise NotImplementedError(f"{ct} format {q.get('format')!r} is not implemented "
                                  "(only 'pack-quantized')")
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise NotImplementedError(f"{ct} with {len(groups)} config_groups is not implemented "
                                  "(only 1)")
    if groups[0].get("input_activations"):
        raise NotImplementedError(f"{ct} input_activations quantization is not implemented")
    w = groups[0].get("weights") or {}
    for key, want in dict(num_bits=4, type="int", symmetric=True, strategy="group").items():
        if w.get(key) != want:
            raise NotImplementedError(f"{ct} weights {key} = {w.get(key)!r} is not implemented "
                                      f"(only {want!r})")
    group = w.get("group_size")
    if not isinstance(group, int) or group <= 0 or group % 8:
        raise NotImplementedError(f"{ct} group_size {group!r} is not implemented "
                                  "(a positive multiple of 8, the values per packed word)")
    return "int4", group


# ---------------------------------------------------------------------------------------------
# Profiling scopes: run.py's component table puts each kernel under the innermost named range
# around the op that launched it (module hooks name the modules; scope() names the math that is
# not a module). A range exists only while a profiler records, never under torch.compile, and
# adds no device work, so capture and compilation see the same code either way.

def scope(component):
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function("component:" + component)


# kernels.py's functions as the model calls them, each wrapped once by torch.compiler.disable:
# torch.compile (run.py --compile) does not trace into them (a graph break there), so their Triton
# launches run as written between the compiled parts.
triton_kernels = SimpleNamespace(**{name: torch.compiler.disable(getattr(kernels, name)) for name in (
    "mla_rope_cache_write", "mla_decode_attention", "router_topk", "add_rmsnorm", "silu_mul", "norm_gemv",
    "head_gemv")})


# ---------------------------------------------------------------------------------------------
# RoPE (YaRN, interleaved pairs as in DeepseekV3)

def at_least_f32(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def yarn_mscale(factor, mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(dim, theta, rope_scaling, max_seq_len, device):
    """cos, sin [S, dim/2] in float32, YaRN-scaled when rope_scaling says so (HF's formulas).

    YaRN applies at every cache length here, as in HF transformers and SGLang. DeepSeek's own
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
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1: keep the original frequency (extrapolate), 0: divide by factor
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
        attention_factor = rs.get("attention_factor")  # as HF: an explicit factor wins, else
        if attention_factor is None:                    # DeepSeek's mscale ratio, else YaRN's own
            if rs.get("mscale") and rs.get("mscale_all_dim"):
                attention_factor = yarn_mscale(factor, rs["mscale"]) / yarn_mscale(factor, rs["mscale_all_dim"])
            else:
                attention_factor = yarn_mscale(factor)
    elif rope_scaling:
        raise NotImplementedError(f"rope_scaling type {rope_scaling.get('type')!r} is not implemented")
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return (freqs.cos() * attention_factor).to(device), (freqs.sin() * attention_factor).to(device)


def apply_rope(x, rope):
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last dim by the angles whose (cos, sin)
    are rope [B, T, R/2, 2] (a head dim is inserted for x [B, T, H, R]). Eager: one complex
    multiply. Under torch.compile the same rotation in real arithmetic, because inductor does
    not generate code for complex numbers and would leave the multiply unfused."""
    if x.dim() == 4:
        rope = rope.unsqueeze(2)
    with scope("elementwise"):
        xf = at_least_f32(x).unflatten(-1, (-1, 2))
        if torch.compiler.is_compiling():
            (x0, x1), (cos, sin) = xf.unbind(-1), rope.unbind(-1)
            out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1)
        else:
            out = torch.view_as_real(torch.view_as_complex(xf.contiguous()) * torch.view_as_complex(rope))
        return out.flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), None, device, dtype)

    def forward(self, x):
        # x * rsqrt(mean(x^2) + eps) * weight, computed in at least float32; in bf16 the weight is
        # applied before the one rounding (HF rounds, then multiplies: up to 1 ulp apart)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def norm_linear(x, weight, norm=None, residual=None, fast=False):
    """(h, norm(h) @ weight^T) for h = x + residual (x without one; without a norm: h @ weight^T).
    fast: one Triton kernel (kernels.norm_gemv) for at most kernels.NORM_GEMV_MAX_ROWS rows, the
    norm recomputed inside the GEMV; more rows, or fast False, run this plain code, its twin."""
    if fast and math.prod(x.shape[:-1]) <= kernels.NORM_GEMV_MAX_ROWS:
        return triton_kernels.norm_gemv(x, weight, None if norm is None else norm.weight,
                                        0.0 if norm is None else norm.eps, residual)
    if residual is not None:
        x = x + residual
    return x, F.linear(x if norm is None else norm(x), weight)


# ---------------------------------------------------------------------------------------------
# MLA

def absorbed_attention(q_lat, q_pe, kv_c, pe_c, future, scale):
    """Attention in the latent space: with kv_b_proj's key half absorbed into the query (q_lat =
    q_nope W_uk), a slot's normalized latent is both its key and its value, so q_lat [B, T, H, C]
    and the rotated q_pe [B, T, H, R] meet kv_c [B, S, C] and pe_c [B, S, R] directly; future
    [B, T, S] masks slots past each query's position. Returns the latent output [B, T, H, C]
    (W_uv still to apply). The plain twin of kernels.mla_decode_attention."""
    scores = torch.einsum("bthc,bsc->bths", q_lat, kv_c) + torch.einsum("bthr,bsr->bths", q_pe, pe_c)
    scores = (scores * scale).masked_fill(future.unsqueeze(2), float("-inf"))
    p = scores.softmax(-1, dtype=torch.promote_types(q_lat.dtype, torch.float32)).to(q_lat.dtype)   # [B, T, H, S]
    return torch.einsum("bths,bsc->bthc", p, kv_c)


def stack_rows(*linears):
    """Make the linears' weights [out_i, in] row blocks of one new buffer [sum out_i, in] and return
    it: each weight becomes a view of its block (no second copy), so a checkpoint still loads, and
    random init still writes, by each linear's own name, while one GEMM over the buffer reads the
    linears' shared input once. The values are kept (so a module can stack again after .to(),
    which moves each parameter and buffer on its own: see MLA._apply, MLP._apply)."""
    buf = torch.cat([linear.weight.detach() for linear in linears])
    for linear, rows in zip(linears, buf.split([linear.weight.shape[0] for linear in linears])):
        view = nn.Parameter(rows, requires_grad=False)
        view.shard_dim = linear.weight.shard_dim
        linear.weight = view
    return buf


class MLA(nn.Module):
    attn_impl = "torch"        # "triton": decode mode through kernels.mla_decode_attention (Transformer.use_kernels)
    rope_cache_impl = "torch"  # "triton": RoPE, latent norm and cache writes by kernels.mla_rope_cache_write
    fused_proj = False         # True: q_a_proj and kv_a_proj_with_mqa as one GEMM (with q_lora_rank)
    gemv_impl = "torch"        # "triton": for <= 16 rows, q_a_layernorm inside q_b_proj's GEMV kernel, o_proj and
    #                            decode mode's absorbed W_uk / W_uv products as GEMV kernels (kernels.norm_gemv, head_gemv)

    def __init__(self, args, tp, max_batch_size, max_seq_len, device, dtype):
        super().__init__()
        a = args
        self.args = a
        self.n_local_heads = tp.split(a.num_attention_heads, "num_attention_heads")
        H = a.num_attention_heads
        if a.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(a.hidden_size, a.q_lora_rank, device, dtype)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, a.rms_norm_eps, device, dtype)
            self.q_b_proj = ColumnParallelLinear(a.q_lora_rank, H * a.qk_head_dim, tp,
                                                 "num_attention_heads", device, dtype)
        else:
            self.q_proj = ColumnParallelLinear(a.hidden_size, H * a.qk_head_dim, tp,
                                               "num_attention_heads", device, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim,
                                                   device, dtype)
        self.register_buffer("q_kv_a_weight", None, persistent=False)     # stack_projections (fused_proj)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, a.rms_norm_eps, device, dtype)
        self.kv_b_proj = ColumnParallelLinear(a.kv_lora_rank, H * (a.qk_nope_head_dim + a.v_head_dim),
                                              tp, "num_attention_heads", device, dtype)
        self.o_proj = RowParallelLinear(H * a.v_head_dim, a.hidden_size, tp, "num_attention_heads",
                                        device=device, dtype=dtype)
        cache = dict(device=device, dtype=dtype)
        self.register_buffer("kv_cache", torch.zeros(max_batch_size, max_seq_len, a.kv_lora_rank, **cache),
                             persistent=False)
        self.register_buffer("pe_cache", torch.zeros(max_batch_size, max_seq_len, a.qk_rope_head_dim, **cache),
                             persistent=False)

    def stack_projections(self):
        """fused_proj: q_a_proj and kv_a_proj_with_mqa (both replicated, both read x) as row blocks
        of one buffer [q_lora_rank + C + R, D], their weights views of it (stack_rows)."""
        if self.q_kv_a_weight is None:
            self.q_kv_a_weight = stack_rows(self.q_a_proj, self.kv_a_proj_with_mqa)

    def _apply(self, fn, recurse=True):   # .to() and the like move each tensor alone: stack again
        super()._apply(fn, recurse)
        if self.q_kv_a_weight is not None:
            self.q_kv_a_weight = stack_rows(self.q_a_proj, self.kv_a_proj_with_mqa)
        return self

    def forward(self, x, positions, rope, future, mode):
        """future [B, T, S]: True where a slot lies after the query's position (not written yet,
        or a rejected draft's), so the query must not see it; S is the number of cache slots read.
        mode "extend" or "decode": the attention path (attend_extend, attend_absorbed)."""
        a, h = self.args, self.n_local_heads
        (B, T, _), kv_len = x.shape, future.shape[-1]
        q, kv_a = self.project(x)                                              # [B, T, h*(d+R)], [B, T, C+R]
        q_nope, q_pe = q.view(B, T, h, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        q_pe = self.write_cache(q_pe, kv_a, positions, rope)
        kv_c, pe_c = self.kv_cache[:B, :kv_len], self.pe_cache[:B, :kv_len]     # [B, S, C], [B, S, R]
        attend = self.attend_extend if mode == "extend" else self.attend_absorbed
        o = attend(q_nope, q_pe, kv_c, pe_c, positions, future)                # [B, T, H, d]
        return self.output(o.flatten(2))

    def project(self, x):
        """The queries and the compressed key-values of x: q [B, T, h*(d+R)], kv_a [B, T, C+R]."""
        a = self.args
        if self.fused_proj:  # q_a_proj and kv_a_proj_with_mqa in one GEMM: x read once
            with scope("attn_proj"):
                q_a, kv_a = F.linear(x, self.q_kv_a_weight).split([a.q_lora_rank, a.kv_lora_rank + a.qk_rope_head_dim], -1)
            return self.query(q_a), kv_a
        q = self.query(self.q_a_proj(x)) if a.q_lora_rank else self.q_proj(x)
        return q, self.kv_a_proj_with_mqa(x)

    def write_cache(self, q_pe, kv_a, positions, rope):
        """Write the new tokens' normalized latents and rotated rope keys at slot = position;
        returns the rotated q_pe."""
        a, B = self.args, kv_a.shape[0]
        kv, k_pe = kv_a.split([a.kv_lora_rank, a.qk_rope_head_dim], -1)            # [B, T, C], [B, T, R]
        if self.rope_cache_impl == "triton":  # the four lines below in one kernel
            norm = self.kv_a_layernorm
            return triton_kernels.mla_rope_cache_write(q_pe, kv, k_pe, norm.weight, norm.eps, rope, positions,
                                                       self.kv_cache, self.pe_cache)
        rows = torch.arange(B, device=kv_a.device).unsqueeze(1)
        self.kv_cache[rows, positions] = self.kv_a_layernorm(kv)
        self.pe_cache[rows, positions] = apply_rope(k_pe, rope)
        return apply_rope(q_pe, rope)

    def kv_b_halves(self):
        """kv_b_proj's weight as its key and value halves per local head: w_uk, w_uv [H, d, C]."""
        a = self.args
        w_kv_b = self.kv_b_proj.weight.view(self.n_local_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        return w_kv_b.split([a.qk_nope_head_dim, a.v_head_dim], 1)

    def attend_extend(self, q_nope, q_pe, kv_c, pe_c, positions, future):
        """Prefill-style: every cached latent expanded by kv_b_proj to per-head keys and values."""
        a, (B, S, _) = self.args, kv_c.shape
        k_nope, v = self.kv_b_proj(kv_c).view(B, S, self.n_local_heads, -1).split(
            [a.qk_nope_head_dim, a.v_head_dim], -1)                            # [B, S, H, d]
        scores = torch.einsum("bthd,bshd->bths", q_nope, k_nope) + torch.einsum("bthr,bsr->bths", q_pe, pe_c)
        scores = (scores * a.softmax_scale).masked_fill(future.unsqueeze(2), float("-inf"))
        p = scores.softmax(-1, dtype=torch.promote_types(q_nope.dtype, torch.float32)).to(q_nope.dtype)   # [B, T, H, S]
        return torch.einsum("bths,bshd->bthd", p, v)

    def attend_absorbed(self, q_nope, q_pe, kv_c, pe_c, positions, future):
        """Decode-style (absorbed MLA): a key is k = W_uk c for a cached latent c, so q . k =
        (W_uk^T q) . c: W_uk moves onto the T queries instead of onto all S cached latents; likewise
        o = sum_s p_s (W_uv c_s) = W_uv (sum_s p_s c_s): attend over latents, then W_uv once."""
        a, (B, T) = self.args, q_nope.shape[:2]
        w_uk, w_uv = self.kv_b_halves()
        fast = self.gemv_impl == "triton" and B * T <= kernels.NORM_GEMV_MAX_ROWS
        with scope("attn_proj"):  # kv_b_proj's key half, absorbed into the query
            if fast:   # the same product as one GEMV kernel over the heads (no copy of q_nope)
                q_lat = triton_kernels.head_gemv(q_nope, w_uk.transpose(1, 2))
            else:
                q_lat = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)           # [B, T, H, C]
        if self.attn_impl == "triton":  # the same math in one pass over the used slots
            o_lat = triton_kernels.mla_decode_attention(q_lat, q_pe, kv_c, pe_c, positions, a.softmax_scale)
        else:
            o_lat = absorbed_attention(q_lat, q_pe, kv_c, pe_c, future, a.softmax_scale)
        with scope("attn_proj"):  # kv_b_proj's value half, absorbed into the output
            if fast:
                return triton_kernels.head_gemv(o_lat, w_uv)
            return torch.einsum("bthc,hdc->bthd", o_lat, w_uv)                 # [B, T, H, d]

    def output(self, o):                                                       # [B, T, h*d] -> [B, T, D]
        if self.gemv_impl == "triton":  # o_proj's GEMV as the kernel (<= 16 rows), then its all-reduce
            with scope("attn_proj"):
                o = norm_linear(o, self.o_proj.weight, fast=True)[1]
            return self.o_proj.tp.all_reduce(o) if self.o_proj.reduce else o
        return self.o_proj(o)

    def query(self, q_a):                                                      # [B, T, q_lora] -> [B, T, h*(d+R)]
        """q_b_proj(q_a_layernorm(q_a)); with the norm_gemv kernel the norm runs inside the GEMV."""
        if self.gemv_impl == "triton":
            with scope("attn_proj"):
                return norm_linear(q_a, self.q_b_proj.weight, self.q_a_layernorm, fast=True)[1]
        return self.q_b_proj(self.q_a_layernorm(q_a))


# ---------------------------------------------------------------------------------------------
# MLP and MoE

class MLP(nn.Module):
    """SwiGLU; gate/up column parallel, down row parallel (reduce=False leaves the sum to the caller)."""
    fused_proj = False    # True: gate_proj and up_proj as one GEMM (Transformer.use_kernels)
    act_impl = "torch"    # "triton": silu(gate) * up in one kernel (kernels.silu_mul)

    def __init__(self, dim, inter, tp, what, reduce=True, device=None, dtype=None):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, inter, tp, what, device, dtype)
        self.up_proj = ColumnParallelLinear(dim, inter, tp, what, device, dtype)
        self.down_proj = RowParallelLinear(inter, dim, tp, what, reduce, device, dtype)
        self.register_buffer("gate_up_weight", None, persistent=False)    # stack_projections (fused_proj)
        self.stackable = True   # False: a shared expert folded into the fused MoE launch (its rows live there)

    def stack_projections(self):
        """fused_proj: gate_proj and up_proj as row blocks of one buffer [2 I, dim], their weights
        views of it (stack_rows)."""
        if self.gate_up_weight is None:
            self.gate_up_weight = stack_rows(self.gate_proj, self.up_proj)

    def _apply(self, fn, recurse=True):   # .to() and the like move each tensor alone: stack again
        super()._apply(fn, recurse)
        if self.gate_up_weight is not None:
            self.gate_up_weight = stack_rows(self.gate_proj, self.up_proj)
        return self

    def forward(self, x, add_to=None):
        """add_to (fused_proj, reduce=False only): a tensor [N, dim] that the down GEMM adds its
        product into, in place (the MoE's routed output), instead of an add after it."""
        if self.fused_proj:  # one GEMM reads x once: [..., 2 I] = [gate | up]
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        h = triton_kernels.silu_mul(gate, up) if self.act_impl == "triton" else F.silu(gate) * up
        if add_to is not None:  # no all-reduce here: the caller reduces the sum (reduce=False)
            assert not self.down_proj.reduce, "add_to needs reduce=False: the sum is reduced by the caller"
            return add_to.addmm_(h, self.down_proj.weight.t())
        return self.down_proj(h)


class Router(nn.Module):
    """Sigmoid scores; the correction bias picks groups and experts, the unbiased scores weigh them.

    routing "uniform" (SIMULATED, for timing random weights; run.py --routing): the scores and the
    selection are computed as always, so their cost stays, then the choice is replaced on the device
    by a balanced one: pair j of the N*K token-expert pairs of a forward goes to expert j mod E, so
    each token gets K distinct experts (K <= E) and the experts are used evenly. The weights are the
    model's scores of those experts, normalized and scaled as usual."""
    impl = "torch"  # "triton": logits, selection and weights in two kernels (kernels.router_topk)

    def __init__(self, args, device, dtype):
        super().__init__()
        self.args = args
        self.routing = "model"
        # kept in (at least) float32, as it is used: no cast of the [E, D] matrix per call
        self.weight = _param((args.n_routed_experts, args.hidden_size), None, device,
                             torch.promote_types(dtype or torch.get_default_dtype(), torch.float32))
        self.e_score_correction_bias = _param((args.n_routed_experts,), None, device, torch.float32)

    def forward(self, x, shared_slot=False):                       # [N, D] -> [N, K] ids, weights
        """shared_slot: one more column, expert E with weight 1 for every token ([N, K + 1]): the
        shared expert as one more expert of the fused MoE launch (MoE.shared_in_launch)."""
        a = self.args
        if self.impl == "triton":  # uniform routing and the shared slot too, in the same two kernels
            return triton_kernels.router_topk(x, self.weight, self.e_score_correction_bias, a.num_experts_per_tok,
                                              a.n_group, a.topk_group, a.norm_topk_prob, a.routed_scaling_factor,
                                              uniform=self.routing == "uniform", shared_slot=shared_slot)
        scores = F.linear(at_least_f32(x), self.weight).sigmoid()               # [N, E] fp32
        biased = scores + self.e_score_correction_bias
        if a.n_group > 1:
            grouped = biased.unflatten(-1, (a.n_group, -1))                    # [N, G, E/G]
            group_score = grouped.topk(2, dim=-1).values.sum(-1)              # [N, G]
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(a.topk_group, -1).indices, 1)
            # dropped groups get -inf, as in DeepSeek's reference and SGLang. transformers v4 fills
            # 0.0, and a biased score (sigmoid + bias) can be negative: there a dropped group's
            # expert can outrank a kept one. Both agree when the K-th best kept score is positive.
            biased = grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).flatten(1)
        ids = biased.topk(a.num_experts_per_tok, dim=-1).indices
        if self.routing == "uniform":
            ids = self.uniform_choice(ids)
        weights = self.normalize(scores.gather(1, ids))
        if shared_slot:
            return F.pad(ids, (0, 1), value=a.n_routed_experts), F.pad(weights, (0, 1), value=1.0)
        return ids, weights

    def uniform_choice(self, ids):
        """SIMULATED balanced routing: pair j of the forward's N*K pairs goes to expert j mod E."""
        return torch.arange(ids.numel(), device=ids.device).view(ids.shape) % self.args.n_routed_experts

    def normalize(self, weights):                                  # [N, K] the chosen experts' scores
        a = self.args
        if a.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.routed_scaling_factor


def grouped_mm_available(device, dtype):
    """torch._grouped_mm: bf16 on Hopper or newer; bf16 and float32 on the CPU."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.bfloat16, torch.float32)
    if device.type != "cuda":   # e.g. "meta" (sizing a model without memory)
        return False
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


def fused_moe_available(device, dtype):
    """The Triton fused MoE (kernels.py) can run here: Triton installed, a bf16 / fp16 / fp32 model,
    and CUDA, or Triton's CPU interpreter (TRITON_INTERPRET=1, which the CPU tests use)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401  (CI's CPU machines may not have it)
    except ImportError:
        return False
    return True


class PackedExperts(nn.Module):
    """One projection of E experts as INT4 pack-quantized [E, out, in]: `weight_packed` int32
    [E, out, in/8] and `weight_scale` [E, out, in/group] (the compute dtype; bf16 as shipped)."""

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

    def kernel_weights(self):
        return kernels.ExpertWeights("int4", self.weight_packed, self.weight_scale, group=self.group)


class Fp8Experts(nn.Module):
    """One projection of E experts kept in FP8 as shipped: `weight` float8_e4m3fn [E, out, in] (this
    rank's slice) and `weight_scale_inv` float32 [E, row blocks, col blocks], the checkpoint's
    block scales over that slice. The slice may start inside a block (block sizes that do not
    divide the per-rank size): element (r, c) uses block ((r + offset[0]) // br, (c + offset[1]) // bc)."""

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
        self.weight_scale_inv = _param((E, *(i.stop - i.start for i in index)), None, device, torch.float32)
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

    def kernel_weights(self):
        return kernels.ExpertWeights("fp8", self.weight, self.weight_scale_inv, self.block, self.offset)


class Experts(nn.Module):
    """All routed experts of a layer, stacked, each sliced along its intermediate dim across ranks.

    impl "gather": gather each token's K experts' weights (the plain reference);
    impl "grouped": sort token-expert pairs by expert and run torch._grouped_mm with device-side
    offsets, reading each expert's weights in place;
    impl "fused": the Triton kernel of kernels.py (for a few tokens a GEMV per expert on the CUDA
    cores, else tiles of pairs sorted by expert on the device through tl.dot), reading each distinct
    expert's weights once, as stored; above FUSED_MAX_TOKENS tokens (prefill)
    the grouped path where torch._grouped_mm exists, for plain experts only (it would dequantize
    every quantized expert of the layer at once). None reads a device value on the host.
    Quantized experts (INT4 packed, args.int4_group_size; FP8 blocks, args.fp8_block) stay as
    stored; for the plain paths, while the N*K token-expert pairs are fewer than the experts
    (decode, verify) only the routed ones are dequantized, by gathering; past that (prefill) impl
    "grouped" dequantizes every expert once per layer."""

    FUSED_MAX_TOKENS = 256

    def __init__(self, args, tp, impl, device, dtype):
        super().__init__()
        E, D = args.n_routed_experts, args.hidden_size
        inter = tp.split(args.moe_intermediate_size, "moe_intermediate_size")
        self.impl, self.group, fp8, self.n_experts = impl, args.int4_group_size, args.fp8_block, E
        self.quantized = self.group is not None or fp8 is not None
        dev = torch.device(device or "cpu")
        self.grouped_ok = grouped_mm_available(dev, dtype or torch.get_default_dtype())
        if fp8 is not None:
            self.gate_proj = Fp8Experts(E, inter, D, fp8, 1, tp, device, dtype)
            self.up_proj = Fp8Experts(E, inter, D, fp8, 1, tp, device, dtype)
            self.down_proj = Fp8Experts(E, D, inter, fp8, 2, tp, device, dtype)  # split along its input
            return
        if self.group is None:
            self.gate_proj = _param((E, inter, D), 1, device, dtype)
            self.up_proj = _param((E, inter, D), 1, device, dtype)
            self.down_proj = _param((E, D, inter), 2, device, dtype)
            return
        for name, size, why in (("hidden_size", D, "gate_proj and up_proj's input"),
                                ("moe_intermediate_size per rank", inter,
                                 f"down_proj's input, split across {tp.world_size} ranks")):
            if size % self.group:
                raise ValueError(f"INT4 experts: {name} = {size} does not fall on whole {self.group}-element "
                                 f"groups ({why})")
        self.gate_proj = PackedExperts(E, inter, D, self.group, 1, device, dtype)
        self.up_proj = PackedExperts(E, inter, D, self.group, 1, device, dtype)
        self.down_proj = PackedExperts(E, D, inter, self.group, 2, device, dtype)  # split along its input

    def weights(self, proj, ids=None):
        """Projection `proj` of experts `ids` (all when None) in the compute dtype: [..., out, in]."""
        w = getattr(self, proj)
        if self.quantized:
            return w.dequantize(ids)
        return w if ids is None else w[ids]

    def expert_bytes(self):
        """Bytes of one expert's three projections as stored (INT4: packed words and scales; FP8:
        values and block scales)."""
        return sum(t[0].numel() * t.element_size() for t in self.parameters())

    def runs_fused(self, n_tokens):
        return self.impl == "fused" and (n_tokens <= self.FUSED_MAX_TOKENS or not self.grouped_ok or self.quantized)

    def fused(self, x, ids, weights, stacked=None, variant=None):   # variant: kernels.fused_moe's (None: its rule)
        projs = stacked or [getattr(self, p) for p in ("gate_proj", "up_proj", "down_proj")]
        return kernels.fused_moe(x, ids, weights, *(p.kernel_weights() if self.quantized
                                                    else kernels.ExpertWeights("plain", p) for p in projs),
                                 variant=variant)

    def forward(self, x, ids, weights, stacked=None):   # x [N, D], ids/weights [N, K] -> [N, D]
        """stacked: MoE.fold_shared_expert's [E + 1, ...] tensors, for ids that may name expert E
        (fused path only)."""
        N, K = ids.shape
        if self.runs_fused(N):
            # torch.compile (run.py --compile) leaves the Triton launches alone: a graph break here
            # (around the whole of fused, which also builds the kernel's weight descriptors)
            return torch.compiler.disable(self.fused)(x, ids, weights, stacked)
        gather = self.impl == "gather" or (self.quantized and N * K < self.n_experts)
        if gather:
            h = (F.silu(torch.einsum("nd,nkid->nki", x, self.weights("gate_proj", ids)))
                 * torch.einsum("nd,nkid->nki", x, self.weights("up_proj", ids)))
            y = torch.einsum("nki,nkdi->nkd", h, self.weights("down_proj", ids))   # [N, K, D]
        else:
            by_expert, order = ids.flatten().sort(stable=True)                # [N*K] pairs by expert
            gate, up, down = (self.weights(p) for p in ("gate_proj", "up_proj", "down_proj"))
            experts = torch.arange(gate.shape[0], device=x.device, dtype=by_expert.dtype)
            offs = torch.searchsorted(by_expert, experts, right=True, out_int32=True)  # end of each group
            xs = x[order // K]                                                 # [N*K, D] by expert
            h = F.silu(torch._grouped_mm(xs, gate.mT, offs=offs)) * torch._grouped_mm(xs, up.mT, offs=offs)
            ys = torch._grouped_mm(h, down.mT, offs=offs)
            y = torch.empty_like(ys).index_copy_(0, order, ys).view(N, K, -1)  # back to token order
        return (at_least_f32(y) * weights.unsqueeze(-1)).sum(1).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, args, tp, impl, device, dtype):
        super().__init__()
        self.tp = tp
        self.gate = Router(args, device, dtype)
        self.experts = Experts(args, tp, impl, device, dtype)
        self.shared_experts = MLP(args.hidden_size, args.n_shared_experts * args.moe_intermediate_size,
                                  tp, "moe_intermediate_size", reduce=False, device=device, dtype=dtype)
        self.stacked = None         # fold_shared_expert's [E + 1, ...] tensors, once folded
        self.shared_in_launch = False

    def can_fold_shared_expert(self):
        """One plain shared expert of a routed expert's shape (Kimi-K2, DeepSeek-V3: n_shared_experts
        1), and the fused kernel: the shared expert can be expert E of the routed launch."""
        ex, sh = self.experts, self.shared_experts
        return (ex.impl == "fused" and not ex.quantized and sh.gate_proj.weight.dtype == ex.gate_proj.dtype
                and sh.gate_proj.weight.shape == ex.gate_proj.shape[1:])

    def fold_shared_expert(self):
        """Move the shared expert's weights in as expert E of the routed experts' tensors, so one
        fused launch computes both (Transformer.use_kernels "shared_expert"). Moved, not copied:
        both modules' parameters become views of the [E + 1, ...] tensors, so a checkpoint loaded
        or initialized afterwards lands in them under the same names."""
        if self.stacked is None:
            ex, sh = self.experts, self.shared_experts
            self.stacked = []
            for routed, shared in ((ex.gate_proj, sh.gate_proj.weight), (ex.up_proj, sh.up_proj.weight),
                                   (ex.down_proj, sh.down_proj.weight)):
                both = torch.cat([routed.data, shared.data.unsqueeze(0)])    # [E + 1, out, in]
                routed.data, shared.data = both[:-1], both[-1]
                self.stacked.append(both)
            sh.gate_up_weight, sh.stackable = None, False   # its gate and up rows live in `stacked` now
        return self

    def _apply(self, fn, recurse=True):   # .to() and the like move each parameter alone: fold again
        super()._apply(fn, recurse)
        if self.stacked is not None:
            self.stacked = None
            self.fold_shared_expert()
        return self

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, shape[-1])
        if self.shared_in_launch and self.experts.runs_fused(x.shape[0]):
            # the shared expert is expert E, chosen by every token with weight 1: K + 1 pairs a token
            ids, weights = self.gate(x, shared_slot=True)
            y = self.experts(x, ids, weights, self.stacked)
        elif self.shared_experts.fused_proj:  # fused_proj also folds the routed + shared add into the
            # shared expert's down GEMM (addmm_ onto the routed output): one kernel less a layer
            ids, weights = self.gate(x)
            y = self.shared_experts(x, add_to=self.experts(x, ids, weights))
        else:
            ids, weights = self.gate(x)
            y = self.experts(x, ids, weights) + self.shared_experts(x)
        return self.tp.all_reduce(y).view(shape)  # routed + shared partial sums: one all-reduce


class Block(nn.Module):
    def __init__(self, layer_id, args, tp, moe_impl, max_batch_size, max_seq_len, device, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, device, dtype)
        self.self_attn = MLA(args, tp, max_batch_size, max_seq_len, device, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, device, dtype)
        if layer_id < args.first_k_dense_replace:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, tp, "intermediate_size",
                           device=device, dtype=dtype)
        else:
            self.mlp = MoE(args, tp, moe_impl, device, dtype)

    def forward(self, x, positions, rope, future, mode):
        """The residual stream x [B, T, D] after this layer: x + attention + MLP."""
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, future, mode)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, pending, positions, rope, future, mode):
        """forward with each residual add fused into the RMSNorm that reads the sum
        (kernels.add_rmsnorm). pending: the previous layer's MLP output, not yet added to x (None:
        nothing pending). Returns (x after the attention add, this layer's MLP output): their sum is
        what forward returns, and the next layer's input norm (or the final one) adds it."""
        norm = self.input_layernorm
        if pending is None:
            h = norm(x)
        else:
            with scope("elementwise"):
                x, h = triton_kernels.add_rmsnorm(x, pending, norm.weight, norm.eps)
        attn = self.self_attn(h, positions, rope, future, mode)
        norm = self.post_attention_layernorm
        with scope("elementwise"):
            x, h = triton_kernels.add_rmsnorm(x, attn, norm.weight, norm.eps)
        return x, self.mlp(h)


# ---------------------------------------------------------------------------------------------
# The model

class TargetOutput(NamedTuple):
    """What Transformer.forward returns, with or without capture_aux."""
    logits: torch.Tensor        # [B, T, V] float32, the full vocabulary on every rank
    aux: torch.Tensor | None    # [B, T, 3*D] the EAGLE-3 states with capture_aux, else None


# Transformer(kernels=...): the fast twins, by name; all but "fused_proj" (GEMMs over stacked weights) are
# Triton ("shared_expert": the shared expert inside the fused MoE launch, where MoE.can_fold_shared_expert)
KERNELS = ("attention", "rope_cache", "router", "add_rmsnorm", "silu_mul", "shared_expert", "fused_proj", "norm_gemv")


class Transformer(nn.Module):
    """This rank's shard of the target. `tp` defaults to the torch.distributed world (or 1).

    aux_layer_ids: decoder layers whose outputs EAGLE-3 reads (default 1, L//2 - 1, L - 4).
    moe_impl: "gather" (plain), "grouped" (torch._grouped_mm), "fused" (the Triton kernel, kernels.py)
    or "auto" (on a GPU: fused where Triton is installed, else grouped where torch._grouped_mm
    runs; on the CPU: gather).
    routing: "model" (the router's own choice) or "uniform" (SIMULATED balanced routing, see Router).
    kernels: names from KERNELS (or "all") to run as their fast twins (Triton kernels, and
    fused_proj's stacked GEMMs) instead of the plain code (see use_kernels)."""

    def __init__(self, args, max_batch_size=1, max_seq_len=4096, device=None, dtype=None, tp=None,
                 aux_layer_ids=None, moe_impl="auto", routing="model", kernels=()):
        super().__init__()
        device = torch.device(device or "cpu")
        dtype = dtype or torch.get_default_dtype()
        self.args, self.tp = args, tp or TP.from_env()
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        if moe_impl == "auto":
            moe_impl = ("gather" if device.type != "cuda" else "fused" if fused_moe_available(device, dtype)
                        else "grouped" if grouped_mm_available(device, dtype) else "gather")
        if moe_impl not in ("gather", "grouped", "fused"):
            raise ValueError(f"moe_impl must be 'auto', 'gather', 'grouped' or 'fused', not {moe_impl!r}")
        if moe_impl == "grouped" and not grouped_mm_available(device, dtype):
            raise ValueError(f"moe_impl='grouped' needs torch._grouped_mm for {dtype} on {device}")
        if moe_impl == "fused" and not fused_moe_available(device, dtype):
            raise ValueError(f"moe_impl='fused' needs Triton and a bf16, fp16 or float32 model on CUDA (or Triton's "
                             f"CPU interpreter, TRITON_INTERPRET=1); here: {dtype} on {device}, Triton "
                             f"{'installed' if importlib.util.find_spec('triton') else 'not installed'}")
        self.moe_impl = moe_impl
        L = args.num_hidden_layers
        self.aux_layer_ids = sorted(aux_layer_ids if aux_layer_ids is not None else args.default_aux_layer_ids())
        if any(not 0 <= i < L for i in self.aux_layer_ids):
            raise ValueError(f"aux layer ids {self.aux_layer_ids} must lie in [0, {L})")
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, self.tp, device, dtype)
        self.layers = nn.ModuleList(Block(i, args, self.tp, moe_impl, max_batch_size, max_seq_len, device, dtype)
                                    for i in range(L))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, device, dtype)
        self.lm_head = ParallelLMHead(args.hidden_size, args.vocab_size, self.tp, device=device, dtype=dtype)
        cos, sin = rope_tables(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling, max_seq_len, device)
        self.register_buffer("rope", torch.stack((cos, sin), -1), persistent=False)   # [S, R/2, 2]
        self.set_routing(routing)
        self.use_kernels(kernels)

    def set_routing(self, routing):
        if routing not in ("model", "uniform"):
            raise ValueError(f"routing must be 'model' or 'uniform', not {routing!r}")
        self.routing = routing
        for m in self.modules():
            if isinstance(m, Router):
                m.routing = routing

    def use_kernels(self, names):
        """Run the named fast twins in place of the plain code, the others plain. Triton kernels
        (kernels.py): "attention" (decode-mode MLA attention), "rope_cache" (RoPE + latent norm +
        cache writes), "router" (logits and selection, SIMULATED uniform routing included),
        "add_rmsnorm" (every residual add fused into the RMSNorm that reads the sum: the
        post-attention one, the next layer's input norm, the final norm), "silu_mul" (the MLPs'
        SwiGLU activation), "norm_gemv" (for <= 16 rows, MLA's q_b_proj as a GEMV kernel with
        q_a_layernorm computed inside it; o_proj and decode mode's absorbed W_uk / W_uv products as
        GEMV kernels), "shared_expert" (the shared expert as one more expert of the fused MoE
        launch; only where MoE.can_fold_shared_expert, else it stays off and is not listed in
        self.kernels). "fused_proj" (plain torch): q_a_proj + kv_a_proj_with_mqa and each MLP's
        gate_proj + up_proj as one GEMM over their stacked weights (not a shared expert folded
        into the launch), the shared expert's down GEMM accumulating onto the routed output.
        names: an iterable, "all" or "none"."""
        names = set(KERNELS if names == "all" else () if names in (None, "none") else
                    [names] if isinstance(names, str) else names)
        if names - set(KERNELS):
            raise ValueError(f"unknown kernels {sorted(names - set(KERNELS))}; choose from {list(KERNELS)} or 'all'")
        if names - {"fused_proj"}:
            kernels.check_available(self.device)
            if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(f"the Triton kernels run bf16, fp16 or fp32 models, not {self.dtype}")
        for layer in self.layers:
            layer.self_attn.attn_impl = "triton" if "attention" in names else "torch"
            layer.self_attn.rope_cache_impl = "triton" if "rope_cache" in names else "torch"
            layer.self_attn.fused_proj = "fused_proj" in names and bool(self.args.q_lora_rank)
            if layer.self_attn.fused_proj:
                layer.self_attn.stack_projections()
            layer.self_attn.gemv_impl = "triton" if "norm_gemv" in names else "torch"
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.impl = "triton" if "router" in names else "torch"
                layer.mlp.shared_in_launch = "shared_expert" in names and layer.mlp.can_fold_shared_expert()
                if layer.mlp.shared_in_launch:
                    layer.mlp.fold_shared_expert()
            for m in layer.mlp.modules():
                if isinstance(m, MLP):   # not a shared expert folded into the launch above
                    m.fused_proj = "fused_proj" in names and m.stackable
                    if m.fused_proj:
                        m.stack_projections()
                    m.act_impl = "triton" if "silu_mul" in names else "torch"
        self.fused_add_norm = "add_rmsnorm" in names
        folded = any(isinstance(m, MoE) and m.shared_in_launch for m in self.modules())
        self.kernels = tuple(k for k in KERNELS if k in names and (k != "shared_expert" or folded))
        return self

    def compile_layers(self):
        """Let torch.compile fuse each decoder layer's small kernels (regional compilation: the
        layers of a kind share one compiled code, one per shape and mode). An option for speed,
        tested equal to the plain layers; CUDA graphs stay explicit (graphs.py captures these)."""
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for layer in self.layers:
            layer.compile(dynamic=False)   # Block.forward, through the module's call
            layer.forward_fused = torch.compile(layer.forward_fused, dynamic=False)   # add_rmsnorm's path
        return self

    @property
    def device(self):
        return self.rope.device

    @property
    def dtype(self):
        return self.norm.weight.dtype

    def forward(self, tokens, positions, mode="extend", capture_aux=False, kv_len=None):
        """tokens, positions: int64 [B, T]. Writes the KV cache at `positions`, then attends to
        slots <= position over the first kv_len slots (default: all). Returns a TargetOutput:
        logits [B, T, V] (float32, full vocabulary on every rank) and, with capture_aux, the
        EAGLE-3 states aux [B, T, 3*D] (the chosen layers' outputs, low to high; else None)."""
        if mode not in ("extend", "decode"):
            raise ValueError(f"mode must be 'extend' or 'decode', not {mode!r}")
        kv_len = kv_len or self.max_seq_len
        x = self.embed_tokens(tokens)                                         # [B, T, D]
        rope = self.rope[positions]                                           # [B, T, R/2, 2]
        future = torch.arange(kv_len, device=x.device) > positions.unsqueeze(-1)   # [B, T, S], once
        captured, pending = {}, None  # pending: the last MLP output, not yet added to x (fused path)
        for i, layer in enumerate(self.layers):
            if self.fused_add_norm:  # the add waits for the next norm, which does both in one kernel
                x, pending = layer.forward_fused(x, pending, positions, rope, future, mode)
            else:
                x = layer(x, positions, rope, future, mode)
            if capture_aux and i in self.aux_layer_ids:
                if pending is not None:  # an EAGLE-3 state is the layer's whole output: add it here
                    with scope("elementwise"):
                        x, pending = x + pending, None
                captured[i] = x
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1) if capture_aux else None
        if pending is None:
            h = self.norm(x)
        else:
            with scope("elementwise"):
                h = triton_kernels.add_rmsnorm(x, pending, self.norm.weight, self.norm.eps)[1]
        return TargetOutput(self.lm_head(h), aux)


# ---------------------------------------------------------------------------------------------
# INT4 experts, the reference format (DESIGN.md): the plain paths dequantize inside forward

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
