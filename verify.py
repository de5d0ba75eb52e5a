"""Verify, accept, commit: the speculative generation loop and the plain baseline loop.

A cycle: the target verifies [x_p, d_1..d_k] at positions p..p+k (one forward, k+1 tokens per row)
in either attention path, "extend" or "decode" (absorbed MLA), the words of model.py (SGLang's
--speculative-attention-mode calls extend "prefill"; run.py maps its flag). Eager or CUDA-graph
captured. Acceptance runs on the device for all rows at once (greedy: drafts that
equal the target's argmax, accepted length by cumulative product; sampling: speculative rejection
sampling, Leviathan et al. arXiv:2211.17192, with the top-1 draft as a point mass, so the output
follows the target's distribution exactly); then the draft head extends over the accepted tokens
and chains the next k drafts. Rejected tokens leave KV slots that the next writes overwrite
(slot = position).

Shapes are fixed per (batch, k): rows that accepted fewer tokens carry junk in their tail, rows
that finished keep running in place, so every step can be captured. The loop reads the device
once per cycle: "are all rows done?" (marked HOST READ below).

The target reads only the cache slots in use, rounded up to a bucket (kv_bucket): the host knows
a bound on every row's position without reading the device (the prompt length plus k+1 per
cycle), so each graphs.GraphKey (phase, mode, batch, tokens, slots) is one fixed shape and one
graph. Prefill runs in chunks through the static cache (slot = position makes that exact), so a
long prompt never holds extend attention's scores for all its positions at once.

A draft tree (topk given, draft.Eagle3Draft.tree) runs tree_cycle instead: its N nodes verified
at slots after the prefix under a mask as data (tree_visible), accepted by a walk from the root
(walk_tree: greedy, or multi-candidate rejection sampling, SpecInfer arXiv:2305.09781), the
accepted path's latents moved to slot = position (Transformer.move_cache).
"""
import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from draft import Tree, check_tree
from graphs import CudaGraphs, GraphKey
from model import eos_union


@dataclass
class GenerateResult:
    tokens: list          # per row, the generated ids (prompt excluded)
    accepted: torch.Tensor  # [cycles, B] tokens a row kept in a cycle, minus one: the drafts
                            # accepted, less any cut at max_new_tokens or after an EOS; -1 once
                            # the row finished. Per row, the sum of (accepted + 1) over its live
                            # cycles, + 1 for the prefill's token, is len(tokens[row])
    cycles: int
    simulated: bool       # acceptance forced (Probe.accept_len): the tokens are not the model's
    drafts: torch.Tensor | None = None  # [cycles, B, k] the ids each cycle verified, -1 once a row
                                        # finished (None for plain decoding); a tree: its N - 1
                                        # nodes below the root, in node order
    parents: torch.Tensor | None = None  # a tree: [cycles, B, N - 1] each node's parent (0: the
                                         # root, i: drafts[..., i - 1]); -1 once a row finished
    paths: torch.Tensor | None = None  # a tree: [cycles, B, D] the accepted nodes by depth (D =
                                       # min(S, N - 1)), -1 past the accepted ones and once finished


@dataclass(frozen=True)
class Probe:
    """What a benchmark puts into the loop, in one object; the default changes nothing.
    mark(name) is called at the end of each phase of each cycle ("start", "verify", "accept",
    "draft_extend", "draft", "commit"; plain: "start", "decode_step", "commit"): run.py records
    device events there. accept_len, when given, forces acceptance (SIMULATED, as SGLang's
    SGLANG_SIMULATE_ACC_LEN): each cycle draws its accepted length, bonus included, around this
    mean (simulated_accept), and the tokens are no longer the model's."""
    mark: Callable[[str], None] = lambda name: None
    accept_len: float | None = None


NO_PROBE = Probe()


@dataclass
class Loop:
    """What every cycle of one generate() call reads: the models, how a forward runs (run: a
    CudaGraphs' run, or eager), verify's attention mode, the sampling, the probe, and the tree's
    sizes (K, S, N; None for a chain)."""
    target: object
    draft: object
    run: Callable
    mode: str
    temperature: float
    generator: torch.Generator
    probe: Probe = NO_PROBE
    sizes: tuple | None = None


def is_id(t):
    """An integer a prompt may hold: an int, a numpy integer or a 0-d integer tensor, not a bool."""
    if isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.is_floating_point()):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def pad_prompts(prompts, device):
    """A list of id lists (ragged allowed) or an integer [B, P] tensor -> padded int64 [B, P],
    lengths [B]."""
    if isinstance(prompts, torch.Tensor):
        if (prompts.dim() != 2 or 0 in prompts.shape or prompts.is_floating_point()
                or prompts.dtype == torch.bool):
            raise ValueError(f"a prompts tensor must be integer ids [B, P] with B, P >= 1, not "
                             f"{prompts.dtype} {list(prompts.shape)}")
        lens = torch.full((prompts.shape[0],), prompts.shape[1], device=device)
        return prompts.to(device, torch.int64), lens
    if (isinstance(prompts, (str, bytes)) or not prompts
            or any(not isinstance(p, (list, tuple, range, torch.Tensor)) and type(p).__module__
                   != "numpy" or not len(p) for p in prompts)
            or not all(is_id(t) for p in prompts for t in p)):
        raise ValueError("prompts must be a list of token-id lists, each of at least one int "
                         f"(or an integer [B, P] tensor), not {str(prompts)[:60]}")
    P = max(len(p) for p in prompts)
    tokens = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], dtype=torch.int64,
                          device=device)
    return tokens, torch.tensor([len(p) for p in prompts], device=device)


