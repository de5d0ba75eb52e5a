"""Time every phase of EAGLE-3 speculative decoding on a Kimi-K2 target, and say when it pays.

    torchrun --nproc-per-node 8 run.py      # real TP 8 (NCCL)
    python run.py                           # one GPU: one SIMULATED rank of TP 8; CPU: tiny model
    python run.py --model-path K2 --prompt-ids p.jsonl --dump ref.npz   # the correctness baseline
    python run.py --compare ref.npz engine.npz                          # no model, no GPU

Answers the background story's question with separate measurements: the attention path of
verify (prefill = extend-style, decode = absorbed MLA) and graph capture (eager, CUDA graph) are
two independent switches, timed in all four combinations. Device work is timed with CUDA events
after warm-up (medians); host clocks are read only after a synchronize. Forced acceptance
(--simulate-accept-len) is labelled SIMULATED everywhere it appears.

--dump writes what the model says (greedy tokens, the target's top-K log-probabilities along them,
the drafts and accepted counts of a speculative run) as an .npz that another engine's output can
be converted to; --compare reports where two such files disagree (README: "Checking an engine
against this reference").
"""
import argparse
import json
import math
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import model
import tp as tpm
from draft import Eagle3Draft, draft_preset, init_random_draft, load_draft
from graphs import CudaGraphs
from verify import ATTENTION_MODES, accept, generate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="HF DeepseekV3 / Kimi-K2 checkpoint folder (else --preset)")
    p.add_argument("--draft-path", help="SpecForge / SGLang EAGLE-3 checkpoint folder (else random)")
    p.add_argument("--preset", choices=sorted(model.PRESETS), help="default: kimi-k2 on a GPU, tiny on CPU")
    p.add_argument("--simulate-tp", type=int, help="build one SIMULATED rank of TP N (default on one GPU "
                   "with kimi-k2: 8)")
    p.add_argument("--routed-experts", type=int, help="keep N routed experts per layer (memory override; "
                   "default on one GPU with bf16 kimi-k2: 128; all 384 with --quant int4 or fp8)")
    p.add_argument("--quant", choices=["none", "int4", "fp8"], help="random weights in this layout: int4 = routed "
                   "experts packed as Kimi-K2-Thinking / K2.5 ship them; fp8 = routed experts in FP8 e4m3 with "
                   "128x128 block scales as Kimi-K2-Instruct ships them (the rest dequantized, as at load) "
                   "(default: the preset's)")
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, help="must be steps + 1 with topk 1")
    p.add_argument("--speculative-attention-mode", choices=["prefill", "decode", "both"],
                   help="default: both (timing), prefill (--dump)")
    p.add_argument("--cuda-graph", choices=["on", "off", "both"], help="default: both on a GPU, off on CPU")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, help="default 256 on a GPU, 16 on CPU")
    p.add_argument("--max-new-tokens", type=int, help="default 64 on a GPU, 24 on CPU")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate-accept-len", type=float, help="force the mean accepted length per cycle "
                   "(bonus included), as SGLANG_SIMULATE_ACC_LEN: output marked SIMULATED")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float64"], help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--moe-impl", choices=["auto", "gather", "grouped", "fused"], default="auto",
                   help="routed experts: gathered weights (plain), torch._grouped_mm, or the fused Triton kernel "
                   "(kernels.py; grouped above 256 tokens for unquantized experts) (auto: fused on a GPU with Triton, else grouped; "
                   "CPU: gather)")
    p.add_argument("--compile", action="store_true", help="also time the captured phases with each decoder "
                   "layer and the draft layer fused by torch.compile (inside our own CUDA graphs), beside the plain ones")
    p.add_argument("--reps", type=int, help="timed repetitions per phase (default 20 GPU, 5 CPU)")
    p.add_argument("--json", help="also write the final JSON line here")
    b = p.add_argument_group("correctness baseline (README: Checking an engine against this reference)")
    b.add_argument("--dump", metavar="PATH", help="write greedy output and top-K log-probabilities of the "
                   "--prompt-ids to this .npz (speculative, with drafts and accepted counts, when --draft-path "
                   "is given); no timing")
    b.add_argument("--prompt-ids", metavar="FILE", help="for --dump: one JSON list of token ids per line")
    b.add_argument("--topk", type=int, default=20, help="for --dump: log-probabilities kept per position")
    b.add_argument("--compare", nargs=2, metavar=("A.npz", "B.npz"), help="compare two dumps (no model, no "
                   "GPU); exit status 1 past the thresholds below, 2 if the files cannot be compared")
    b.add_argument("--max-logprob-diff", type=float, default=MAX_LOGPROB_DIFF, help="largest |log p_A - log p_B| "
                   "over ids in both top-K lists, on positions both runs read the same tokens (default %(default)s)")
    b.add_argument("--min-top1-agreement", type=float, default=MIN_TOP1_AGREEMENT, help="share of those "
                   "positions, all rows together, whose top-1 ids agree (default %(default)s)")
    b.add_argument("--max-accept-diff", type=float, default=MAX_ACCEPT_DIFF, help="largest difference in drafts "
                   "accepted per cycle (mean over all rows' cycles), when both files have 'accepted' "
                   "(default %(default)s)")
    return p.parse_args(argv)


