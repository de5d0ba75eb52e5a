"""Measure speculative decoding with an EAGLE-3 draft head on a Kimi-K2 (DeepSeek-V3 architecture)
mixture-of-experts model, phase by phase, and say at which acceptance it pays.

In speculative decoding a small draft head proposes num_steps tokens; the large target model checks
them all in one forward (verify) and keeps the longest prefix it agrees with, plus one token of its
own. A cycle costs more than one plain decode step, so it pays only when enough drafts are
accepted. run.py builds the target and the head (checkpoints with --model-path / --draft-path;
on a CPU by default the tiny trained pair of train.py; else random weights), times each phase
alone (a plain decode step, verify of num_steps + 1 tokens, the draft's extend and step), runs
plain and speculative decoding end to end, and prints a cost model: the accepted length per
cycle at which speculation breaks even.
The model's attention (MLA) caches one compressed latent per token; verify can read it two ways
(prefill: expanded to per-head keys and values, as a prefill does; decode: attending in the latent
space, as a decode step does) and runs eager or captured in CUDA graphs: two independent switches,
timed in all four combinations. Device work is timed with CUDA events after warm-up, host clocks
read only after a synchronize; each time is a median, printed with its spread.

    python run.py                           # CPU: the tiny model; a GPU: a SIMULATED rank of TP 8
    torchrun --nproc-per-node 8 run.py      # real tensor parallelism over 8 GPUs
    python run.py --simulate-accept-len 2.5 # what the measured costs give at 2.5 tokens a cycle
    python run.py --model-path K2 --prompt-ids p.jsonl --dump ref.npz   # the correctness baseline
    python run.py --compare ref.npz engine.npz                          # no model, no GPU

A table per context length says where the time of a decode step and of a verify goes, by
component (a profiled eager run of the captured shapes), against each component's byte floor; the
output ends with the answer in words. Random weights accept almost nothing: forced acceptance
(--simulate-accept-len), balanced routing on random weights (--routing uniform, the default
there) and modelled all-reduces (--allreduce-us) are labelled SIMULATED or MODELLED everywhere
they appear. --routing distinct (SIMULATED: D distinct experts a MoE layer) and --routing trace
(TRACE: recorded routing replayed; --dump-routing records one) choose the experts for the timing
(routing.py); --distinct-sweep times the verify across D and says at which D an accepted length
pays.

    python run.py --preset kimi-k2.5 --speculative-num-steps 2 --cuda-graph on --allreduce-us 35
        # the story's deployment (INT4 Kimi-K2.5, TP 8 over PCIe, 2 draft steps), one rank of it

--dump writes what the model says (greedy tokens, the target's top-K log-probabilities along them,
the drafts and accepted counts of a speculative run) as an .npz that another engine's output can
be converted to; --compare judges where two such files disagree (baseline.py; README: "Checking an
engine against this reference").

The stages: timing.py builds the models and times the phases, components.py attributes their
time to components and sets their floors and the cost model, report.py prints the result and
writes it as JSON; baseline.py dumps and compares. This file is the command line: the flags and
their refusals, answered before torch is imported, and the exits under torchrun.

Exit status: 0 done; 1 --compare found a difference past its thresholds; 2 the input cannot be used
(a flag, a file, a checkpoint), said in one line on stderr; 130 interrupted (Ctrl-C), in one line;
141 stdout closed by its reader (`run.py | head`), quietly.
"""
import argparse
import math
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

from tqdm import tqdm

import baseline  # numpy only: --compare and the flags' defaults

# the profiler (kineto) prints "USDT: ... profiler_start" and "profiler_stop" on stderr around
# every profile the component tables take; its log level 6 keeps them (and its other log lines)
# out. Set before torch is imported.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# bf16 Kimi-K2 on one GPU, as one simulated TP-8 rank: 384 routed experts weigh 259 GB there, 1.8x
# an H200's 141 GB; 128 of them, 89 GB with the rest of the rank, leave room for the cache and
# graphs
BF16_EXPERTS_ON_ONE_GPU = 128

# --speculative-attention-mode speaks SGLang, whose "prefill" is the model's "extend" attention;
# the run's names and JSON keys keep the flag's word (verify/prefill/graph)
ATTENTION_MODES = {"prefill": ["extend"], "decode": ["decode"], "both": ["extend", "decode"]}

# The names the flags offer, written here so that --help and a refusal need no torch:
# checkpoint.PRESETS, tp.ALLREDUCES, kernels.KERNELS and kernels.DRAFT_KERNELS (a test holds them
# equal)
PRESETS = ("kimi-k2", "kimi-k2.5", "tiny")
ALLREDUCES = ("nccl", "one-shot")
KERNELS = ("attention", "rope_cache", "router", "add_rmsnorm", "silu_mul", "shared_expert",
           "fused_proj", "norm_gemv")
DRAFT_KERNELS = ("attention", "router", "add_rmsnorm", "silu_mul", "fused_proj")
# the verify sweep's largest forward a user may ask for (--sweep-tokens: batch x tokens a row);
# past it the model runs prefill's paths (the fused MoE's grouped GEMM for plain experts)
SWEEP_MOST_TOKENS = 256


