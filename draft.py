"""The EAGLE-3 draft head (Li et al., "EAGLE-3", arXiv:2503.01840), in the SpecForge / SGLang layout.

One decoder layer (the "midlayer") reads the concatenation [input_layernorm(embedding of the next
token), hidden_norm(hidden)] where `hidden` is fc(three target hidden states) on extend rows and
the head's own previous output g on chain steps. g = the midlayer output before the final norm
(residual = the hidden input). Logits come from lm_head over the draft vocabulary; draft id i
means target id i + d2t[i].

Alignment (SpecForge training and SGLang inference agree): row t reads the target's states at
position t, the embedding of the token at t+1, RoPE position t, and predicts the token at t+2.
So after the target has verified up to position q and produced the token at q+1, the last extend
row (position q) gives d_1, the guess for position q+2, and chain step i (RoPE position q+1+i)
turns d_{i+1} into d_{i+2}. Slot = position in the head's own KV cache, as in the target.

Shape legend: B batch, T rows, D draft hidden, Dt target hidden, H local heads, G local kv heads,
Hd head dim, Vd draft vocab.
"""
import json
import os
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn

from model import (MLP, CheckpointError, RMSNorm, check_config_types, checkpoint_files, config_file, init_random,
                   load_weights, normalize_rope_scaling, read_config, rope_tables, write_safetensors)
from tp import ColumnParallelLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear, \
    VocabParallelEmbedding, _param


@dataclass
class DraftArgs:
    """Fields are the keys of a SpecForge LlamaForCausalLMEagle3 config.json."""
    hidden_size: int = 7168
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    head_dim: int = 128
    intermediate_size: int = 18432
    vocab_size: int = 163840
    draft_vocab_size: int = 32000
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 131072
    target_hidden_size: int | None = None
    eagle_config: dict | None = field(default_factory=lambda: {"eagle_aux_hidden_state_layer_ids": [2, 30, 58],
                                                        "use_aux_hidden_state": True})

    @property
    def aux_layer_ids(self):
        return (self.eagle_config or {}).get("eagle_aux_hidden_state_layer_ids")

    @classmethod
    def from_hf_config(cls, path_or_dict):
        cfg, where = read_config(path_or_dict), config_file(path_or_dict)
        arch = cfg.get("architectures") or []
        if "LlamaForCausalLMEagle3" not in arch:
            raise CheckpointError(f"{where}: architectures {arch} is not ['LlamaForCausalLMEagle3']")
        check_config_types(cls, cfg, where)
        cfg = dict(cfg, rope_scaling=normalize_rope_scaling(cfg.get("rope_scaling")))
        heads = cfg.get("num_attention_heads", cls.num_attention_heads)
        cfg.setdefault("head_dim", cfg.get("hidden_size", cls.hidden_size) // heads)
        cfg.setdefault("num_key_value_heads", heads)
        cfg["draft_vocab_size"] = cfg.get("draft_vocab_size") or cfg.get("vocab_size", cls.vocab_size)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})

    def to_hf_config(self):
        return dict(asdict(self), architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                    num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False)


DRAFT_PRESETS = {
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                 intermediate_size=128, vocab_size=256, draft_vocab_size=64, rope_theta=10000.0,
                 max_position_embeddings=1024, eagle_config=None),
    "kimi-k2": {},  # SpecForge configs/kimi-k2-eagle3.json
}


def draft_preset(name, **overrides):
    if name not in DRAFT_PRESETS:
        raise ValueError(f"unknown draft preset {name!r}; choose from {sorted(DRAFT_PRESETS)}")
    return DraftArgs(**{**DRAFT_PRESETS[name], **overrides})


