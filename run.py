"""Time every phase of EAGLE-3 speculative decoding on a Kimi-K2 target, and say when it pays.

    torchrun --nproc-per-node 8 run.py      # real TP 8 (NCCL)
    python run.py                           # one GPU: one SIMULATED rank of TP 8; CPU: tiny model
    python run.py --model-path K2 --prompt-ids p.jsonl --dump ref.npz   # the correctness baseline
    python run.py --compare ref.npz engine.npz                          # no model, no GPU

Answers the background story's question with separate measurements: the attention path of
verify (prefill = extend-style, decode = absorbed MLA) and graph capture (eager, CUDA graph) are
two independent switches, timed in all four combinations. Device work is timed with CUDA events
after warm-up (medians); host clocks are read only after a synchronize. A table per context length
says where the time of a decode step and of a verify goes, by component (a profiled eager run of
the captured shapes), against each component's byte floor; the output ends with the answer in
words. Forced acceptance (--simulate-accept-len), balanced routing on random weights (--routing
uniform, the default there) and modelled all-reduces (--allreduce-us) are labelled SIMULATED or
MODELLED everywhere they appear.

    python run.py --preset kimi-k2.5 --speculative-num-steps 2 --cuda-graph on --allreduce-us 35
        # the background's deployment (INT4 Kimi-K2.5, TP 8 over PCIe, 2 draft steps), one rank of it

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
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import model
import tp as tpm
from draft import Eagle3Draft, draft_preset, init_random_draft, load_draft
from graphs import CudaGraphs
from verify import ATTENTION_MODES, accept, draft_prefill, generate, kv_bucket, prefill


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="HF DeepseekV3 / Kimi-K2 checkpoint folder (else --preset)")
    p.add_argument("--draft-path", help="SpecForge / SGLang EAGLE-3 checkpoint folder (else random)")
    p.add_argument("--preset", choices=sorted(model.PRESETS), help="default: kimi-k2 on a GPU, tiny on CPU")
    p.add_argument("--simulate-tp", type=int, help="build one SIMULATED rank of TP N (default on one GPU "
                   "with kimi-k2: 8)")
    p.add_argument("--routed-experts", type=int, help="keep N routed experts per layer (memory override; "
                   "default on one GPU with bf16 kimi-k2: 128; all 384 with --quant int4)")
    p.add_argument("--quant", choices=["none", "int4"], help="random weights in this layout: int4 = routed "
                   "experts packed as Kimi-K2-Thinking / K2.5 ship them (default: the preset's)")
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
    p.add_argument("--moe-impl", choices=["auto", "gather", "grouped"], default="auto",
                   help="routed experts: gathered weights (plain) or torch._grouped_mm (auto: grouped on a GPU)")
    p.add_argument("--compile", action="store_true", help="also time the captured phases with each decoder "
                   "layer and the draft layer fused by torch.compile (inside our own CUDA graphs), beside the plain ones")
    p.add_argument("--reps", type=int, help="timed repetitions per phase (default 20 GPU, 5 CPU)")
    p.add_argument("--routing", choices=["model", "uniform"], help="model: the router's own choice; uniform: "
                   "SIMULATED balanced routing (the router still runs, then each token gets K distinct experts and "
                   "the tokens of a forward spread evenly over the experts), as engines benchmark random weights "
                   "(default: uniform for random weights, model for --model-path and --dump)")
    p.add_argument("--context-len", type=int, nargs="+", metavar="N", help="cached tokens before the isolated "
                   "phases and their component tables, one or more lengths (default: --prompt-len)")
    p.add_argument("--skip-e2e", action="store_true", help="time the phases in isolation only: no end-to-end "
                   "loops (the cost model then takes the isolated decode step as the plain step)")
    p.add_argument("--allreduce-us", type=float, metavar="X", help="for a SIMULATED rank, which skips its "
                   "collectives: add 2 x layers all-reduces of X microseconds to each forward in the predictions, "
                   "labelled MODELLED (~15-20 on NVLink, ~35 over PCIe at TP 8; a torchrun run prints the X it "
                   "measured in a CUDA graph)")
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
                  args.speculative_attention_mode == "both", "--routing uniform": args.routing == "uniform"}
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
    int4 = args.quant == "int4" or args.quant is None and args.preset == "kimi-k2.5"
    if args.routed_experts is None and big and gpu and not int4 and not args.dump:
        args.routed_experts = 128  # bf16: 384 experts are 2.3x one H200; INT4 ones fit
    args.prompt_len = args.prompt_len or (256 if gpu else 16)
    args.max_new_tokens = args.max_new_tokens or (64 if gpu else 24)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.reps = args.reps or (20 if gpu else 5)
    args.routing = args.routing or ("model" if args.model_path or args.dump else "uniform")
    args.context_len = args.context_len or [args.prompt_len]
    if not args.dump and min(args.context_len) < want:
        sys.exit(f"--context-len {min(args.context_len)}: the isolated verify re-reads {want} cached tokens "
                 f"(num_steps + 1); use at least {want}")
    if args.allreduce_us is not None and (args.allreduce_us < 0 or args.simulate_tp <= 1):
        sys.exit(f"--allreduce-us {args.allreduce_us}: models the collectives a SIMULATED rank skips "
                 "(--simulate-tp N, N > 1), with X >= 0; under torchrun they run and are measured")
    return args


def build(args, device, dtype, world):
    """The target and the head, loaded or random. Returns (target, head, description)."""
    tp = tpm.TP.simulate(args.simulate_tp) if args.simulate_tp > 1 else tpm.TP.from_env()
    if args.simulate_tp > 1 and world > 1:
        sys.exit("--simulate-tp is for a single process; under torchrun the TP is real")
    k = args.speculative_num_steps
    sweep = 6  # the isolated phases write up to 6 tokens after the longest context
    max_seq_len = max(args.prompt_len + args.max_new_tokens, max(args.context_len) + sweep) + 2 * k + 2
    if args.model_path:
        target = model.load_target(args.model_path, args.batch_size, max_seq_len, device, dtype, tp,
                                   moe_impl=args.moe_impl, routing=args.routing)
        how = f"loaded {args.model_path}"
    else:
        quant = {None: {}, "none": dict(quantization_config=None), "int4": dict(quantization_config="int4")}
        margs = model.preset(args.preset, **quant[args.quant])
        if args.routed_experts:
            tpm.print0(f"memory override: {args.routed_experts} of {margs.n_routed_experts} routed experts per layer kept")
            margs.n_routed_experts = args.routed_experts
        target = model.Transformer(margs, args.batch_size, max_seq_len, device, dtype, tp, moe_impl=args.moe_impl,
                                   routing=args.routing)
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
# Floors and components: bytes that must move over measured bandwidth; kernel time by component

def copy_bandwidth(clock, device):
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = median_ms(clock, lambda: y.copy_(x), 10)
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


def routed_distinct(target, fn, inputs):
    """Distinct experts per MoE layer in one call of fn(*inputs) (recorded by hooks on the routers)."""
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[0].unique().numel()))
             for layer in target.layers if isinstance(layer.mlp, model.MoE)]
    fn(*inputs)
    for h in hooks:
        h.remove()
    return seen


COMPONENTS = {  # the rows of the component table, in order
    "attn_core": "attention core (scores, softmax, values, cache write)",
    "attn_proj": "attention projections (q/kv down, up, o_proj)",
    "router": "router (scores, selection, weights)",
    "routed_experts": "routed experts",
    "shared_mlp": "shared expert + dense MLP",
    "elementwise": "norms, residual, RoPE, elementwise",
    "allreduce": "all-reduce",
    "embed_head": "embedding + lm_head",
    "other": "other (mask, RoPE table, aux concat)",
}


def component_bytes(target, distinct, kv_slots, batch, tokens):
    """{component: bytes} one forward of `batch` rows of `tokens` new tokens must move: weights as
    stored (routed experts: only the `distinct` ones reached, per MoE layer), the latent cache of
    kv_slots positions per row, and only the embedding rows looked up."""
    out = dict.fromkeys(COMPONENTS, 0)
    for name, p in target.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".mlp.experts." in name:
            continue
        if name.startswith("embed_tokens."):
            out["embed_head"] += batch * tokens * p.shape[1] * p.element_size()
        elif name.startswith("lm_head."):
            out["embed_head"] += nbytes
        elif "norm" in name:
            out["elementwise"] += nbytes
        elif ".self_attn." in name:
            out["attn_proj"] += nbytes
        elif ".mlp.gate." in name:
            out["router"] += nbytes
        else:  # the shared expert and the dense MLP
            out["shared_mlp"] += nbytes
    moe = [layer.mlp.experts for layer in target.layers if isinstance(layer.mlp, model.MoE)]
    out["routed_experts"] = sum(n * experts.expert_bytes() for experts, n in zip(moe, distinct))
    a = target.args
    out["attn_core"] = (len(target.layers) * batch * kv_slots * (a.kv_lora_rank + a.qk_rope_head_dim)
                        * target.dtype.itemsize)
    return out


def draft_bytes(head, kv_slots, batch, with_fc):
    total = sum(p.numel() * p.element_size() for n, p in head.named_parameters() if with_fc or not n.startswith("fc."))
    attn = head.midlayer.self_attn
    return total + 2 * batch * kv_slots * attn.n_local_kv_heads * attn.head_dim * head.norm.weight.element_size()


def component_of(name, module):
    """The component of a module's own ops (None: its parent's). MLA's own ops are the attention
    core; model.scope() names the RoPE and the absorbed projections inside it."""
    if isinstance(module, model.RMSNorm):
        return "elementwise"
    if isinstance(module, model.MLA):
        return "attn_core"
    if ".self_attn." in name:   # q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj
        return "attn_proj"
    kinds = {model.Router: "router", model.Experts: "routed_experts", model.MLP: "shared_mlp",
             model.MoE: "elementwise", model.Block: "elementwise"}  # the routed + shared sum, the residual adds
    for kind, component in kinds.items():
        if isinstance(module, kind):
            return component
    return "embed_head" if name in ("embed_tokens", "lm_head") else None


@contextmanager
def component_scopes(target):
    """Each module's forward inside a profiler range named by its component (hooks, removed after)."""
    active, handles = [], []

    def enter(component):
        def hook(module, inputs):
            active.append(model.scope(component))
            active[-1].__enter__()
        return hook

    def leave(module, inputs, output):
        active.pop().__exit__(None, None, None)
    for name, m in target.named_modules():
        component = component_of(name, m)
        if component:
            handles += [m.register_forward_pre_hook(enter(component)), m.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def component_at(event, kernel_names=()):
    """The innermost component range around a profiled op; any all-reduce is "allreduce" (the
    row-parallel layers' and the MoE's collectives, wherever they sit)."""
    chain = []
    while event is not None:
        chain.append(event.name)
        event = event.cpu_parent
    if any("allreduce" in n.lower().replace("_", "") for n in chain + list(kernel_names)):
        return "allreduce"
    return next((n.removeprefix("component:") for n in chain if n.startswith("component:")), "other")


def profile_components(target, fn, gpu, calls=None):
    """Where one eager call of fn goes, by component: {component: ms} of the device kernels it
    launches (GPU) or of its ops' own CPU time (CPU), each put under the innermost component range
    around the op that launched it; "kernel_ms" sums all kernels independently of that
    attribution; "kernels": kernels (GPU) or leaf ops (CPU) per call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    calls = calls or (1 if gpu else 3)  # kernel times are steady; CPU op times are not
    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with component_scopes(target), profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        Clock(target.device).sync()
    parts, kernels = dict.fromkeys(COMPONENTS, 0.0), 0
    ours = ("component:", "profiler::")  # our ranges and their enter/exit ops: not kernels
    for e in prof.events():
        if e.device_type != DeviceType.CPU or e.name.startswith(ours):
            continue
        if gpu:  # the kernels (and copies) this op launched; our ranges' GPU projections are not kernels
            launched = [k for k in e.kernels if not k.name.startswith(ours)]
            us, names = sum(k.duration for k in launched), [k.name for k in launched]
            kernels += len(launched)
        else:
            us, names = e.self_cpu_time_total, ()
            kernels += not e.cpu_children
        if us:
            parts[component_at(e, names)] += us / 1e3 / calls
    if gpu:
        total = sum(e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    else:
        total = sum(e.self_cpu_time_total for e in prof.key_averages() if not e.key.startswith(ours))
    return dict(parts_ms=parts, kernel_ms=total / 1e3 / calls, kernels=kernels // calls)


def count_kernels(fn):
    """Device kernels (and copies) one eager call launches: what a CUDA graph replays as nodes."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)


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
# The timing run, in the order of its output: build, the phases in isolation (with where their
# time goes and their floors), end to end, collectives, torch.compile, the cost model, the report.

@dataclass
class Bench:
    """What the stages share: the models, the clock, the graph runner and the run's settings."""
    args: argparse.Namespace
    target: model.Transformer
    head: Eagle3Draft
    how: str                   # what the target is, for the header
    clock: Clock
    runner: CudaGraphs | None
    fill: torch.Tensor = None  # [B, C] random ids prefilled into the cache, C the longest context
    aux: torch.Tensor = None   # [B, C, 3D] the target's EAGLE-3 states along `fill`

    @property
    def gpu(self):
        return self.target.device.type == "cuda"

    @property
    def k(self):
        return self.args.speculative_num_steps

    @property
    def modes(self):  # the attention modes timed
        mode = self.args.speculative_attention_mode
        return ["prefill", "decode"] if mode == "both" else [mode]

    @property
    def graph_opts(self):
        return {"both": [False, True], "on": [True], "off": [False]}[self.args.cuda_graph]

    @property
    def best(self):  # the fastest variant: graph when captured; the cost model's attention mode
        return "graph" if self.graph_opts[-1] else "eager", "decode" if "decode" in self.modes else self.modes[0]

    def positions(self, ctx, T):  # [B, T]: T new tokens after ctx cached ones
        return ctx + torch.arange(T, device=self.target.device).expand(self.args.batch_size, T)

    def timed(self, key, fn, *inputs, graph):
        call = (lambda: self.runner.run(key, fn, *inputs)) if graph else (lambda: fn(*inputs))
        return median_ms(self.clock, call, self.args.reps, desc=f"{key[0]} {'graph' if graph else 'eager'}")


def prepare(args, device, world):
    """Build the models and fill their caches with random ids up to the longest context."""
    torch.manual_seed(args.seed)
    target, head, how = build(args, device, getattr(torch, args.dtype), world)
    b = Bench(args, target, head, how, Clock(device), CudaGraphs(device) if args.cuda_graph != "off" else None)
    B, C = args.batch_size, max(args.context_len)
    g = torch.Generator().manual_seed(args.seed)
    b.fill = torch.randint(0, target.args.vocab_size, (B, max(C, args.prompt_len)), generator=g).to(device)
    last = torch.full((B,), C - 1, device=device)
    _, b.aux = prefill(target, b.fill[:, :C], last, capture_aux=True)
    draft_prefill(head, b.fill[:, :C], b.aux, last)  # fills the draft's cache (its output is not used)
    return b


def phase_calls(b, ctx, tag=""):
    """The isolated phases at ctx cached tokens: {name: (graph key, fn, inputs)}. Only their shapes
    matter for timing, so the inputs are deliberately arbitrary: the decode step and the verify
    re-read prefilled ids at new positions; the draft extend reads those ids unshifted (draft.py
    pairs token t+1 with state t) beside target states captured at other positions; the draft
    step starts from that extend's output. The target reads the slots in use (kv_bucket), as
    verify.generate does, so the plain phases share its graphs."""
    k, B, t = b.k, b.args.batch_size, b.target
    pos1, posv = b.positions(ctx, 1), b.positions(ctx, k + 1)
    kv1, kvv = kv_bucket(ctx + 1, t.max_seq_len), kv_bucket(ctx + k + 1, t.max_seq_len)
    kvd = kv_bucket(ctx + 2 * k + 1, t.max_seq_len)  # the draft's reads, as in generate (its chain runs ahead)
    step_tok, vtok = b.fill[:, ctx - 1:ctx], b.fill[:, ctx - k - 1:ctx]
    aux, last = b.aux[:, ctx - k - 1:ctx], torch.full((B,), k, device=t.device)

    def key(*parts):
        return parts + (tag,) if tag else parts
    calls = {"decode_step": (key("decode", B, 1, kv1), partial(t, mode="decode", kv_len=kv1), (step_tok, pos1))}
    for mode in b.modes:
        m = ATTENTION_MODES[mode]
        calls[f"verify/{mode}"] = (key("verify", m, B, k + 1, kvv), partial(t, mode=m, capture_aux=True, kv_len=kvv),
                                   (vtok, posv))
    calls["draft_extend"] = (key("draft_extend", B, k + 1, kvd), partial(b.head.extend, kv_len=kvd),
                             (vtok, posv, aux, last))
    first, g = b.head.extend(vtok, posv, aux, last, kv_len=kvd)
    calls["draft_step"] = (key("draft_chain", B, 2, kvd), partial(b.head.chain, num_steps=2, kv_len=kvd),
                           (first, g, pos1[:, 0] + k))
    return calls


def time_phases(b, ctx, graph, tag=""):
    """Median ms of each isolated phase at ctx cached tokens, eager or replayed from its graph."""
    name = ("graph" if graph else "eager") + tag
    return {f"{phase}/{name}": b.timed(key, fn, *inputs, graph=graph)
            for phase, (key, fn, inputs) in phase_calls(b, ctx, tag).items()}


def isolated(b, ctx, bandwidth):
    """One context: the phases eager and/or captured; for the decode step and each verify, the
    distinct experts a MoE layer reaches, the bytes each component must move and where the kernel
    time goes (a profiled eager run of the same shapes); the floors of every phase."""
    out = dict(phases_ms={})
    for graph in b.graph_opts:
        out["phases_ms"].update(time_phases(b, ctx, graph))
        if b.gpu and not graph:
            out["gpu_mem_peak_eager_GB"] = torch.cuda.max_memory_allocated(b.target.device) / 1e9
    out.update(distinct_experts={}, bytes={}, components={}, floors_ms={})
    B = b.args.batch_size
    for phase, (_, fn, inputs) in phase_calls(b, ctx).items():
        T = inputs[0].shape[1] if inputs[0].dim() == 2 else 1  # the draft step's input is d_1 [B]
        if phase.startswith("draft"):
            nbytes = draft_bytes(b.head, ctx + T, B, with_fc=phase == "draft_extend")
        else:
            distinct = routed_distinct(b.target, fn, inputs)
            out["distinct_experts"][phase] = statistics.mean(distinct) if distinct else 0.0
            parts = component_bytes(b.target, distinct, ctx + T, B, T)
            out["bytes"][phase], nbytes = parts, sum(parts.values())
            out["components"][phase] = profile_components(b.target, partial(fn, *inputs), b.gpu)
        out["floors_ms"][phase] = nbytes / bandwidth / 1e6 if bandwidth else None
    return out


def verify_sweep(b, ctx):
    """Verify (the cost model's attention mode) and draft extend of T = 1..6 tokens at ctx cached
    tokens, fastest variant: what a cycle of num_steps T - 1 pays. Inputs as in phase_calls."""
    graph, mode = b.graph_opts[-1], ATTENTION_MODES[b.best[1]]
    B, t, sweep = b.args.batch_size, b.target, {}
    for T in range(1, 7):
        if ctx < T:
            break
        kv, vt, pos = kv_bucket(ctx + T, t.max_seq_len), b.fill[:, ctx - T:ctx], b.positions(ctx, T)
        kvd = kv_bucket(ctx + 2 * T - 1, t.max_seq_len)  # as generate's draft extend for num_steps T - 1
        sweep[T] = dict(
            verify=b.timed(("verify", mode, B, T, kv), partial(t, mode=mode, capture_aux=True, kv_len=kv), vt, pos,
                           graph=graph),
            draft_extend=b.timed(("draft_extend", B, T, kvd), partial(b.head.extend, kv_len=kvd), vt, pos,
                                 b.aux[:, ctx - T:ctx], torch.full((B,), T - 1, device=t.device), graph=graph))
    return sweep


def run_generate(b, draft, mode, graph):
    """One generate() call on the random prompts, with device events at each phase of each cycle."""
    a, timer = b.args, PhaseTimer(b.clock)
    b.clock.sync()
    t0 = time.perf_counter()
    res = generate(b.target, draft, b.fill[:, :a.prompt_len].cpu(), max_new_tokens=a.max_new_tokens, num_steps=b.k,
                   attention_mode=mode, use_graphs=graph, temperature=a.temperature, seed=a.seed, eos_id=-1,
                   graphs=b.runner if graph else None, simulate_accept_len=a.simulate_accept_len if draft else None,
                   timer=timer)
    b.clock.sync()
    wall = time.perf_counter() - t0
    n = sum(len(t) for t in res.tokens)
    out = dict(tok_per_s=n / wall, wall_s=wall, tokens=n, cycles=res.cycles, phases_ms=timer.phases())
    if draft is not None:
        live = res.accepted[res.accepted >= 0]
        out["accept_len_mean"] = (live.float().mean().item() + 1) if live.numel() else 0.0
        out["accept_len_hist"] = torch.bincount(live + 1, minlength=b.k + 2)[1:].tolist()
        out["simulated"] = res.simulated
    return out, res


def end_to_end(b):
    """The plain loop and each speculative configuration, each run twice (the first captures its
    graphs); and how many tokens speculative greedy output shares with plain greedy output."""
    e2e, agreement = {}, {}
    for graph in b.graph_opts:
        run_generate(b, None, "decode", graph)
        e2e[f"baseline/{'graph' if graph else 'eager'}"], base = run_generate(b, None, "decode", graph)
    for graph in b.graph_opts:
        for mode in b.modes:
            run_generate(b, b.head, mode, graph)
            name = f"eagle3/{mode}/{'graph' if graph else 'eager'}"
            e2e[name], res = run_generate(b, b.head, mode, graph)
            same = sum(x == y for r, p in zip(res.tokens, base.tokens) for x, y in zip(r, p))
            agreement[name] = same / max(1, sum(len(p) for p in base.tokens))
    # greedy and the model's own routing: uniform routing picks experts by a token's place in the forward
    same_model = b.args.temperature == 0 and not b.args.simulate_accept_len and b.target.routing == "model"
    return e2e, agreement if same_model else None


def collectives(b):
    """Real TP only: the 2 x layers all-reduces of one forward at its message sizes, as eager
    launches (host latency included) and captured back to back in a graph, as inside a captured
    step (the replay also copies the input in and the output out, a few KB)."""
    comm, n, B = {}, 2 * b.target.args.num_hidden_layers, b.args.batch_size

    def all_reduces(buf):
        for _ in range(n):
            dist.all_reduce(buf)
        return buf
    for T in (1, b.k + 1):
        buf = torch.zeros(B * T * b.target.args.hidden_size, dtype=b.target.dtype, device=b.target.device)
        comm[f"eager/{T}"] = median_ms(b.clock, lambda: dist.all_reduce(buf), b.args.reps) * n
        if b.runner is not None:
            comm[f"graph/{T}"] = b.timed(("allreduce", T), all_reduces, buf, graph=True)
    return comm


def compiled(b, ctx, result):
    """The captured phases again with torch.compile fusing each layer (last: it changes the modules)."""
    try:
        b.target.compile_layers()
        b.head.midlayer.compile(dynamic=False)
        result["contexts"][ctx]["phases_ms"].update(time_phases(b, ctx, True, "+compile"))
        key, fn, inputs = phase_calls(b, ctx)["decode_step"]
        result["kernels_per_decode_step_compiled"] = count_kernels(partial(fn, *inputs))
    except Exception as e:  # an optional measurement: say why it is missing, keep the rest
        result["compile_error"] = f"{type(e).__name__}: {e}"[:500]
        tpm.print0(f"torch.compile variant failed: {result['compile_error']}")


def modelled_allreduce(b):
    """MODELLED all-reduce ms per target forward and per draft forward (2 a layer) for a simulated
    rank given --allreduce-us; None otherwise."""
    x = b.args.allreduce_us
    if x is None or not b.target.tp.simulated:
        return None
    return dict(us_each=x, target_forward_ms=2 * b.target.args.num_hidden_layers * x / 1e3, draft_forward_ms=2 * x / 1e3)


def cost_model(r, b):
    """cycle(s) = draft extend(s+1) + (s-1) draft steps + verify(s+1) + accept + host [+ modelled
    all-reduces: 1 target and s draft forwards]; break-even accepted length = cycle / plain step."""
    variant, _ = b.best
    ph, ar = r["phases_ms"], r["allreduce_modelled"] or dict(target_forward_ms=0.0, draft_forward_ms=0.0)
    base = r["e2e"][f"baseline/{variant}"]["phases_ms"]["cycle"] if r["e2e"] else ph[f"decode_step/{variant}"]
    base += ar["target_forward_ms"]
    hosts = [v["phases_ms"].get("host", 0.0) for n, v in r["e2e"].items() if n.startswith("eagle3")]
    host, sweep, cm = statistics.median(hosts) if hosts else 0.0, r["verify_sweep_ms"], {}
    for s in range(1, 6):
        if s + 1 not in sweep:
            break
        cyc = (sweep[s + 1]["draft_extend"] + (s - 1) * ph[f"draft_step/{variant}"] + sweep[s + 1]["verify"]
               + ph["accept"] + host + ar["target_forward_ms"] + s * ar["draft_forward_ms"])
        cm[s] = dict(cycle_ms=cyc, break_even_accept_len=cyc / base,
                     speedup_at={tau: tau * base / cyc for tau in range(1, s + 2)})
    for name, v in r["e2e"].items():  # against the baseline with the same graph setting
        if name.startswith("eagle3"):
            plain = r["e2e"][f"baseline/{name.split('/')[-1]}"]
            v["speedup_measured"] = v["tok_per_s"] / plain["tok_per_s"]
            v["speedup_predicted"] = v["accept_len_mean"] * plain["phases_ms"]["cycle"] / v["phases_ms"]["cycle"]
    return dict(plain_step_ms=base, steps=cm)


def header_of(b):
    t, a = b.target, b.args
    group = t.args.int4_group_size
    routing = "routing SIMULATED uniform" if t.routing == "uniform" else "routing: the model's router"
    ar = modelled_allreduce(b)
    return (f"target: {b.how}, {t.args.num_hidden_layers} layers, {t.args.n_routed_experts} routed experts, "
            f"{t.tp.describe()}, {a.dtype}" + (f" (routed experts INT4, group {group})" if group else "")
            + f", moe {t.moe_impl}, {routing} | batch {a.batch_size}, prompt {a.prompt_len}, cached "
            f"{'/'.join(map(str, a.context_len))} (isolated phases), num_steps {b.k} | "
            f"{torch.cuda.get_device_name(t.device) if b.gpu else 'CPU'}, torch {torch.__version__}"
            + (" | acceptance SIMULATED" if a.simulate_accept_len else "")
            + (f" | all-reduces MODELLED at {ar['us_each']:g} us" if ar else ""))


def bench_main(args, device, world):
    b = prepare(args, device, world)
    header = header_of(b)
    tpm.print0(header)
    env = dict(device=torch.cuda.get_device_name(device) if b.gpu else "cpu", torch=torch.__version__,
               world_size=world, simulated_tp=args.simulate_tp if b.target.tp.simulated else None, dtype=args.dtype,
               int4_group_size=b.target.args.int4_group_size, moe_impl=b.target.moe_impl, routing=b.target.routing,
               simulated_routing=b.target.routing == "uniform", seed=args.seed,
               simulated_acceptance=bool(args.simulate_accept_len), target=b.how, config=vars(args))
    bandwidth = copy_bandwidth(b.clock, device) if b.gpu else None
    r = dict(env=env, bandwidth_GBps=bandwidth, contexts={c: isolated(b, c, bandwidth) for c in args.context_len})
    first = args.context_len[0]
    r["phases_ms"] = r["contexts"][first]["phases_ms"]
    key, fn, inputs = phase_calls(b, first)["verify/" + b.modes[0]]
    logits = fn(*inputs)[0]
    gen = None if args.temperature == 0 else torch.Generator(device).manual_seed(0)
    r["phases_ms"]["accept"] = median_ms(b.clock, lambda: accept(logits, inputs[0][:, 1:], args.temperature, gen), args.reps)
    r["verify_sweep_ms"] = verify_sweep(b, first)
    r["e2e"], r["greedy_agreement_with_plain"] = ({}, None) if args.skip_e2e else end_to_end(b)
    r["floors"] = legacy_floors(r["contexts"][first], bandwidth)
    r["allreduce_ms_per_forward"] = collectives(b) if b.target.tp.communicates else None
    r["allreduce_modelled"] = modelled_allreduce(b)
    if args.compile:
        compiled(b, first, r)
    r["cost_model"] = cost_model(r, b)
    if b.gpu:
        env["gpu_mem_peak_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
        env["gpu_mem_peak_eager_GB"] = r["contexts"][first].get("gpu_mem_peak_eager_GB")
        env["weights_GB"] = sum(p.numel() * p.element_size() for p in b.target.parameters()) / 1e9
        r["kernels_per_decode_step"] = r["contexts"][first]["components"]["decode_step"]["kernels"]
    r["answer"] = answer(r, b)
    report(r, header, b)
    line = json.dumps(r)
    if is_rank0():
        if args.json:
            with open(args.json, "w") as f:
                f.write(line + "\n")
        print(line, flush=True)
    return r


def legacy_floors(c, bandwidth):
    """The first context's floors in ms and GB, as earlier JSONs hold them (None without a GPU)."""
    if not bandwidth:
        return None
    fl = c["floors_ms"]
    ms = dict(decode_step_ms=fl["decode_step"], verify_ms=next(v for p, v in fl.items() if p.startswith("verify/")),
              draft_step_ms=fl["draft_step"], draft_extend_ms=fl["draft_extend"])
    return dict(bandwidth_GBps=bandwidth, **ms, **{n.replace("_ms", "_GB"): v * bandwidth / 1e3 for n, v in ms.items()})


# ---------------------------------------------------------------------------------------------
# The report: the tables, then the answer in words

def answer(r, b):
    """The run's answer in a few plain sentences (what the background story needed to know)."""
    (variant, mode), k, ctx = b.best, b.k, b.args.context_len[0]
    c, ar = r["contexts"][ctx], (r["allreduce_modelled"] or {}).get("target_forward_ms", 0.0)
    dec, ver = c["phases_ms"][f"decode_step/{variant}"] + ar, c["phases_ms"][f"verify/{mode}/{variant}"] + ar
    d, v = (c["components"][p] for p in ("decode_step", f"verify/{mode}"))
    extra = sorted(((v["parts_ms"][n] - d["parts_ms"][n], n) for n in COMPONENTS), reverse=True)
    more, top = v["kernel_ms"] - d["kernel_ms"], []
    for x, n in extra[:3]:  # the largest parts of the extra kernel time, until they make 60% of it
        if x <= 0 or top and sum(y for y, _ in top) >= 0.6 * more:
            break
        top.append((x, n))
    unit = "kernels" if b.gpu else "ops (CPU time)"
    lines = [f"Verify of k+1 = {k + 1} tokens ({mode} attention, {variant}, {ctx} cached tokens) costs "
             f"{ver / dec:.2f} decode steps ({ver:.2f} vs {dec:.2f} ms" + (", all-reduces MODELLED" if ar else "") + ")."]
    if more > 0 and top:
        lines.append(f"Its {unit} take {more:.2f} ms more ({v['kernel_ms']:.2f} vs {d['kernel_ms']:.2f} ms summed), "
                     "mostly " + ", ".join(f"{COMPONENTS[n]} +{x:.2f} ms" for x, n in top) + "; launches and gaps "
                     f"{'inside the graph' if variant == 'graph' else 'between ops'} make the other "
                     f"{(ver - dec) - more:+.2f} ms.")
    else:
        lines.append(f"Its {unit} take no longer ({v['kernel_ms']:.2f} vs {d['kernel_ms']:.2f} ms summed): the "
                     "difference is launches and gaps.")
    cm = r["cost_model"]["steps"].get(k)
    if cm:
        at2 = 2 * r["cost_model"]["plain_step_ms"] / cm["cycle_ms"]
        lines += [f"EAGLE-3 with num_steps {k} pays above {cm['break_even_accept_len']:.2f} accepted tokens per cycle "
                  f"(bonus included: a {cm['cycle_ms']:.2f} ms cycle against a {r['cost_model']['plain_step_ms']:.2f} "
                  f"ms plain step).",
                  f"At the background's ~2 tokens per cycle it would give {at2:.2f}x"
                  + (" (slower than plain decoding)." if at2 < 1 else ".")]
    notes = [note for note, on in (
        ("routing SIMULATED uniform (random weights route unlike a trained router)", b.target.routing == "uniform"),
        (f"one SIMULATED rank of TP {b.target.tp.world_size}" + (f", all-reduces MODELLED at {b.args.allreduce_us:g} us"
         if ar else ", all-reduces not counted (--allreduce-us X models them)"), b.target.tp.simulated),
        ("acceptance SIMULATED", bool(b.args.simulate_accept_len)),
        ("CPU op times, not a GPU's", not b.gpu)) if on]
    return lines + (["Simulated or modelled here: " + "; ".join(notes) + "."] if notes else [])


def print_phases(r, ctx, c):
    bw = r["bandwidth_GBps"]
    print(f"\nphase times at {ctx} cached tokens, isolated (ms, median" + (
        f"; x floor: bytes that must move / {bw:.0f} GB/s measured" if bw else "; floors need a GPU") + ")")
    for name, ms in c["phases_ms"].items():
        phase = name.rsplit("/", 1)[0] if "/" in name else name
        floor, experts = c["floors_ms"].get(phase), c["distinct_experts"].get(phase)
        print(f"  {name:30s} {ms:9.3f}" + (f"   {ms / floor:5.1f}x floor {floor:.3f}" if floor else "")
              + (f"   {experts:5.1f} distinct experts per MoE layer" if experts is not None else ""))


def print_components(r, ctx, c, b):
    """Rows: components, then totals; columns: each target phase and its floor, verify - decode."""
    comps, bw = c["components"], r["bandwidth_GBps"]
    verifies = [p for p in comps if p.startswith("verify/")]
    variant = b.best[0]
    unit, floor = ("kernel", "floor ms") if b.gpu else ("CPU op", "MB")

    def floor_of(phase, n):
        nbytes = c["bytes"][phase][n] if n else sum(c["bytes"][phase].values())
        return nbytes / bw / 1e6 if bw else nbytes / 1e6
    cols = ["decode", floor] + [p.replace("verify/", "verify ") for p in verifies] + [floor] + \
           [f"d {p.split('/')[1]}" for p in verifies]
    print(f"\nwhere the time goes at {ctx} cached tokens: ms per forward of summed {unit} time in a profiled "
          f"eager run of the same shapes; floor: the component's bytes" + (" / bandwidth" if bw else "")
          + "; d: verify minus decode")
    print(f"  {'':48s}" + "".join(f"{h:>15s}" for h in cols))

    def row(label, values):
        print(f"  {label:54s}" + "".join(f"{x:15.3f}" if isinstance(x, float) else f"{str(x):>15s}" for x in values))
    dec = comps["decode_step"]
    for n, label in COMPONENTS.items():
        d = dec["parts_ms"][n]
        row(label, [d, floor_of("decode_step", n)] + [comps[p]["parts_ms"][n] for p in verifies]
            + [floor_of(verifies[0], n)] + [comps[p]["parts_ms"][n] - d for p in verifies])
    totals = {p: c["phases_ms"][f"{p}/{variant}"] for p in comps}
    row(f"summed {unit} time", [dec["kernel_ms"], floor_of("decode_step", None)] + [comps[p]["kernel_ms"] for p in verifies]
        + [floor_of(verifies[0], None)] + [comps[p]["kernel_ms"] - dec["kernel_ms"] for p in verifies])
    row(f"{'captured' if variant == 'graph' else 'eager'} total (median)", [totals["decode_step"], ""]
        + [totals[p] for p in verifies] + [""] + [totals[p] - totals["decode_step"] for p in verifies])
    gap = {p: totals[p] - comps[p]["kernel_ms"] for p in comps}
    row("difference (launches, gaps" + (" inside the graph)" if variant == "graph" else ", host)"),
        [gap["decode_step"], ""] + [gap[p] for p in verifies] + [""] + [gap[p] - gap["decode_step"] for p in verifies])
    row("kernels" if b.gpu else "leaf ops", [dec["kernels"], ""] + [comps[p]["kernels"] for p in verifies] + [""]
        + [comps[p]["kernels"] - dec["kernels"] for p in verifies])
    ex = c["distinct_experts"]
    row("distinct experts per MoE layer" + (" (SIMULATED uniform)" if b.target.routing == "uniform" else ""),
        [ex["decode_step"], ""] + [ex[p] for p in verifies] + [""] + [ex[p] - ex["decode_step"] for p in verifies])
    ar = r["allreduce_modelled"]
    if ar:
        print(f"  all-reduce MODELLED, not in the rows above: 2 x {b.target.args.num_hidden_layers} x "
              f"{ar['us_each']:g} us = {ar['target_forward_ms']:.2f} ms per forward")


def print_e2e(r, b):
    if not r["e2e"]:
        return
    sim = " (SIMULATED acceptance)" if b.args.simulate_accept_len else ""
    print(f"\nend to end{sim}: tok/s, per-cycle phases (ms, median), accepted tokens per cycle")
    for name, v in r["e2e"].items():
        phases = " ".join(f"{p}={t:.2f}" for p, t in v["phases_ms"].items())
        extra = ""
        if "accept_len_mean" in v:
            extra = (f" | accept len {v['accept_len_mean']:.2f} hist {v['accept_len_hist']}"
                     f" | speedup {v['speedup_measured']:.2f}x (predicted {v['speedup_predicted']:.2f}x)")
        print(f"  {name:24s} {v['tok_per_s']:9.1f} tok/s | {phases}{extra}")


def print_cost_model(r):
    cm = r["cost_model"]
    ar = " + all-reduces MODELLED" if r["allreduce_modelled"] else ""
    print(f"\ncost model (fastest variant{ar}): plain step {cm['plain_step_ms']:.2f} ms; cycle and break-even "
          "accepted length per num_steps")
    for steps, c in cm["steps"].items():
        sp = " ".join(f"{t}:{s:.2f}x" for t, s in c["speedup_at"].items())
        print(f"  num_steps {steps}: cycle {c['cycle_ms']:.2f} ms, break-even {c['break_even_accept_len']:.2f} | "
              f"speedup at accept len {sp}")


def print_extras(r, b):
    env = r["env"]
    if "gpu_mem_peak_GB" in env:
        print(f"\nGPU memory: weights {env['weights_GB']:.1f} GB, peak allocated {env['gpu_mem_peak_GB']:.1f} GB "
              f"(eager phases only: {env.get('gpu_mem_peak_eager_GB') or float('nan'):.1f} GB)")
        print(f"kernels per eager decode step: {r.get('kernels_per_decode_step')}"
              + (f", with torch.compile: {r['kernels_per_decode_step_compiled']}"
                 if "kernels_per_decode_step_compiled" in r else ""))
    comm = r.get("allreduce_ms_per_forward")
    if comm:
        n = 2 * b.target.args.num_hidden_layers
        print("\nall-reduce ms per forward (2 per layer; eager launches vs captured in a graph), by tokens: "
              + ", ".join(f"{key} {ms:.2f}" for key, ms in comm.items()))
        if "graph/1" in comm:
            print(f"measured in a graph: {comm['graph/1'] / n * 1e3:.1f} us per all-reduce of one token's hidden row "
                  f"(give it to a simulated rank as --allreduce-us)")
    line = agreement_line(r, b)
    if line:
        print("\n" + line)


def agreement_line(r, b):
    ag = r["greedy_agreement_with_plain"]
    if not ag:
        return None if not r["e2e"] or b.target.routing == "model" else (
            "greedy speculative vs plain output: not compared, since SIMULATED uniform routing gives a token its "
            "experts by its place in the forward, so a verify and a decode step compute different functions "
            "(--routing model compares them)")
    shares = ", ".join(f"{name.removeprefix('eagle3/')} {x:.0%}" for name, x in ag.items())
    if all(x == 1 for x in ag.values()):
        meaning = "identical, as lossless greedy speculative decoding must be"
    else:
        meaning = ("verify reads k+1 tokens where plain decoding reads one, so the reductions run in another order; in "
                   f"{b.args.dtype}" + (" on random weights, whose logits over the whole vocabulary nearly tie,"
                                        if not b.args.model_path else ",")
                   + " that flips an argmax now and then and the sequences part from there. It measures rounding, "
                   "not correctness: exact equality is tested in float64 (test_equivalence.py)")
    return f"greedy speculative output vs plain greedy output, share of tokens equal: {shares} ({meaning})"


def report(r, header, b):
    if not is_rank0():
        return
    print("\n" + header)
    for ctx, c in r["contexts"].items():
        print_phases(r, ctx, c)
        print_components(r, ctx, c, b)
    print_e2e(r, b)
    print_cost_model(r)
    print_extras(r, b)
    print("\n" + "\n".join(r["answer"]) + "\n")


@torch.no_grad()
def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        compare_main(args)
    rank, world, device = tpm.init_distributed()
    args = settle(args, device, world)
    if args.dump:
        return dump_main(args, device, world)
    return bench_main(args, device, world)


if __name__ == "__main__":
    try:
        main()
    finally:  # every rank leaves the group together (gloo aborts a rank whose peer exits first)
        if dist.is_initialized():
            dist.destroy_process_group()
