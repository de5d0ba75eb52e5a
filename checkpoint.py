"""Loading and saving the target and the EAGLE-3 head: the stage between files and modules.

Reads a Hugging Face folder (config.json, generation_config.json, model.safetensors or the shards
of model.safetensors.index.json) into this rank's model.Transformer or draft.Eagle3Draft, each
rank reading only its own slices (safetensors get_slice), one tensor at a time; writes the same
layouts back (TP 1); fills a model with seeded random weights that are the same at any TP.
Maps a config.json to model.ModelArgs / draft.DraftArgs and back, and holds the presets (the
random targets run.py builds) and the quantization_config layouts as shipped.

The formats read and written:
  plain: bf16 / fp16 / fp32, copied into the model's dtype.
  FP8 (Kimi-K2-Instruct, DeepSeek-V3): float8_e4m3fn `weight` times a float32 `weight_scale_inv`
    per block (128 x 128, partial at the edges). The routed experts stay FP8 in memory (this
    rank's slice and the scale blocks over it); every other weight is dequantized per rank slice.
  INT4 (Kimi-K2-Thinking, K2.5; compressed-tensors "pack-quantized", symmetric): the routed
    experts only, kept packed in memory (`weight_packed`, `weight_scale`, checked `weight_shape`);
    element c of a row sits in word c//8 at bits 4*(c%8)..+3, stored as q + 8 (pack_int4,
    model.unpack_int4).
  Kimi-K2.5: the text model under `language_model.` and `text_config`; the vision tower skipped.

One table drives every step: checkpoint_table lists (checkpoint name, parameter, expert index)
and each parameter's `shard_dim` (tp.py) says how the global tensor is split across ranks.
model.py and draft.py know nothing of this file; it imports them.

Public: load_target, save_target, load_draft, save_draft, init_random, init_random_draft,
read_target_args, read_draft_args, target_args, target_config, draft_args, draft_config, preset,
PRESETS,
fp8_quantization_config, int4_quantization_config, quant_scheme, CheckpointError.
"""
import json
import math
import os
import re
import sys
import typing
import zlib
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, fields

if __name__ == "__main__":   # before torch's import: the answer comes at once
    print("checkpoint.py is a module (loading, saving, random init), not a command: "
          "run.py --model-path DIR loads a pair, train.py makes one", file=sys.stderr)
    sys.exit(2)

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from draft import DraftArgs, Eagle3Draft, set_target_aux_layers
from model import ModelArgs, Transformer, eos_union
from tp import print0


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be loaded; the message names the file and the problem."""


# ---------------------------------------------------------------------------------------------
# Configs: a config.json's keys as model.ModelArgs / draft.DraftArgs (whose fields are those
# keys) and back, the spellings that differ between transformers versions read as one, and
# what this model does not implement refused by name

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


def rope_fields(cfg, default_theta):
    """cfg with rope_theta and rope_scaling as the model reads them, from either spelling: the
    newer transformers' rope_parameters, or rope_theta (default_theta where it is missing) and
    rope_scaling."""
    cfg = dict(cfg)
    if "rope_parameters" in cfg:
        rp = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rp.pop("rope_theta", default_theta)
        kind = rp.pop("rope_type", rp.pop("type", "default"))
        cfg["rope_scaling"] = None if kind == "default" else dict(rp, type=kind)
    else:
        cfg.setdefault("rope_theta", default_theta)
        cfg["rope_scaling"] = normalize_rope_scaling(cfg.get("rope_scaling"))
    return cfg


# the targets this model implements, as their config.json names them (Kimi-K2 and K2-Thinking:
# DeepseekV3ForCausalLM with model_type kimi_k2; Kimi-K2.5 wraps the text model), and the sizes
# a config must give (a missing one would silently be Kimi-K2's)
TARGET_ARCHITECTURES = ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
TARGET_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")
TARGET_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "n_routed_experts", "num_experts_per_tok", "kv_lora_rank")


def check_architecture(top, cfg):
    """ValueError where a config names another model (its architectures or model_type) or leaves
    out a size; top: the file's contents, cfg: its text model's (top itself but for Kimi-K2.5)."""
    arch = top.get("architectures")
    if arch is not None and not set(arch) & set(TARGET_ARCHITECTURES):
        raise ValueError(f"architectures {arch} is not one of {list(TARGET_ARCHITECTURES)} (a "
                         "DeepSeek-V3 / Kimi-K2 target)")
    kind = top.get("model_type")
    if arch is None and kind is not None and kind not in TARGET_MODEL_TYPES:
        raise ValueError(f"model_type {kind!r} is not one of {list(TARGET_MODEL_TYPES)} (a "
                         "DeepSeek-V3 / Kimi-K2 target)")
    missing = [k for k in TARGET_REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"no {', '.join(missing)}: not a DeepSeek-V3 / Kimi-K2 config")


def target_args(top):
    """A DeepseekV3 / Kimi-K2 / Kimi-K2.5 config.json's contents as ModelArgs (read_target_args
    reads a checkpoint's: the EOS ids of its generation_config.json added, errors naming the
    file). Kimi-K2.5 nests the text model under text_config; its EOS ids and those of the outer
    config are taken together."""
    cfg = dict(top.get("text_config", top))
    check_architecture(top, cfg)
    eos = eos_union(cfg.get("eos_token_id"), top.get("eos_token_id"))
    if eos:
        cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    cfg["quantization_config"] = (cfg.get("quantization_config")
                                  or top.get("quantization_config"))
    quant_scheme(cfg["quantization_config"])  # refuses what is not implemented, by name
    cfg = rope_fields(cfg, ModelArgs.rope_theta)
    refuse_unimplemented(cfg)
    check_config_types(ModelArgs, cfg)
    names = {f.name for f in fields(ModelArgs)}
    return ModelArgs(**{k: v for k, v in cfg.items() if k in names})


def target_config(args):
    """ModelArgs as a DeepseekV3 config.json's contents."""
    cfg = asdict(args)
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return cfg


