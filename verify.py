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
"""
import math
from dataclasses import dataclass
from functools import partial

import torch

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
    simulated: bool       # acceptance forced by simulate_accept_len: the tokens are not the model's
    drafts: torch.Tensor | None = None  # [cycles, B, k] the ids each cycle verified, -1 once a row
                                        # finished (None for plain decoding)


def pad_prompts(prompts, device):
    """A list of id lists (ragged allowed) or an int64 [B, P] tensor -> padded [B, P],
    lengths [B]."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts tensor must be [B, P], not {list(prompts.shape)}")
        lens = torch.full((prompts.shape[0],), prompts.shape[1], device=device)
        return prompts.to(device, torch.int64), lens
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
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


def prefill_draft(draft, tokens, aux, last, chunk=PREFILL_CHUNK, progress=None):
    """Eagle3Draft.extend over all prompt rows [B, P] in chunks (exact, as `prefill_target`).
    Returns d_1 [B] and g [B, D] of each row's row `last`."""
    B, P = tokens.shape
    first = g = None
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        positions = torch.arange(s, e, device=tokens.device).expand(B, e - s)
        f, h = draft.extend(tokens[:, s:e], positions, aux[:, s:e], (last - s).clamp(0, e - s - 1),
                            kv_len=e)
        here = (last >= s) & (last < e)                                           # [B]
        first = f if first is None else torch.where(here, f, first)
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
    Returns m [B] (drafts accepted) and the target's own next token [B] after them."""
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


def simulated_mean(center, k):
    """The mean of round(clamp(N(center, 1), 1, k+1)): 1 + the sum over j = 1..k of P(length > j),
    and length > j when the draw passes j + 1/2."""
    return 1 + sum(0.5 * math.erfc((j + 0.5 - center) / math.sqrt(2)) for j in range(1, k + 1))


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


def prefill(target, draft, tokens, lens, max_new_tokens, k, temperature, generator, eos):
    """The prompts through the target (eager: the shape changes with the prompt) and the first
    token committed; with a draft head, its extend over the prompts and the first k drafts.
    Returns the Rows and the drafts [B, k] (None for plain decoding)."""
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
    first, g = prefill_draft(draft, shifted, aux, last)
    return rows, draft.chain(first, g, last, k, kv_len=kv_bucket(P + k, target.max_seq_len))


def decode_cycle(target, run, rows, pos, kv, temperature, generator, mark):
    """Plain decoding: the target reads x at cur (and the first kv cache slots) and emits its next
    token. Returns m = 0, emitted [B, 1]."""
    key = GraphKey("decode_step", "decode", len(pos), 1, kv)
    logits, _ = run(key, partial(target, mode="decode", kv_len=kv), rows.x.unsqueeze(1), pos)
    mark("decode_step")
    return torch.zeros_like(rows.cur), sample(logits[:, 0], temperature, generator).unsqueeze(1)


def speculative_cycle(target, draft, run, rows, pos, kv, kv_draft, drafts, mode, temperature,
                      generator, simulate_accept_len, mark):
    """Verify [x, d_1..d_k] at cur..cur+k (reading the first kv cache slots), accept, then the head
    extends over the accepted tokens and chains the next drafts (reading kv_draft slots of its own
    cache). Returns m [B] drafts accepted, emitted [B, k+1] and the new drafts."""
    B, k = drafts.shape
    verify_in = torch.cat([rows.x.unsqueeze(1), drafts], 1)                   # [x_p, d_1..d_k]
    logits, aux = run(GraphKey("verify", mode, B, k + 1, kv),
                      partial(target, mode=mode, capture_aux=True, kv_len=kv), verify_in, pos)
    mark("verify")
    m, bonus = accept(logits, drafts, temperature, generator)
    if simulate_accept_len is not None:
        m = simulated_accept(m, simulate_accept_len, k, generator)
        bonus = logits.argmax(-1).gather(1, m.unsqueeze(1)).squeeze(1)
    # [d_1..d_m, bonus, junk]: the tokens emitted, and the draft extend's input rows
    emitted = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, m.unsqueeze(1), bonus.unsqueeze(1))
    mark("accept")
    first, g = run(GraphKey("draft_extend", None, B, k + 1, kv_draft),
                   partial(draft.extend, kv_len=kv_draft), emitted, pos, aux, m)
    mark("draft_extend")
    drafts = run(GraphKey("draft", None, B, k - 1, kv_draft),
                 partial(draft.chain, num_steps=k, kv_len=kv_draft), first, g, rows.cur + m)
    mark("draft")
    return m, emitted, drafts