class BadInput(ValueError):
    """A flag or an input file the run cannot use. The entry point prints the message as one line
    on stderr and exits with status 2, argparse's own status for a bad command line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own refusals (a bad int, an unknown flag) the same way
        raise BadInput(message)


def parse_args(argv=None):
    args = make_parser().parse_args(argv)
    check_flags(args)
    return args


def make_parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    add_speculative_flags(p)
    add_run_flags(p)
    add_timing_flags(p)
    add_routing_flags(p)
    add_baseline_flags(p)
    return p


def add_speculative_flags(p):
    """The draft's shape and verify's attention path, in SGLang's words."""
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft tokens proposed "
                   "per cycle, k (verify reads k + 1 tokens; default %(default)s)")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="draft branches per "
                   "step, K: 1 drafts a chain; above 1 a tree (EAGLE-2/3's and SGLang's; "
                   "num_steps levels, K x K candidates a level, the best K expanded; EAGLE's tree "
                   "mask, which SGLang's draft decode approximates from depth 3: "
                   "docs/engine-check.md; default %(default)s)")
    p.add_argument("--speculative-num-draft-tokens", type=int, help="tokens verified per cycle, "
                   "N: with topk 1 always num_steps + 1 (another value is adjusted, with a note, "
                   "as SGLang does); with topk K > 1 required, the tree's nodes with the root, 2 "
                   "to 1 + K + (num_steps - 1) K^2")
    p.add_argument("--speculative-attention-mode", choices=["prefill", "decode", "both"],
                   help="attention path of verify: prefill (keys and values expanded) or decode "
                   "(absorbed MLA); default: both (timing), prefill (--dump)")


def add_run_flags(p):
    """How the run goes: graphs, sizes, sampling, dtype, the MoE path and the kernels."""
    p.add_argument("--cuda-graph", choices=["on", "off", "both"], help="replay captured CUDA "
                   "graphs; default: both on a GPU, off on CPU (graphs need CUDA)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (default "
                   "%(default)s)")
    p.add_argument("--prompt-len", type=int, help="tokens in each prompt of the timing run: "
                   "held-out stdlib source for the trained tiny pair (the CPU default), random "
                   "ids otherwise (default 256 on a GPU, 16 on CPU)")
    p.add_argument("--max-new-tokens", type=int, help="tokens generated per sequence (default 64 "
                   "on a GPU, 24 on CPU)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampling "
                   "with speculative rejection sampling (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights, the random "
                   "prompt ids (the trained pair reads fixed held-out text), sampling and the "
                   "SIMULATED draws (--simulate-accept-len, --routing distinct) (default "
                   "%(default)s)")
    p.add_argument("--simulate-accept-len", type=float, help="force the mean accepted length per "
                   "cycle, bonus token included, between 1 and num_steps + 1 (as "
                   "SGLANG_SIMULATE_ACC_LEN: each cycle draws its length around this mean); "
                   "output marked SIMULATED")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float64"], help="default bf16 on "
                   "GPU, fp32 on CPU")
    p.add_argument("--moe-impl", choices=["auto", "gather", "grouped", "fused"], default="auto",
                   help="routed experts: gathered weights (plain), torch._grouped_mm, or the "
                   "fused Triton kernel (kernels/' swaps, put in by kernels.accelerate; fused: "
                   "grouped above 256 tokens for unquantized experts); auto: on a GPU fused with "
                   "Triton, else grouped where torch._grouped_mm runs, else gather; on a CPU "
                   "gather")
    p.add_argument("--kernels", help="fast twins swapped in for model.py's plain modules "
                   "(kernels.accelerate: Triton kernels, and fused_proj: stacked-weight GEMMs): "
                   "'all', 'none' or a comma list of "
                   + ", ".join(KERNELS)
                   + " (default: all on a CUDA GPU with Triton and a bf16/fp16/fp32 model, else "
                   "none); the draft head takes those of "
                   + ", ".join(DRAFT_KERNELS) + " (kernels.accelerate_draft)")


def add_timing_flags(p):
    """What the timing run measures and models, and where its numbers go."""
    p.add_argument("--compile", action="store_true", help="also time the captured phases with "
                   "each decoder layer and the draft layer fused by torch.compile (inside our own "
                   "CUDA graphs), beside the plain ones")
    p.add_argument("--reps", type=int, help="timed repetitions per phase, after warm-up (default "
                   "20); on a CPU also the profiled calls behind a component table, at most 3")
    p.add_argument("--context-len", type=int, nargs="+", metavar="N", help="cached tokens before "
                   "the isolated phases and their component tables, one or more lengths (default: "
                   "--prompt-len)")
    p.add_argument("--sweep-tokens", type=token_counts, metavar="T,T,...", help="the verify "
                   "sweep's tokens a row, comma-separated (default: on a GPU 1 to 8, 10, 12 and "
                   "every 4 to 32 while batch x T is at most 32; on a CPU 1 to 6); with them or "
                   "the default, 1 to num_steps + 1 are timed always (the cost model's chains, "
                   "the run's own among them)")
    p.add_argument("--skip-e2e", action="store_true", help="time the phases in isolation only: no "
                   "end-to-end loops (the cost model then takes the isolated decode step as the "
                   "plain step)")
    p.add_argument("--allreduce-us", type=float, metavar="X", help="for a SIMULATED rank, which "
                   "skips its collectives: add those a real rank runs, X microseconds each, to "
                   "each forward in the predictions, labelled MODELLED (2 x layers + 2: the "
                   "embedding's all-reduce, 2 a layer, the logits' all-gather; a torchrun run "
                   "prints the X it measured between compute in a CUDA graph: ~14 with NCCL, ~7 "
                   "one-shot (measured with torch's in-kernel copy, BENCHMARKS.md) at TP 2 on "
                   "H200 NVLink; ~35 over PCIe at TP 8)")
    p.add_argument("--allreduce", choices=ALLREDUCES, default="nccl", help="real TP (torchrun) on "
                   "CUDA GPUs: NCCL's all-reduce, or one-shot: each rank reads its peers' rows "
                   "from torch's symmetric memory and sums them, for messages up to 1 MB (decode, "
                   "verify; NCCL above) (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write every number of the run and its "
                   "environment as one JSON line to PATH ('-': to stdout, after the report)")


