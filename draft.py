"""The EAGLE-3 draft head (Li et al., "EAGLE-3", arXiv:2503.01840), in the SpecForge / SGLang
layout.

One decoder layer (the "midlayer") reads the concatenation [input_layernorm(embedding of the next
token), hidden_norm(hidden)] where `hidden` is fc(three target hidden states) on extend rows and
the head's own previous output g on chain steps. g = the midlayer output before the final norm
(residual = the hidden input). Logits come from lm_head over the draft vocabulary; draft id i
means target id i + d2t[i].

Alignment (SpecForge training and SGLang inference agree): row t reads the target's states at
position t, the embedding of the token at t+1, RoPE position t, and predicts the token at t+2.
So after the target has verified up to position p and produced the token at p+1, the last extend
row (position p) gives d_1, the guess for position p+2, and chain step i (RoPE position p+1+i)
turns d_{i+1} into d_{i+2}: the draft phase, a chain of num_steps - 1 head steps. Slot =
position in the head's own KV cache, as in the target. A tree (topk > 1; EAGLE-2, arXiv:2406.16858,
and SGLang) expands the top-K at each level instead (Eagle3Draft.tree, select_tree), its rows at
scratch slots after the prefix, each seeing its ancestors only.

Training (the end of this file): EAGLE-3's "training-time test". The head is unrolled num_steps
times over whole sequences as inference runs it (Eagle3Draft.unroll: step 1 reads the target's
fused states, every later step its own fed-back g, with the attention inference allows), and each
step is scored against the frozen target's own distribution over the draft vocabulary (ttt_loss,
SpecForge's loss). test_equivalence.py checks that the unrolled head is the inference head.

Shape legend: B batch, T rows, D draft hidden, Dt target hidden, H local heads, G local kv heads,
Hd head dim, Vd draft vocab.
"""
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn

from model import MLP, RMSNorm, rope_tables, slots_read
from tp import ColumnParallelLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear, \
    VocabParallelEmbedding, _param