def draft_args(cfg):
    """An EAGLE-3 head's config.json's contents as DraftArgs (read_draft_args reads a
    checkpoint's, errors naming the file)."""
    arch = cfg.get("architectures") or []
    if "LlamaForCausalLMEagle3" not in arch:
        raise ValueError(f"architectures {arch} is not ['LlamaForCausalLMEagle3']")
    derived = ("head_dim", "num_key_value_heads", "draft_vocab_size")   # null: derive them
    cfg = {k: v for k, v in cfg.items() if v is not None or k not in derived}
    check_config_types(DraftArgs, cfg)
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise NotImplementedError("eagle_config.use_aux_hidden_state is false: a head that reads "
                                  "the target's last hidden state, not three aux states, is not "
                                  "implemented")
    # what a config leaves out means what it means to SGLang, not our Kimi-K2 preset's values:
    # rope_theta Llama's 10000, no eagle_config the target's default aux layers
    cfg = rope_fields(cfg, 10000.0)
    cfg.setdefault("eagle_config", None)
    heads = cfg.get("num_attention_heads", DraftArgs.num_attention_heads)
    cfg.setdefault("head_dim", cfg.get("hidden_size", DraftArgs.hidden_size) // heads)
    cfg.setdefault("num_key_value_heads", heads)
    vocab = cfg.get("vocab_size", DraftArgs.vocab_size)
    cfg["draft_vocab_size"] = cfg.get("draft_vocab_size") or vocab
    names = {f.name for f in fields(DraftArgs)}
    return DraftArgs(**{k: v for k, v in cfg.items() if k in names})


def draft_config(args):
    """DraftArgs as a SpecForge LlamaForCausalLMEagle3 config.json's contents; fields that are
    None left out (SGLang reads a present target_hidden_size or eagle_config as set)."""
    cfg = {k: v for k, v in asdict(args).items() if v is not None}
    return dict(cfg, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False)


# ---------------------------------------------------------------------------------------------
# Quantized experts: what a quantization_config means for the model. FP8 (Kimi-K2-Instruct,
# DeepSeek-V3): the routed experts stay float8_e4m3fn with float32 block scales; INT4
# (Kimi-K2-Thinking, K2.5; compressed-tensors "pack-quantized", symmetric): the routed experts
# stay packed. quant_scheme checks a config against these layouts; ModelArgs.fp8_block and
# ModelArgs.int4_group_size then read the block or the group from it, which picks the Experts
# the model builds.

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
# Presets: the random targets run.py builds (--preset) and the tests use

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
    quant_scheme(kw.get("quantization_config"))  # an override this model does not implement
    return ModelArgs(**kw)


# ---------------------------------------------------------------------------------------------
# Config files: found and read (target_args / draft_args map their contents), every problem one
# error naming the file.

def config_file(path):
    """The config.json a path names: the file, or the one in its folder."""
    path = os.fspath(path)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def read_config(path):
    """A config.json (the file, or the one in a folder) as a dict."""
    if not os.path.exists(path):
        raise CheckpointError(f"{os.fspath(path)}: no such file or folder")
    file = config_file(path)
    if not os.path.exists(file):
        raise CheckpointError(f"{os.fspath(path)} has no config.json")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        where = f"{file} line {e.lineno} column {e.colno}"
        raise CheckpointError(f"{where}: not JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{file}: not a text file") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def generation_eos(path):
    """The eos_token_id of the generation_config.json beside a config.json (None without one)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(folder, "generation_config.json")
    if not os.path.exists(file):
        return None
    return read_config(file).get("eos_token_id")   # a broken file: a CheckpointError naming it


def read_target_args(path):
    """ModelArgs of a checkpoint's config.json (the file or its folder). Its EOS ids are those of
    config.json and of a generation_config.json beside it, together (engines stop at every one:
    SGLang's model config takes the union, vLLM adds them as stops)."""
    cfg = read_config(path)
    extra = generation_eos(path)
    if extra is not None:
        cfg = dict(cfg, eos_token_id=eos_union(cfg.get("eos_token_id"), extra))
    try:
        return target_args(cfg)
    except ValueError as e:   # a field of the wrong type
        raise CheckpointError(f"{config_file(path)}: {e}") from None


def read_draft_args(path):
    """DraftArgs of an EAGLE-3 checkpoint's config.json (the file or its folder)."""
    cfg = read_config(path)
    try:
        return draft_args(cfg)
    except ValueError as e:   # not an EAGLE-3 head, a field of the wrong type
        raise CheckpointError(f"{config_file(path)}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Quantized formats: what only loading and saving need (the dequantize-then-multiply reference
# the experts run, unpack_int4 and dequantize_int4, lives in model.py)

def ignored(module, ignore):
    """compressed-tensors' ignore rule: "re:" entries match by regex, others by name (or dotted
    suffix)."""
    return any(re.match(e[3:], module) if e.startswith("re:")
               else module == e or module.endswith("." + e) for e in ignore)


def check_int4_scope(table, ignore):
    """compressed-tensors quantizes every linear layer whose module the ignore list does not name.
    Only the routed experts quantized is implemented, so each linear layer of the checkpoint table
    must be quantized exactly when it is a routed expert; anything else is refused by name."""
    for name, _, _ in table:
        module, leaf = name.rsplit(".", 1)
        routed = ".mlp.experts." in name
        linear = routed or name.endswith(("_proj.weight", "_proj_with_mqa.weight",
                                          "lm_head.weight"))
        if not linear or leaf == "weight_scale":   # a packed expert: checked by its weight_packed
            continue
        if ignored(module, ignore) == routed:
            raise NotImplementedError(
                f"INT4 quantization_config: {module} is {'' if routed else 'not '}in the ignore "
                "list; only the routed experts quantized is implemented")


def pack_int4(q):
    """int [..., n] in [-8, 7] -> int32 [..., n/8]; the inverse of model.unpack_int4."""
    if q.shape[-1] % 8 or q.min() < -8 or q.max() > 7:
        raise ValueError("pack_int4 needs values in [-8, 7] and a last dim divisible by 8, "
                         f"got {list(q.shape)}")
    nibbles = (q.to(torch.int64) + 8).unflatten(-1, (-1, 8))
    words = (nibbles << torch.arange(0, 32, 4, device=q.device)).sum(-1)     # in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def dequantize_fp8_slice(name, sl, scale_sl, index, block, device, dtype):
    """This rank's slice of an FP8 weight times its block scales, in `dtype` (at least float32) on
    `device`. Only the scale blocks that overlap the slice are read; a slice may start or end
    inside a block."""
    shape, (br, bc) = sl.get_shape(), block
    want = [-(-shape[0] // br), -(-shape[1] // bc)]
    if list(scale_sl.get_shape()) != want:
        raise CheckpointError(f"{name}_scale_inv: expected shape {want} for {shape} in {br}x{bc} "
                              f"blocks, found {list(scale_sl.get_shape())}")
    (r0, r1), (c0, c1) = [(s.start, s.stop) for s in index]
    w = sl[index].to(device, dtype)
    s = scale_sl[r0 // br:-(-r1 // br), c0 // bc:-(-c1 // bc)].to(device, dtype)
    s = s.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return w * s[r0 % br:r0 % br + r1 - r0, c0 % bc:c0 % bc + c1 - c0]


# ---------------------------------------------------------------------------------------------
# The table: our parameter names are the HF names (with "model." in front of all but lm_head),
# except the stacked experts, which map to one HF tensor per expert. The draft's names are
# SpecForge's as they are.

def global_shape(p, tp):
    """The shape of the whole tensor whose slice this rank's parameter holds."""
    if hasattr(p, "global_shape"):   # FP8 experts' block scales (model.Fp8Experts)
        return list(p.global_shape)
    shape = list(p.shape)
    if p.shard_dim is not None:
        shape[p.shard_dim] *= tp.world_size
    return shape


def rank_slice(shape, dim, tp):
    """The index of this rank's slice of a tensor of global `shape` split along `dim` (or whole)."""
    index = [slice(0, n) for n in shape]
    if dim is not None:
        n = shape[dim] // tp.world_size
        index[dim] = slice(tp.rank * n, (tp.rank + 1) * n)
    return tuple(index)


def checkpoint_table(model, prefix=""):
    """[(hf_name, parameter, expert index or None)] for every tensor of the target's checkpoint."""
    table = []
    for name, p in model.named_parameters():
        hf = prefix + (name if name.startswith("lm_head.") else "model." + name)
        if ".mlp.experts." in name:   # "gate_proj" (a plain weight), "gate_proj.weight_packed", ...
            head, tail = hf.split(".mlp.experts.")
            proj, _, kind = tail.partition(".")
            table += [(f"{head}.mlp.experts.{j}.{proj}.{kind or 'weight'}", p, j)
                      for j in range(p.shape[0])]
        else:
            table.append((hf, p, None))
    return table


def draft_table(draft):
    """The head's checkpoint table: its parameter names as they are, no experts."""
    return [(name, p, None) for name, p in draft.named_parameters()]


# ---------------------------------------------------------------------------------------------
# Random weights

def random_weight(model, name, p, shape, g):
    """A random value for parameter p, called `name`, of global (or rank-local) `shape`."""
    device = g.device
    if name.endswith("weight_packed"):  # random nibbles; stored 0 (q = -8) becomes 8 (q = 0)
        w = torch.randint(-2**31, 2**31, shape, generator=g, device=device, dtype=torch.int64)
        b = w.to(torch.int32).view(torch.uint8)
        lo, hi = b & 0xF, b >> 4
        return (lo.masked_fill(lo == 0, 8) | (hi.masked_fill(hi == 0, 8) << 4)).view(torch.int32)
    noise = torch.randn(shape, generator=g, device=device)
    if p.dtype == torch.float8_e4m3fn:  # FP8 experts: N(0, 1) values; the block scales set |W|
        return noise
    if name.endswith("weight_scale_inv"):
        fan_in = global_shape(model.get_parameter(name.removesuffix("_scale_inv")), model.tp)[-1]
        return (1 + 0.1 * noise) / math.sqrt(fan_in)
    if name.endswith("weight_scale"):  # q in [-7, 7], 0 twice as likely (nibble 0 folded onto 8):
        # E[q^2] = 280 / 16 = 17.5
        fan_in = shape[-1] * model.args.int4_group_size
        return (1 + 0.1 * noise) / (math.sqrt(17.5) * math.sqrt(fan_in))
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1 + 0.1 * noise
    if name.endswith("e_score_correction_bias"):
        return 0.1 * noise
    return noise / math.sqrt(shape[-1])


def init_random(model, seed, rank_local=False):
    """Random weights for a model.Transformer (or a draft.Eagle3Draft: init_random_draft). Default:
    each tensor drawn whole on the CPU from a generator seeded by (seed, name), then sliced, so
    TP 1 and TP N hold the same model. rank_local=True draws only this rank's slice on the device
    (cheap for configs too big to draw whole; TP N != TP 1). INT4 experts get random values q,
    symmetric in [-7, 7] (zero-mean, so the experts share no constant component), and scales that
    give |W| ~ 1/sqrt(in); FP8 experts N(0, 1) values in e4m3 and block scales ~1/sqrt(in).
    Either way a replicated parameter (the router, the norms, q_a and kv_a, the head's fc) is the
    same on every rank: rank_local seeds only a split one's slice by its rank."""
    tp = model.tp
    for name, p in model.named_parameters():
        if not p.dtype.is_floating_point and not name.endswith("weight_packed"):
            continue   # index tables (the draft's d2t) are set by their owner
        device = p.device if rank_local else torch.device("cpu")
        split = p.shard_dim is not None or hasattr(p, "block_index")
        g = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode())
                                                + (7919 * tp.rank if rank_local and split else 0))
        shape = list(p.shape) if rank_local else global_shape(p, tp)
        w = random_weight(model, name, p, shape, g)
        if not rank_local and p.shard_dim is not None:
            w = w.chunk(tp.world_size, p.shard_dim)[tp.rank]
        elif not rank_local and hasattr(p, "block_index"):   # the scale blocks over this slice
            w = w[(slice(None),) + p.block_index]
        p.copy_(w)
    return model


def init_random_draft(draft, seed, rank_local=False):
    """Random weights (as init_random) and a random sorted d2t over distinct target ids."""
    init_random(draft, seed, rank_local)
    g = torch.Generator().manual_seed(seed + 17)
    n = draft.args.draft_vocab_size
    hot = torch.randperm(draft.args.vocab_size, generator=g)[:n].sort().values
    draft.d2t.copy_(hot - torch.arange(n))
    return draft


# ---------------------------------------------------------------------------------------------
# Saving (TP 1: a rank holds only its slices)

def write_config(cfg, path):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def save_target(model, path, max_shard_bytes=None):
    """Write config.json plus model.safetensors (or shards and model.safetensors.index.json)
    in the HF DeepseekV3 layout; INT4 experts as compressed-tensors pack-quantized, with their
    weight_shape; FP8 experts as stored (weight + weight_scale_inv), every other weight plain
    (it was dequantized at load; the loader reads plain weights under an FP8 config too)."""
    if model.tp.world_size != 1:
        raise ValueError("save_target needs the whole model (TP 1); this rank holds a 1/"
                         f"{model.tp.world_size} shard")
    cfg = target_config(model.args)
    if model.args.int4_group_size is None and model.args.fp8_block is None:
        cfg.pop("quantization_config")
    write_config(cfg, path)
    write_safetensors(checkpoint_tensors(model), path, max_shard_bytes)


def checkpoint_tensors(model, prefix=""):
    """{checkpoint name: CPU tensor} of a whole (TP 1) model; INT4 experts with their
    weight_shape."""
    tensors = {k: (p if j is None else p[j]).detach().contiguous().cpu()
               for k, p, j in checkpoint_table(model, prefix)}
    for k in [k for k in tensors if k.endswith(".weight_packed")]:
        out, words = tensors[k].shape
        tensors[k.removesuffix("packed") + "shape"] = torch.tensor([out, words * 8])
    return tensors


def write_safetensors(tensors, path, max_shard_bytes=None):
    """One model.safetensors, or shards of at most max_shard_bytes plus the index json."""
    if not max_shard_bytes:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    shards, size = [{}], 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname))
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def save_draft(draft, path):
    """Write the SpecForge / SGLang layout (config.json + model.safetensors, with t2d). TP 1."""
    if draft.tp.world_size != 1:
        raise ValueError("save_draft needs the whole head (TP 1)")
    write_config(draft_config(draft.args), path)
    tensors = {name: p.detach().contiguous().cpu() for name, p, _ in draft_table(draft)}
    t2d = torch.zeros(draft.args.vocab_size, dtype=torch.bool)
    t2d[torch.arange(draft.args.draft_vocab_size) + tensors["d2t"]] = True
    tensors["t2d"] = t2d
    write_safetensors(tensors, path)


# ---------------------------------------------------------------------------------------------
# Loading: this rank's slice of each tensor, one at a time

def checkpoint_files(path):
    """{tensor name: file} from model.safetensors.index.json or a single model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map "
                                  f"({type(e).__name__}: {e})") from None
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(f"{os.fspath(path)} has neither model.safetensors nor "
                              "model.safetensors.index.json")
    with open_safetensors(single) as f:
        return {k: single for k in f.keys()}


def open_safetensors(file):
    """safe_open, with a truncated or corrupt file (or a shard the index names but the folder
    lacks) refused by name."""
    try:
        return safe_open(file, "pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError, or an OSError
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def check_tensor_names(files, expected, path, what, skip, derived=()):
    """Every expected tensor present, none left over (but the scales and shapes read with their
    weight, the `derived` names the format always carries and this code computes instead, passed
    over silently, and what skip(name) labels: passed over, counted in one line)."""
    companions = {k for k in files if k.endswith((".weight_scale_inv", ".weight_shape"))}
    companions |= set(derived)
    skipped = Counter(skip(k) for k in files if k not in expected and skip(k))
    missing = [k for k in expected if k not in files]
    unexpected = [k for k in files if k not in expected and k not in companions and not skip(k)]
    packed = [k for k in unexpected if k.endswith(".weight_packed")]
    if packed:
        raise NotImplementedError(
            f"{what} {path}: {len(packed)} tensor(s) are INT4-packed where this model expects "
            f"plain weights, e.g. {packed[:2]}: the config has no compressed-tensors "
            "quantization_config, or INT4 reaches beyond the routed experts (only they are "
            "implemented)")
    if missing:
        raise CheckpointError(f"{what} {path} is missing {len(missing)} tensor(s), "
                              f"e.g. {missing[:3]}")
    if unexpected:
        raise CheckpointError(f"{what} {path} has {len(unexpected)} unexpected tensor(s), "
                              f"e.g. {unexpected[:3]}")
    if skipped:
        print0(f"{what}: skipping {sum(skipped.values())} tensors this model does not use: "
               + ", ".join(f"{label} ({n})" for label, n in sorted(skipped.items())))


FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
INT_DTYPES = {torch.int64: "I64", torch.int32: "I32"}


class Reader:
    """The safetensors files of one checkpoint, each opened once (on `stack`) when first read."""

    def __init__(self, files, path, what, stack):
        self.files, self.path, self.what, self.stack, self.handles = files, path, what, stack, {}

    def get_slice(self, k):
        if k not in self.files:
            raise CheckpointError(f"{self.what} {self.path} is missing {k}")
        file = self.files[k]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(open_safetensors(file))
        return self.handles[file].get_slice(k)

    def error(self, k, problem):
        return CheckpointError(f"{self.what} {self.files[k]}: tensor {k} {problem}")


def read_rank_slice(reader, k, p, j, tp, fp8_block):
    """This rank's slice of tensor k, for parameter p (expert j of it, or all of it if j is None),
    checked against the parameter's global shape and dtype; FP8 weights of plain parameters
    dequantized; INT4 words checked against their weight_shape."""
    sl = reader.get_slice(k)
    want = global_shape(p, tp)[1:] if j is not None else global_shape(p, tp)
    if list(sl.get_shape()) != want:
        raise reader.error(k, f"has shape {list(sl.get_shape())}, expected {want}")
    if hasattr(p, "block_index"):   # FP8 experts' scales: the blocks over this rank's slice
        index = p.block_index        # (per expert: the tensor is [rows, cols] blocks)
    else:
        # expert j's tensor lacks the stacked parameter's leading dim (experts): its split dim is
        # one less
        dim = p.shard_dim if j is None or p.shard_dim is None else p.shard_dim - 1
        index = rank_slice(want, dim, tp)
    if p.dtype == torch.float8_e4m3fn:   # FP8 experts stay FP8: this rank's slice as stored
        if sl.get_dtype() != "F8_E4M3":
            raise reader.error(k, f"has dtype {sl.get_dtype()}, expected F8_E4M3 (the config "
                                  "says FP8)")
        return sl[index]
    if sl.get_dtype() == "F8_E4M3" and fp8_block and p.dtype.is_floating_point:
        return dequantize_fp8_slice(k, sl, reader.get_slice(k + "_scale_inv"), index, fp8_block,
                                    p.device, torch.promote_types(p.dtype, torch.float32))
    allowed = FLOAT_DTYPES if p.dtype.is_floating_point else {INT_DTYPES[p.dtype]}
    if sl.get_dtype() not in allowed:
        raise reader.error(k, f"has dtype {sl.get_dtype()}, not supported here (expected one of "
                              f"{sorted(allowed)}; FP8 needs an fp8 quantization_config)")
    if k.endswith(".weight_packed"):
        shape = reader.get_slice(k.removesuffix("packed") + "shape")[:].tolist()
        if shape != [want[0], want[1] * 8]:
            raise CheckpointError(f"{reader.what} tensor {k}: packed shape {want} does not match "
                                  f"its weight_shape {shape} (expected [{shape[0]}, "
                                  f"{shape[1] // 8}] words)")
    return sl[index]


def load_weights(table, path, tp, what="checkpoint", skip=lambda name: None, fp8_block=None,
                 derived=()):
    """Copy this rank's slice of every tensor in `table` [(name, param, expert or None)] from the
    safetensors files under `path`, reading only those slices (safetensors get_slice), one tensor
    at a time, file by file. skip(name) gives a label for a tensor to pass over (None: not
    skipped), said in one line; `derived` names are passed over silently. FP8 tensors are
    dequantized with their `weight_scale_inv` in fp8_block blocks; INT4 ones are copied packed
    after their `weight_shape` is checked."""
    files = checkpoint_files(path)
    expected = {name: (p, j) for name, p, j in table}
    check_tensor_names(files, expected, path, what, skip, derived)
    with ExitStack() as stack:  # closes the files and the bar, also when a tensor is refused
        bar = stack.enter_context(tqdm(total=len(expected), desc=f"loading {what}",
                                       disable=tp.rank != 0, unit="tensor"))
        reader = Reader(files, path, what, stack)
        for k in sorted(expected, key=lambda k: files[k]):  # each shard is opened once
            p, j = expected[k]
            (p if j is None else p[j]).copy_(read_rank_slice(reader, k, p, j, tp, fp8_block))
            bar.update()


def load_target(path, max_batch_size=1, max_seq_len=4096, device=None, dtype=None, tp=None,
                **kwargs):
    """config.json + safetensors (single file or sharded index) -> this rank's model.Transformer
    (kwargs go to its constructor). Each rank reads only its own slices; no rank ever holds the
    whole model. Reads bf16/fp16/fp32 checkpoints, FP8 block-quantized ones (routed experts kept
    FP8, the rest dequantized per slice) and INT4 pack-quantized experts (kept packed), and the
    Kimi-K2.5 layout (text model under `language_model.`; the vision tower and projector
    skipped)."""
    args = read_target_args(path)
    kind, block_or_group = quant_scheme(args.quantization_config)
    try:
        model = Transformer(args, max_batch_size, max_seq_len, device, dtype, tp, **kwargs)
    except ValueError as e:  # a size the TP does not divide, aux layer ids outside the model
        raise CheckpointError(f"{config_file(path)}: {e}") from None
    prefix = "language_model." if "text_config" in read_config(path) else ""
    table = checkpoint_table(model, prefix)
    if kind == "int4":
        check_int4_scope(table, args.quantization_config.get("ignore") or [])
    n = args.num_hidden_layers

    def skip(name):
        if prefix and not name.startswith(prefix):
            return name.split(".")[0]   # the vision tower and the projector
        parts = name.removeprefix(prefix).split(".")
        if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= n:
            return f"layers >= {n} (DeepSeek's MTP module)"
        return None
    load_weights(table, path, model.tp, "target", skip=skip,
                 fp8_block=block_or_group if kind == "fp8" else None)
    return model


def load_draft(path, target, max_batch_size=None, max_seq_len=None, device=None, dtype=None):
    """A SpecForge / SGLang EAGLE-3 checkpoint for `target` (made to capture the layers the head
    was trained on: draft.set_target_aux_layers); each rank reads only its slices."""
    args = read_draft_args(path)
    # as SGLang (set_embed): the target's embedding, whatever the head carries, unless the widths
    # differ (a head's own table is a copy of the target's in SpecForge's exports)
    own = ("embed_tokens.weight" in checkpoint_files(path)
           and args.hidden_size != target.args.hidden_size)
    try:
        set_target_aux_layers(target, args)
        draft = Eagle3Draft(args, target, max_batch_size, max_seq_len, device, dtype,
                            own_embedding=own)
    except ValueError as e:  # a head that does not fit this target (sizes, vocabulary, layer ids)
        raise CheckpointError(f"draft {os.fspath(path)}: {e}") from None
    # t2d, SGLang's draft-vocabulary mask, says what d2t says: every such head carries it, so
    # passing it over is expected, not news (other tensors a head does not use are still named)
    def skip(name):
        return "embed_tokens (the target's is used)" if name == "embed_tokens.weight" else None
    load_weights(draft_table(draft), path, draft.tp, "draft", skip=skip, derived=("t2d",))
    return draft