def check_request(target, tokens, max_new_tokens, lookahead):
    B, P = tokens.shape
    a = target.args
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
    if B > target.max_batch_size:
        raise ValueError(f"batch of {B} prompts > max_batch_size {target.max_batch_size}")
    need = P + max_new_tokens + lookahead
    if need > target.max_seq_len:
        raise ValueError(f"prompt of {P} tokens + max_new_tokens {max_new_tokens} + {lookahead} "
                         f"lookahead = {need} slots > max_seq_len {target.max_seq_len} of the KV "
                         "cache")
    bad = (tokens < 0) | (tokens >= a.vocab_size)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(f"prompt row {row} has id {tokens[row, col].item()} at position {col}, "
                         f"outside the vocabulary [0, {a.vocab_size})")


def check_draft_cache(draft, target, B):
    """The head's cache holds the batch and every slot of the target's (the head writes where the
    target does); a planted draft without max_seq_len is not checked."""
    rows, slots = getattr(draft, "max_batch_size", None), getattr(draft, "max_seq_len", None)
    if slots is not None and (rows < B or slots < target.max_seq_len):
        raise ValueError(f"the draft head's cache holds {rows} rows x {slots} slots: a batch of "
                         f"{B} on the target's {target.max_seq_len} slots needs at least as many")