def settle(args, device, world):
    """Fill in device-dependent defaults and check the speculative flags as SGLang does."""
    gpu = device.type == "cuda"
    if args.dump:  # the model's own greedy answers, in one configuration
        refuse = {"--simulate-tp": (args.simulate_tp or 1) > 1, "--routed-experts": args.routed_experts,
                  "--simulate-accept-len": args.simulate_accept_len, "--temperature": args.temperature != 0,
                  "--cuda-graph both": args.cuda_graph == "both", "--speculative-attention-mode both":
                  args.speculative_attention_mode == "both"}
        for flag, bad in refuse.items():
            if bad:
                sys.exit(f"--dump records the model's own greedy answers in one configuration: drop {flag}")
        if not args.prompt_ids:
            sys.exit("--dump needs --prompt-ids FILE (one JSON list of token ids per line)")
        try:
            args.prompts = read_prompt_ids(args.prompt_ids)
        except (OSError, ValueError) as e:
            sys.exit(f"--prompt-ids: {e}")
        args.batch_size, args.prompt_len = len(args.prompts), max(len(p) for p in args.prompts)
        args.simulate_tp, args.cuda_graph = 1, args.cuda_graph or "off"
        args.speculative_attention_mode = args.speculative_attention_mode or "prefill"
    args.speculative_attention_mode = args.speculative_attention_mode or "both"
    if args.speculative_eagle_topk != 1:
        sys.exit(f"--speculative-eagle-topk {args.speculative_eagle_topk}: only 1 (chain drafting) is implemented")
    want = args.speculative_num_steps + 1
    if args.speculative_num_draft_tokens not in (None, want):
        tpm.print0(f"note: --speculative-num-draft-tokens {args.speculative_num_draft_tokens} adjusted to "
                   f"{want} (= num_steps + 1 with topk 1)")
    args.speculative_num_draft_tokens = want
    args.preset = args.preset or ("kimi-k2" if gpu else "tiny")
    args.cuda_graph = args.cuda_graph or ("both" if gpu else "off")
    if args.compile and (not gpu or args.cuda_graph == "off"):
        sys.exit("--compile times the captured phases: it needs a CUDA GPU and --cuda-graph on or both")
    if args.cuda_graph != "off" and not gpu:
        sys.exit("--cuda-graph on/both needs a CUDA GPU; use --cuda-graph off on CPU")
    big = args.preset.startswith("kimi-k2") and not args.model_path
    if args.simulate_tp is None:
        args.simulate_tp = 8 if big and gpu and world == 1 else 1
    if args.model_path and args.quant:
        sys.exit("--quant sets the layout of random weights; a checkpoint's config.json says its own")
    quantized = args.quant in ("int4", "fp8") or args.quant is None and args.preset == "kimi-k2.5"
    if args.routed_experts is None and big and gpu and not quantized and not args.dump:
        args.routed_experts = 128  # bf16: 384 experts are 2.3x one H200; INT4 and FP8 ones fit
    args.prompt_len = args.prompt_len or (256 if gpu else 16)
    args.max_new_tokens = args.max_new_tokens or (64 if gpu else 24)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.reps = args.reps or (20 if gpu else 5)
    return args


def build(args, device, dtype, world):
    """The target and the head, loaded or random. Returns (target, head, description)."""
    tp = tpm.TP.simulate(args.simulate_tp) if args.simulate_tp > 1 else tpm.TP.from_env()
    if args.simulate_tp > 1 and world > 1:
        sys.exit("--simulate-tp is for a single process; under torchrun the TP is real")
    k = args.speculative_num_steps
    max_seq_len = args.prompt_len + args.max_new_tokens + k + 2
    if args.model_path:
        target = model.load_target(args.model_path, args.batch_size, max_seq_len, device, dtype, tp,
                                   moe_impl=args.moe_impl)
        how = f"loaded {args.model_path}"
    else:
        quant = {None: {}, "none": dict(quantization_config=None), "int4": dict(quantization_config="int4"),
                 "fp8": dict(quantization_config="fp8")}
        margs = model.preset(args.preset, **quant[args.quant])
        if args.routed_experts:
            tpm.print0(f"memory override: {args.routed_experts} of {margs.n_routed_experts} routed experts per layer kept")
            margs.n_routed_experts = args.routed_experts
        target = model.Transformer(margs, args.batch_size, max_seq_len, device, dtype, tp, moe_impl=args.moe_impl)
        whole = tp.world_size == 1 or not tp.simulated and sum(p.numel() for p in target.parameters()) < 5e8
        model.init_random(target, args.seed, rank_local=not whole)
        how = f"random {args.preset} ({'seeded whole, same at any TP' if whole else 'rank-local init'})"
    if args.draft_path:
        head = load_draft(args.draft_path, target)
    elif args.dump:  # a dump without a draft checkpoint is plain greedy
        head = None
    else:
        dargs = draft_preset("tiny" if target.args.hidden_size == 64 else "kimi-k2")
        dargs.eagle_config = None if target.args.num_hidden_layers < 59 else dargs.eagle_config
        head = init_random_draft(Eagle3Draft(dargs, target), args.seed + 1, rank_local=tp.simulated)
    return target, head, how


# ---------------------------------------------------------------------------------------------
# Timing: device events on a GPU (the CPU runs its ops synchronously, so a clock is honest there)