@dataclass
class DraftArgs:
    """Fields are the keys of a SpecForge LlamaForCausalLMEagle3 config.json (checkpoint.draft_args
    reads one)."""
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
    eagle_config: dict | None = field(default_factory=lambda: {
        "eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True})

    @property
    def aux_layer_ids(self):
        return (self.eagle_config or {}).get("eagle_aux_hidden_state_layer_ids")


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
        heads, kv_heads = "draft num_attention_heads", "draft num_key_value_heads"
        self.n_local_heads = tp.split(a.num_attention_heads, heads)
        self.n_local_kv_heads = tp.split(a.num_key_value_heads, kv_heads)
        self.head_dim, self.scale = a.head_dim, a.head_dim ** -0.5
        q_out, kv_out = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        self.q_proj = ColumnParallelLinear(2 * a.hidden_size, q_out, tp, heads, device, dtype)
        self.k_proj = ColumnParallelLinear(2 * a.hidden_size, kv_out, tp, kv_heads, device, dtype)
        self.v_proj = ColumnParallelLinear(2 * a.hidden_size, kv_out, tp, kv_heads, device, dtype)
        self.o_proj = RowParallelLinear(q_out, a.hidden_size, tp, heads, device=device, dtype=dtype)
        shape = (max_batch_size, max_seq_len, self.n_local_kv_heads, a.head_dim)
        for name in ("k_cache", "v_cache"):
            self.register_buffer(name, torch.zeros(shape, device=device, dtype=dtype),
                                 persistent=False)

    def forward(self, x, positions, cos, sin, kv_len=None, past=None, slots=None, visible=None):
        """x [B, T, 2D]. past None (inference): write this step's keys and values into the cache
        at `slots` (default: slot = position) and attend among the first kv_len slots (default
        all) to those `visible` [B, T, kv_len] allows (default: slots <= position). A draft tree
        passes both (Eagle3Draft.tree: its nodes share positions, so they need slots of their
        own, and each sees only its ancestors). past a list (training, see Eagle3Draft.unroll):
        the earlier unrolled steps' keys and values, this step's appended; no cache is touched."""
        q, k, v = self.project(x)
        q, k = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
        if past is None:
            o = self.attend_cache(q, k, v, positions, kv_len, slots, visible)
        else:
            o = self.attend_unrolled(q, k, v, past)
        return self.o_proj(o.flatten(2))

    def project(self, x):
        """q [B, T, H, Hd], k and v [B, T, G, Hd] of x [B, T, 2D], before RoPE."""
        B, T, _ = x.shape
        H, G = self.n_local_heads, self.n_local_kv_heads
        return (self.q_proj(x).view(B, T, H, -1), self.k_proj(x).view(B, T, G, -1),
                self.v_proj(x).view(B, T, G, -1))

    def expand_kv(self, t):                                    # [B, S, G, Hd] -> [B, S, H, Hd]
        return t.repeat_interleave(self.n_local_heads // self.n_local_kv_heads, 2)

    def attend_cache(self, q, k, v, positions, kv_len, slots=None, visible=None):
        B = q.shape[0]
        rows = torch.arange(B, device=q.device).unsqueeze(1)
        slots = positions if slots is None else slots
        self.k_cache[rows, slots] = k
        self.v_cache[rows, slots] = v
        S = slots_read(kv_len, self.k_cache.shape[1])  # the first kv_len (default all)
        k = self.expand_kv(self.k_cache[:B, :S])                                 # [B, S, H, Hd]
        v = self.expand_kv(self.v_cache[:B, :S])
        scores = torch.einsum("bthd,bshd->bths", q, k) * self.scale
        if visible is None:
            visible = torch.arange(S, device=q.device) <= positions.unsqueeze(-1)   # [B, T, S]
        scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
        p = scores.softmax(-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        return torch.einsum("bths,bshd->bthd", p, v)

    def attend_unrolled(self, q, k, v, past):
        """Row t of unrolled step i (RoPE position t + i) sees what chain step i - 1 from extend
        row t sees at inference: step 0's keys at rows <= t (the extend rows, slots 0..t) and its
        own row's keys of steps 1..i (the chain steps before it and itself, slots t+1..t+i),
        nothing else. (EAGLE's reference training code, and SpecForge after it, also hides step
        0's keys of rows t-i+1..t from step i; inference reads those slots, so we do not.
        SpecForge PR #245 and EAGLE issue #247 question that mask; the tests pin ours to
        inference.)"""
        past.append((k, v))
        (k0, v0), later = past[0], past[1:]
        T = q.shape[1]
        scores = torch.einsum("bthd,bshd->bths", q, self.expand_kv(k0))          # [B, T, H, T]
        rows = torch.arange(T, device=q.device)
        future = rows > rows.unsqueeze(1)                                         # [T, T]
        scores = scores.masked_fill(future.view(1, T, 1, T), float("-inf"))
        diag = [(q * self.expand_kv(kj)).sum(-1, keepdim=True) for kj, _ in later]  # [B, T, H, 1]
        p = (torch.cat([scores, *diag], -1) * self.scale).softmax(
            -1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)     # [B, T, H, T+i]
        o = torch.einsum("bths,bshd->bthd", p[..., :T], self.expand_kv(v0))
        for j, (_, vj) in enumerate(later):
            o = o + p[..., T + j:T + j + 1] * self.expand_kv(vj)
        return o


class MidLayer(nn.Module):
    def __init__(self, a, tp, max_batch_size, max_seq_len, device, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, device, dtype)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps, device, dtype)
        self.self_attn = DraftAttention(a, tp, max_batch_size, max_seq_len, device, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, device, dtype)
        self.mlp = MLP(a.hidden_size, a.intermediate_size, tp, "draft intermediate_size",
                       device=device, dtype=dtype)

    def forward(self, emb, hidden, positions, cos, sin, kv_len=None, past=None, slots=None,
                visible=None):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)   # [B, T, 2D]
        attn = self.self_attn(x, positions, cos, sin, kv_len, past, slots, visible)
        h = hidden + attn                                                # residual = hidden
        return h + self.mlp(self.post_attention_layernorm(h))                  # g, before the norm


class Tree(NamedTuple):
    """A draft tree per row. Node 0 is the root (the verified token); the others follow in
    SGLang's and EAGLE's order: the order expansion scored them in (level by level; within a
    level by the parent's rank in the frontier, then by the child's rank among its siblings),
    so every parent precedes its children and siblings carry distinct tokens."""
    tokens: torch.Tensor   # [B, N] target ids
    parents: torch.Tensor  # [B, N] the parent's node index; -1 for the root
    depths: torch.Tensor   # [B, N] 0 for the root, 1 for the level of d_1, ...
    scores: torch.Tensor   # [B, N] cumulative log-probability under the head (0 for the root)


def tree_capacity(topk, num_steps):
    """The nodes a tree can hold, the root included: 1 + K + (S - 1) K^2 (all that is scored)."""
    return 1 + topk + (num_steps - 1) * topk * topk


def check_tree(topk, num_steps, num_nodes):
    if topk < 1 or num_steps < 1:
        raise ValueError(f"topk and num_steps must be >= 1, not {topk} and {num_steps}")
    if not 2 <= num_nodes <= tree_capacity(topk, num_steps):
        most = tree_capacity(topk, num_steps)
        raise ValueError(f"num_draft_tokens {num_nodes} outside [2, {most}]: a tree of topk {topk} "
                         f"and {num_steps} steps holds 1 + K + (S - 1) K^2 = {most} nodes")


def log_probs(logits):
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)


def select_tree(root, scores, tokens, parents, topk, num_nodes):
    """The tree of the num_nodes - 1 best scored nodes under `root` [B] (SGLang's
    organize_draft_results and build_tree_kernel_efficient; EAGLE's topK_genrate). scores,
    tokens, parents [B, M]: every node the expansion scored, in flat order (level 1's K nodes,
    then each later level's K x K children by frontier rank and child rank); parents as flat
    indices, -1 for the root. The sort is stable, so on a tie a parent (earlier in flat order,
    and never scored below its child) comes first: the chosen set holds every chosen node's
    parent. The chosen nodes keep flat order. All on the device, shapes fixed by (K, S, N)."""
    (B, M), dev = scores.shape, scores.device
    chosen = scores.sort(dim=-1, descending=True, stable=True).indices[:, :num_nodes - 1]
    chosen = chosen.sort(-1).values                                        # [B, N-1], flat order
    node_of = torch.zeros(B, M + 1, dtype=torch.long, device=dev)  # flat index + 1 -> node; 0: root
    node_of.scatter_(1, chosen + 1, torch.arange(1, num_nodes, device=dev).expand(B, -1))
    flat = torch.arange(M, device=dev)
    level = torch.where(flat < topk, 1, 2 + (flat - topk) // (topk * topk))  # [M]
    first = torch.zeros(B, 1, dtype=torch.long, device=dev)
    return Tree(tokens=torch.cat([root.unsqueeze(1), tokens.gather(1, chosen)], 1),
                parents=torch.cat([first - 1, node_of.gather(1, parents.gather(1, chosen) + 1)], 1),
                depths=torch.cat([first, level[chosen]], 1),
                scores=torch.cat([first.to(scores.dtype), scores.gather(1, chosen)], 1))


def set_target_aux_layers(target, args):
    """Make `target` capture the layers the head was trained on (the draft config's
    eagle_aux_hidden_state_layer_ids; without them the target keeps its default layers). The one
    place where a draft changes its target: checkpoint.load_draft calls it, and so must anyone
    who builds an Eagle3Draft from a config that names its layers."""
    ids = args.aux_layer_ids
    if ids is None:
        return
    if len(ids) != 3 or any(not 0 <= i < target.args.num_hidden_layers for i in ids):
        raise ValueError(f"draft eagle_aux_hidden_state_layer_ids {ids}: EAGLE-3 reads 3 layers, "
                         f"each among the target's {target.args.num_hidden_layers}")
    target.aux_layer_ids = sorted(ids)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 head for `target` (a model.Transformer), tensor parallel like it.

    The target's embedding is shared unless own_embedding (checkpoint.load_draft: a head of another
    width that carries embed_tokens). The target must already capture the layers the head reads
    (set_target_aux_layers)."""

    def __init__(self, args, target, max_batch_size=None, max_seq_len=None, device=None,
                 dtype=None, own_embedding=False):
        super().__init__()
        self.args, self.tp = args, target.tp
        device, dtype = device or target.device, dtype or target.dtype
        self.max_batch_size = max_batch_size = max_batch_size or target.max_batch_size
        self.max_seq_len = max_seq_len = max_seq_len or target.max_seq_len
        check_fits(args, target, own_embedding)
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, self.tp,
                                                       device, dtype)
        else:  # not registered: the target owns (and loads) these weights
            object.__setattr__(self, "embed_tokens", target.embed_tokens)
        self.fc = ReplicatedLinear(3 * target.args.hidden_size, args.hidden_size, device, dtype)
        self.midlayer = MidLayer(args, self.tp, max_batch_size, max_seq_len, device, dtype)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, device, dtype)
        self.lm_head = ParallelLMHead(args.hidden_size, args.draft_vocab_size, self.tp,
                                      "draft_vocab_size", device, dtype)
        self.d2t = _param((args.draft_vocab_size,), None, device, torch.int64)
        cos, sin = rope_tables(args.head_dim, args.rope_theta, args.rope_scaling, max_seq_len,
                               device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens, positions, hidden, kv_len=None, past=None, slots=None, visible=None):
        """One pass of the midlayer. tokens, positions [B, T]; hidden [B, T, D], in the head's
        own width: fc(target states) on extend rows, the previous step's g on chain steps.
        EAGLE-3 fuses only the target's states through fc (`extend` applies it, `chain` does
        not). Attention over the first kv_len cache slots (default all); past, slots, visible:
        see DraftAttention.forward. Returns draft logits [B, T, Vd] and g [B, T, D]."""
        if (slots is None) != (visible is None):
            raise ValueError("slots and visible go together: a tree's cache slots and its mask")
        if hidden.shape[-1] != self.args.hidden_size:
            raise ValueError(f"hidden is {hidden.shape[-1]} wide, not the head's hidden_size "
                             f"{self.args.hidden_size}: target states go through extend (which "
                             "applies fc), not straight into the head")
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        emb = self.embed_tokens(tokens)
        g = self.midlayer(emb, hidden, positions, cos, sin, kv_len, past, slots, visible)
        return self.lm_head(self.norm(g)), g

    def hot_ids(self):
        """The target ids of the draft vocabulary, in draft order: [Vd]."""
        return torch.arange(self.args.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, logits):
        ids = logits.argmax(-1)
        return ids + self.d2t[ids]

    def extend(self, tokens, positions, target_states, last, kv_len=None):
        """Rows with fresh target states [B, T, 3*Dt] (fused by fc); `last` [B] is each row's last
        valid row. Returns d_1 [B] (target ids) and g [B, D] of that row."""
        logits, g = self.extend_logits(tokens, positions, target_states, last, kv_len)
        return self.to_target_ids(logits), g

    def extend_logits(self, tokens, positions, target_states, last, kv_len=None):
        """`extend`, returning the draft logits [B, Vd] of each row's row `last` instead of its
        top-1 (a tree drafts the top-K of them), and g [B, D] of that row."""
        logits, g = self(tokens, positions, self.fc(target_states), kv_len)
        pick = last.view(-1, 1, 1)
        logits = logits.gather(1, pick.expand(-1, 1, logits.shape[-1])).squeeze(1)
        return logits, g.gather(1, pick.expand(-1, 1, g.shape[-1])).squeeze(1)

    def chain(self, first, g, last_pos, num_steps, kv_len=None):
        """The draft phase: d_1 = first [B], then num_steps - 1 head steps. last_pos [B] is the
        position of the last extend row; step i reads d_{i+1} and the previous g (no fc: g is
        already the head's width) at RoPE position last_pos + 1 + i, written at that slot, so
        kv_len (default: the whole cache) must exceed last_pos + num_steps - 1. Returns drafts
        [B, num_steps] in target ids."""
        drafts = [first]
        for i in range(num_steps - 1):
            pos = (last_pos + 1 + i).unsqueeze(1)                                       # [B, 1]
            logits, g = self(drafts[-1].unsqueeze(1), pos, g.unsqueeze(1), kv_len)
            drafts.append(self.to_target_ids(logits[:, 0]))
            g = g[:, 0]
        return torch.stack(drafts, 1)

    def propose(self, tokens, positions, target_states, last, num_steps):
        """Extend over the rows, then chain, in one call, reading the whole cache: the head's part
        of verify.prefill, which also shifts the prompt (row t reads token t + 1; `tokens` here
        already are), extends in chunks (prefill_draft) and bounds the slots read (kv_len)."""
        first, g = self.extend(tokens, positions, target_states, last)
        last_pos = positions.gather(1, last.unsqueeze(1)).squeeze(1)
        return self.chain(first, g, last_pos, num_steps)

    def tree(self, root, logits, g, last_pos, topk, num_steps, num_nodes, kv_len=None):
        """The draft tree of EAGLE-2/3 and SGLang (--speculative-eagle-topk K,
        --speculative-num-steps S, --speculative-num-draft-tokens N). root [B]: the verified
        token x, at position p + 1 (p = last_pos [B], the position of the extend's last row);
        logits [B, Vd] and g [B, D]: that row's (extend_logits), which guess x's children.
        Level 1: their top-K. Each later level: one head pass over the K frontier nodes (RoPE
        position p + level - 1, each reading the g of the row that proposed it), each proposes
        its top-K children, K x K candidates scored by cumulative log-probability under the head;
        the best K are the next frontier.
        After S levels (S - 1 head passes) the N - 1 best of all scored nodes under the root are
        the tree (select_tree). Returns a Tree.

        The head's cache: pass j (1-based) writes its K rows at the scratch slots
        p + 1 + (j - 1) K .. p + j K after the prefix (slots <= p), and a row sees the prefix, its
        ancestors' slots and its own (EAGLE's tree mask; `seen` [B, K, L] follows the frontier).
        SGLang's draft decode instead lets frontier row r see the earlier passes' row r, an
        ancestor only if the frontier kept its order. With K = 1 the slots are the positions and
        this is `chain`. The next extend writes slots from p + 1 on before reading them (slot =
        position), so the scratch is never read stale. kv_len must exceed p + (S - 1) K."""
        check_tree(topk, num_steps, num_nodes)
        (B, K), D, dev = (logits.shape[0], topk), g.shape[-1], root.device
        L = kv_len or self.midlayer.self_attn.k_cache.shape[1]   # the slots read (each pass checks)
        score, ids = log_probs(logits).topk(K, -1)                           # [B, K], best first
        tok = ids + self.d2t[ids]
        scores, tokens, parents = [score], [tok], [torch.full_like(ids, -1)]
        frontier, hidden = torch.arange(K, device=dev).expand(B, K), g.unsqueeze(1).expand(B, K, D)
        prefix = (torch.arange(L, device=dev) <= last_pos.unsqueeze(1)).unsqueeze(1)   # [B, 1, L]
        seen = torch.zeros(B, K, L, dtype=torch.bool, device=dev)  # the scratch slots a row sees
        for j in range(1, num_steps):
            slots = last_pos.unsqueeze(1) + 1 + (j - 1) * K + torch.arange(K, device=dev)   # [B, K]
            seen = seen.scatter(2, slots.unsqueeze(2), True)
            pos = (last_pos + j).unsqueeze(1).expand(B, K)
            logits, g = self(tok, pos, hidden, kv_len, slots=slots, visible=prefix | seen)
            child, ids = log_probs(logits).topk(K, -1)                       # [B, K, K]
            cum = (score.unsqueeze(2) + child).flatten(1)                    # [B, K*K]
            scores.append(cum)
            tokens.append((ids + self.d2t[ids]).flatten(1))
            parents.append(frontier.repeat_interleave(K, 1))
            score, pick = cum.topk(K, -1)                                    # the next frontier
            frontier = K + (j - 1) * K * K + pick                            # its flat indices
            tok, up = tokens[-1].gather(1, pick), (pick // K).unsqueeze(2)   # up: its parent row
            hidden, seen = g.gather(1, up.expand(B, K, D)), seen.gather(1, up.expand(B, K, L))
        return select_tree(root, torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1),
                           K, num_nodes)

    def unroll(self, tokens, target_states, num_steps):
        """EAGLE-3's training-time test: the head run num_steps times over whole sequences exactly
        as inference runs it, in one differentiable pass that touches no cache.
        tokens [B, T]: sequences x_0..x_{T-1}; target_states [B, T, 3*Dt]: the target's states
        along them. Step 0 is the extend over every row: row t reads the states at t, token
        x_{t+1}, RoPE position t. Step i > 0 is chain step i - 1 started from every row at once:
        row t reads x_{t+1+i} (where inference reads its own draft d_i, the guess for that
        token), the g of step i - 1 on the same row, RoPE position t + i, and attends as
        DraftAttention.attend_unrolled says. Returns logits [num_steps, B, T, Vd]: step i, row t
        predicts x_{t+2+i}. Rows that run past the end read token 0 and have no label."""
        B, T = tokens.shape
        seq = torch.cat([tokens[:, 1:], tokens.new_zeros(B, num_steps)], 1)  # step i reads t + i
        positions = torch.arange(T, device=tokens.device).expand(B, T)
        hidden, past, steps = self.fc(target_states), [], []
        for i in range(num_steps):
            logits, hidden = self(seq[:, i:i + T], positions + i, hidden, past=past)  # g, fed back
            steps.append(logits)
        return torch.stack(steps)


def check_fits(args, target, own_embedding=False):
    """A head of config `args` reads `target`: the same width of states, the same vocabulary, the
    target's embedding only at the target's width, whole groups of query heads a kv head, and the
    layers it was trained on captured."""
    t_hidden = args.target_hidden_size or target.args.hidden_size
    if t_hidden != target.args.hidden_size:
        raise ValueError(f"draft target_hidden_size {t_hidden} != target hidden_size "
                         f"{target.args.hidden_size}")
    if not own_embedding and args.hidden_size != target.args.hidden_size:
        raise ValueError(f"draft hidden_size {args.hidden_size} != target hidden_size "
                         f"{target.args.hidden_size}: the head shares the target's embedding "
                         "only at its width (a head of another width carries embed_tokens)")
    if args.num_attention_heads % args.num_key_value_heads:
        raise ValueError(f"draft num_attention_heads {args.num_attention_heads} is not a multiple "
                         f"of num_key_value_heads {args.num_key_value_heads}")
    if args.vocab_size != target.args.vocab_size:
        raise ValueError(f"draft vocab_size {args.vocab_size} != target vocab_size "
                         f"{target.args.vocab_size}")
    if not 1 <= args.draft_vocab_size <= args.vocab_size:
        raise ValueError(f"draft_vocab_size {args.draft_vocab_size} must lie in [1, vocab_size "
                         f"{args.vocab_size}]: the draft vocabulary is a subset of the target's")
    if args.aux_layer_ids is not None and sorted(args.aux_layer_ids) != target.aux_layer_ids:
        raise ValueError(f"the draft reads target layers {sorted(args.aux_layer_ids)} (its "
                         "eagle_aux_hidden_state_layer_ids) but the target captures "
                         f"{target.aux_layer_ids}: call draft.set_target_aux_layers(target, args) "
                         "first (checkpoint.load_draft does)")


# ---------------------------------------------------------------------------------------------
# Training (EAGLE-3's training-time test, with SpecForge's loss): the target is frozen; its
# states and its own predictions along training text are the head's input and labels.

def draft_vocab(predicted, vocab_size, draft_vocab_size):
    """d2t [Vd] for the draft_vocab_size target ids the target predicts most often (`predicted`:
    any tensor of its argmax ids along the training text), sorted by id; ties go to the lower id."""
    counts = torch.bincount(predicted.flatten().cpu(), minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices
    hot = order[:draft_vocab_size].sort().values
    return hot - torch.arange(draft_vocab_size)


def ttt_loss(head, tokens, target_states, target_logits, num_steps, decay=0.8):
    """The EAGLE-3 loss over an unrolled head (SpecForge's recipe). tokens [B, T]; target_states
    [B, T, 3*Dt] and target_logits [B, T, V] from one target forward over them. Step i, row t is
    scored against the target's own distribution at position t + 1 + i (its prediction of
    x_{t+2+i}) restricted to the draft vocabulary and renormalized: cross-entropy, averaged over
    the rows that have that label and whose target argmax lies in the draft vocabulary; step i
    weighs decay**i. Returns the loss and, per step, the share of labelled rows where the head's
    top-1 (in target ids) equals the target's argmax (the rate at which greedy verify would
    accept that draft, had all before it been accepted and had the text been the target's own).
    Steps with no labelled row (i >= T - 1) are not scored, nor listed."""
    if tokens.shape[1] < 2:
        raise ValueError(f"ttt_loss needs sequences of at least 2 tokens (step 0 of row t is "
                         f"scored on the target's prediction at t + 1), not {tokens.shape[1]}")
    steps = head.unroll(tokens, target_states, num_steps)                      # [S, B, T, Vd]
    hot = head.hot_ids()
    in_vocab = torch.zeros(target_logits.shape[-1], dtype=torch.bool, device=hot.device)
    in_vocab[hot] = True
    T, loss, agree = tokens.shape[1], 0.0, []
    for i in range(num_steps):
        n = T - 1 - i                                       # rows t < n have a label x_{t+2+i}
        if n <= 0:
            break
        label = target_logits[:, 1 + i:].float()                               # [B, n, V]
        best = label.argmax(-1)
        p = label[..., hot].softmax(-1)                                        # [B, n, Vd]
        logp = steps[i, :, :n].float().log_softmax(-1)
        keep = in_vocab[best]
        loss = loss + decay ** i * -((p * logp).sum(-1) * keep).sum() / keep.sum().clamp(min=1)
        agree.append((head.to_target_ids(steps[i, :, :n]) == best).float().mean().item())
    return loss, agree


def train_step(head, optimizer, tokens, target_states, target_logits, num_steps):
    """One optimizer step on ttt_loss; the head's floating-point parameters must require grad.
    Returns the loss and the per-step top-1 agreement."""
    loss, agree = ttt_loss(head, tokens, target_states, target_logits, num_steps)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item(), agree