def kv_bucket(n, limit):
    """Cache slots a forward reads when the positions in use are < n: n rounded up to 4
    significant bits or to a multiple of 64, whichever is coarser (so at most 1/8 or 63 slots
    more than needed, and 8 buckets, so 8 graphs, per doubling), at most the cache size `limit`."""
    step = max(64, 1 << max(0, n.bit_length() - 4))
    return min(limit, -(-n // step) * step)


PREFILL_CHUNK = 2048  # positions a prefill forward: extend attention holds [B, chunk, H, S] scores


def prefill_target(target, tokens, last, capture_aux, chunk=PREFILL_CHUNK, progress=None):
    """The extend forward over prompts [B, P] in chunks of `chunk` positions, each reading only
    the slots written so far; a chunk attends to the slots the earlier ones wrote (slot = position),
    so this equals one pass. Returns the logits at each row's last prompt position `last` [B]
    ([B, V]) and, with capture_aux, the EAGLE-3 states of every position [B, P, 3D] (else None).
    progress(n), if given, is called with each chunk's positions (run.py's progress bar)."""
    B, P = tokens.shape
    out_logits, auxes = None, []
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        positions = torch.arange(s, e, device=tokens.device).expand(B, e - s)
        logits, aux = target(tokens[:, s:e], positions, "extend", capture_aux=capture_aux, kv_len=e)
        auxes.append(aux)
        row = (last - s).clamp(0, e - s - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
        picked = logits.gather(1, row).squeeze(1)                               # [B, V]
        here = ((last >= s) & (last < e)).unsqueeze(1)                          # [B, 1]
        out_logits = picked if out_logits is None else torch.where(here, picked, out_logits)
        if progress:
            progress(e - s)
    return out_logits, torch.cat(auxes, 1) if capture_aux else None


def prefill_draft(draft, tokens, aux, last, chunk=PREFILL_CHUNK, progress=None, extend=None):
    """Eagle3Draft.extend (or `extend`: its extend_logits, for a tree) over all prompt rows
    [B, P] in chunks (exact, as `prefill_target`). Returns d_1 [B] (or the logits [B, Vd]) and
    g [B, D] of each row's row `last`."""
    B, P = tokens.shape
    extend = extend or draft.extend
    first = g = None
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        positions = torch.arange(s, e, device=tokens.device).expand(B, e - s)
        f, h = extend(tokens[:, s:e], positions, aux[:, s:e], (last - s).clamp(0, e - s - 1),
                      kv_len=e)
        here = (last >= s) & (last < e)                                           # [B]
        first = f if first is None else torch.where(here.view(-1, *[1] * (f.dim() - 1)), f, first)
        g = h if g is None else torch.where(here.unsqueeze(1), h, g)
        if progress:
            progress(e - s)
    return first, g


def exponential_race(weights, generator):
    """A sample from each row of nonnegative weights: argmax w / E with E ~ Exp(1), no host sync."""
    return (weights / torch.empty_like(weights).exponential_(generator=generator)).argmax(-1)


def sample(logits, temperature, generator):
    if temperature == 0:
        return logits.argmax(-1)
    return exponential_race(torch.softmax(logits / temperature, -1), generator)


def accept(logits, drafts, temperature, generator):
    """logits [B, k+1, V] of the target at the verified positions, drafts [B, k].
    Returns m [B] (drafts accepted) and the token after them [B]: greedy, the target's argmax
    there; sampling, a draw from p there with the rejected draft removed (all k accepted: from p
    at position k)."""
    k = drafts.shape[1]
    if temperature == 0:
        pred = logits.argmax(-1)                                             # [B, k+1]
        m = (drafts == pred[:, :k]).long().cumprod(1).sum(1)
        return m, pred.gather(1, m.unsqueeze(1)).squeeze(1)
    p = torch.softmax(logits / temperature, -1)                              # [B, k+1, V]
    p_draft = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)             # [B, k]
    u = torch.rand(p_draft.shape, generator=generator, device=p.device, dtype=p.dtype)
    m = (u < p_draft).long().cumprod(1).sum(1)                        # accept d with prob p(d)
    p_m = p.gather(1, m.view(-1, 1, 1).expand(-1, 1, p.shape[-1])).squeeze(1)  # [B, V]
    rejected = drafts.gather(1, m.clamp(max=k - 1).unsqueeze(1))
    residual = torch.where((m < k).unsqueeze(1), p_m.scatter(1, rejected, 0.0), p_m)  # max(p-q, 0)
    return m, exponential_race(residual, generator)


def accept_chain(logits, drafts, done, temperature, generator, accept_len=None):
    """A chain's acceptance after its verify (speculative_cycle), its tensors positional (a graph's
    inputs): accept (with accept_len, simulated_accept after it), m held at 0 for finished rows
    (done [B]: with m = 0 a finished row's draft chain never writes past the cache) and the
    tokens emitted, [d_1..d_m, bonus, junk] (the draft extend's input rows). Nothing here reads
    the device. Returns m [B] and emitted [B, k + 1]."""
    m, bonus = accept(logits, drafts, temperature, generator)
    if accept_len is not None:
        m = simulated_accept(m, accept_len, drafts.shape[1], generator)
        bonus = logits.argmax(-1).gather(1, m.unsqueeze(1)).squeeze(1)
    m = m.masked_fill(done, 0)
    return m, torch.cat([drafts, drafts[:, :1]], 1).scatter(1, m.unsqueeze(1), bonus.unsqueeze(1))


def run_accept(loop, key, fn, *inputs):
    """A cycle's acceptance, fn (accept_chain or accept_tree, its other arguments bound) on
    inputs: greedy and not simulated it draws nothing and runs through loop.run (a CUDA graph's
    replay where the loop captures); else eagerly, drawing from loop.generator, which no graph
    registers."""
    if loop.temperature == 0 and loop.probe.accept_len is None:
        return loop.run(key, partial(fn, temperature=0.0, generator=None), *inputs)
    return fn(*inputs, temperature=loop.temperature, generator=loop.generator,
              accept_len=loop.probe.accept_len)


def simulated_mean(center, k):
    """The mean of round(clamp(N(center, 1), 1, k+1)): 1 + the sum over j = 1..k of P(length > j),
    and length > j when the draw passes j + 1/2."""
    return 1 + sum(0.5 * math.erfc((j + 0.5 - center) / math.sqrt(2)) for j in range(1, k + 1))


@functools.cache   # one bisection a run (a few hundred µs of host time a cycle otherwise)
def simulated_center(mean_len, k):
    """The center whose rounded, clamped normal has mean `mean_len` (bisection: the mean rises
    with the center). The clamp piles the tails onto 1 and k+1, so a normal centered at the mean
    itself comes out nearer the middle (1.49 for 1.2 at k = 3); at 1 or k+1 the center is far
    out."""
    lo, hi = 1.0 - 8 * k, k + 1.0 + 8 * k
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated_mean(mid, k) < mean_len else (lo, mid)
    return (lo + hi) / 2


def simulated_accept(m, mean_len, k, generator):
    """SGLang's SGLANG_SIMULATE_ACC_LEN: accepted length (bonus included) ~ round(clamp(N(c, 1),
    1, k+1)), drawn per row on the device, with c (simulated_center) chosen so that the mean is
    mean_len; returns drafts accepted."""
    center = simulated_center(float(mean_len), k)
    n = torch.normal(center, 1.0, m.shape, generator=generator, device=m.device)
    return n.clamp(1, k + 1).round().long() - 1


# ---------------------------------------------------------------------------------------------
# Trees (draft.Tree, topk given): the verify mask and acceptance, as functions of tensors

def tree_ancestors(parents):
    """[B, N, N] bool: [b, i, a] when node a is node i or one of its ancestors. parents [B, N]
    (-1 for the root, node 0). Reachability by squaring: a node reaches itself and its parent in
    one step, and A @ A (0/1, clamped) reaches in 2, 4, ... steps, until 2^k >= N - 1 covers the
    deepest path: log2(N) launches, not N (every tree cycle's verify builds its mask with it)."""
    N = parents.shape[1]
    step = torch.nn.functional.one_hot(parents.clamp(min=0), N).float()      # [B, N, N]: parent
    anc = (step + torch.eye(N, device=parents.device)).clamp(max=1)          # the root: itself
    for _ in range(max(N - 1, 1).bit_length()):
        anc = (anc @ anc).clamp(max=1)   # counts of paths, at most N: exact in float32 and tf32
    return anc.bool()


def tree_visible(parents, start, kv_len):
    """The tree's attention mask as data, [B, N, kv_len] bool: node i, written at slot
    start + i (start [B]: the root's slot, the prefix length), sees the prefix (slots < start),
    its ancestors' slots and its own; no sibling, no cousin, nothing past the tree."""
    N = parents.shape[1]
    rel = torch.arange(kv_len, device=parents.device) - start.unsqueeze(1)   # [B, S]: node of slot
    in_tree = ((rel >= 0) & (rel < N)).unsqueeze(1)                           # [B, 1, S]
    anc = tree_ancestors(parents)                                            # [B, N, N]
    seen = anc.gather(2, rel.clamp(0, N - 1).unsqueeze(1).expand(-1, N, -1))  # [B, N, S]
    return (rel < 0).unsqueeze(1) | (seen & in_tree)


def walk_tree(logits, tree, max_depth, temperature, generator):
    """Walk each row's tree from the root: at the current node, accept one of its children or
    stop. logits [B, N, V]: the target's at the tree's nodes; tree: a draft.Tree; max_depth: the
    deepest path, min(num_steps, N - 1). Greedy: the child whose token is the target's argmax
    there (siblings' tokens are distinct, so at most one). Sampling: multi-candidate rejection
    sampling with the drafts as point masses (SpecInfer, arXiv:2305.09781; SGLang's target-only
    tree sampling): one uniform u per node, the children in node order accepted at the first
    whose cumulative target probability exceeds u (child c with probability p(c)); with none,
    the bonus token comes from p with every child's token removed, so each emitted token follows
    the target's distribution exactly. Fixed shapes: max_depth steps for every row. Returns m
    [B] (nodes accepted below the root), path [B, max_depth + 1] (the accepted nodes by depth,
    root first; past m it repeats the last) and the target's own next token [B]."""
    B, tokens, parents = tree.tokens.shape[0], tree.tokens, tree.parents
    if temperature == 0:
        best = logits.argmax(-1)                                             # [B, N]
    else:
        p = torch.softmax(logits / temperature, -1)                          # [B, N, V]
    cur = torch.zeros(B, dtype=torch.long, device=tokens.device)
    walking, m, path = torch.ones_like(cur, dtype=torch.bool), torch.zeros_like(cur), [cur]
    for _ in range(max_depth):
        kids = parents == cur.unsqueeze(1)                                   # [B, N]
        if temperature == 0:
            hit = kids & (tokens == best.gather(1, cur.unsqueeze(1)))
        else:
            p_kid = node_rows(p, cur).gather(1, tokens) * kids               # [B, N]
            u = torch.rand(B, 1, generator=generator, device=p.device, dtype=p.dtype)
            hit = u < p_kid.cumsum(1)   # from the accepted child on (the sum grows only at kids)
        walking = walking & hit.any(1)
        cur = torch.where(walking, hit.long().argmax(1), cur)
        m, path = m + walking, path + [cur]
    if temperature == 0:
        return m, torch.stack(path, 1), best.gather(1, cur.unsqueeze(1)).squeeze(1)
    kids = (parents == cur.unsqueeze(1)).long()              # where the walk stopped: all rejected
    p_cur = node_rows(p, cur)
    rejected = torch.zeros_like(p_cur).scatter_add(1, tokens, kids.to(p_cur.dtype)) > 0   # [B, V]
    left = p_cur.masked_fill(rejected, 0.0)
    # the children may hold all of p's mass while their sum, rounded, stays below a u close to 1:
    # then the token comes from p itself (one of them), never from an empty remainder
    left = torch.where(left.sum(-1, keepdim=True) > 0, left, p_cur)
    return m, torch.stack(path, 1), exponential_race(left, generator)


def node_rows(x, nodes):
    """x [B, N, V] at one node per row, nodes [B] -> [B, V]."""
    return x.gather(1, nodes.view(-1, 1, 1).expand(-1, 1, x.shape[-1])).squeeze(1)


def tree_emitted(tree, path, m, bonus):
    """[B, max_depth + 1]: the accepted nodes' tokens below the root, then the bonus token, then
    junk (the chain's `emitted`, along the accepted path)."""
    along = tree.tokens.gather(1, path[:, 1:])                              # [B, max_depth]
    return torch.cat([along, along[:, :1]], 1).scatter(1, m.unsqueeze(1), bonus.unsqueeze(1))


@dataclass
class Rows:
    """The loop's per-row state, all on the device. `cur` is always prompt length - 1 + n_out."""
    out: torch.Tensor      # [B, max_new_tokens + k + 1] generated ids; columns >= n_out are junk
    n_out: torch.Tensor    # [B] tokens generated so far
    x: torch.Tensor        # [B] the newest token, not yet in the target's KV cache
    cur: torch.Tensor      # [B] x's position
    done: torch.Tensor     # [B] bool: took an EOS or max_new_tokens tokens
    offsets: torch.Tensor  # [k + 1] arange, built once: the columns of a cycle's tokens


def commit(rows, emitted, m, eos, max_new_tokens):
    """Append each row's accepted tokens to `rows`, in place. emitted [B, k+1] is [d_1..d_m, b,
    junk]: the m accepted drafts, the target's own token b, then leftovers that mean nothing;
    eos [E] the ids that end a row.

    Invariants (no shape depends on a value, so nothing here reads the device):
    - a live row takes count = m + 1 tokens, cut just after the first EOS among them and at
      max_new_tokens, so n_out never passes max_new_tokens;
    - a finished row takes nothing: its n_out, x and cur stay, and it stays finished;
    - all k+1 columns are written at out[n_out : n_out+k+1]; those past count are junk that the
      next commit overwrites or that lie past the row's final n_out (out has k+1 spare columns);
    - x becomes the last token taken and cur its position: the next cycle verifies from there;
    - a row finishes when it takes an EOS or its max_new_tokens-th token.
    Returns count [B], the tokens each row took (0 for a row already finished)."""
    offsets = rows.offsets[:emitted.shape[1]]
    count = m + 1
    is_eos = (emitted.unsqueeze(-1) == eos).any(-1) & (offsets < count.unsqueeze(1))   # [B, k+1]
    hit_eos = is_eos.any(1)
    count = torch.where(hit_eos, is_eos.long().argmax(1) + 1, count)          # up to the first EOS
    count = torch.minimum(count, max_new_tokens - rows.n_out).masked_fill(rows.done, 0)
    rows.out.scatter_(1, rows.n_out.unsqueeze(1) + offsets, emitted)
    rows.n_out += count
    last_taken = emitted.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    rows.x = torch.where(rows.done, rows.x, last_taken)
    rows.cur = rows.cur + count
    rows.done = rows.done | hit_eos | (rows.n_out >= max_new_tokens)
    return count


def prefill(target, draft, tokens, lens, max_new_tokens, k, temperature, generator, eos,
            sizes=None):
    """The prompts through the target (eager: the shape changes with the prompt) and the first
    token committed; with a draft head, its extend over the prompts and the first k drafts.
    Returns the Rows and the drafts [B, k] (None for plain decoding). sizes: a tree's (K, S, N)
    to draft a tree instead (a draft.Tree is returned); k is then its deepest path,
    min(S, N - 1)."""
    B, P = tokens.shape
    last = lens - 1                                            # each prompt's last position
    logits, aux = prefill_target(target, tokens, last, capture_aux=draft is not None)
    rows = Rows(out=torch.zeros(B, max_new_tokens + k + 1, dtype=torch.int64, device=tokens.device),
                n_out=torch.zeros_like(last), x=tokens.gather(1, last.unsqueeze(1)).squeeze(1),
                cur=last.clone(), done=torch.zeros_like(last, dtype=torch.bool),
                offsets=torch.arange(k + 1, device=tokens.device))
    first_token = sample(logits, temperature, generator).unsqueeze(1)
    commit(rows, first_token, torch.zeros_like(last), eos, max_new_tokens)
    if draft is None:
        return rows, None
    # the head reads token t+1 on row t: shift the prompt left, put x at the last row
    shifted = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)
    shifted = shifted.scatter(1, last.unsqueeze(1), rows.x.unsqueeze(1))
    if sizes is not None:
        K, S, N = sizes
        logits, g = prefill_draft(draft, shifted, aux, last, extend=draft.extend_logits)
        kv_draft = kv_bucket(P + (S - 1) * K, target.max_seq_len)
        return rows, draft.tree(rows.x, logits, g, last, K, S, N, kv_len=kv_draft)
    first, g = prefill_draft(draft, shifted, aux, last)
    return rows, draft.chain(first, g, last, k, kv_len=kv_bucket(P + k, target.max_seq_len))


def decode_cycle(loop, rows, pos, kv):
    """Plain decoding: the target reads x at cur (and the first kv cache slots) and emits its next
    token. Returns m = 0, emitted [B, 1]."""
    key = GraphKey("decode_step", "decode", len(pos), 1, kv)
    logits, _ = loop.run(key, partial(loop.target, mode="decode", kv_len=kv),
                         rows.x.unsqueeze(1), pos)
    loop.probe.mark("decode_step")
    return (torch.zeros_like(rows.cur),
            sample(logits[:, 0], loop.temperature, loop.generator).unsqueeze(1))


def speculative_cycle(loop, rows, drafts, *, pos, kv, kv_draft):
    """Verify [x, d_1..d_k] at cur..cur+k (reading the first kv cache slots), accept (accept_chain,
    through run_accept), then the head extends over the accepted tokens and chains the next drafts
    (reading kv_draft slots of its own cache). Returns m [B] drafts accepted, emitted [B, k+1] and
    the new drafts."""
    (B, k), run, mark = drafts.shape, loop.run, loop.probe.mark
    verify_in = torch.cat([rows.x.unsqueeze(1), drafts], 1)                   # [x_p, d_1..d_k]
    logits, aux = run(GraphKey("verify", loop.mode, B, k + 1, kv),
                      partial(loop.target, mode=loop.mode, capture_aux=True, kv_len=kv),
                      verify_in, pos)
    mark("verify")
    m, emitted = run_accept(loop, GraphKey("accept_chain", None, B, k + 1), accept_chain, logits,
                            drafts, rows.done)
    mark("accept")
    first, g = run(GraphKey("draft_extend", None, B, k + 1, kv_draft),
                   partial(loop.draft.extend, kv_len=kv_draft), emitted, pos, aux, m)
    mark("draft_extend")
    drafts = run(GraphKey("draft", None, B, k - 1, kv_draft),
                 partial(loop.draft.chain, num_steps=k, kv_len=kv_draft), first, g, rows.cur + m)
    mark("draft")
    return m, emitted, drafts


def tree_cycle(loop, rows, tree, *, kv, kv_draft):
    """speculative_cycle for a draft tree (loop.sizes: K, S, N): the target verifies the tree's N
    nodes, x at the root, at positions cur + depth, writing them at the slots cur .. cur + N - 1
    in node order, each seeing the prefix, its ancestors and itself (tree_forward's mask,
    tree_visible); accept_tree walks the tree (walk_tree) and emits its tokens (run_accept);
    the accepted path's latents move to slot = position (Transformer.move_cache); the head extends
    over the path with the target's states there (writing its own cache at slot = position, so
    the head needs no move) and drafts the next tree. Returns m [B], emitted [B, D + 1] (D =
    min(S, N - 1)), the next tree and the accepted nodes by depth [B, D] (-1 past m)."""
    (K, S, N), B, run, mark = loop.sizes, rows.cur.shape[0], loop.run, loop.probe.mark
    D, start = min(S, N - 1), rows.cur.unsqueeze(1)
    tree = tree._replace(tokens=torch.cat([rows.x.unsqueeze(1), tree.tokens[:, 1:]], 1))
    logits, aux = run(GraphKey("verify_tree", loop.mode, B, N, kv),
                      partial(tree_forward, loop.target, mode=loop.mode, kv_len=kv),
                      tree.tokens, tree.parents, tree.depths, rows.cur)
    mark("verify")
    m, path, bonus, emitted = run_accept(loop, GraphKey("accept_tree", None, B, N),
                                         partial(accept_tree, max_depth=D), logits, tree.tokens,
                                         tree.parents, tree.depths, rows.done)
    along = start + rows.offsets[:D + 1]                          # [B, D + 1]: the path's positions
    # eager, outside accept_tree's graph: a capture's warm-up runs would repeat the move, and a
    # path that skips a node moves a slot that an earlier move of the same path has overwritten
    loop.target.move_cache(start + path, along)
    mark("accept")
    aux = aux.gather(1, path.unsqueeze(2).expand(-1, -1, aux.shape[-1]))      # [B, D + 1, 3 Dt]
    first, g = run(GraphKey("draft_extend_tree", None, B, D + 1, kv_draft),
                   partial(loop.draft.extend_logits, kv_len=kv_draft), emitted, along, aux, m)
    mark("draft_extend")
    expand = partial(loop.draft.tree, topk=K, num_steps=S, num_nodes=N, kv_len=kv_draft)
    tree = run(GraphKey("draft_tree", None, B, (S - 1) * K, kv_draft), expand, bonus, first, g,
               rows.cur + m)
    mark("draft")
    depth = rows.offsets[1:D + 1]
    return m, emitted, tree, path[:, 1:].masked_fill(depth > m.unsqueeze(1), -1)


def tree_forward(target, tokens, parents, depths, start, mode, kv_len):
    """The target's forward over a tree's nodes (tokens, parents, depths [B, N]: a draft.Tree's)
    written at slots start .. start + N - 1 (start [B]: the root's slot, the prefix length), at
    positions start + depth, each node seeing the prefix, its ancestors and itself
    (tree_visible); its tensors positional (a graph's inputs; the mask is built inside)."""
    slots = start.unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)
    return target(tokens, start.unsqueeze(1) + depths, mode, capture_aux=True, kv_len=kv_len,
                  slots=slots, visible=tree_visible(parents, start, kv_len))


