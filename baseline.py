"""The correctness baseline: what the model says, in a file that another engine's output can be
converted to (run.py --dump), and a judge of two such files (run.py --compare); README,
"Checking an engine against this reference".

`dump` runs greedy generation (speculative with an EAGLE-3 head, or plain) and then a separate
teacher-forced extend forward over each row's prompt and output for the target's top-K
log-probabilities. `compare` judges dump B against reference A row by row: where the greedy
outputs first part (a near-tie that another reduction order may flip, or a failure), the top-1
agreement and the largest log-probability difference over the positions both read alike, and the
drafts accepted per cycle. run.py calls settle_dump, dump_main and compare_main; a file or a
request they cannot use raises ValueError, which run.py prints as one line (exit status 2).

One .npz (docs/engine-check.md has it in full). B prompts, P the longest, N =
max_new_tokens, K = --topk, C cycles, k the drafts a cycle verifies (a chain: num_steps; a tree
of M = --speculative-num-draft-tokens nodes: M - 1). Row b's sequence is its own prompt then its
output, with no padding between them; position t of the topk arrays holds the target's top-K
log-softmax after reading the sequence's first t+1 tokens, predicting token t+1.
  prompt_ids     int64   [B, P]         -1 after a shorter prompt
  output_ids     int64   [B, N]         greedy; -1 after the row stopped (its EOS is kept)
  topk_ids       int64   [B, P+N-1, K]  highest first; -1 where a row has no such position
  topk_logprobs  float32 [B, P+N-1, K]  NaN there
  draft_ids      int64   [B, C, k]      speculative only: the drafts cycle c verified, -1 once
                                        the row finished
  accepted       int64   [B, C]         speculative only: drafts accepted in cycle c (the target's
                                        bonus token not counted; a cycle cut at max_new_tokens or
                                        an EOS counts the tokens it kept, minus 1), -1 once the
                                        row finished
  draft_parents  int64   [B, C, k]      a tree only (k = M - 1 nodes below the root, in node
                                        order): node i's parent, 0 the root, j the j-th draft
  accepted_nodes int64   [B, C, D]      a tree only: the accepted drafts' node numbers by depth
                                        (1-based, as draft_parents), D = min(num_steps, M - 1);
                                        -1 past the accepted ones
  meta           str     []             optional: JSON saying what produced the file
With --dump-routing, also a routing trace (routing.py's format, which --routing-trace reads), from
the same teacher-forced forward: the router's ids of every MoE layer for each row's tokens (prompt,
then output, as far as the top-K arrays read them), the rows one after another.
  routing_ids      int16/32 [L, tokens, top_k]  L MoE layers, in model order
  n_experts        int64   []           the model's routed experts
  top_k            int64   []           experts per token
  sequence_lengths int64   [B]          each row's tokens in routing_ids
"""
import json
import math
import os
import sys
import tempfile
import textwrap

import numpy as np


# Defaults for --compare, set for bf16 against float32 with room to spare: on the tiny model made
# well-conditioned (docs/engine-check.md), bf16 against float32 reached at worst top-1 agreement
# 0.886 and max |logprob diff| 0.244 over 12 seeds; the defaults allow about twice that. A random
# MoE without that conditioning is chaotic in bf16 (near-tied routing flips) and fails them.
MAX_LOGPROB_DIFF = 0.5
MIN_TOP1_AGREEMENT = 0.8
MAX_ACCEPT_DIFF = 0.5
DUMP_TOPK = 20