class Clock:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def median_ms(clock, fn, reps, warmup=3, desc=None):
    for _ in range(warmup):
        fn()
    stamps = []
    for _ in tqdm(range(reps), desc=desc, disable=desc is None or not is_rank0(), leave=False):
        a = clock.stamp()
        fn()
        stamps.append((a, clock.stamp()))
    clock.sync()
    return statistics.median(clock.ms(a, b) for a, b in stamps)


class PhaseTimer:
    """verify.generate calls mark(name) at the end of each phase; durations are mark to mark."""

    def __init__(self, clock):
        self.clock, self.marks = clock, []

    def mark(self, name):
        self.marks.append((name, self.clock.stamp()))

    def phases(self):
        self.clock.sync()
        out, host_ms = {}, []
        for (n0, t0), (n1, t1) in zip(self.marks, self.marks[1:]):
            if n1 == "start":  # the gap between cycles: the host read and the host's own work
                host_ms.append(self.clock.ms(t0, t1))
            else:
                out.setdefault(n1, []).append(self.clock.ms(t0, t1))
        starts = [t for n, t in self.marks if n == "start"]
        cycle_ms = [self.clock.ms(a, b) for a, b in zip(starts, starts[1:])]
        med = {k: statistics.median(v) for k, v in out.items()}
        med["host"] = statistics.median(host_ms) if host_ms else 0.0
        med["cycle"] = statistics.median(cycle_ms) if cycle_ms else sum(med.values())
        return med


def is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


# ---------------------------------------------------------------------------------------------
# Floors: bytes that must move over measured bandwidth

def copy_bandwidth(clock, device):
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = median_ms(clock, lambda: y.copy_(x), 10)
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


def routed_distinct(target, tokens, positions, mode):
    """Distinct experts per MoE layer for one forward of these tokens (recorded by hooks)."""
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[0].unique().numel()))
             for layer in target.layers if isinstance(layer.mlp, model.MoE)]
    target(tokens, positions, mode)
    for h in hooks:
        h.remove()
    return seen


def target_bytes(target, distinct, kv_slots, batch):
    """Weights touched by one forward (distinct routed experts only) + the latent KV cache read."""
    total = 0
    for name, p in target.named_parameters():
        if ".mlp.experts." not in name:
            total += p.numel() * p.element_size()
    for layer, n in zip([l for l in target.layers if isinstance(l.mlp, model.MoE)], distinct):
        total += n * layer.mlp.experts.expert_bytes()
    a = target.args
    total += len(target.layers) * batch * kv_slots * (a.kv_lora_rank + a.qk_rope_head_dim) * target.dtype.itemsize
    return total