def accept_tree(logits, tokens, parents, depths, done, max_depth, temperature, generator,
                accept_len=None):
    """A tree's acceptance after its verify (tree_cycle), its tensors positional (a graph's
    inputs): the walk (walk_tree on logits [B, N, V] and the tree's tokens, parents and depths
    [B, N]; with accept_len, simulated_walk_tree), m held at 0 for finished rows (done [B]: a
    finished row stays where it is, its head scratch too) and the tokens emitted (tree_emitted).
    Nothing here reads the device or writes outside its outputs, so a capture's warm-up runs may
    repeat it. Returns m [B], path [B, max_depth + 1], the target's own next token [B] and
    emitted [B, max_depth + 1]."""
    tree = Tree(tokens, parents, depths, None)
    if accept_len is None:
        m, path, bonus = walk_tree(logits, tree, max_depth, temperature, generator)
    else:
        m, path, bonus = simulated_walk_tree(logits, tree, max_depth, accept_len, generator)
    m = m.masked_fill(done, 0)
    return m, path, bonus, tree_emitted(tree, path, m, bonus)


def simulated_walk_tree(logits, tree, max_depth, mean_len, generator):
    """simulated_accept for a tree (SIMULATED): an accepted length drawn as there, taken along
    the tree's deepest branch (at each node the child with the deepest descendant; as far as the
    tree goes), and the target's argmax after it. (SGLang's SGLANG_SIMULATE_ACC_LEN takes the
    first nodes in node order, whatever the tree.)"""
    m_sim = simulated_accept(tree.tokens[:, 0], mean_len, max_depth, generator)
    anc = tree_ancestors(tree.parents)                                       # [B, j, i]: i above j
    deepest = (anc * tree.depths.unsqueeze(2)).amax(1)                       # [B, N]: below node i
    cur = torch.zeros_like(m_sim)
    m, path = torch.zeros_like(m_sim), [cur]
    for d in range(max_depth):
        kids = tree.parents == cur.unsqueeze(1)
        go = kids.any(1) & (d < m_sim)
        cur = torch.where(go, (deepest + 1).masked_fill(~kids, 0).argmax(1), cur)
        m, path = m + go, path + [cur]
    return m, torch.stack(path, 1), logits.argmax(-1).gather(1, cur.unsqueeze(1)).squeeze(1)