def rotate_half_rope(x, cos, sin):
    """Llama RoPE on halves. x [B, T, H, Hd]; cos, sin [B, T, Hd/2]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = xf.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)


class DraftAttention(nn.Module):
    """Llama attention whose q/k/v read the 2*D concatenation; heads column/row parallel."""

    def __init__(self, a, tp, max_batch_size, max_seq_len, device, dtype):
        super().__init__()
        self.n_local_heads = tp.split(a.num_attention_heads, "draft num_attention_heads")
        self.n_local_kv_heads = tp.split(a.num_key_value_heads, "draft num_key_value_heads")
        self.head_dim, self.scale = a.head_dim, a.head_dim ** -0.5
        what = "draft num_attention_heads"
        self.q_proj = ColumnParallelLinear(2 * a.hidden_size, a.num_attention_heads * a.head_dim, tp, what, device, dtype)
        self.k_proj = ColumnParallelLinear(2 * a.hidden_size, a.num_key_value_heads * a.head_dim, tp,
                                           "draft num_key_value_heads", device, dtype)
        self.v_proj = ColumnParallelLinear(2 * a.hidden_size, a.num_key_value_heads * a.head_dim, tp,
                                           "draft num_key_value_heads", device, dtype)
        self.o_proj = RowParallelLinear(a.num_attention_heads * a.head_dim, a.hidden_size, tp, what,
                                        device=device, dtype=dtype)
        shape = (max_batch_size, max_seq_len, self.n_local_kv_heads, a.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def forward(self, x, positions, cos, sin, kv_len=None):          # x [B, T, 2D]
        B, T, _ = x.shape
        q = rotate_half_rope(self.q_proj(x).view(B, T, self.n_local_heads, -1), cos, sin)
        rows = torch.arange(B, device=x.device).unsqueeze(1)
        self.k_cache[rows, positions] = rotate_half_rope(self.k_proj(x).view(B, T, self.n_local_kv_heads, -1), cos, sin)
        self.v_cache[rows, positions] = self.v_proj(x).view(B, T, self.n_local_kv_heads, -1)
        S = kv_len or self.k_cache.shape[1]  # the slots read: the first kv_len (default all)
        k = self.k_cache[:B, :S].repeat_interleave(self.n_local_heads // self.n_local_kv_heads, 2)  # [B, S, H, Hd]
        v = self.v_cache[:B, :S].repeat_interleave(self.n_local_heads // self.n_local_kv_heads, 2)
        scores = torch.einsum("bthd,bshd->bths", q, k) * self.scale
        future = torch.arange(S, device=x.device) > positions.unsqueeze(-1)     # [B, T, S], as in model.py
        scores = scores.masked_fill(future.unsqueeze(2), float("-inf"))
        p = scores.softmax(-1, dtype=torch.promote_types(x.dtype, torch.float32)).to(x.dtype)
        return self.o_proj(torch.einsum("bths,bshd->bthd", p, v).flatten(2))


class MidLayer(nn.Module):
    def __init__(self, a, tp, max_batch_size, max_seq_len, device, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, device, dtype)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps, device, dtype)
        self.self_attn = DraftAttention(a, tp, max_batch_size, max_seq_len, device, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, device, dtype)
        self.mlp = MLP(a.hidden_size, a.intermediate_size, tp, "draft intermediate_size", device=device, dtype=dtype)

    def forward(self, emb, hidden, positions, cos, sin, kv_len=None):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)   # [B, T, 2D]
        h = hidden + self.self_attn(x, positions, cos, sin, kv_len)                # residual = hidden
        return h + self.mlp(self.post_attention_layernorm(h))                      # g, before the norm


class Eagle3Draft(nn.Module):
    """The EAGLE-3 head for `target` (a model.Transformer), tensor parallel like it.

    The target's embedding is shared unless own_embedding (the checkpoint has embed_tokens)."""

    def __init__(self, args, target, max_batch_size=None, max_seq_len=None, device=None, dtype=None,
                 own_embedding=False):
        super().__init__()
        self.args, self.tp = args, target.tp
        device, dtype = device or target.device, dtype or target.dtype
        max_batch_size, max_seq_len = max_batch_size or target.max_batch_size, max_seq_len or target.max_seq_len
        t_hidden = args.target_hidden_size or target.args.hidden_size
        if t_hidden != target.args.hidden_size:
            raise ValueError(f"draft target_hidden_size {t_hidden} != target hidden_size {target.args.hidden_size}")
        if args.vocab_size != target.args.vocab_size:
            raise ValueError(f"draft vocab_size {args.vocab_size} != target vocab_size {target.args.vocab_size}")
        ids = args.aux_layer_ids
        if ids is not None:  # the target captures the layers this head was trained on
            if any(not 0 <= i < target.args.num_hidden_layers for i in ids):
                raise ValueError(f"draft eagle_aux_hidden_state_layer_ids {ids} outside the target's layers")
            target.aux_layer_ids = sorted(ids)
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, self.tp, device, dtype)
        else:  # not registered: the target owns (and loads) these weights
            object.__setattr__(self, "embed_tokens", target.embed_tokens)
        self.fc = ReplicatedLinear(3 * t_hidden, args.hidden_size, device, dtype)
        self.midlayer = MidLayer(args, self.tp, max_batch_size, max_seq_len, device, dtype)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, device, dtype)
        self.lm_head = ParallelLMHead(args.hidden_size, args.draft_vocab_size, self.tp, "draft_vocab_size",
                                      device, dtype)
        self.d2t = _param((args.draft_vocab_size,), None, device, torch.int64)
        cos, sin = rope_tables(args.head_dim, args.rope_theta, args.rope_scaling, max_seq_len, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens, positions, hidden, kv_len=None):
        """tokens, positions [B, T]; hidden [B, T, 3*Dt] (target states) or [B, T, D] (own g);
        attention over the first kv_len cache slots (default all). Returns draft logits [B, T, Vd]
        and g [B, T, D]."""
        if hidden.shape[-1] != self.args.hidden_size:
            hidden = self.fc(hidden)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        g = self.midlayer(self.embed_tokens(tokens), hidden, positions, cos, sin, kv_len)
        return self.lm_head(self.norm(g)), g

    def to_target_ids(self, logits):
        ids = logits.argmax(-1)
        return ids + self.d2t[ids]

    def extend(self, tokens, positions, hidden, last, kv_len=None):
        """Rows with fresh target states; `last` [B] is each row's last valid row. Returns d_1 [B]
        (target ids) and g [B, D] of that row."""
        logits, g = self(tokens, positions, hidden, kv_len)
        pick = last.view(-1, 1, 1)
        logits = logits.gather(1, pick.expand(-1, 1, logits.shape[-1])).squeeze(1)
        return self.to_target_ids(logits), g.gather(1, pick.expand(-1, 1, g.shape[-1])).squeeze(1)

    def chain(self, first, g, q, num_steps, kv_len=None):
        """d_1 = first [B]; step i reads d_{i+1} and g at RoPE position q + 1 + i. Returns
        drafts [B, num_steps] in target ids."""
        drafts = [first]
        for i in range(num_steps - 1):
            logits, g = self(drafts[-1].unsqueeze(1), (q + 1 + i).unsqueeze(1), g.unsqueeze(1), kv_len)
            drafts.append(self.to_target_ids(logits[:, 0]))
            g = g[:, 0]
        return torch.stack(drafts, 1)

    def propose(self, tokens, positions, hidden, last, num_steps):
        """Extend over the rows, then chain: what verify.generate does after the prefill, in one call."""
        first, g = self.extend(tokens, positions, hidden, last)
        q = positions.gather(1, last.unsqueeze(1)).squeeze(1)
        return self.chain(first, g, q, num_steps)