def settle_dump(args):
    """--dump records the model's own greedy answers in one configuration: refuse what would
    change them (ValueError naming the flag), read the prompts, and size the run to them.
    Returns the settled values of the flags the dump decides."""
    refuse = {"--simulate-tp": (args.simulate_tp or 1) > 1,
              "--routed-experts": args.routed_experts is not None,
              "--simulate-accept-len": args.simulate_accept_len is not None,
              "--temperature": args.temperature != 0,
              "--cuda-graph both": args.cuda_graph == "both",
              "--speculative-attention-mode both": args.speculative_attention_mode == "both",
              "--prompt-len": args.prompt_len is not None, "--batch-size": args.batch_size != 1,
              "--routing uniform": args.routing == "uniform"}
    for flag, bad in refuse.items():
        if bad:
            raise ValueError("--dump records the model's own greedy answers to --prompt-ids in one "
                             f"configuration: drop {flag}")
    if not args.prompt_ids:
        raise ValueError("--dump needs --prompt-ids FILE (one JSON list of token ids per line)")
    try:
        prompts = read_prompt_ids(args.prompt_ids)
    except ValueError as e:
        raise ValueError(f"--prompt-ids {e}") from None
    return dict(prompts=prompts, batch_size=len(prompts), prompt_len=max(map(len, prompts)),
                simulate_tp=1, cuda_graph=args.cuda_graph or "off",
                speculative_attention_mode=args.speculative_attention_mode or "prefill",
                topk=DUMP_TOPK if args.topk is None else args.topk)