@torch.no_grad()
def generate(target, draft, prompts, *, max_new_tokens=32, num_steps=3, attention_mode="extend",
             use_graphs=False, temperature=0.0, seed=0, eos_id=None, graphs=None, topk=None,
             num_draft_tokens=None, probe=NO_PROBE):
    """Speculative decoding with `draft` (an Eagle3Draft, or any object with its `extend` and
    `chain`, and for a tree `extend_logits` and `tree`: the tests plant one, run eager), or plain
    decoding when draft is None. Prefill runs eager; with use_graphs the decode step, the verify
    step, the head's extend and chain, and a greedy, unsimulated accept (accept_chain,
    accept_tree) replay CUDA graphs; `graphs`, a CudaGraphs (or anything with its run), is the
    runner they replay in, given or not use_graphs; attention_mode: "extend" or "decode".
    topk K (any K >= 1): a tree (tree_cycle) of num_steps levels and num_draft_tokens nodes,
    the root included (default num_steps + 1), instead of the chain.
    eos_id: an id or a list of ids that end a row (default: the checkpoint's EOS ids; -1: none).
    Every rank draws from the same seeded generator, so all ranks agree.
    probe: a Probe, whose mark(name) ends each phase of each cycle and whose accept_len forces a
    SIMULATED acceptance (run.py's timing run); the default does neither."""
    sizes, k = check_generate(draft, num_steps, attention_mode, probe.accept_len, topk,
                              num_draft_tokens, temperature)
    device = target.device
    eos = torch.tensor(eos_union(target.args.eos_token_ids if eos_id is None else eos_id),
                       dtype=torch.int64, device=device)                        # [E]
    tokens, lens = pad_prompts(prompts, device)
    # slots past the output: verify writes `width` from the newest token; the head's scratch
    # (chain steps, tree passes) lies up to `scratch` past the last accepted one
    width, scratch = (sizes[2], (num_steps - 1) * sizes[0]) if sizes else (k + 1, k - 1)
    check_request(target, tokens, max_new_tokens, max(width, k + scratch - 1))
    check_draft_cache(draft, target, tokens.shape[0])
    gen = torch.Generator(device).manual_seed(seed)
    runner = graphs or (CudaGraphs(device) if use_graphs else None)
    loop = Loop(target, draft, runner.run if runner else eager, attention_mode, temperature, gen,
                probe, sizes)
    rows, drafts = prefill(target, draft, tokens, lens, max_new_tokens, k, temperature, gen, eos,
                           sizes)
    # host-side bounds, no device read: reach > every position the next verify (or decode)
    # writes; no row ever writes at or past limit (a live row's cur < P + max_new_tokens - 1, a
    # finished one stays)
    reach, limit = tokens.shape[1] + width, tokens.shape[1] + max_new_tokens + width - 1
    accepted, proposed = [], []
    while not bool(rows.done.all()):  # HOST READ: the loop's one device->host sync per cycle
        probe.mark("start")
        pos = rows.cur.unsqueeze(1) + rows.offsets                                # [B, k+1]
        kv = kv_bucket(min(reach, limit), target.max_seq_len)  # verify (or decode) writes below
        kv_draft = kv_bucket(min(reach, limit) + scratch + 1, target.max_seq_len)  # and the head's
        reach += k + 1
        if draft is None:
            m, emitted = decode_cycle(loop, rows, pos, kv)
        elif sizes is None:
            proposed.append(drafts)  # kept on the device, stacked after the loop
            m, emitted, drafts = speculative_cycle(loop, rows, drafts, pos=pos, kv=kv,
                                                   kv_draft=kv_draft)
        else:
            verified = (drafts.tokens[:, 1:], drafts.parents[:, 1:])
            m, emitted, drafts, path = tree_cycle(loop, rows, drafts, kv=kv, kv_draft=kv_draft)
            proposed.append(verified + (path,))
        # what commit kept, not what accept accepted: a cycle cut at max_new_tokens or an EOS
        # counts only its kept tokens (and a finished row's 0 becomes -1)
        accepted.append(commit(rows, emitted, m, eos, max_new_tokens) - 1)
        probe.mark("commit")
    return result(rows, accepted, proposed if draft is not None else None, width - 1,
                  probe.accept_len is not None)