def token_counts(text):
    """--sweep-tokens' value: comma-separated token counts of 1 or more, sorted, each once."""
    try:
        counts = sorted({int(t) for t in text.split(",")})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated token counts of 1 or more, "
                                         "e.g. 1,4,16")
    return counts


def add_routing_flags(p):
    """Which experts the timed forwards reach (routing.py): the router's, or SIMULATED / TRACE."""
    p.add_argument("--routing", choices=["model", "uniform", "distinct", "trace"], help="model: "
                   "the router's own choice; uniform: SIMULATED balanced routing (the router "
                   "still runs, then each token gets K distinct experts and the tokens of a "
                   "forward spread evenly over the experts), as engines benchmark random weights; "
                   "distinct: SIMULATED, each MoE layer of a forward draws its tokens x top-k "
                   "choices from exactly --distinct-experts D experts (a decode step keeps top-k); "
                   "trace: TRACE, the ids of --routing-trace FILE replayed in order (a decode step "
                   "takes one token's, a verify of T tokens the next T tokens', cycling). distinct "
                   "and trace start after the caches are filled (default: uniform for random "
                   "weights, model for --model-path and --dump)")
    p.add_argument("--distinct-experts", type=int, metavar="D", help="with --routing distinct: "
                   "experts a MoE layer of a forward reaches, top-k ... min(tokens of the verify x "
                   "top-k, routed experts on the rank); a forward of fewer tokens reaches "
                   "min(D, its tokens x top-k)")
    p.add_argument("--routing-trace", metavar="FILE", help="with --routing trace: a routing trace "
                   "(.npz: routing.py's format; --dump-routing writes one, routing.py "
                   "convert-sglang makes one from SGLang's recorder). Its experts and top-k must "
                   "be the model's; a rank keeping fewer experts (--routed-experts) gets each "
                   "window's experts renamed onto its own, which tokens share an expert kept (a "
                   "window reaching more experts than the rank keeps reaches all of them)")
    p.add_argument("--moe-adaptive", type=int, metavar="N", help="FP8 routed experts, from N "
                   "tokens a forward: the fused MoE's adaptive variant, which picks the tiles or "
                   "the GEMV on the GPU for each call, the tiles where its distinct experts are at "
                   "most 3/4 of its token-expert pairs (faster where tokens share experts, as "
                   "under --routing model; slower where every pair is distinct, as under uniform: "
                   "BENCHMARKS.md, Routing; default: the GEMV)")
    p.add_argument("--distinct-sweep", action="store_true", help="also time the verify (the cost "
                   "model's attention mode, graphs where on) at D = top-k, 1.5, 2, 3, 4, 6, ... x "
                   "top-k up to min(its tokens x top-k, experts) distinct experts a MoE layer "
                   "(SIMULATED), with each D's verify in plain steps (the cost model's), cycle and "
                   "break-even accepted length (JSON: routing_sweep)")


def add_model_flags(p):
    """Which target and head: checkpoints, or random weights of a preset."""
    p.add_argument("--model-path", help="HF DeepseekV3 / Kimi-K2 checkpoint folder (else --preset)")
    p.add_argument("--draft-path", help="SpecForge / SGLang EAGLE-3 checkpoint folder (else the "
                   "trained tiny pair's head on a CPU, or a random head)")
    p.add_argument("--random-weights", action="store_true", help="with the tiny preset: a random "
                   "target and head instead of the trained pair in checkpoints/tiny-stdlib "
                   "(train.py), the tiny default")
    p.add_argument("--preset", choices=PRESETS, help="random target to build: kimi-k2 (GPU only), "
                   "kimi-k2.5 (INT4 experts, GPU only), tiny (a toy with every feature; default "
                   "on CPU; the trained pair unless --random-weights)")
    p.add_argument("--simulate-tp", type=int, help="build one SIMULATED rank of TP N (default on "
                   "one GPU with kimi-k2: 8)")
    p.add_argument("--routed-experts", type=int, help="keep N routed experts per layer of a "
                   "random target (memory override; default on one GPU with bf16 kimi-k2: 128; "
                   "all 384 with --quant int4 or fp8)")
    p.add_argument("--quant", choices=["none", "int4", "fp8"], help="random weights in this "
                   "layout: int4 = routed experts packed as Kimi-K2-Thinking / K2.5 ship them; "
                   "fp8 = routed experts in FP8 e4m3 with 128x128 block scales as "
                   "Kimi-K2-Instruct ships them (the rest dequantized, as at load) (default: the "
                   "preset's)")