def read_prompt_ids(path):
    """One JSON list of token ids per line (blank lines skipped); ValueError naming the file and
    the problem (a missing or unreadable file, not UTF-8 text, a line that is not such a list)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a folder, not a file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {i} is not JSON: {e}") from None
        ok = isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)
        if not ok:
            raise ValueError(f"{path} line {i}: expected a non-empty JSON list of token ids "
                             f"(integers >= 0), got {line.strip()[:80]}")
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def dump(target, head, prompts, max_new_tokens, num_steps=3, topk=DUMP_TOPK,
         attention_mode="extend", use_graphs=False, eos_id=None, chunk=256, tree=None,
         recorder=None):
    """Greedy generation (speculative with `head`, plain with None; tree: (K, M) to draft a tree
    of topk K and M draft tokens) and the target's top-K log-probabilities along the sequences
    it produced: the dump's arrays, the same on every rank. recorder (routing.RoutingRecorder, or
    any target -> object with pop() and remove()): also the routers' ids in that forward (the
    routing arrays of the module docstring).

    The log-probabilities come from a separate teacher-forced extend forward over each row's prompt
    and output, so they do not depend on how generation batched, drafted or graphed its steps."""
    import torch  # the model's work: --compare and the command line need numpy only
    with torch.no_grad():
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens}: must be at least 1")
        if not 1 <= topk <= target.args.vocab_size:
            raise ValueError(f"topk {topk}: must lie in [1, the vocabulary's "
                             f"{target.args.vocab_size} ids]")
        K, M = tree or (None, None)
        res = generate_shown(target, head, prompts, max_new_tokens=max_new_tokens,
                             num_steps=num_steps, attention_mode=attention_mode,
                             use_graphs=use_graphs, eos_id=eos_id, topk=K, num_draft_tokens=M)
        B, P, N = len(prompts), max(len(p) for p in prompts), max_new_tokens
        T = P + N - 1  # the last output token predicts nothing we keep
        prompt_ids, output_ids = np.full((B, P), -1, np.int64), np.full((B, N), -1, np.int64)
        # past a row's end: zeros, read by no kept position
        seqs = torch.zeros(B, T, dtype=torch.int64)
        ends = torch.zeros(B, 1, dtype=torch.int64)  # positions < end have a next token in the row
        for b, (p, out) in enumerate(zip(prompts, res.tokens)):
            prompt_ids[b, :len(p)], output_ids[b, :len(out)] = p, out
            seq = (list(p) + out)[:T]
            seqs[b, :len(seq)] = torch.tensor(seq)
            ends[b] = len(p) + len(out) - 1
        seqs = seqs.to(target.device)
        positions = torch.arange(T, device=target.device).expand(B, T)
        if recorder is not None:
            recorder = recorder(target)
        ids, logprobs = teacher_forced(target, seqs, positions, topk, chunk)
        kept = (torch.arange(T) < ends).unsqueeze(-1)                                # [B, T, 1]
        routed = {}
        if recorder is not None:
            recorder.remove()
            lengths = ends.flatten().tolist()   # the positions the top-K arrays keep, every row
            routed = routing_arrays(recorder.pop(), B, T, chunk, lengths, target.args)
        out = dict(prompt_ids=prompt_ids, output_ids=output_ids,
                   topk_ids=ids.masked_fill(~kept, -1).numpy(),
                   topk_logprobs=logprobs.masked_fill(~kept, float("nan")).numpy())
        if head is not None:
            out["draft_ids"] = res.drafts.transpose(0, 1).numpy()                   # [B, C, k]
            out["accepted"] = res.accepted.T.numpy()                                 # [B, C]
        if res.parents is not None:
            out["draft_parents"] = res.parents.transpose(0, 1).numpy()              # [B, C, M-1]
            out["accepted_nodes"] = res.paths.transpose(0, 1).numpy()               # [B, C, D]
        return out | routed


def generate_shown(target, head, prompts, **kw):
    """verify.generate(target, head, prompts, **kw) under a progress bar on stderr that counts its
    cycles (a plain loop's steps), rank 0's alone, as timing.py's bars."""
    from tqdm import tqdm
    from verify import generate, Probe
    with tqdm(desc="dump: generating", unit="cycle", disable=target.tp.rank != 0,
              leave=False) as bar:
        # a cycle (or a plain step) ends at its commit
        return generate(target, head, prompts,
                        probe=Probe(mark=lambda name: name == "commit" and bar.update()), **kw)


def teacher_forced(target, seqs, positions, topk, chunk):
    """The target's top-`topk` ids and log-probabilities over seqs [B, T] in one extend forward a
    chunk of positions (slot = position), under a progress bar as generate_shown's: [B, T, topk]
    each, on the CPU, the log-probabilities in float32 or wider."""
    import torch
    from tqdm import tqdm
    ids, logprobs = [], []
    for s in tqdm(range(0, seqs.shape[1], chunk), desc="dump: log-probabilities, teacher-forced",
                  unit="chunk", disable=target.tp.rank != 0, leave=False):
        logits, _ = target(seqs[:, s:s + chunk], positions[:, s:s + chunk], "extend")
        lp, top = torch.log_softmax(logits, -1).topk(topk, -1)  # logits are float32 or wider
        ids.append(top.cpu())
        logprobs.append(lp.float().cpu())
    return torch.cat(ids, 1), torch.cat(logprobs, 1)


def routing_arrays(ids, B, T, chunk, lengths, args):
    """The recorder's ids [L, chunks of B x chunk tokens, K] (each chunk's rows one after another)
    as a trace's arrays: each row's first `lengths` tokens in order, the rows one after another."""
    import torch
    L, K = ids.shape[0], ids.shape[-1]
    rows = torch.cat([part.view(L, B, -1, K) for part in ids.split(
        [B * min(chunk, T - s) for s in range(0, T, chunk)], dim=1)], dim=2)     # [L, B, T, K]
    routing_ids = torch.cat([rows[:, b, :n] for b, n in enumerate(lengths)], dim=1)
    E = args.n_routed_experts
    dtype = np.int16 if E <= np.iinfo(np.int16).max else np.int32
    return dict(routing_ids=routing_ids.numpy().astype(dtype), n_experts=np.int64(E),
                top_k=np.int64(K), sequence_lengths=np.asarray(lengths, dtype=np.int64))


def check_dump(d, name):
    """Every array a dump needs, with integer or float values and shapes that fit together.
    Returns (B, P, N)."""
    for key in ("prompt_ids", "output_ids", "topk_ids", "topk_logprobs"):
        if key not in d:
            raise ValueError(f"{name} has no array {key!r}")

    def check(key, kind, dims):  # an int in dims must match; a letter is free
        a = d[key]
        if a.dtype.kind not in kind:
            want = "an integer" if kind == "iu" else "a float"
            raise ValueError(f"{name}: {key} has dtype {a.dtype}, expected {want} type")
        if a.ndim != len(dims) or any(type(n) is int and n != got for n, got in zip(dims, a.shape)):
            want = ", ".join(map(str, dims))
            raise ValueError(f"{name}: {key} has shape {list(a.shape)}, expected [{want}]")
        return a.shape

    B, P = check("prompt_ids", "iu", ["B", "P"])
    N = check("output_ids", "iu", [B, "N"])[1]
    K = check("topk_ids", "iu", [B, P + N - 1, "K"])[2]
    check("topk_logprobs", "f", [B, P + N - 1, K])
    reported = d["topk_ids"] >= 0
    if not np.isfinite(d["topk_logprobs"][reported]).all():  # NaN would compare as "no difference"
        b, t, j = np.argwhere(reported & ~np.isfinite(d["topk_logprobs"]))[0]
        raise ValueError(f"{name}: topk_logprobs[{b}, {t}, {j}] is not finite where topk_ids holds "
                         "an id")
    C = check("accepted", "iu", [B, "C"])[1] if "accepted" in d else "C"
    if "draft_ids" in d:
        k = check("draft_ids", "iu", [B, C, "k"])[2]
        if "accepted" in d and (d["accepted"] > k).any():
            b, c = np.argwhere(d["accepted"] > k)[0]
            raise ValueError(f"{name}: accepted[{b}, {c}] = {d['accepted'][b, c]} drafts, more "
                             f"than the k = {k} that draft_ids says each cycle verified")
        if "draft_parents" in d:
            check_tree_arrays(d, name, check, B, C, k)
    return B, P, N


def check_tree_arrays(d, name, check, B, C, k):
    """A tree's arrays: each node's parent precedes it; the accepted nodes, one per depth down
    to `accepted`, form a path from the root through the tree."""
    check("draft_parents", "iu", [B, C, k])
    if "accepted_nodes" not in d or "accepted" not in d:
        raise ValueError(f"{name}: draft_parents (a tree) needs accepted and accepted_nodes")
    D = check("accepted_nodes", "iu", [B, C, "D"])[2]
    parents, nodes, m = d["draft_parents"], d["accepted_nodes"], d["accepted"]
    live = m >= 0                                                             # [B, C]
    bad = live[..., None] & ((parents < 0) | (parents > np.arange(k)))
    if bad.any():
        b, c, i = np.argwhere(bad)[0]
        raise ValueError(f"{name}: draft_parents[{b}, {c}, {i}] = {parents[b, c, i]}: node "
                         f"{i + 1}'s parent must be the root (0) or a node before it")
    for b, c in np.argwhere(live):
        want = nodes[b, c, :m[b, c]]
        up = [0] + list(want)
        ok = (m[b, c] <= D and (nodes[b, c, m[b, c]:] == -1).all() and (want >= 1).all()
              and (want <= k).all() and all(parents[b, c, n - 1] == p for n, p in zip(want, up)))
        if not ok:
            raise ValueError(f"{name}: accepted_nodes[{b}, {c}] = {nodes[b, c].tolist()} is not a "
                             f"path of accepted[{b}, {c}] = {m[b, c]} nodes down from the root")


def check_npz(path):
    """Refuse (ValueError, one line naming it) a file that is missing or is no .npz by its first
    bytes, before numpy reads it (numpy would try a pickle, and suggest allow_pickle)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    if magic != b"PK\x03\x04":  # an .npz is a zip archive of .npy files
        raise ValueError(f"{path} is not an .npz file (a zip of numpy arrays): it starts with "
                         f"{magic!r}")


def load_dump(path):
    """A dump's arrays. A file that is not a readable .npz (missing, not a zip, truncated, holding
    pickled objects) raises ValueError naming it."""
    check_npz(path)
    try:
        with np.load(path) as f:
            return {key: f[key] for key in f.files}
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise ValueError(f"{path} holds an object (pickled) array; a dump holds only int, "
                             "float and str arrays") from None
        raise ValueError(f"{path} is a corrupt .npz: {e}") from None
    except Exception as e:  # a truncated archive: zipfile.BadZipFile, EOFError, zlib.error, OSError
        raise ValueError(f"{path} is a truncated or corrupt .npz ({type(e).__name__}: "
                         f"{e})") from None


def compare_row(a, b, r):
    """One row of two dumps: where the outputs part, and how the log-probabilities agree before."""
    prompt_len = int((a["prompt_ids"][r] >= 0).sum())
    out_a, out_b = (d["output_ids"][r][d["output_ids"][r] >= 0] for d in (a, b))
    n = min(len(out_a), len(out_b))
    differ = np.flatnonzero(out_a[:n] != out_b[:n])
    diverge = int(differ[0]) if len(differ) else (n if len(out_a) != len(out_b) else None)
    same = prompt_len + (n if diverge is None else diverge)  # positions < same: same tokens read
    ids_a, ids_b = a["topk_ids"][r, :same], b["topk_ids"][r, :same]             # [same, K]
    lp_a, lp_b = (d["topk_logprobs"][r, :same].astype(np.float64) for d in (a, b))
    both = (ids_a[:, 0] >= 0) & (ids_b[:, 0] >= 0)                              # reported by both
    match = ((ids_a[:, :, None] == ids_b[:, None, :]) & (ids_a[:, :, None] >= 0)
             & both[:, None, None])                                             # [same, K, K]
    gaps = np.abs(lp_a[:, :, None] - lp_b[:, None, :])
    diff = np.where(match, gaps, 0.0).max((1, 2), initial=0.0)
    worst = float(diff.max(initial=0.0))
    row = dict(row=r, prompt_len=prompt_len, out_len=(len(out_a), len(out_b)), diverge=diverge,
               positions=int(both.sum()), top1_agree=int((ids_a[both, 0] == ids_b[both, 0]).sum()),
               max_logprob_diff=worst, at=int(diff.argmax()) if worst > 0 else None)
    if "accepted" in a and "accepted" in b:
        live = [d["accepted"][r][d["accepted"][r] >= 0] for d in (a, b)]
        m = min(len(live[0]), len(live[1]))
        first = np.flatnonzero(live[0][:m] != live[1][:m])
        row["accepted_per_cycle"] = tuple(float(x.mean()) if len(x) else math.nan for x in live)
        row["accept_differs_at"] = (int(first[0]) if len(first)
                                    else m if len(live[0]) != len(live[1]) else None)
    return row


def judge_divergence(a, b, row, max_logprob_diff):
    """Where a row's greedy outputs first differ, B's token must be one that A could have chosen
    on a near-tie that another reduction order flips: in A's top-K at that position and at most
    max_logprob_diff below A's top-1 (the pattern of vLLM's check_logprobs_close). Returns None
    (no divergence, or a near-tie) or the failure, naming the row, the position, both tokens and
    their log-probabilities."""
    r, j = row["row"], row["diverge"]
    if j is None:
        return None
    t = row["prompt_len"] - 1 + j                               # the position that chose output j
    tok_a, tok_b = int(a["output_ids"][r, j]), int(b["output_ids"][r, j])
    where = f"row {r}, output {j} (position {t})"
    if tok_a < 0 or tok_b < 0:  # one file stopped (an EOS, or its end), the other went on
        stopped, went_on, tok = ("A", "B", tok_b) if tok_a < 0 else ("B", "A", tok_a)
        return f"{where}: {stopped} stops, {went_on} goes on with token {tok}"
    ids, lps = a["topk_ids"][r, t], a["topk_logprobs"][r, t].astype(np.float64)

    def logp(d, tok):  # a token's log p in file d at position t, if d's top-K has it
        hit = np.flatnonzero(d["topk_ids"][r, t] == tok)
        return float(d["topk_logprobs"][r, t, hit[0]]) if len(hit) else None
    lp_a, lp_b = logp(a, tok_a), logp(a, tok_b)
    in_b = [logp(b, tok) for tok in (tok_a, tok_b)]
    b_view = "" if in_b == [None, None] else " (B's own log p: " + ", ".join(
        f"{tok} {'absent' if lp is None else f'{lp:.4f}'}"
        for tok, lp in zip((tok_a, tok_b), in_b)) + ")"
    if ids[0] < 0 or lp_a is None:
        return (f"{where}: A chose {tok_a}, B chose {tok_b}, and A's top-K there does not hold "
                f"{tok_a} to judge by")
    if lp_b is None:
        return (f"{where}: A chose {tok_a} (log p {lp_a:.4f}), B chose {tok_b}, which is not in "
                f"A's top-{len(ids)}{b_view}")
    gap = float(lps[0]) - lp_b
    if gap > max_logprob_diff:
        return (f"{where}: A chose {tok_a} (log p {lp_a:.4f}), B chose {tok_b} (log p {lp_b:.4f} "
                f"in A, {gap:.4f} below A's top-1 > --max-logprob-diff {max_logprob_diff}){b_view}")
    return None


def compare(a, b, names=("A", "B"), max_logprob_diff=MAX_LOGPROB_DIFF,
            min_top1_agreement=MIN_TOP1_AGREEMENT, max_accept_diff=MAX_ACCEPT_DIFF):
    """Judge dump B against reference A (dicts of arrays of the same request). Per row: the first
    output index where the greedy outputs differ, judged by judge_divergence; over the positions
    whose context is the same in both (the prompt and the outputs before that index) and that both
    files report, the top-1 agreement and the largest |log p| difference over ids in both top-K
    lists; the drafts accepted per cycle, where both have them. The thresholds on agreement and
    accepted drafts apply to all rows together. Returns a report dict whose "failures" lists what
    failed (empty: pass); files that cannot be compared raise ValueError."""
    for d, name in zip((a, b), names):
        check_dump(d, name)
    for key in ("prompt_ids", "output_ids"):
        if a[key].shape != b[key].shape:
            raise ValueError(f"{key}: {names[0]} has shape {list(a[key].shape)}, {names[1]} has "
                             f"{list(b[key].shape)}: not dumps of the same prompts and "
                             "max_new_tokens")
    if (a["prompt_ids"] != b["prompt_ids"]).any():
        row = int(np.argwhere(a["prompt_ids"] != b["prompt_ids"])[0, 0])
        raise ValueError(f"prompt_ids differ in row {row}: not dumps of the same prompts")
    trees = ["draft_parents" in d for d in (a, b) if "draft_ids" in d]
    if len(trees) == 2 and trees[0] != trees[1]:
        raise ValueError(f"{names[0]} drafts a {'tree' if trees[0] else 'chain'}, {names[1]} a "
                         f"{'tree' if trees[1] else 'chain'}: not runs of the same drafting")
    ks = [d["draft_ids"].shape[2] for d in (a, b) if "draft_ids" in d]
    if len(ks) == 2 and ks[0] != ks[1]:
        raise ValueError(f"draft_ids: {names[0]} drafts k = {ks[0]} tokens a cycle, {names[1]} "
                         f"k = {ks[1]}: not runs with the same "
                         + ("tree size (num_draft_tokens)" if trees[0] else "num_steps"))
    rows = [compare_row(a, b, r) for r in range(len(a["prompt_ids"]))]
    fail = []
    for row in rows:
        row["divergence_failure"] = judge_divergence(a, b, row, max_logprob_diff)
        fail += [row["divergence_failure"]] if row["divergence_failure"] else []
    seen = sum(r["positions"] for r in rows)
    agree = sum(r["top1_agree"] for r in rows) / seen if seen else math.nan
    report = dict(rows=rows, top1_agreement=agree, accept_diff=None, failures=fail,
                  max_logprob_diff=max(r["max_logprob_diff"] for r in rows))
    if not seen:
        fail.append("no position to compare: the files share no reported position")
    elif agree < min_top1_agreement:
        fail.append(f"top-1 agreement {agree:.4f} < --min-top1-agreement {min_top1_agreement}")
    if report["max_logprob_diff"] > max_logprob_diff:
        fail.append(f"max |logprob diff| {report['max_logprob_diff']:.3g} > --max-logprob-diff "
                    f"{max_logprob_diff}")
    live = [d["accepted"][d["accepted"] >= 0] for d in (a, b) if "accepted" in d]
    if len(live) == 2 and all(len(x) for x in live):
        report["accept_diff"] = abs(float(live[0].mean() - live[1].mean()))
        if report["accept_diff"] > max_accept_diff:
            fail.append(f"drafts accepted per cycle differ by {report['accept_diff']:.3f} > "
                        f"--max-accept-diff {max_accept_diff}")
    return report


def print_comparison(report, names, metas):
    for name, meta in zip(names, metas):
        print(fill(f"{name}: {meta or '(no meta array)'}"))
    accept = "accepted_per_cycle" in report["rows"][0]
    head = (f"{'row':>4} {'prompt':>6} {'out A/B':>9} {'diverge@':>8} {'judged':>8} "
            f"{'top-1 agree':>17} {'max|dlogp|':>10} {'@pos':>5}")
    print("\n" + head + (f" {'accepted/cycle A/B':>18} {'differ@cycle':>12}" if accept else ""))

    def dash(x):
        return "-" if x is None else x
    for r in report["rows"]:
        share = r["top1_agree"] / r["positions"] if r["positions"] else math.nan
        judged = "-" if r["diverge"] is None else "FAIL" if r["divergence_failure"] else "near-tie"
        line = (f"{r['row']:>4} {r['prompt_len']:>6} {'%d/%d' % r['out_len']:>9} "
                f"{dash(r['diverge']):>8} {judged:>8} "
                f"{'%d/%d' % (r['top1_agree'], r['positions']):>11} {share:5.3f} "
                f"{r['max_logprob_diff']:>10.2e} {dash(r['at']):>5}")
        if accept:
            line += (f" {'%.2f/%.2f' % r['accepted_per_cycle']:>18} "
                     f"{dash(r['accept_differs_at']):>12}")
        print(line)
    accept_line = "" if report["accept_diff"] is None else (
        f", drafts accepted per cycle (bonus token not counted) differ by "
        f"{report['accept_diff']:.3f}")
    print("\n" + fill(f"all rows: top-1 agreement {report['top1_agreement']:.4f}, max |logprob "
                      f"diff| {report['max_logprob_diff']:.3g}{accept_line}"))
    fails = report["failures"]  # each on a line of its own, where it names its row
    print("\n".join(fill(("FAIL: " if i == 0 else "  ") + f + (";" if i < len(fails) - 1 else ""),
                          rest="    ") for i, f in enumerate(fails)) if fails else "PASS")


def fill(text, width=110, rest="  "):
    """A long line of the dump's or the comparison's output in lines of at most `width`."""
    return textwrap.fill(text, width, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False)


def compare_main(args):
    """--compare A B: prints the comparison; returns 0 (pass) or 1 (a divergence or a threshold
    failed). Files that cannot be compared raise ValueError naming the problem."""
    a, b = (load_dump(path) for path in args.compare)
    report = compare(a, b, args.compare, args.max_logprob_diff, args.min_top1_agreement,
                     args.max_accept_diff)
    metas = [str(d["meta"]) if "meta" in d else None for d in (a, b)]
    print_comparison(report, args.compare, metas)
    return 1 if report["failures"] else 0


# A reader that closes stdout early (`run.py | head -1`, `report.py tables ... | head -1`) has
# what it wanted: no traceback, and exit status 141, 128 + SIGPIPE, the status a shell reports for
# any command that a closed pipe ends (`yes | head -1`), so that `set -o pipefail` treats these
# commands as those (0 would say everything was printed; 1 is --compare's "a difference").
CLOSED_PIPE = 141


def closed_stdout():
    """After a BrokenPipeError on stdout (run.py, report.py, routing.py): stdout pointed at
    /dev/null, so what is left in its buffer is flushed there at exit, not into the closed pipe
    again; returns CLOSED_PIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout with no file descriptor (in-process callers)
        pass
    return CLOSED_PIPE


