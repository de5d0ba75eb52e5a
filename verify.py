"""Verify, accept, commit: the speculative generation loop and the plain baseline loop.

A cycle: the target verifies [x_p, d_1..d_k] at positions p..p+k (one forward, k+1 tokens per row)
in either attention path (`attention_mode` "prefill" = extend-style, "decode" = absorbed MLA, the
words of SGLang's --speculative-attention-mode), eager or CUDA-graph captured; acceptance runs on
the device for all rows at once (greedy: drafts that equal the target's argmax, accepted length
by cumulative product; sampling: speculative rejection sampling, Leviathan et al.
arXiv:2211.17192, with the top-1 draft as a point mass, so the output follows the target's
distribution exactly); then the draft head extends over the accepted tokens and chains the next
k drafts. Rejected tokens leave KV slots that the next writes overwrite (slot = position).

Shapes are fixed per (batch, k): rows that accepted fewer tokens carry junk in their tail, rows
that finished keep running in place, so every step can be captured. The loop reads the device
once per cycle: "are all rows done?" (marked HOST READ below).

The target reads only the cache slots in use, rounded up to a bucket (kv_bucket): the host knows
a bound on every row's position without reading the device (the prompt length plus k+1 per
cycle), so each (step, batch, tokens, bucket) is one fixed shape and one graph. Prefill runs in
chunks through the static cache (slot = position makes that exact), so a long prompt never holds
extend attention's scores for all its positions at once.
"""
from dataclasses import dataclass
from functools import partial

import torch

from draft import Eagle3Draft
from graphs import CudaGraphs

ATTENTION_MODES = {"prefill": "extend", "decode": "decode"}


@dataclass
class GenerateResult:
    tokens: list          # per row, the generated ids (prompt excluded)
    accepted: torch.Tensor  # [cycles, B] drafts accepted per row per cycle, -1 once a row finished
    cycles: int
    simulated: bool       # acceptance forced by simulate_accept_len: the tokens are not the model's
    drafts: torch.Tensor | None = None  # [cycles, B, k] the ids each cycle verified, -1 once a row
                                        # finished (None for plain decoding)


def pad_prompts(prompts, device):
    """A list of id lists (ragged allowed) or an int64 [B, P] tensor -> padded [B, P], lengths [B]."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts tensor must be [B, P], not {list(prompts.shape)}")
        return prompts.to(device, torch.int64), torch.full((prompts.shape[0],), prompts.shape[1], device=device)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    tokens = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], dtype=torch.int64, device=device)
    return tokens, torch.tensor([len(p) for p in prompts], device=device)


def check_request(target, tokens, lens, max_new_tokens, lookahead):
    B, P = tokens.shape
    a = target.args
    if B > target.max_batch_size:
        raise ValueError(f"batch of {B} prompts > max_batch_size {target.max_batch_size}")
    need = P + max_new_tokens + lookahead
    if need > target.max_seq_len:
        raise ValueError(f"prompt of {P} tokens + max_new_tokens {max_new_tokens} + {lookahead} lookahead "
                         f"= {need} slots > max_seq_len {target.max_seq_len} of the KV cache")
    bad = (tokens < 0) | (tokens >= a.vocab_size)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(f"prompt row {row} has id {tokens[row, col].item()} at position {col}, outside the "
                         f"vocabulary [0, {a.vocab_size})")


def kv_bucket(n, limit):
    """Cache slots a forward reads when the positions in use are < n: n rounded up to 4
    significant bits or to a multiple of 64, whichever is coarser (so at most 1/8 or 63 slots
    more than needed, and 8 buckets, so 8 graphs, per doubling), at most the cache size `limit`."""
    step = max(64, 1 << max(0, n.bit_length() - 4))
    return min(limit, -(-n // step) * step)


PREFILL_CHUNK = 2048  # positions per prefill forward: extend attention holds [B, chunk, H, S] scores


def prefill(target, tokens, last, capture_aux, chunk=PREFILL_CHUNK):
    """The extend forward over prompts [B, P] in chunks of `chunk` positions, each reading only
    the slots written so far; a chunk attends to the slots the earlier ones wrote (slot = position),
    so this equals one pass. Returns the logits at each row's last prompt position `last` [B]
    ([B, V]) and, with capture_aux, the EAGLE-3 states of every position [B, P, 3D] (else None)."""
    B, P = tokens.shape
    out_logits, auxes = None, []
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        positions = torch.arange(s, e, device=tokens.device).expand(B, e - s)
        out = target(tokens[:, s:e], positions, "extend", capture_aux=capture_aux, kv_len=e)
        logits, aux = out if capture_aux else (out, None)
        auxes.append(aux)
        picked = logits.gather(1, (last - s).clamp(0, e - s - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1]))
        here = ((last >= s) & (last < e)).unsqueeze(1)                          # [B, 1]
        out_logits = picked.squeeze(1) if out_logits is None else torch.where(here, picked.squeeze(1), out_logits)
    return out_logits, torch.cat(auxes, 1) if capture_aux else None


def draft_prefill(draft, tokens, aux, last, chunk=PREFILL_CHUNK):
    """Eagle3Draft.extend over all prompt rows [B, P] in chunks (exact, as `prefill`). Returns
    d_1 [B] and g [B, D] of each row's row `last`."""
    B, P = tokens.shape
    first = g = None
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        positions = torch.arange(s, e, device=tokens.device).expand(B, e - s)
        f, h = draft.extend(tokens[:, s:e], positions, aux[:, s:e], (last - s).clamp(0, e - s - 1), kv_len=e)
        here = (last >= s) & (last < e)                                           # [B]
        first = f if first is None else torch.where(here, f, first)
        g = h if g is None else torch.where(here.unsqueeze(1), h, g)
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
    m = (u < p_draft).long().cumprod(1).sum(1)                               # accept d with prob p(d)
    p_m = p.gather(1, m.view(-1, 1, 1).expand(-1, 1, p.shape[-1])).squeeze(1)  # [B, V]
    rejected = drafts.gather(1, m.clamp(max=k - 1).unsqueeze(1))
    residual = torch.where((m < k).unsqueeze(1), p_m.scatter(1, rejected, 0.0), p_m)  # max(p - q, 0)
    return m, exponential_race(residual, generator)