def add_baseline_flags(p):
    """The correctness baseline's flags (baseline.py)."""
    b = p.add_argument_group("correctness baseline (README: Checking an engine against this "
                             "reference)")
    b.add_argument("--dump", metavar="PATH", help="write greedy output and top-K "
                   "log-probabilities of the --prompt-ids to this .npz; no timing. Speculative, "
                   "with the drafts and accepted counts, where there is a head: --draft-path, or "
                   "the trained tiny pair's (the CPU default); plain greedy otherwise "
                   "(--model-path alone, --random-weights)")
    b.add_argument("--dump-routing", action="store_true", help="with --dump: also record the "
                   "router's top-k ids of every MoE layer for every token of the dumped sequences "
                   "(prompt and output, as the log-probabilities' forward reads them) as "
                   "routing_ids [MoE layers, tokens, top_k] with n_experts, top_k and "
                   "sequence_lengths (routing.py's trace format; --routing-trace reads the file)")
    b.add_argument("--prompt-ids", metavar="FILE", help="for --dump: one JSON list of token ids "
                   "per line")
    b.add_argument("--topk", type=int, help="for --dump: log-probabilities kept per position "
                   "(default 20)")
    b.add_argument("--compare", nargs=2, metavar=("A.npz", "B.npz"), help="judge dump B against "
                   "reference A (no model, no GPU); exit status 1 past the thresholds below, 2 if "
                   "the files cannot be compared")
    b.add_argument("--max-logprob-diff", type=float, default=baseline.MAX_LOGPROB_DIFF,
                   help="largest |log p_A - log p_B| over ids in both top-K lists, on positions "
                   "both runs read the same tokens; also how far below A's top-1 B's token may be "
                   "where the outputs part (default %(default)s)")
    b.add_argument("--min-top1-agreement", type=float, default=baseline.MIN_TOP1_AGREEMENT,
                   help="share of those positions, all rows together, whose top-1 ids agree "
                   "(default %(default)s)")
    b.add_argument("--max-accept-diff", type=float, default=baseline.MAX_ACCEPT_DIFF,
                   help="largest difference in drafts accepted per cycle (mean over all rows' "
                   "cycles), when both files have 'accepted' (default %(default)s)")


def check_flags(args):
    """Refuse values no run can use, naming the flag, the value and what is allowed, before
    anything is built. (Flags that depend on the device are checked in settle.)"""
    at_least = {"--speculative-num-steps": (args.speculative_num_steps, 1),
                "--batch-size": (args.batch_size, 1), "--prompt-len": (args.prompt_len, 1),
                "--max-new-tokens": (args.max_new_tokens, 1), "--reps": (args.reps, 1),
                "--simulate-tp": (args.simulate_tp, 1), "--topk": (args.topk, 1),
                "--routed-experts": (args.routed_experts, 1),
                "--temperature": (args.temperature, 0),
                "--max-logprob-diff": (args.max_logprob_diff, 0),
                "--max-accept-diff": (args.max_accept_diff, 0)}
    for flag, (value, low) in at_least.items():  # None: the flag's default
        if value is not None and not value >= low:  # (NaN fails too)
            raise BadInput(f"{flag} {value}: must be at least {low}")
    if not math.isfinite(args.temperature):
        raise BadInput(f"--temperature {args.temperature}: must be finite (0: greedy)")
    if not 0 <= args.min_top1_agreement <= 1:
        raise BadInput(f"--min-top1-agreement {args.min_top1_agreement}: must lie in [0, 1]")
    k, sim = check_tree_flags(args), args.simulate_accept_len
    if sim is not None and not 1 <= sim <= k + 1:
        raise BadInput(f"--simulate-accept-len {sim}: must lie in [1, {k + 1}] (accepted tokens "
                       "per cycle, the bonus token included: at most the deepest draft path + 1)")
    check_flags_apply(args)
    if args.model_path and (args.quant or args.routed_experts or args.preset):
        raise BadInput("--quant, --routed-experts and --preset shape random weights; a "
                       "checkpoint's config.json says its own")
    if args.draft_path and not args.model_path:
        raise BadInput("--draft-path needs --model-path: a head is trained for one target, and "
                       "without --model-path that target would be a random one")
    if args.random_weights and (args.model_path or args.draft_path):
        raise BadInput("--random-weights replaces the trained tiny pair; with --model-path / "
                       "--draft-path the checkpoints are used: drop one")
    if not args.dump and args.max_new_tokens == 1:
        raise BadInput("--max-new-tokens 1: the timing run needs at least 2 (the prefill makes the "
                       "first token; a speculative cycle and a plain step need one more)")
    most = max(args.sweep_tokens or [1])
    if args.batch_size * most > SWEEP_MOST_TOKENS:
        asked = f"--sweep-tokens {most}, " if args.sweep_tokens else ""
        raise BadInput(f"{asked}--batch-size {args.batch_size}: {args.batch_size} x {most} "
                       "tokens a forward; the sweep times verify-sized forwards, at most "
                       f"{SWEEP_MOST_TOKENS} tokens")
    check_outputs_apart(args)
    with refusal():
        if args.json not in (None, "-"):
            baseline.check_writable("--json", args.json)
        if args.dump:
            baseline.check_writable("--dump", args.dump)
    check_routing_flags(args)


# the flags --compare reads; every other flag shapes a model or a run that --compare does not make
COMPARE_FLAGS = ("compare", "max_logprob_diff", "min_top1_agreement", "max_accept_diff")
# the timing run's flags, which a --dump (it times nothing) does not read
TIMING_FLAGS = ("json", "reps", "context_len", "skip_e2e", "compile", "sweep_tokens",
                "allreduce_us", "distinct_sweep")


def flags_set(args):
    """The dests of the flags given on the command line: those whose value is not the parser's
    default (a flag given its default value counts as not given)."""
    p = make_parser()
    return [dest for dest, value in vars(args).items() if value != p.get_default(dest)]