def init_random_draft(draft, seed, rank_local=False):
    """Random weights (as model.init_random) and a random sorted d2t over distinct target ids."""
    init_random(draft, seed, rank_local)
    g = torch.Generator().manual_seed(seed + 17)
    hot = torch.randperm(draft.args.vocab_size, generator=g)[:draft.args.draft_vocab_size].sort().values
    draft.d2t.copy_(hot - torch.arange(draft.args.draft_vocab_size))
    return draft


def draft_table(draft):
    return [(name, p, None) for name, p in draft.named_parameters()]


def save_draft(draft, path):
    """Write the SpecForge / SGLang layout (config.json + model.safetensors, with t2d). TP 1 only."""
    if draft.tp.world_size != 1:
        raise ValueError("save_draft needs the whole head (TP 1)")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(draft.args.to_hf_config(), f, indent=2)
    tensors = {name: p.detach().contiguous().cpu() for name, p, _ in draft_table(draft)}
    t2d = torch.zeros(draft.args.vocab_size, dtype=torch.bool)
    t2d[torch.arange(draft.args.draft_vocab_size) + tensors["d2t"]] = True
    tensors["t2d"] = t2d
    write_safetensors(tensors, path)


def load_draft(path, target, max_batch_size=None, max_seq_len=None, device=None, dtype=None):
    """A SpecForge / SGLang EAGLE-3 checkpoint for `target`; each rank reads only its slices."""
    args = DraftArgs.from_hf_config(path)
    own = "embed_tokens.weight" in checkpoint_files(path)
    try:
        draft = Eagle3Draft(args, target, max_batch_size, max_seq_len, device, dtype, own_embedding=own)
    except ValueError as e:  # a head that does not fit this target (sizes, vocabulary, layer ids)
        raise CheckpointError(f"draft {os.fspath(path)}: {e}") from None
    load_weights(draft_table(draft), path, draft.tp, "draft", skip=lambda name: "t2d (not needed)" if name == "t2d" else None)
    return draft