def simulated_accept(m, mean_len, k, generator):
    """SGLang's SGLANG_SIMULATE_ACC_LEN: accepted length (bonus included) ~ round(clamp(N(mean, 1),
    1, k+1)), drawn per row on the device; returns drafts accepted."""
    n = torch.normal(float(mean_len), 1.0, m.shape, generator=generator, device=m.device)
    return n.clamp(1, k + 1).round().long() - 1


@torch.no_grad()
def generate(target, draft, prompts, max_new_tokens=32, num_steps=3, attention_mode="prefill",
             use_graphs=False, temperature=0.0, seed=0, eos_id=None, graphs=None,
             simulate_accept_len=None, timer=None):
    """Speculative decoding with `draft` (an Eagle3Draft or any object with its `propose`), or
    plain decoding when draft is None. Prefill runs eager; with use_graphs the decode step, the
    verify step and the EAGLE-3 head's extend and chain replay CUDA graphs (a planted proposer
    runs as it is). Every rank draws from the same seeded generator, so all ranks agree.
    timer: an object whose mark(name) is called at the end of each phase of each cycle
    ("start", "verify", "accept", "draft_extend", "draft", "commit"; plain: "start", "decode",
    "commit"): run.py records device events there."""
    if attention_mode not in ATTENTION_MODES:
        raise ValueError(f"attention_mode must be one of {list(ATTENTION_MODES)}, not {attention_mode!r}")
    if draft is not None and num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, not {num_steps}")
    device, k = target.device, num_steps if draft is not None else 0
    mode = ATTENTION_MODES[attention_mode]
    eos_id = target.args.eos_token_id if eos_id is None else eos_id
    tokens, lens = pad_prompts(prompts, device)
    # slots past the output: verify writes k+1 from the newest token; the draft chain, k-1 past those
    check_request(target, tokens, lens, max_new_tokens, max(k + 1, 2 * k - 2))
    B, P = tokens.shape
    gen = torch.Generator(device).manual_seed(seed)
    runner = graphs or (CudaGraphs(device) if use_graphs else None)
    run = runner.run if runner else (lambda key, fn, *inputs: fn(*inputs))
    offsets = torch.arange(k + 1, device=device)

    # prefill (eager: its shape changes with the prompt)
    positions = torch.arange(P, device=device).expand(B, P)
    last = lens - 1
    logits, aux = prefill(target, tokens, last, capture_aux=draft is not None)
    x = sample(logits, temperature, gen)
    cur = lens.clone()                                          # position of x, the newest token
    generated = torch.zeros(B, max_new_tokens + k + 1, dtype=torch.int64, device=device)
    generated[:, 0] = x
    n_out = torch.ones(B, dtype=torch.int64, device=device)
    done = (x == eos_id) | (n_out >= max_new_tokens)
    if draft is not None:  # the head reads token t+1 on row t: shift the prompt, put x at row n-1
        shifted = torch.cat([tokens[:, 1:], tokens[:, :1]], 1).scatter(1, last.unsqueeze(1), x.unsqueeze(1))
        if isinstance(draft, Eagle3Draft):
            drafts = draft.chain(*draft_prefill(draft, shifted, aux, last), last, num_steps,
                                 kv_len=kv_bucket(P + num_steps, target.max_seq_len))
        else:
            drafts = draft.propose(shifted, positions, aux, last, num_steps)
    mark = timer.mark if timer is not None else (lambda name: None)
    reach = P + k + 1  # > every position the next forward writes (the host's bound, no device read)
    accepted, proposed = [], []
    while True:
        if bool(done.all()):  # HOST READ: the loop's one device->host sync per cycle
            break
        mark("start")
        pos = cur.unsqueeze(1) + offsets                                          # [B, k+1]
        kv = kv_bucket(reach, target.max_seq_len)            # verify (or decode) writes below reach
        kv_draft = kv_bucket(reach + k, target.max_seq_len)  # the draft chain writes up to k - 1 further
        reach += k + 1
        if draft is None:
            logits = run(("decode", B, 1, kv), partial(target, mode="decode", kv_len=kv), x.unsqueeze(1), pos)
            mark("decode")
            m, emitted = torch.zeros_like(cur), sample(logits[:, 0], temperature, gen).unsqueeze(1)
        else:
            proposed.append(drafts)  # kept on the device, stacked after the loop
            verify_in = torch.cat([x.unsqueeze(1), drafts], 1)                   # [x_p, d_1..d_k]
            logits, aux = run(("verify", mode, B, k + 1, kv), partial(target, mode=mode, capture_aux=True, kv_len=kv),
                              verify_in, pos)
            mark("verify")
            m, bonus = accept(logits, drafts, temperature, gen)
            if simulate_accept_len:
                m = simulated_accept(m, simulate_accept_len, k, gen)
                bonus = logits.argmax(-1).gather(1, m.unsqueeze(1)).squeeze(1)
            # [d_1..d_m, bonus, junk]: the tokens emitted, and the draft extend's input rows
            emitted = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, m.unsqueeze(1), bonus.unsqueeze(1))
            mark("accept")
            if isinstance(draft, Eagle3Draft):  # extend and chain, each one graph in graph mode
                first, g = run(("draft_extend", B, k + 1, kv_draft), partial(draft.extend, kv_len=kv_draft),
                               emitted, pos, aux, m)
                mark("draft_extend")
                drafts = run(("draft_chain", B, num_steps, kv_draft),
                             partial(draft.chain, num_steps=num_steps, kv_len=kv_draft), first, g, cur + m)
            else:  # a planted proposer: eager, one phase
                drafts = draft.propose(emitted, pos, aux, m, num_steps)
            mark("draft")
        # commit: m + 1 tokens per row, cut at EOS and at max_new_tokens; finished rows stay put
        count = m + 1
        is_eos = (emitted == eos_id) & (offsets < count.unsqueeze(1))
        hit_eos = is_eos.any(1)
        count = torch.where(hit_eos, is_eos.long().argmax(1) + 1, count)
        count = torch.minimum(count, max_new_tokens - n_out).masked_fill(done, 0)
        generated.scatter_(1, n_out.unsqueeze(1) + offsets, emitted)
        accepted.append(m.masked_fill(done, -1))
        n_out += count
        x = torch.where(done, x, emitted.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1))
        cur = torch.where(done, cur, cur + count)
        done = done | hit_eos | (n_out >= max_new_tokens)
        mark("commit")
    n = n_out.tolist()
    rows = generated.tolist()
    stats = torch.stack(accepted).cpu() if accepted else torch.zeros(0, B, dtype=torch.int64)
    drafted = None
    if draft is not None:
        drafted = torch.stack(proposed).cpu() if proposed else torch.zeros(0, B, k, dtype=torch.int64)
        drafted = drafted.masked_fill((stats < 0).unsqueeze(-1), -1)
    return GenerateResult([r[:c] for r, c in zip(rows, n)], stats, len(accepted), bool(simulate_accept_len),
                          drafted)