def flag_name(dest):
    """A dest as the command line spells it: max_new_tokens -> --max-new-tokens."""
    return "--" + dest.replace("_", "-")


def check_flags_apply(args):
    """Refuse a flag that the run asked for does not read: beside --compare any but its
    thresholds; beside --dump the timing run's flags and --compare's thresholds; --prompt-ids and
    --topk without --dump. (--max-new-tokens stays with --skip-e2e: it sizes the cache.)"""
    given = flags_set(args)
    if args.compare:
        drop = [flag_name(d) for d in given if d not in COMPARE_FLAGS]
        if drop:
            raise BadInput("--compare reads two dump files and builds no model: drop "
                           + ", ".join(drop))
        return
    if args.dump:
        for d in given:
            if d in TIMING_FLAGS:
                raise BadInput(f"{flag_name(d)} shapes the timing run; --dump times nothing")
            if d in COMPARE_FLAGS:
                raise BadInput(f"{flag_name(d)} is a threshold of --compare; --dump writes a "
                               "file to compare")
        return
    if args.prompt_ids is not None:
        raise BadInput("--prompt-ids is for --dump (the correctness baseline); the timing run "
                       "makes its own prompts (--prompt-len)")
    if args.topk is not None:
        raise BadInput("--topk is for --dump: the log-probabilities it keeps per position")
    for d in COMPARE_FLAGS[1:]:   # the thresholds
        if d in given:
            raise BadInput(f"{flag_name(d)} is a threshold of --compare A B; this run compares "
                           "nothing")


def check_outputs_apart(args):
    """Refuse an output file (--json, --dump) that is one of the run's input files (--prompt-ids,
    --routing-trace; --compare writes none), by the path it resolves to: the run would write over
    what it read."""
    outputs = {"--json": None if args.json == "-" else args.json, "--dump": args.dump}
    inputs = {"--prompt-ids": args.prompt_ids, "--routing-trace": args.routing_trace}
    for out, out_path in outputs.items():
        for src, src_path in inputs.items():
            if out_path and src_path and os.path.realpath(out_path) == os.path.realpath(src_path):
                raise BadInput(f"{out} {out_path}: is the {src} file the run reads; write it "
                               "elsewhere")


def check_routing_flags(args):
    """--routing's companions: each with its routing, files that exist; the range of D is checked
    with the model's sizes (routing.check_run)."""
    if args.routing == "distinct" and args.distinct_experts is None:
        raise BadInput("--routing distinct needs --distinct-experts D (experts a MoE layer of a "
                       "forward reaches)")
    if args.distinct_experts is not None and args.routing != "distinct":
        raise BadInput(f"--distinct-experts {args.distinct_experts} is for --routing distinct")
    if args.routing == "trace" and not args.routing_trace:
        raise BadInput("--routing trace needs --routing-trace FILE (a routing trace .npz)")
    if args.routing_trace and args.routing != "trace":
        raise BadInput("--routing-trace is for --routing trace")
    if args.routing_trace and not os.path.isfile(args.routing_trace):
        raise BadInput(f"--routing-trace {args.routing_trace}: no such file")
    if args.dump_routing and not args.dump:
        raise BadInput("--dump-routing records the routing of a --dump run; add --dump PATH")
    if args.dump and args.routing in ("distinct", "trace"):
        raise BadInput(f"--dump records the model's own routing: drop --routing {args.routing}")


def check_tree_flags(args):
    """The tree flags as SGLang takes them (K = 1: a chain, N adjusted in settle); returns the
    most drafts a cycle can accept: num_steps, or min(num_steps, N - 1) for a tree."""
    K, S = args.speculative_eagle_topk, args.speculative_num_steps
    N = args.speculative_num_draft_tokens
    if K < 1:
        raise BadInput(f"--speculative-eagle-topk {K}: must be at least 1")
    if K == 1:
        return S
    most = 1 + K + (S - 1) * K * K  # draft.tree_capacity: all that a tree's passes score
    if N is None:
        raise BadInput(f"--speculative-eagle-topk {K}: a tree needs --speculative-num-draft-tokens "
                       f"N, its nodes with the root (2 to {most} here)")
    if not 2 <= N <= most:
        raise BadInput(f"--speculative-num-draft-tokens {N}: a tree of topk {K} and {S} steps "
                       f"holds 2 to 1 + K + (num_steps - 1) K^2 = {most} tokens")
    return min(S, N - 1)


def uses_trained_pair(args):
    """The tiny preset with nothing else asked of it runs the trained pair (train.py); --quant none
    is the tiny preset's own layout."""
    other = (args.model_path or args.draft_path or args.random_weights
             or reshaping_flag(args) is not None)
    return args.preset == "tiny" and not other


def reshaping_flag(args):
    """The first flag given that shapes random weights away from the trained tiny pair (--quant
    int4 or fp8, --routed-experts, --simulate-tp N > 1), as the user wrote it; else None."""
    for flag, given in ((f"--quant {args.quant}", args.quant not in (None, "none")),
                        (f"--routed-experts {args.routed_experts}",
                         args.routed_experts is not None),
                        (f"--simulate-tp {args.simulate_tp}", (args.simulate_tp or 1) > 1)):
        if given:
            return flag
    return None