def check_generate(draft, num_steps, attention_mode, accept_len, topk=None,
                   num_draft_tokens=None, temperature=0.0):
    """generate's arguments checked (accept_len: the probe's); returns the tree's sizes (K, S, N),
    or None for the chain, and k: the most drafts a cycle can accept (0 for plain decoding)."""
    if attention_mode not in ("extend", "decode"):
        raise ValueError(f"attention_mode must be 'extend' or 'decode', not {attention_mode!r}")
    if not temperature >= 0:   # NaN too
        raise ValueError(f"temperature must be >= 0 (0: greedy), not {temperature}")
    if draft is not None and num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, not {num_steps}")
    if num_draft_tokens is not None and topk is None:
        raise ValueError("num_draft_tokens sizes a tree: give topk too (topk 1 for a chain)")
    if draft is None and topk is not None:
        raise ValueError("topk sizes a draft tree: plain decoding (draft None) has none")
    vocab = getattr(getattr(draft, "args", None), "draft_vocab_size", None)
    if vocab is not None and topk is not None and topk > vocab:
        raise ValueError(f"topk {topk} > the head's draft vocabulary of {vocab} tokens")
    if draft is None and accept_len is not None:
        raise ValueError("a SIMULATED accept_len forces a draft's acceptance: plain decoding "
                         "(draft None) has none")
    sizes = None
    if draft is not None and topk is not None:
        sizes = (topk, num_steps, num_draft_tokens or num_steps + 1)
        check_tree(*sizes)
    k = 0 if draft is None else min(num_steps, sizes[2] - 1) if sizes else num_steps
    if accept_len is not None and not 1 <= accept_len <= k + 1:
        raise ValueError(f"the probe's simulated accept_len must lie in [1, {k + 1}] (the most "
                         f"drafts a cycle accepts, + 1), not {accept_len}")
    return sizes, k