def count_kernels(fn):
    """Device kernels (and copies) one eager call launches: what a CUDA graph replays as nodes."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def draft_bytes(head, kv_slots, batch, with_fc):
    total = sum(p.numel() * p.element_size() for n, p in head.named_parameters() if with_fc or not n.startswith("fc."))
    attn = head.midlayer.self_attn
    return total + 2 * batch * kv_slots * attn.n_local_kv_heads * attn.head_dim * head.norm.weight.element_size()


# ---------------------------------------------------------------------------------------------
# The correctness baseline: dump what the model says; compare any engine's dump with it.
#
# One .npz (README, "Checking an engine against this reference"). B prompts, P the longest, N =
# max_new_tokens, K = --topk, C cycles, k = num_steps. Row b's sequence is its own prompt then its
# output, with no padding between them; position t of the topk arrays holds the target's top-K
# log-softmax after reading the sequence's first t+1 tokens, predicting token t+1.
#   prompt_ids     int64   [B, P]         -1 after a shorter prompt
#   output_ids     int64   [B, N]         greedy; -1 after the row stopped (its EOS is kept)
#   topk_ids       int64   [B, P+N-1, K]  highest first; -1 where a row has no such position
#   topk_logprobs  float32 [B, P+N-1, K]  NaN there
#   draft_ids      int64   [B, C, k]      speculative only: the drafts cycle c verified, -1 once finished
#   accepted       int64   [B, C]         speculative only: drafts accepted in cycle c (the target's
#                                         bonus token not counted), -1 once the row finished
#   meta           str     []             optional: JSON saying what produced the file

# Defaults for --compare, set for bf16 against float32 with room to spare: on the tiny model made
# well-conditioned (README), bf16 against float32 reached at worst top-1 agreement 0.886 and max
# |logprob diff| 0.244 over 12 seeds; the defaults allow about twice that. A random MoE without
# that conditioning is chaotic in bf16 (near-tied routing flips) and fails them.
MAX_LOGPROB_DIFF = 0.5
MIN_TOP1_AGREEMENT = 0.8
MAX_ACCEPT_DIFF = 0.5


def read_prompt_ids(path):
    """One JSON list of token ids per line (blank lines skipped)."""
    prompts = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i} is not JSON: {e}") from None
            if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                raise ValueError(f"{path} line {i}: expected a non-empty JSON list of token ids, "
                                 f"got {line.strip()[:80]}")
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


@torch.no_grad()
def dump(target, head, prompts, max_new_tokens, num_steps=3, topk=20, attention_mode="prefill",
         use_graphs=False, eos_id=None, chunk=256):
    """Greedy generation (speculative with `head`, plain with None) and the target's top-K
    log-probabilities along the sequences it produced: the dump's arrays, the same on every rank.

    The log-probabilities come from a separate teacher-forced extend forward over each row's prompt
    and output, so they do not depend on how generation batched, drafted or graphed its steps."""
    if max_new_tokens < 1 or not 1 <= topk <= target.args.vocab_size:
        raise ValueError(f"need max_new_tokens >= 1 (got {max_new_tokens}) and 1 <= topk <= vocab_size "
                         f"{target.args.vocab_size} (got {topk})")
    res = generate(target, head, prompts, max_new_tokens=max_new_tokens, num_steps=num_steps,
                   attention_mode=attention_mode, use_graphs=use_graphs, eos_id=eos_id)
    B, P, N = len(prompts), max(len(p) for p in prompts), max_new_tokens
    T = P + N - 1  # the last output token predicts nothing we keep
    prompt_ids, output_ids = np.full((B, P), -1, np.int64), np.full((B, N), -1, np.int64)
    seqs = torch.zeros(B, T, dtype=torch.int64)  # after a row's own end: zeros, read by no kept position
    ends = torch.zeros(B, 1, dtype=torch.int64)  # positions < end have a next token in the row
    for b, (p, out) in enumerate(zip(prompts, res.tokens)):
        prompt_ids[b, :len(p)], output_ids[b, :len(out)] = p, out
        seq = (list(p) + out)[:T]
        seqs[b, :len(seq)] = torch.tensor(seq)
        ends[b] = len(p) + len(out) - 1
    seqs = seqs.to(target.device)
    positions = torch.arange(T, device=target.device).expand(B, T)
    ids, logprobs = [], []
    for s in range(0, T, chunk):  # chunks over the cache (slot = position) bound the [B, chunk, V] logits
        logits = target(seqs[:, s:s + chunk], positions[:, s:s + chunk], "extend")
        lp, top = torch.log_softmax(logits, -1).topk(topk, -1)  # logits are float32 or wider
        ids.append(top.cpu())
        logprobs.append(lp.float().cpu())
    kept = (torch.arange(T) < ends).unsqueeze(-1)                                # [B, T, 1]
    out = dict(prompt_ids=prompt_ids, output_ids=output_ids,
               topk_ids=torch.cat(ids, 1).masked_fill(~kept, -1).numpy(),
               topk_logprobs=torch.cat(logprobs, 1).masked_fill(~kept, float("nan")).numpy())
    if head is not None:
        out["draft_ids"] = res.drafts.transpose(0, 1).numpy()                   # [B, C, k]
        out["accepted"] = res.accepted.T.numpy()                                 # [B, C]
    return out


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
            raise ValueError(f"{name}: {key} has shape {list(a.shape)}, expected [{', '.join(map(str, dims))}]")
        return a.shape

    B, P = check("prompt_ids", "iu", ["B", "P"])
    N = check("output_ids", "iu", [B, "N"])[1]
    K = check("topk_ids", "iu", [B, P + N - 1, "K"])[2]
    check("topk_logprobs", "f", [B, P + N - 1, K])
    reported = d["topk_ids"] >= 0
    if not np.isfinite(d["topk_logprobs"][reported]).all():  # a NaN would compare as "no difference"
        b, t, j = np.argwhere(reported & ~np.isfinite(d["topk_logprobs"]))[0]
        raise ValueError(f"{name}: topk_logprobs[{b}, {t}, {j}] is not finite where topk_ids holds an id")
    C = check("accepted", "iu", [B, "C"])[1] if "accepted" in d else "C"
    if "draft_ids" in d:
        check("draft_ids", "iu", [B, C, "k"])
    return B, P, N


def load_dump(path):
    try:
        with np.load(path) as f:
            return {key: f[key] for key in f.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable .npz: {e}") from None


def compare_row(a, b, r):
    """One row of two dumps: where the outputs part, and how the log-probabilities agree before."""
    prompt_len = int((a["prompt_ids"][r] >= 0).sum())
    out_a, out_b = (d["output_ids"][r][d["output_ids"][r] >= 0] for d in (a, b))
    n = min(len(out_a), len(out_b))
    differ = np.flatnonzero(out_a[:n] != out_b[:n])
    diverge = int(differ[0]) if len(differ) else (n if len(out_a) != len(out_b) else None)
    same = prompt_len + (n if diverge is None else diverge)  # positions < same read the same tokens in both
    ids_a, ids_b = a["topk_ids"][r, :same], b["topk_ids"][r, :same]                 # [same, K]
    lp_a, lp_b = (d["topk_logprobs"][r, :same].astype(np.float64) for d in (a, b))
    both = (ids_a[:, 0] >= 0) & (ids_b[:, 0] >= 0)                                  # reported by both
    match = (ids_a[:, :, None] == ids_b[:, None, :]) & (ids_a[:, :, None] >= 0) & both[:, None, None]
    diff = np.where(match, np.abs(lp_a[:, :, None] - lp_b[:, None, :]), 0.0).max((1, 2), initial=0.0)
    worst = float(diff.max(initial=0.0))
    row = dict(row=r, prompt_len=prompt_len, out_len=(len(out_a), len(out_b)), diverge=diverge,
               positions=int(both.sum()), top1_agree=int((ids_a[both, 0] == ids_b[both, 0]).sum()),
               max_logprob_diff=worst, at=int(diff.argmax()) if worst > 0 else None)
    if "accepted" in a and "accepted" in b:
        live = [d["accepted"][r][d["accepted"][r] >= 0] for d in (a, b)]
        m = min(len(live[0]), len(live[1]))
        first = np.flatnonzero(live[0][:m] != live[1][:m])
        row["accepted_per_cycle"] = tuple(float(x.mean()) if len(x) else math.nan for x in live)
        row["accept_differs_at"] = int(first[0]) if len(first) else (m if len(live[0]) != len(live[1]) else None)
    return row


def compare(a, b, names=("A", "B"), max_logprob_diff=MAX_LOGPROB_DIFF, min_top1_agreement=MIN_TOP1_AGREEMENT,
            max_accept_diff=MAX_ACCEPT_DIFF):
    """Two dumps of the same request (dicts of arrays). Per row: the first output index where the
    greedy outputs differ; over the positions whose context is the same in both (the prompt and the
    outputs before that index) and that both files report, the top-1 agreement and the largest
    |log p| difference over ids in both top-K lists; the drafts accepted per cycle, where both have
    them. The thresholds apply to all rows together. Returns a report dict whose "failures" lists
    the thresholds passed (empty: pass)."""
    for d, name in zip((a, b), names):
        check_dump(d, name)
    for key in ("prompt_ids", "output_ids"):
        if a[key].shape != b[key].shape:
            raise ValueError(f"{key}: {names[0]} has shape {list(a[key].shape)}, {names[1]} has "
                             f"{list(b[key].shape)}: not dumps of the same prompts and max_new_tokens")
    if (a["prompt_ids"] != b["prompt_ids"]).any():
        row = int(np.argwhere(a["prompt_ids"] != b["prompt_ids"])[0, 0])
        raise ValueError(f"prompt_ids differ in row {row}: not dumps of the same prompts")
    rows = [compare_row(a, b, r) for r in range(len(a["prompt_ids"]))]
    seen = sum(r["positions"] for r in rows)
    report = dict(rows=rows, top1_agreement=sum(r["top1_agree"] for r in rows) / seen if seen else math.nan,
                  max_logprob_diff=max(r["max_logprob_diff"] for r in rows), accept_diff=None, failures=[])
    fail = report["failures"]
    if not seen:
        fail.append("no position to compare: the files share no reported position")
    elif report["top1_agreement"] < min_top1_agreement:
        fail.append(f"top-1 agreement {report['top1_agreement']:.4f} < --min-top1-agreement {min_top1_agreement}")
    if report["max_logprob_diff"] > max_logprob_diff:
        fail.append(f"max |logprob diff| {report['max_logprob_diff']:.3g} > --max-logprob-diff {max_logprob_diff}")
    live = [d["accepted"][d["accepted"] >= 0] for d in (a, b) if "accepted" in d]
    if len(live) == 2 and all(len(x) for x in live):
        report["accept_diff"] = abs(float(live[0].mean() - live[1].mean()))
        if report["accept_diff"] > max_accept_diff:
            fail.append(f"drafts accepted per cycle differ by {report['accept_diff']:.3f} > --max-accept-diff "
                        f"{max_accept_diff}")
    return report


def print_comparison(report, names, metas):
    for name, meta in zip(names, metas):
        print(f"{name}: {meta or '(no meta array)'}")
    accept = "accepted_per_cycle" in report["rows"][0]
    head = (f"{'row':>4} {'prompt':>6} {'out A/B':>9} {'diverge@':>8} {'top-1 agree':>17} {'max|dlogp|':>10} "
            f"{'@pos':>5}")
    print("\n" + head + (f" {'accepted/cycle A/B':>18} {'differ@cycle':>12}" if accept else ""))

    def dash(x):
        return "-" if x is None else x
    for r in report["rows"]:
        share = r["top1_agree"] / r["positions"] if r["positions"] else math.nan
        line = (f"{r['row']:>4} {r['prompt_len']:>6} {'%d/%d' % r['out_len']:>9} {dash(r['diverge']):>8} "
                f"{'%d/%d' % (r['top1_agree'], r['positions']):>11} {share:5.3f} {r['max_logprob_diff']:>10.2e} "
                f"{dash(r['at']):>5}")
        if accept:
            line += f" {'%.2f/%.2f' % r['accepted_per_cycle']:>18} {dash(r['accept_differs_at']):>12}"
        print(line)
    accept_line = "" if report["accept_diff"] is None else \
        f", drafts accepted per cycle differ by {report['accept_diff']:.3f}"
    print(f"\nall rows: top-1 agreement {report['top1_agreement']:.4f}, max |logprob diff| "
          f"{report['max_logprob_diff']:.3g}{accept_line}")
    print("FAIL: " + "; ".join(report["failures"]) if report["failures"] else "PASS")


def compare_main(args):
    """--compare: exit 0 (pass), 1 (a threshold passed), 2 (the files cannot be compared)."""
    try:
        a, b = (load_dump(path) for path in args.compare)
        report = compare(a, b, args.compare, args.max_logprob_diff, args.min_top1_agreement, args.max_accept_diff)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print_comparison(report, args.compare, [str(d["meta"]) if "meta" in d else None for d in (a, b)])
    sys.exit(1 if report["failures"] else 0)


def dump_main(args, device, world):
    dtype = getattr(torch, args.dtype)
    target, head, how = build(args, device, dtype, world)
    what = (f"EAGLE-3 {args.draft_path}, num_steps {args.speculative_num_steps}, attention "
            f"{args.speculative_attention_mode}, graphs {args.cuda_graph}" if head else "plain greedy")
    meta = dict(target=how, tp=target.tp.world_size, dtype=args.dtype, decoding=what,
                max_new_tokens=args.max_new_tokens, topk=args.topk, torch=torch.__version__,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    tpm.print0(f"dump: {meta}")
    try:
        arrays = dump(target, head, args.prompts, args.max_new_tokens, args.speculative_num_steps, args.topk,
                      args.speculative_attention_mode, use_graphs=args.cuda_graph == "on")
    except ValueError as e:
        sys.exit(f"--dump: {e}")
    if is_rank0():
        with open(args.dump, "wb") as f:  # np.savez on a name would append ".npz" to other names
            np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
        print("wrote " + args.dump + ": " + ", ".join(f"{k} {list(v.shape)}" for k, v in arrays.items()), flush=True)
    return arrays


# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        compare_main(args)
    rank, world, device = tpm.init_distributed()
    args = settle(args, device, world)
    if args.dump:
        return dump_main(args, device, world)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    clock = Clock(device)
    target, head, how = build(args, device, dtype, world)
    k, B, P = args.speculative_num_steps, args.batch_size, args.prompt_len
    modes = ["prefill", "decode"] if args.speculative_attention_mode == "both" else [args.speculative_attention_mode]
    graph_opts = {"both": [False, True], "on": [True], "off": [False]}[args.cuda_graph]
    sim = bool(args.simulate_accept_len)
    group, fp8 = target.args.int4_group_size, target.args.fp8_block
    quant_note = (f" (routed experts INT4, group {group})" if group else
                  f" (routed experts FP8 e4m3, {fp8[0]}x{fp8[1]} blocks)" if fp8 else "")
    experts = next((layer.mlp.experts for layer in target.layers if isinstance(layer.mlp, model.MoE)), None)
    moe_note = target.moe_impl
    if target.moe_impl == "fused":  # the header says which path ran for which token counts
        moe_note = "fused Triton kernel" + (f" (grouped above {experts.FUSED_MAX_TOKENS} tokens)" if experts is not None
                                            and experts.grouped_ok and not experts.quantized else "")
    header = (f"target: {how}, {target.args.num_hidden_layers} layers, {target.args.n_routed_experts} routed experts, "
              f"{target.tp.describe()}, {args.dtype}{quant_note}, moe {moe_note} | batch {B}, prompt {P}, "
              f"num_steps {k} | {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
              f"torch {torch.__version__}" + (" | acceptance SIMULATED" if sim else ""))
    tpm.print0(header)
    result = dict(env=dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           torch=torch.__version__, world_size=world, simulated_tp=args.simulate_tp if target.tp.simulated else None,
                           dtype=args.dtype, int4_group_size=group, fp8_block=fp8, moe_impl=target.moe_impl, seed=args.seed, simulated_acceptance=sim,
                           target=how, config=vars(args)), phases_ms={}, e2e={}, floors=None, cost_model={})

    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, target.args.vocab_size, (B, P), generator=g)
    runner = CudaGraphs(device) if True in graph_opts else None

    # -- plain decode step and verify / draft phases in isolation (state: a prefilled prompt)
    tokens = prompts.to(device)
    pos0 = torch.arange(P, device=device).expand(B, P)
    _, aux = target(tokens, pos0, "extend", capture_aux=True)
    head(tokens, pos0, aux)
    step_tok = tokens[:, -1:]

    def positions(T):
        return P + torch.arange(T, device=device).expand(B, T)

    def timed(key, fn, *inputs, graph):
        call = (lambda: runner.run(key, fn, *inputs)) if graph else (lambda: fn(*inputs))
        return median_ms(clock, call, args.reps, desc=f"{key[0]} {'graph' if graph else 'eager'}")

    ph = result["phases_ms"]
    vtok, last = tokens[:, -(k + 1):], torch.full((B,), k, device=device)

    def time_phases(graph, tag=""):
        """decode step, verify in each mode, draft extend and one draft step (chain of 2 minus 1)."""
        gname = ("graph" if graph else "eager") + tag

        def key(*parts):  # the plain phases share their graphs with generate's
            return parts + (tag,) if tag else parts
        ph[f"decode_step/{gname}"] = timed(key("decode", B, 1), partial(target, mode="decode"), step_tok,
                                           positions(1), graph=graph)
        for mode in modes:
            ph[f"verify/{mode}/{gname}"] = timed(key("verify", ATTENTION_MODES[mode], B, k + 1),
                                                 partial(target, mode=ATTENTION_MODES[mode], capture_aux=True),
                                                 vtok, positions(k + 1), graph=graph)
        ph[f"draft_extend/{gname}"] = timed(key("draft_extend", B, k + 1), head.extend, vtok, positions(k + 1),
                                            aux[:, -(k + 1):], last, graph=graph)
        first, gh = head.extend(vtok, positions(k + 1), aux[:, -(k + 1):], last)
        ph[f"draft_step/{gname}"] = timed(key("draft_chain", B, 2), partial(head.chain, num_steps=2), first, gh,
                                          positions(1)[:, 0] + k, graph=graph)

    for graph in graph_opts:
        time_phases(graph)
        if device.type == "cuda" and not graph:
            result["env"]["gpu_mem_peak_eager_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    if device.type == "cuda":
        result["kernels_per_decode_step"] = count_kernels(lambda: target(step_tok, positions(1), "decode"))
    logits = target(tokens[:, -(k + 1):], positions(k + 1), "decode")
    ph["accept"] = median_ms(clock, lambda: accept(logits, tokens[:, -k:], args.temperature, None if args.temperature == 0
                                                   else torch.Generator(device).manual_seed(0)), args.reps)

    # -- cost model sweep: verify and draft extend at T = 1..6 tokens, the fastest variant
    best_graph = graph_opts[-1]
    sweep_mode = "decode" if "decode" in modes else modes[0]
    sweep = {}
    for T in range(1, 7):
        if P < T:
            break
        vt = tokens[:, -T:]
        sweep[T] = dict(
            verify=timed(("verify", ATTENTION_MODES[sweep_mode], B, T), partial(target, mode=ATTENTION_MODES[sweep_mode],
                         capture_aux=True), vt, positions(T), graph=best_graph),
            draft_extend=timed(("draft_extend", B, T), head.extend, vt, positions(T), aux[:, -T:],
                               torch.full((B,), T - 1, device=device), graph=best_graph))
    result["verify_sweep_ms"] = sweep

    # -- end to end: plain baseline and each speculative configuration
    def e2e(draft, mode, graph):
        timer = PhaseTimer(clock)
        clock.sync()
        t0 = time.perf_counter()
        res = generate(target, draft, prompts, max_new_tokens=args.max_new_tokens, num_steps=k,
                       attention_mode=mode, use_graphs=graph, temperature=args.temperature, seed=args.seed,
                       eos_id=-1, graphs=runner if graph else None, simulate_accept_len=args.simulate_accept_len if draft else None,
                       timer=timer)
        clock.sync()
        wall = time.perf_counter() - t0
        n = sum(len(t) for t in res.tokens)
        live = res.accepted[res.accepted >= 0]
        out = dict(tok_per_s=n / wall, wall_s=wall, tokens=n, cycles=res.cycles, phases_ms=timer.phases())
        if draft is not None:
            out["accept_len_mean"] = (live.float().mean().item() + 1) if live.numel() else 0.0
            out["accept_len_hist"] = torch.bincount(live + 1, minlength=k + 2)[1:].tolist()
            out["simulated"] = res.simulated
        return out, res

    for graph in graph_opts:  # warm run (captures graphs), then the measured one
        e2e(None, "decode", graph)
        result["e2e"][f"baseline/{'graph' if graph else 'eager'}"], base_res = e2e(None, "decode", graph)
    agreement = {}
    for graph in graph_opts:
        for mode in modes:
            e2e(head, mode, graph)
            name = f"eagle3/{mode}/{'graph' if graph else 'eager'}"
            result["e2e"][name], res = e2e(head, mode, graph)
            if not sim:
                same = sum(a == b for x, y in zip(res.tokens, base_res.tokens) for a, b in zip(x, y))
                agreement[name] = same / max(1, sum(len(x) for x in base_res.tokens))
    result["greedy_agreement_with_plain"] = agreement if args.temperature == 0 and not sim else None

    # -- floors (GPU only)
    if device.type == "cuda":
        bw = copy_bandwidth(clock, device)
        kv = P + k + 1
        dec_b = target_bytes(target, routed_distinct(target, step_tok, positions(1), "decode"), kv, B)
        ver_b = target_bytes(target, routed_distinct(target, tokens[:, -(k + 1):], positions(k + 1), "decode"), kv, B)
        result["floors"] = dict(bandwidth_GBps=bw, decode_step_GB=dec_b / 1e9, verify_GB=ver_b / 1e9,
                                draft_step_GB=draft_bytes(head, kv, B, False) / 1e9,
                                draft_extend_GB=draft_bytes(head, kv, B, True) / 1e9)
        fl = result["floors"]
        fl["decode_step_ms"] = fl["decode_step_GB"] / bw * 1e3
        fl["verify_ms"] = fl["verify_GB"] / bw * 1e3
        fl["draft_step_ms"] = fl["draft_step_GB"] / bw * 1e3
        fl["draft_extend_ms"] = fl["draft_extend_GB"] / bw * 1e3

    # -- all-reduce cost at the layer's message sizes (real TP only)
    # (eager: one launch each, host latency included; in a CUDA graph: the 2 x layers all-reduces
    # of one forward captured back to back, as they run inside a captured step; the replay also
    # copies the input in and the output out, a few KB)
    if target.tp.communicates:
        comm, n = {}, 2 * target.args.num_hidden_layers

        def all_reduces(buf):
            for _ in range(n):
                dist.all_reduce(buf)
            return buf
        for T in (1, k + 1):
            buf = torch.zeros(B * T * target.args.hidden_size, dtype=dtype, device=device)
            comm[f"eager/{T}"] = median_ms(clock, lambda: dist.all_reduce(buf), args.reps) * n
            if runner is not None:
                comm[f"graph/{T}"] = timed(("allreduce", T), all_reduces, buf, graph=True)
        result["allreduce_ms_per_forward"] = comm

    # -- the same captured phases with torch.compile fusing each layer (last: it changes the modules)
    if args.compile:
        try:
            target.compile_layers()
            head.midlayer.compile(dynamic=False)
            time_phases(True, "+compile")
            result["kernels_per_decode_step_compiled"] = count_kernels(lambda: target(step_tok, positions(1), "decode"))
        except Exception as e:  # an optional measurement: say why it is missing, keep the rest
            result["compile_error"] = f"{type(e).__name__}: {e}"[:500]
            tpm.print0(f"torch.compile variant failed: {result['compile_error']}")

    # -- cost model: cycle(k) = draft_extend(k+1) + (k-1) draft steps + verify(k+1) + accept + host
    base_step = result["e2e"][f"baseline/{'graph' if best_graph else 'eager'}"]["phases_ms"]["cycle"]
    host = statistics.median([v["phases_ms"].get("host", 0.0) for n, v in result["e2e"].items() if n.startswith("eagle3")] or [0])
    dstep = ph[f"draft_step/{'graph' if best_graph else 'eager'}"]
    cm = result["cost_model"]
    for steps in range(1, 6):
        if steps + 1 not in sweep:
            break
        cyc = sweep[steps + 1]["draft_extend"] + (steps - 1) * dstep + sweep[steps + 1]["verify"] + ph["accept"] + host
        cm[steps] = dict(cycle_ms=cyc, break_even_accept_len=cyc / base_step,
                         speedup_at={tau: tau * base_step / cyc for tau in range(1, steps + 2)})
    for name, v in result["e2e"].items():  # against the baseline with the same graph setting
        if name.startswith("eagle3"):
            base = result["e2e"][f"baseline/{name.split('/')[-1]}"]
            v["speedup_measured"] = v["tok_per_s"] / base["tok_per_s"]
            v["speedup_predicted"] = v["accept_len_mean"] * base["phases_ms"]["cycle"] / v["phases_ms"]["cycle"]
    if device.type == "cuda":
        result["env"]["gpu_mem_peak_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
        result["env"]["weights_GB"] = sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9
        result["env"]["routed_experts_GB"] = sum(p.numel() * p.element_size() for n, p in target.named_parameters()
                                                 if ".mlp.experts." in n) / 1e9
    report(result, header, k)
    line = json.dumps(result)
    if is_rank0():
        if args.json:
            with open(args.json, "w") as f:
                f.write(line + "\n")
        print(line, flush=True)
    return result


def report(r, header, k):
    if not is_rank0():
        return
    sim = " (SIMULATED acceptance)" if r["env"]["simulated_acceptance"] else ""
    fl = r["floors"]
    print("\n" + header)
    print("\nphase times, isolated (ms, median" + (", x floor" if fl else "; floors not computed on CPU") + ")")
    floor_of = {"decode_step": "decode_step_ms", "verify": "verify_ms", "draft_step": "draft_step_ms",
                "draft_extend": "draft_extend_ms"}
    for name, ms in r["phases_ms"].items():
        f = fl.get(floor_of.get(name.split("/")[0], ""), None) if fl else None
        print(f"  {name:28s} {ms:9.3f}" + (f"   {ms / f:5.1f}x floor {f:.3f}" if f else ""))
    if fl:
        print(f"  bandwidth {fl['bandwidth_GBps']:.0f} GB/s; decode step moves {fl['decode_step_GB']:.2f} GB, "
              f"verify {fl['verify_GB']:.2f} GB (distinct experts only)")
    print(f"\nend to end{sim}: tok/s, per-cycle phases (ms, median), accepted tokens per cycle")
    for name, v in r["e2e"].items():
        phases = " ".join(f"{p}={t:.2f}" for p, t in v["phases_ms"].items())
        extra = ""
        if "accept_len_mean" in v:
            extra = (f" | accept len {v['accept_len_mean']:.2f} hist {v['accept_len_hist']}"
                     f" | speedup {v['speedup_measured']:.2f}x"
                     + (f" (predicted {v['speedup_predicted']:.2f}x)" if "speedup_predicted" in v else ""))
        print(f"  {name:24s} {v['tok_per_s']:9.1f} tok/s | {phases}{extra}")
    print("\ncost model (fastest variant): cycle ms and break-even accepted length per num_steps")
    for steps, c in r["cost_model"].items():
        sp = " ".join(f"{t}:{s:.2f}x" for t, s in c["speedup_at"].items())
        print(f"  num_steps {steps}: cycle {c['cycle_ms']:.2f} ms, break-even {c['break_even_accept_len']:.2f} | speedup at accept len {sp}")
    if "gpu_mem_peak_GB" in r["env"]:
        print(f"\nGPU memory: weights {r['env']['weights_GB']:.1f} GB (routed experts {r['env']['routed_experts_GB']:.1f}), peak allocated {r['env']['gpu_mem_peak_GB']:.1f} GB "
              f"(eager phases only: {r['env'].get('gpu_mem_peak_eager_GB', float('nan')):.1f} GB)")
        print(f"kernels per eager decode step: {r.get('kernels_per_decode_step')}"
              + (f", with torch.compile: {r['kernels_per_decode_step_compiled']}" if "kernels_per_decode_step_compiled" in r else ""))
    if r.get("allreduce_ms_per_forward"):
        print("\nall-reduce ms per forward (2 per layer; eager launches vs captured in a graph), by tokens: "
              + ", ".join(f"{key} {ms:.2f}" for key, ms in r["allreduce_ms_per_forward"].items()))
    if r.get("greedy_agreement_with_plain"):
        print(f"\ngreedy speculative vs plain token agreement: {r['greedy_agreement_with_plain']}")
    print()


if __name__ == "__main__":
    try:
        main()
    finally:  # every rank leaves the group together (gloo aborts a rank whose peer exits first)
        if dist.is_initialized():
            dist.destroy_process_group()