def check_writable(flag, path):
    """Refuse (ValueError naming `flag`, one line) an output path a run could not write at its end,
    before anything is built, by creating (and removing) a temporary file in its folder: what the
    end does (write_whole)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: cannot write there (is a folder)")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: cannot write there (no folder {folder})")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".run-py-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there (folder {folder}: "
                       f"{e.strerror or e})") from None


def write_whole(path, write):
    """write(file) into a temporary file beside `path`, then rename it to `path`: a run stopped
    halfway (Ctrl-C) leaves no half-written file, and no temporary one."""
    tmp = f"{path}.{os.getpid()}.part"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def dump_main(cfg, target, head, how, recorder=None):
    """--dump: generates (speculative with `head`, plain with None), writes the file on rank 0
    and returns 0. cfg: run.py's settled configuration (its attention_modes: verify's one mode,
    in the model's words); how: what the target is (for the meta array); recorder: dump's, for
    --dump-routing. A request the model cannot take raises ValueError."""
    import torch
    from tp import print0
    K, N = cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens
    tree = (K, N) if K > 1 else None
    what = "plain greedy" if head is None else (
        f"EAGLE-3 {cfg.draft_path}, num_steps {cfg.speculative_num_steps}"
        + (f", tree of topk {K} and {N} draft tokens" if tree else "")
        + f", attention {cfg.speculative_attention_mode}, graphs {cfg.cuda_graph}")
    device = target.device
    meta = dict(target=how, tp=target.tp.world_size, dtype=cfg.dtype, decoding=what,
                max_new_tokens=cfg.max_new_tokens, topk=cfg.topk, torch=torch.__version__,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    print0(fill(f"dump: {json.dumps(meta)}"))
    arrays = dump(target, head, cfg.prompts, cfg.max_new_tokens, cfg.speculative_num_steps,
                  cfg.topk, cfg.attention_modes[0], use_graphs=cfg.cuda_graph == "on", tree=tree,
                  recorder=recorder)
    if target.tp.rank == 0:  # np.savez on a file, not a name: a name would gain ".npz"
        write_whole(cfg.dump, lambda f: np.savez(f, meta=np.array(json.dumps(meta)), **arrays))
        shapes = ", ".join(f"{k} {list(v.shape)}" if np.ndim(v) else f"{k} {v.item()}"
                           for k, v in arrays.items())   # scalars (n_experts, top_k) by value
        print(fill(f"wrote {cfg.dump}: {shapes}"), flush=True)
        if head is not None:
            print(fill("accepted counts the tokens each cycle kept minus the target's bonus token "
                       "(SGLang's accept length minus 1; a cycle cut at max_new_tokens or an EOS "
                       "counts what it kept)"), flush=True)
    return 0


if __name__ == "__main__":
    import sys
    print("baseline.py: a module, not a command: use `python run.py --dump PATH --prompt-ids "
          "FILE` or `python run.py --compare A.npz B.npz`", file=sys.stderr)
    sys.exit(2)