def settle(args, device, world):
    """The run's settled configuration: a new Namespace with every flag of `args` (left as parsed)
    and its device-dependent default filled in (None means the default; 0 is a value), plus
    trained_pair, attention_modes (verify's, in the model's words) and, for --dump, prompts.
    Refuses the flags that depend on the device, the speculative ones as SGLang does."""
    cfg, gpu = argparse.Namespace(**vars(args)), device.type == "cuda"
    if args.dump:
        try:
            vars(cfg).update(baseline.settle_dump(args))
        except ValueError as e:
            raise BadInput(str(e)) from None
    settle_speculative(cfg)
    cfg.preset = cfg.preset or ("kimi-k2" if gpu else "tiny")
    cfg.trained_pair = uses_trained_pair(cfg)
    flag = reshaping_flag(cfg)
    if cfg.preset == "tiny" and flag and not (cfg.random_weights or cfg.model_path):
        print_rank0(f"note: {flag} shapes random weights: a random tiny target and head, not the "
                    "trained pair (checkpoints/tiny-stdlib)")
    settle_device(cfg, gpu, world)
    from timing import settle_defaults  # the run's defaults (imports torch and the stages)
    settle_defaults(cfg, gpu)
    check_device_flags(cfg, device)
    if cfg.trained_pair:
        import train
        cfg.model_path, cfg.draft_path = train.TARGET_DIR, train.DRAFT_DIR
    elif cfg.draft_path:  # the head's config.json read now, not after the target has loaded
        import checkpoint
        checkpoint.read_draft_args(cfg.draft_path)  # checkpoint.CheckpointError names the problem
    return cfg


def settle_speculative(cfg):
    """Verify's attention modes, and with topk 1 the draft tokens num_steps + 1 (as SGLang)."""
    cfg.speculative_attention_mode = cfg.speculative_attention_mode or "both"
    cfg.attention_modes = ATTENTION_MODES[cfg.speculative_attention_mode]
    want = cfg.speculative_num_steps + 1
    if cfg.speculative_eagle_topk == 1:
        if cfg.speculative_num_draft_tokens not in (None, want):
            print_rank0(f"note: --speculative-num-draft-tokens {cfg.speculative_num_draft_tokens} "
                        f"adjusted to {want} (= num_steps + 1 with topk 1)")
        cfg.speculative_num_draft_tokens = want


def settle_device(cfg, gpu, world):
    """What needs a GPU or a single process: refused elsewhere; graphs and the simulated TP."""
    big = cfg.preset.startswith("kimi-k2") and not cfg.model_path
    if big and not gpu:
        raise BadInput(f"--preset {cfg.preset}: a random Kimi-K2 needs a GPU (hundreds of GB in "
                       "memory); on CPU use --preset tiny (the default) or --model-path")
    cfg.cuda_graph = cfg.cuda_graph or ("both" if gpu else "off")
    if cfg.compile and (not gpu or cfg.cuda_graph == "off"):
        raise BadInput("--compile times the captured phases: it needs a CUDA GPU and --cuda-graph "
                       "on or both")
    if cfg.cuda_graph != "off" and not gpu:
        raise BadInput(f"--cuda-graph {cfg.cuda_graph}: CUDA graphs need a CUDA GPU; use "
                       "--cuda-graph off on CPU")
    if cfg.simulate_tp is None:
        cfg.simulate_tp = 8 if big and gpu and world == 1 else 1
    if cfg.simulate_tp > 1 and world > 1:
        raise BadInput(f"--simulate-tp {cfg.simulate_tp} is for a single process; under torchrun "
                       "the TP is real")
    if cfg.allreduce != "nccl" and world == 1:
        raise BadInput(f"--allreduce {cfg.allreduce}: picks real TP's all-reduce (torchrun, 2 or "
                       "more processes); a single process runs none")
    quantized = cfg.quant in ("int4", "fp8") or cfg.quant is None and cfg.preset == "kimi-k2.5"
    if cfg.routed_experts is None and big and gpu and not quantized and not cfg.dump:
        cfg.routed_experts = BF16_EXPERTS_ON_ONE_GPU  # INT4 and FP8 experts all fit


def tree_note(cfg):
    """What a tree (topk > 1) changes: in the timing run, the rows it adds; in a dump, its file."""
    K, S, N = (cfg.speculative_eagle_topk, cfg.speculative_num_steps,
               cfg.speculative_num_draft_tokens)
    if cfg.dump:
        return (f"note: the dump drafts a tree (topk {K}, num_steps {S}, {N} draft tokens): its "
                "file holds\n      draft_parents and accepted_nodes beside the drafts")
    return (f"note: the end-to-end rows draft a tree (topk {K}, num_steps {S}, {N} draft tokens); "
            "the isolated\n      phases and the cost model add its verify, expansion and cycle")