def eager(key, fn, *inputs):
    """CudaGraphs.run's signature, without a graph."""
    return fn(*inputs)


def result(rows, accepted, proposed, columns, simulated):
    """The GenerateResult, read back once after the loop. columns: the drafts a cycle proposes."""
    B = rows.out.shape[0]
    stats = torch.stack(accepted).cpu() if accepted else torch.zeros(0, B, dtype=torch.int64)
    finished = (stats < 0).unsqueeze(-1)
    drafted = parents = paths = None
    if proposed:
        if isinstance(proposed[0], tuple):   # a tree: tokens, parents below the root; accepted path
            parents, paths = (torch.stack([x[i] for x in proposed]).cpu().masked_fill(finished, -1)
                              for i in (1, 2))
            depth = torch.arange(1, paths.shape[-1] + 1)   # the nodes commit kept (EOS, max_new)
            paths = paths.masked_fill(depth > stats.unsqueeze(-1), -1)
            proposed = [x[0] for x in proposed]
        drafted = torch.stack(proposed).cpu().masked_fill(finished, -1)
    elif proposed is not None:
        drafted = torch.zeros(0, B, columns, dtype=torch.int64)
    tokens = [row[:n] for row, n in zip(rows.out.tolist(), rows.n_out.tolist())]
    return GenerateResult(tokens, stats, len(accepted), simulated, drafted, parents, paths)