@torch.no_grad()
def generate(target, draft, prompts, max_new_tokens=32, num_steps=3, attention_mode="extend",
             use_graphs=False, temperature=0.0, seed=0, eos_id=None, graphs=None,
             simulate_accept_len=None, timer=None):
    """Speculative decoding with `draft` (an Eagle3Draft, or any object with its `extend` and
    `chain`: the tests plant one, run eager), or plain decoding when draft is None. Prefill runs
    eager; with use_graphs the decode step, the verify step and the head's extend and chain
    replay CUDA graphs (from `graphs`, a CudaGraphs, if given).
    attention_mode: verify's, "extend" or "decode".
    eos_id: an id or a list of ids that end a row (default: every EOS id the checkpoint declares;
    -1: none).
    Every rank draws from the same seeded generator, so all ranks agree.
    timer: an object whose mark(name) is called at the end of each phase of each cycle
    ("start", "verify", "accept", "draft_extend", "draft", "commit"; plain: "start",
    "decode_step", "commit"): run.py records device events there."""
    check_generate(draft, num_steps, attention_mode, simulate_accept_len)
    device, k = target.device, num_steps if draft is not None else 0
    eos = torch.tensor(eos_union(target.args.eos_token_ids if eos_id is None else eos_id),
                       dtype=torch.int64, device=device)                        # [E]
    tokens, lens = pad_prompts(prompts, device)
    # slots past the output: verify writes k+1 from the newest token; the chain, k-1 past those
    check_request(target, tokens, max_new_tokens, max(k + 1, 2 * k - 2))
    gen = torch.Generator(device).manual_seed(seed)
    runner = graphs or (CudaGraphs(device) if use_graphs else None)
    run = runner.run if runner else eager
    mark = timer.mark if timer is not None else (lambda name: None)
    rows, drafts = prefill(target, draft, tokens, lens, max_new_tokens, k, temperature, gen, eos)
    # host-side bounds, no device read: reach > every position the next verify (or decode)
    # writes; no row ever writes at or past limit (a live row's cur < P + max_new_tokens - 1, a
    # finished one stays)
    reach, limit = tokens.shape[1] + k + 1, tokens.shape[1] + max_new_tokens + k
    accepted, proposed = [], []
    while not bool(rows.done.all()):  # HOST READ: the loop's one device->host sync per cycle
        mark("start")
        pos = rows.cur.unsqueeze(1) + rows.offsets                                # [B, k+1]
        kv = kv_bucket(min(reach, limit), target.max_seq_len)  # verify (or decode) writes below
        kv_draft = kv_bucket(min(reach, limit) + k, target.max_seq_len)  # the chain: k-1 further
        reach += k + 1
        if draft is None:
            m, emitted = decode_cycle(target, run, rows, pos, kv, temperature, gen, mark)
        else:
            proposed.append(drafts)  # kept on the device, stacked after the loop
            m, emitted, drafts = speculative_cycle(target, draft, run, rows, pos, kv, kv_draft,
                                                   drafts, attention_mode, temperature, gen,
                                                   simulate_accept_len, mark)
        # what commit kept, not what accept accepted: a cycle cut at max_new_tokens or an EOS
        # counts only its kept tokens (and a finished row's 0 becomes -1)
        accepted.append(commit(rows, emitted, m, eos, max_new_tokens) - 1)
        mark("commit")
    return result(rows, accepted, proposed if draft is not None else None, k,
                  simulate_accept_len is not None)


def check_generate(draft, num_steps, attention_mode, simulate_accept_len):
    if attention_mode not in ("extend", "decode"):
        raise ValueError(f"attention_mode must be 'extend' or 'decode', not {attention_mode!r}")
    if draft is not None and num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, not {num_steps}")
    if simulate_accept_len is not None and not 1 <= simulate_accept_len <= num_steps + 1:
        raise ValueError(f"simulate_accept_len must lie in [1, num_steps + 1], not "
                         f"{simulate_accept_len}")


def eager(key, fn, *inputs):
    """CudaGraphs.run's signature, without a graph."""
    return fn(*inputs)


def result(rows, accepted, proposed, k, simulated):
    """The GenerateResult, read back once after the loop."""
    B = rows.out.shape[0]
    stats = torch.stack(accepted).cpu() if accepted else torch.zeros(0, B, dtype=torch.int64)
    drafted = None
    if proposed is not None:
        drafted = (torch.stack(proposed).cpu() if proposed
                   else torch.zeros(0, B, k, dtype=torch.int64))
        drafted = drafted.masked_fill((stats < 0).unsqueeze(-1), -1)
    tokens = [row[:n] for row, n in zip(rows.out.tolist(), rows.n_out.tolist())]
    return GenerateResult(tokens, stats, len(accepted), simulated, drafted)