def print_rank0(text):
    """print on rank 0 only (tp.print0, without importing torch before the flags are settled)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(text, flush=True)


def check_device_flags(args, device):
    """What depends on the preset, the device or the defaults just settled."""
    import torch

    import checkpoint
    if args.allreduce_us is not None and (args.allreduce_us < 0 or args.simulate_tp <= 1):
        raise BadInput(f"--allreduce-us {args.allreduce_us}: models the collectives a SIMULATED "
                       "rank skips (--simulate-tp N, N > 1), with X >= 0; under torchrun they run "
                       "and are measured")
    want = args.speculative_num_steps + 1
    if not args.dump and args.context_len == [args.prompt_len] and want > args.prompt_len:
        raise BadInput(f"--speculative-num-steps {args.speculative_num_steps}: the isolated "
                       "timings re-read the last num_steps + 1 cached tokens, as many as the "
                       f"prompt by default, so it must be below --prompt-len ({args.prompt_len}) "
                       "(or give a --context-len above it)")
    if not args.dump and min(args.context_len) < want:
        raise BadInput(f"--context-len {min(args.context_len)}: the isolated verify re-reads "
                       f"{want} cached tokens (num_steps + 1); use at least {want}")
    over = [T for T in args.sweep_tokens or [] if T > args.context_len[0]]
    if over:
        raise BadInput(f"--sweep-tokens {','.join(map(str, over))}: a verify of T tokens re-reads "
                       f"the last T of the first context's {args.context_len[0]} cached tokens "
                       "(--context-len, default --prompt-len); use at most "
                       f"{args.context_len[0]}")
    unknown = [] if isinstance(args.kernels, str) else sorted(set(args.kernels) - set(KERNELS))
    if unknown:
        raise BadInput(f"--kernels: unknown {', '.join(unknown)}; choose from "
                       f"{', '.join(KERNELS)}, all or none")
    if args.kernels not in ("none", ["fused_proj"]):   # fused_proj is plain torch
        import kernels
        try:
            kernels.check_available(device)
        except RuntimeError as e:
            asked = ",".join(args.kernels) if isinstance(args.kernels, list) else args.kernels
            raise BadInput(f"--kernels {asked}: {e}") from None
    if args.routed_experts is not None and not args.model_path:
        m = checkpoint.preset(args.preset)
        n = args.routed_experts
        if not m.num_experts_per_tok <= n <= m.n_routed_experts or n % m.n_group:
            raise BadInput(f"--routed-experts {args.routed_experts}: {args.preset} needs between "
                           f"{m.num_experts_per_tok} (experts per token) and {m.n_routed_experts}, "
                           f"a multiple of n_group {m.n_group}")
    check_moe_flag(args, device, getattr(torch, args.dtype))


def check_moe_flag(args, device, dtype):
    """--moe-impl fused or grouped where it runs; --moe-adaptive a count (check_sizes refuses it
    for experts that are not FP8, once the target's format is known)."""
    n = args.moe_adaptive
    if n is not None and n < 1:
        raise BadInput(f"--moe-adaptive {n}: a token count of 1 or more")
    if args.moe_impl not in ("fused", "grouped"):
        return
    import kernels
    if args.moe_impl == "fused" and not kernels.fused_moe_available(device, dtype):
        lacks = [why for why, lacking in (
            ("a CUDA GPU (this run is on the CPU)",
             device.type != "cuda" and not kernels.interpreting()),
            ("Triton (not installed)", not kernels.HAVE_TRITON),
            (f"bf16, fp16 or fp32 (not --dtype {args.dtype})",
             args.dtype not in ("bfloat16", "float16", "float32"))) if lacking]
        raise BadInput("--moe-impl fused: the Triton kernel needs " + ", ".join(lacks)
                       + "; use --moe-impl gather or auto")
    if args.moe_impl == "grouped" and not kernels.grouped_mm_available(device, dtype):
        raise BadInput(f"--moe-impl grouped: torch._grouped_mm does not run {args.dtype} on "
                       f"{device.type} here; use --moe-impl gather or auto")


def check_sizes(cfg, device, world):
    """Refuse, before anything is built, a run whose caches and weights cannot fit (one line, the
    estimate's parts), sizes the TP does not divide, a --topk above the vocabulary, prompt ids
    outside it, a tree wider than the head's vocabulary; warn when positions pass the model's
    max_position_embeddings."""
    import routing
    from timing import cache_slots, memory_free, memory_needed
    parts, margs, dargs = memory_needed(cfg, device, world)
    if parts is None and not cfg.model_path:  # (a checkpoint's loader names its own problem)
        raise BadInput(f"--preset {cfg.preset} at TP {max(cfg.simulate_tp, world)}: {dargs}")
    if cfg.dump and cfg.topk > margs.vocab_size:
        raise BadInput(f"--topk {cfg.topk}: must lie in [1, the vocabulary's {margs.vocab_size} "
                       "ids]")
    if cfg.dump:
        check_prompt_ids(cfg, margs.vocab_size)
    if cfg.moe_adaptive is not None and margs.fp8_block is None:
        import report
        held = report.weight_format(dict(dtype=cfg.dtype, int4_group_size=margs.int4_group_size))
        raise BadInput(f"--moe-adaptive {cfg.moe_adaptive}: for FP8 routed experts; this "
                       f"target's are {held} (--quant fp8, or an FP8 checkpoint)")
    with refusal():  # routing.py's ValueError as BadInput
        routing.check_run(cfg, margs)
    K = cfg.speculative_eagle_topk
    if parts is not None and K > dargs.draft_vocab_size:
        raise BadInput(f"--speculative-eagle-topk {K}: above the draft head's vocabulary of "
                       f"{dargs.draft_vocab_size} ids, of which each step keeps the top K")
    free, where = memory_free(device)
    if parts and free is not None and sum(parts.values()) > free:
        raise BadInput(too_big(cfg, parts, free, where))
    slots = cache_slots(cfg)
    if slots > margs.max_position_embeddings:
        print_rank0(f"warning: positions reach {slots}, past the model's max_position_embeddings "
                    f"{margs.max_position_embeddings}: its RoPE was not made for them, so "
                    + ("the dumped tokens and log-probabilities mean little" if cfg.dump
                       else "the timings hold but the tokens mean little"))


def too_big(cfg, parts, free, where):
    """The refusal of a run that does not fit in memory: what asked for it, and the parts."""
    why = (f"--context-len {max(cfg.context_len)}"
           if max(cfg.context_len) > cfg.prompt_len + cfg.max_new_tokens
           else f"--prompt-len {cfg.prompt_len} + --max-new-tokens {cfg.max_new_tokens}")
    return (f"{why}, batch {cfg.batch_size}: needs about {sum(parts.values()) / 1e9:.1f} GB of "
            "memory (" + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items() if v >= 1e8)
            + f"), {where} has {free / 1e9:.1f} GB free: ask for fewer tokens or a smaller batch")


def check_prompt_ids(cfg, vocab_size):
    """Every id of --prompt-ids inside the target's vocabulary, named by line, before the build."""
    for line, ids in enumerate(cfg.prompts, 1):
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise BadInput(f"--prompt-ids {cfg.prompt_ids}: line {line} holds id {bad[0]}, outside "
                           f"the vocabulary's {vocab_size} ids (0 to {vocab_size - 1})")


def refusals():
    """The exceptions the command line answers in one line. checkpoint.CheckpointError once
    checkpoint.py is imported (none can be raised before)."""
    ckpt = sys.modules.get("checkpoint")
    return (BadInput, NotImplementedError) + ((ckpt.CheckpointError,) if ckpt else ())


def print_refusal(e):
    """One line on stderr, no traceback; returns the exit status. A flag is the same on every
    rank, so under torchrun rank 0 alone says it and fails (the other ranks exit quietly with
    status 0, before it, so that torchrun's report names one failure: rank 0, exit code 2); a
    checkpoint may fail on one rank only, so each rank that refuses one says so, tagged."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not isinstance(e, (BadInput, NotImplementedError)):  # a CheckpointError
        print(f"run.py: error: [rank {rank}] {e}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(f"run.py: error: {e}", file=sys.stderr, flush=True)
    if world > 1 and rank == 0:
        time.sleep(1.0)  # let the other ranks leave first: torchrun then reports rank 0's alone
    return 2 if rank == 0 else 0


def cli(argv=None):
    """The command line: main's exit status; a refusal in one line (status 2); Ctrl-C in one line
    (status 130, the shell's for SIGINT; an output file is written whole or not at all), also
    while torch and the kernels are still being imported; stdout closed by its reader (`run.py |
    head`) quietly (status 141, baseline.closed_stdout)."""
    status, orderly = 2, False
    try:
        status = main(argv)
        orderly = True
    except BrokenPipeError:
        status = baseline.closed_stdout()
    except KeyboardInterrupt:
        status = 130
        if int(os.environ.get("RANK", 0)) == 0:
            tqdm.write("run.py: interrupted (Ctrl-C); no output file written", file=sys.stderr)
    except Exception as e:
        if not isinstance(e, refusals()):
            raise
        status = print_refusal(e)
    finally:  # a finished run's ranks leave the group together (tp.leave_group)
        if "tp" in sys.modules:
            sys.modules["tp"].leave_group(orderly)
    return status


@contextmanager
def ctrl_c_after_the_block():
    """A Ctrl-C inside the block is raised (KeyboardInterrupt) at its end, not where it lands:
    raised inside torch's or Triton's C++ during an import, it can abort the process ("terminate
    called after throwing an instance of 'pybind11::error_already_set'") instead of unwinding to
    cli's one line. Only the main thread holds the signal handler; elsewhere the block runs as it
    is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def main(argv=None):
    """Returns the exit status (0, or 1 when --compare fails); a flag, file or checkpoint the run
    cannot use raises BadInput or checkpoint.CheckpointError, which the command line prints as
    one line. torch and the stages are imported only after the flags are parsed."""
    args = parse_args(argv)
    if args.compare:
        with refusal():
            return baseline.compare_main(args)
    with ctrl_c_after_the_block():   # torch, Triton and the stages: seconds of imports
        import torch

        import report  # noqa: F401 (bench's; imported here, inside the block)
        import timing  # noqa: F401 (bench's and dump's)
        import tp
    rank, world, device = tp.init_distributed()
    cfg = settle(args, device, world)
    check_sizes(cfg, device, world)
    if cfg.speculative_eagle_topk > 1:
        print_rank0(tree_note(cfg))
    with torch.no_grad():
        return dump(cfg, device) if cfg.dump else bench(cfg, device, world)


def dump(cfg, device):
    """--dump: build, generate, write the file (baseline.py)."""
    import torch

    import routing
    import timing
    target, head, how = timing.build(cfg, device, getattr(torch, cfg.dtype))
    with refusal("--dump: "):
        return baseline.dump_main(cfg, target, head, how,
                                  routing.RoutingRecorder if cfg.dump_routing else None)


def bench(cfg, device, world):
    """The timing run: build and fill the caches, print the header, measure, report."""
    import report
    import timing
    b = timing.prepare(cfg, device)
    print_rank0(report.header(b))
    r = timing.measure(b, world)
    if timing.is_rank0():  # the file first: a report cut short (stdout closed) leaves it whole
        if cfg.json not in (None, "-"):
            baseline.write_whole(cfg.json, lambda f: f.write(report.json_line(r).encode()))
        report.report(r, b)
        if cfg.json == "-":
            print(report.json_line(r), end="", flush=True)
    return 0


@contextmanager
def refusal(prefix=""):
    """The baseline's ValueErrors (a file or a request it cannot use) as BadInput: one line,
    status 2."""
    try:
        yield
    except ValueError as e:
        raise BadInput(prefix + str(e)) from None


if __name__ == "__main__":
    sys.exit(cli())
