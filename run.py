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
space, as a decode step does) and runs eager or captured in CUDA graphs; the two switches are timed
separately. GPU work is timed with CUDA events after warm-up; each time is a median, printed with
its spread. Random weights accept almost nothing: --simulate-accept-len forces an acceptance,
labelled SIMULATED everywhere it appears.

    python run.py                           # CPU: the tiny model; one GPU: one SIMULATED rank of TP 8
    torchrun --nproc-per-node 8 run.py      # real tensor parallelism over 8 GPUs
    python run.py --simulate-accept-len 2.5 # what the measured costs give at 2.5 tokens a cycle
    python run.py --model-path K2 --prompt-ids p.jsonl --dump ref.npz   # the correctness baseline
    python run.py --compare ref.npz engine.npz                          # no model, no GPU

Answers the README story's question with separate measurements: the attention path of
verify (prefill = extend-style, decode = absorbed MLA) and graph capture (eager, CUDA graph) are
two independent switches, timed in all four combinations. Device work is timed with CUDA events
after warm-up (medians); host clocks are read only after a synchronize. A table per context length
says where the time of a decode step and of a verify goes, by component (a profiled eager run of
the captured shapes), against each component's byte floor; the output ends with the answer in
words. Forced acceptance (--simulate-accept-len), balanced routing on random weights (--routing
uniform, the default there) and modelled all-reduces (--allreduce-us) are labelled SIMULATED or
MODELLED everywhere they appear.

    python run.py --preset kimi-k2.5 --speculative-num-steps 2 --cuda-graph on --allreduce-us 35
        # the story's deployment (INT4 Kimi-K2.5, TP 8 over PCIe, 2 draft steps), one rank of it

--dump writes what the model says (greedy tokens, the target's top-K log-probabilities along them,
the drafts and accepted counts of a speculative run) as an .npz that another engine's output can
be converted to; --compare judges where two such files disagree (baseline.py; README: "Checking an
engine against this reference").

Exit status: 0 done; 1 --compare found a difference past its thresholds; 2 the input cannot be used
(a flag, a file, a checkpoint), said in one line on stderr.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import baseline
import checkpoint
import kernels
import model
import tp as tpm
import train
from draft import Eagle3Draft, draft_preset, set_target_aux_layers, tree_capacity
from graphs import CudaGraphs, GraphKey
from report import COMPONENTS, Timing, answer, legacy_floors, report, spreads, timing_warnings, verdict, wrap
from verify import (PREFILL_CHUNK, accept, generate, kv_bucket, prefill_draft, prefill_target, tree_forward,
                    tree_visible)


# the profiler (kineto) prints "USDT: ... profiler_start" and "profiler_stop" on stderr around every
# profile the component tables take; its log level 6 keeps them (and its other log lines) out
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# bf16 Kimi-K2 on one GPU, as one simulated TP-8 rank: 384 routed experts weigh 259 GB there, 1.8x
# an H200's 141 GB; 128 of them, 89 GB with the rest of the rank, leave room for the cache and graphs
BF16_EXPERTS_ON_ONE_GPU = 128
# a real TP rank seeds every tensor whole on its CPU and keeps its slice (so TP N holds the same model
# as TP 1) while its shard stays under this many parameters; a bigger one draws its slice on the device
MAX_PARAMS_SEEDED_WHOLE = 5e8


# --speculative-attention-mode speaks SGLang, whose "prefill" is the model's "extend" attention;
# the run's names and JSON keys keep the flag's word (verify/prefill/graph)
ATTENTION_MODES = {"prefill": ["extend"], "decode": ["decode"], "both": ["extend", "decode"]}
FLAG_WORD = {"extend": "prefill", "decode": "decode"}


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
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft tokens proposed per cycle, k "
                   "(verify reads k + 1 tokens; default %(default)s)")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="draft branches per step, K: 1 "
                   "drafts a chain; above 1 a tree (EAGLE-2/3's and SGLang's; num_steps levels, K x K "
                   "candidates a level, the best K expanded; default %(default)s)")
    p.add_argument("--speculative-num-draft-tokens", type=int, help="tokens verified per cycle, N: with topk "
                   "1 always num_steps + 1 (another value is adjusted, with a note, as SGLang does); with topk "
                   "K > 1 required, the tree's nodes with the root, 2 to 1 + K + (num_steps - 1) K^2")
    p.add_argument("--speculative-attention-mode", choices=["prefill", "decode", "both"],
                   help="attention path of verify: prefill (keys and values expanded) or decode (absorbed "
                   "MLA); default: both (timing), prefill (--dump)")
    p.add_argument("--cuda-graph", choices=["on", "off", "both"], help="replay captured CUDA graphs; default: "
                   "both on a GPU, off on CPU (graphs need CUDA)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (default %(default)s)")
    p.add_argument("--prompt-len", type=int, help="tokens in each prompt of the timing run: held-out stdlib "
                   "source for the trained tiny pair (the CPU default), random ids otherwise (default 256 on "
                   "a GPU, 16 on CPU)")
    p.add_argument("--max-new-tokens", type=int, help="tokens generated per sequence (default 64 on a GPU, 24 on CPU)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampling with "
                   "speculative rejection sampling (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights, prompts and sampling "
                   "(default %(default)s)")
    p.add_argument("--simulate-accept-len", type=float, help="force the mean accepted length per cycle, bonus "
                   "token included, between 1 and num_steps + 1 (as SGLANG_SIMULATE_ACC_LEN: each cycle draws "
                   "its length around this mean); output marked SIMULATED")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float64"], help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--moe-impl", choices=["auto", "gather", "grouped", "fused"], default="auto",
                   help="routed experts: gathered weights (plain), torch._grouped_mm, or the fused Triton kernel "
                   "(kernels.py's swaps, put in by kernels.accelerate; fused: grouped above 256 tokens for unquantized "
                   "experts) (auto: fused on a GPU with Triton, else grouped; CPU: gather)")
    p.add_argument("--kernels", help="fast twins swapped in for model.py's plain modules (kernels.accelerate: "
                   "Triton kernels, and fused_proj: stacked-weight GEMMs): 'all', 'none' or a comma list of "
                   + ",".join(kernels.KERNELS)
                   + " (default: all on a CUDA GPU with Triton and a bf16/fp16/fp32 model, else none); the draft "
                   "head takes those of " + ",".join(kernels.DRAFT_KERNELS) + " (kernels.accelerate_draft)")
    p.add_argument("--compile", action="store_true", help="also time the captured phases with each decoder "
                   "layer and the draft layer fused by torch.compile (inside our own CUDA graphs), beside the plain ones")
    p.add_argument("--reps", type=int, help="timed repetitions per phase, after warm-up (default 20)")
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
                   "labelled MODELLED (a torchrun run prints the X it measured between compute in a CUDA graph: "
                   "~11 with NCCL, ~7 one-shot at TP 2 on H200 NVLink; ~35 over PCIe at TP 8)")
    p.add_argument("--allreduce", choices=tpm.ALLREDUCES, default="nccl", help="real TP (torchrun) on CUDA GPUs: "
                   "NCCL's all-reduce, or one-shot: each rank reads its peers' rows from torch's symmetric memory "
                   "and sums them, for messages up to 1 MB (decode, verify; NCCL above) (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write every number of the run and its environment as one "
                   "JSON line to PATH ('-': to stdout, after the report)")
    add_baseline_flags(p)
    return p


def add_model_flags(p):
    """Which target and head: checkpoints, or random weights of a preset."""
    p.add_argument("--model-path", help="HF DeepseekV3 / Kimi-K2 checkpoint folder (else --preset)")
    p.add_argument("--draft-path", help="SpecForge / SGLang EAGLE-3 checkpoint folder (else the trained tiny "
                   "pair's head on a CPU, or a random head)")
    p.add_argument("--random-weights", action="store_true", help="with the tiny preset: a random target and "
                   "head instead of the trained pair in checkpoints/tiny-stdlib (train.py), the tiny default")
    p.add_argument("--preset", choices=sorted(checkpoint.PRESETS), help="random target to build: kimi-k2 (GPU only), "
                   "kimi-k2.5 (INT4 experts, GPU only), tiny (a toy with every feature; default on CPU)")
    p.add_argument("--simulate-tp", type=int, help="build one SIMULATED rank of TP N (default on one GPU "
                   "with kimi-k2: 8)")
    p.add_argument("--routed-experts", type=int, help="keep N routed experts per layer of a random target "
                   "(memory override; default on one GPU with bf16 kimi-k2: 128; all 384 with --quant int4 or fp8)")
    p.add_argument("--quant", choices=["none", "int4", "fp8"], help="random weights in this layout: int4 = routed "
                   "experts packed as Kimi-K2-Thinking / K2.5 ship them; fp8 = routed experts in FP8 e4m3 with "
                   "128x128 block scales as Kimi-K2-Instruct ships them (the rest dequantized, as at load) "
                   "(default: the preset's)")


def add_baseline_flags(p):
    """The correctness baseline's flags (baseline.py)."""
    b = p.add_argument_group("correctness baseline (README: Checking an engine against this reference)")
    b.add_argument("--dump", metavar="PATH", help="write greedy output and top-K log-probabilities of the "
                   "--prompt-ids to this .npz (speculative, with drafts and accepted counts, when --draft-path "
                   "is given); no timing")
    b.add_argument("--prompt-ids", metavar="FILE", help="for --dump: one JSON list of token ids per line")
    b.add_argument("--topk", type=int, help="for --dump: log-probabilities kept per position (default 20)")
    b.add_argument("--compare", nargs=2, metavar=("A.npz", "B.npz"), help="judge dump B against reference A "
                   "(no model, no GPU); exit status 1 past the thresholds below, 2 if the files cannot be compared")
    b.add_argument("--max-logprob-diff", type=float, default=baseline.MAX_LOGPROB_DIFF, help="largest |log p_A - log p_B| "
                   "over ids in both top-K lists, on positions both runs read the same tokens; also how far "
                   "below A's top-1 B's token may be where the outputs part (default %(default)s)")
    b.add_argument("--min-top1-agreement", type=float, default=baseline.MIN_TOP1_AGREEMENT, help="share of those "
                   "positions, all rows together, whose top-1 ids agree (default %(default)s)")
    b.add_argument("--max-accept-diff", type=float, default=baseline.MAX_ACCEPT_DIFF, help="largest difference in drafts "
                   "accepted per cycle (mean over all rows' cycles), when both files have 'accepted' "
                   "(default %(default)s)")


def check_flags(args):
    """Refuse values no run can use, naming the flag, the value and what is allowed, before
    anything is built. (Flags that depend on the device are checked in settle.)"""
    at_least = {"--speculative-num-steps": (args.speculative_num_steps, 1), "--batch-size": (args.batch_size, 1),
                "--prompt-len": (args.prompt_len, 1), "--max-new-tokens": (args.max_new_tokens, 1),
                "--reps": (args.reps, 1), "--simulate-tp": (args.simulate_tp, 1),
                "--routed-experts": (args.routed_experts, 1), "--topk": (args.topk, 1),
                "--temperature": (args.temperature, 0), "--max-logprob-diff": (args.max_logprob_diff, 0),
                "--max-accept-diff": (args.max_accept_diff, 0)}
    for flag, (value, low) in at_least.items():  # None: the flag's default
        if value is not None and not value >= low:  # (NaN fails too)
            raise BadInput(f"{flag} {value}: must be at least {low}")
    if not 0 <= args.min_top1_agreement <= 1:
        raise BadInput(f"--min-top1-agreement {args.min_top1_agreement}: must lie in [0, 1]")
    k, sim = check_tree_flags(args), args.simulate_accept_len
    if sim is not None and not 1 <= sim <= k + 1:
        raise BadInput(f"--simulate-accept-len {sim}: must lie in [1, {k + 1}] (accepted tokens per cycle, "
                       "the bonus token included: at most the deepest draft path + 1)")
    if args.compare and (args.dump or args.model_path or args.draft_path):
        raise BadInput("--compare reads two dump files and builds no model: drop --dump, --model-path, --draft-path")
    for flag, value in (("--prompt-ids", args.prompt_ids), ("--topk", args.topk)):
        if value is not None and not args.dump:
            raise BadInput(f"{flag} is for --dump (the correctness baseline); the timing run makes its own "
                           "prompts (--prompt-len)")
    if args.model_path and (args.quant or args.routed_experts or args.preset):
        raise BadInput("--quant, --routed-experts and --preset shape random weights; a checkpoint's "
                       "config.json says its own")
    if args.draft_path and not args.model_path:
        raise BadInput("--draft-path needs --model-path: a head is trained for one target, and without "
                       "--model-path that target would be a random one")
    if args.random_weights and (args.model_path or args.draft_path):
        raise BadInput("--random-weights replaces the trained tiny pair; with --model-path / --draft-path the "
                       "checkpoints are used: drop one")
    if args.dump and (args.context_len or args.skip_e2e or args.compile):
        raise BadInput("--context-len, --skip-e2e and --compile shape the timing run; --dump times nothing")
    if args.json not in (None, "-"):
        check_writable("--json", args.json)
    if args.dump:
        check_writable("--dump", args.dump)


def check_writable(flag, path):
    """Refuse an output path the run could not write at its end, before anything is built (the
    file itself is written only then, whole: write_whole)."""
    folder = os.path.dirname(os.path.abspath(path))
    why = ("is a folder" if os.path.isdir(path) else f"no folder {folder}" if not os.path.isdir(folder)
           else f"folder {folder} is not writable" if not os.access(folder, os.W_OK | os.X_OK) else None)
    if why:
        raise BadInput(f"{flag} {path}: cannot write there ({why})")


def check_tree_flags(args):
    """The tree flags as SGLang takes them (K = 1: a chain, N adjusted in settle); returns the
    most drafts a cycle can accept: num_steps, or min(num_steps, N - 1) for a tree."""
    K, S, N = args.speculative_eagle_topk, args.speculative_num_steps, args.speculative_num_draft_tokens
    if K < 1:
        raise BadInput(f"--speculative-eagle-topk {K}: must be at least 1")
    if K == 1:
        return S
    most = tree_capacity(K, S)
    if N is None:
        raise BadInput(f"--speculative-eagle-topk {K}: a tree needs --speculative-num-draft-tokens N, its nodes "
                       f"with the root (2 to {most} here)")
    if not 2 <= N <= most:
        raise BadInput(f"--speculative-num-draft-tokens {N}: a tree of topk {K} and {S} steps holds 2 to "
                       f"1 + K + (num_steps - 1) K^2 = {most} tokens")
    return min(S, N - 1)


def uses_trained_pair(args):
    """The tiny preset with nothing else asked of it runs the trained pair (train.py)."""
    other = (args.model_path or args.draft_path or args.random_weights or args.quant
             or args.routed_experts is not None or (args.simulate_tp or 1) > 1)
    return args.preset == "tiny" and not other


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
    cfg.speculative_attention_mode = cfg.speculative_attention_mode or "both"
    cfg.attention_modes = ATTENTION_MODES[cfg.speculative_attention_mode]
    want = cfg.speculative_num_steps + 1
    if cfg.speculative_eagle_topk == 1:
        if cfg.speculative_num_draft_tokens not in (None, want):
            tpm.print0(f"note: --speculative-num-draft-tokens {cfg.speculative_num_draft_tokens} adjusted to "
                       f"{want} (= num_steps + 1 with topk 1)")
        cfg.speculative_num_draft_tokens = want
    else:
        tpm.print0(f"note: the end-to-end rows draft a tree (topk {cfg.speculative_eagle_topk}, num_steps "
                   f"{cfg.speculative_num_steps}, {cfg.speculative_num_draft_tokens} draft tokens); the isolated "
                   "phases\n      and the cost model add its verify, expansion and cycle")
    cfg.preset = cfg.preset or ("kimi-k2" if gpu else "tiny")
    cfg.trained_pair = uses_trained_pair(cfg)
    if cfg.trained_pair:
        cfg.model_path, cfg.draft_path = train.TARGET_DIR, train.DRAFT_DIR
    big = cfg.preset.startswith("kimi-k2") and not cfg.model_path
    if big and not gpu:
        raise BadInput(f"--preset {cfg.preset}: a random Kimi-K2 needs a GPU (hundreds of GB in memory); "
                       "on CPU use --preset tiny (the default) or --model-path")
    cfg.cuda_graph = cfg.cuda_graph or ("both" if gpu else "off")
    if cfg.compile and (not gpu or cfg.cuda_graph == "off"):
        raise BadInput("--compile times the captured phases: it needs a CUDA GPU and --cuda-graph on or both")
    if cfg.cuda_graph != "off" and not gpu:
        raise BadInput(f"--cuda-graph {cfg.cuda_graph}: CUDA graphs need a CUDA GPU; use --cuda-graph off on CPU")
    if cfg.simulate_tp is None:
        cfg.simulate_tp = 8 if big and gpu and world == 1 else 1
    if cfg.simulate_tp > 1 and world > 1:
        raise BadInput(f"--simulate-tp {cfg.simulate_tp} is for a single process; under torchrun the TP is real")
    quantized = cfg.quant in ("int4", "fp8") or cfg.quant is None and cfg.preset == "kimi-k2.5"
    if cfg.routed_experts is None and big and gpu and not quantized and not cfg.dump:
        cfg.routed_experts = BF16_EXPERTS_ON_ONE_GPU  # INT4 and FP8 experts all fit
    if not gpu and not cfg.dump and not os.environ.get("OMP_NUM_THREADS"):
        # timing on a CPU: one thread, unless asked. The toy model gains nothing from more, and
        # threads spinning on cores that other jobs share made a busy 2-core machine 10x slower
        torch.set_num_threads(1)
    defaults = dict(prompt_len=256 if gpu else 16, max_new_tokens=64 if gpu else 24,
                    dtype="bfloat16" if gpu else "float32", reps=20)
    for name, value in defaults.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    cfg.routing = cfg.routing or ("model" if cfg.model_path or cfg.dump else "uniform")
    cfg.context_len = cfg.context_len or [cfg.prompt_len]
    if cfg.kernels is None:  # the fast twins where they run (each tested equal to its plain twin)
        fast = gpu and kernels.HAVE_TRITON and cfg.dtype in ("bfloat16", "float16", "float32")
        cfg.kernels = "all" if fast else "none"
    cfg.kernels = cfg.kernels if cfg.kernels in ("all", "none") else cfg.kernels.split(",")
    check_device_flags(cfg, device)
    return cfg


def check_device_flags(args, device):
    """What depends on the preset, the device or the defaults just settled."""
    if args.allreduce_us is not None and (args.allreduce_us < 0 or args.simulate_tp <= 1):
        raise BadInput(f"--allreduce-us {args.allreduce_us}: models the collectives a SIMULATED rank skips "
                       "(--simulate-tp N, N > 1), with X >= 0; under torchrun they run and are measured")
    want = args.speculative_num_steps + 1
    if not args.dump and args.context_len == [args.prompt_len] and want > args.prompt_len:
        raise BadInput(f"--speculative-num-steps {args.speculative_num_steps}: the isolated timings re-read the last "
                       "num_steps + 1 cached tokens, as many as the prompt by default, so it must be below "
                       f"--prompt-len ({args.prompt_len}) (or give a --context-len above it)")
    if not args.dump and min(args.context_len) < want:
        raise BadInput(f"--context-len {min(args.context_len)}: the isolated verify re-reads {want} cached tokens "
                       f"(num_steps + 1); use at least {want}")
    unknown = [] if isinstance(args.kernels, str) else sorted(set(args.kernels) - set(kernels.KERNELS))
    if unknown:
        raise BadInput(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(kernels.KERNELS)}, all or none")
    if args.kernels not in ("none", ["fused_proj"]):   # fused_proj is plain torch
        try:
            kernels.check_available(device)
        except RuntimeError as e:
            raise BadInput(f"--kernels {','.join(args.kernels) if isinstance(args.kernels, list) else args.kernels}: "
                           f"{e}") from None
    if args.routed_experts is not None and not args.model_path:
        m = checkpoint.preset(args.preset)
        if not m.num_experts_per_tok <= args.routed_experts <= m.n_routed_experts or args.routed_experts % m.n_group:
            raise BadInput(f"--routed-experts {args.routed_experts}: {args.preset} needs between "
                           f"{m.num_experts_per_tok} (experts per token) and {m.n_routed_experts}, a multiple of "
                           f"n_group {m.n_group}")
    if args.moe_impl == "fused" and not kernels.fused_moe_available(device, getattr(torch, args.dtype)):
        raise BadInput(f"--moe-impl fused: the Triton kernel does not run {args.dtype} on {device.type} here (it "
                       "needs Triton and a CUDA GPU, and bf16, fp16 or fp32); use --moe-impl gather or auto")
    if args.moe_impl == "grouped" and not kernels.grouped_mm_available(device, getattr(torch, args.dtype)):
        raise BadInput(f"--moe-impl grouped: torch._grouped_mm does not run {args.dtype} on {device.type} here; "
                       "use --moe-impl gather or auto")


def cache_slots(cfg):
    """KV cache slots a row needs: the prompt and output, or the longest context and the 6 tokens
    the isolated phases write after it, and the draft chain's lookahead (a tree's: its N verified
    slots, or its deepest path and the head's (S - 1) K scratch slots past it, as verify.generate)."""
    sweep, k, K, N = 6, cfg.speculative_num_steps, cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens
    ahead = 2 * k + 2 if K == 1 else max(2 * k + 2, max(N, min(k, N - 1) + (k - 1) * K) + 2)
    return max(cfg.prompt_len + cfg.max_new_tokens, max(cfg.context_len) + sweep) + ahead


def random_target_args(cfg):
    """The preset's ModelArgs with --quant and --routed-experts applied."""
    quant = {None: {}, "none": dict(quantization_config=None), "int4": dict(quantization_config="int4"),
             "fp8": dict(quantization_config="fp8")}
    margs = checkpoint.preset(cfg.preset, **quant[cfg.quant])
    if cfg.routed_experts is not None:
        margs.n_routed_experts = cfg.routed_experts
    return margs


def random_draft_args(target):
    """A random head's DraftArgs: the tiny one for the tiny target, else Kimi-K2's."""
    tiny = target.args.hidden_size == checkpoint.PRESETS["tiny"]["hidden_size"]
    dargs = draft_preset("tiny" if tiny else "kimi-k2")
    if max(dargs.aux_layer_ids or [0]) >= target.args.num_hidden_layers:  # Kimi's ids, a shallower target
        dargs.eagle_config = None  # EAGLE-3's default layers of this target instead
    return dargs


def build(args, device, dtype):
    """The target and the head, loaded or random. Returns (target, head, description)."""
    tp = tpm.TP.simulate(args.simulate_tp) if args.simulate_tp > 1 else tpm.TP.from_env(args.allreduce)
    max_seq_len = cache_slots(args)
    if args.model_path:
        target = checkpoint.load_target(args.model_path, args.batch_size, max_seq_len, device, dtype, tp,
                                        routing=args.routing)
        how = f"loaded {args.model_path}"
        if args.trained_pair:
            how = ("the trained tiny pair (checkpoints/tiny-stdlib, made by train.py from bytes of Python stdlib "
                   "source" + ("" if args.dump else "; prompts: held-out stdlib source") + "; --random-weights for "
                   "random ones)")
    else:
        margs = random_target_args(args)
        if args.routed_experts is not None:
            tpm.print0(f"memory override: {args.routed_experts} of {checkpoint.preset(args.preset).n_routed_experts} "
                       "routed experts per layer kept")
        try:
            target = model.Transformer(margs, args.batch_size, max_seq_len, device, dtype, tp, routing=args.routing)
        except ValueError as e:  # a size the TP does not divide
            raise BadInput(f"--preset {args.preset} at TP {tp.world_size}: {e}") from None
        whole = tp.world_size == 1 or not tp.simulated and sum(p.numel() for p in target.parameters()) < MAX_PARAMS_SEEDED_WHOLE
        checkpoint.init_random(target, args.seed, rank_local=not whole)
        how = f"random {args.preset} ({'seeded whole, same at any TP' if whole else 'rank-local init'})"
    kernels.accelerate(target, args.kernels, moe=args.moe_impl)   # the fast paths, swapped in from outside
    if args.draft_path:
        head = checkpoint.load_draft(args.draft_path, target)
    elif args.dump:  # a dump without a draft checkpoint is plain greedy
        head = None
    else:
        dargs = random_draft_args(target)
        set_target_aux_layers(target, dargs)
        head = checkpoint.init_random_draft(Eagle3Draft(dargs, target), args.seed + 1, rank_local=tp.simulated)
    if head is not None:
        kernels.accelerate_draft(head, args.kernels)   # the head's fast paths, as the target's
    return target, head, how


# ---------------------------------------------------------------------------------------------
# Sizes: what the run will hold, estimated before anything is allocated

def memory_needed(cfg, device, world):
    """Bytes one rank will hold at its peak, by part: the target and the head built on the meta
    device (their weights, KV caches and RoPE tables, exactly, without allocating them), and the
    largest transient: one prefill chunk of extend attention (scores and probabilities [B, T, H,
    S] in float32, keys and values expanded [B, S, H, d], logits [B, T, V] in float32), with the
    plain `gather` MoE each of its tokens' K experts' weights gathered [B T, K, 3, I, D], and the
    EAGLE-3 states kept along the cache fill [B, S, 3D]. Also returns the target's ModelArgs."""
    margs = checkpoint.read_target_args(cfg.model_path) if cfg.model_path else random_target_args(cfg)
    tp = tpm.TP.simulate(max(cfg.simulate_tp, world))
    dtype, meta = getattr(torch, cfg.dtype), torch.device("meta")
    B, slots = cfg.batch_size, cache_slots(cfg)
    try:
        target = model.Transformer(margs, B, slots, meta, dtype, tp)
        dargs = checkpoint.read_draft_args(cfg.draft_path) if cfg.draft_path else random_draft_args(target)
        set_target_aux_layers(target, dargs)
        own = bool(cfg.draft_path) and "embed_tokens.weight" in checkpoint.checkpoint_files(cfg.draft_path)
        head = Eagle3Draft(dargs, target, own_embedding=own)
    except ValueError:  # a size the TP does not divide, a head that does not fit: build says which
        return None, margs
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    fill = max(max(cfg.context_len), cfg.prompt_len)
    T, H, a = min(PREFILL_CHUNK, fill), margs.num_attention_heads // tp.world_size, margs
    parts = {"weights": size(target.parameters()) + size(head.parameters()),
             "KV caches": size(target.buffers()) + size(head.buffers()),
             "one prefill chunk": B * T * H * fill * 4 * 2 + B * T * a.vocab_size * 4
             + B * fill * H * (a.qk_nope_head_dim + a.v_head_dim) * dtype.itemsize,
             "gathered expert weights": B * T * a.num_experts_per_tok * 3 * (a.moe_intermediate_size // tp.world_size)
             * a.hidden_size * dtype.itemsize if kernels.pick_moe(cfg.moe_impl, device, dtype) == "gather" else 0,
             "EAGLE-3 states": B * fill * 3 * a.hidden_size * dtype.itemsize}
    return parts, margs


def memory_free(device):
    """Bytes free for this rank: the GPU's free memory, or the host's available memory shared by
    the ranks on it (None where the system does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"{torch.cuda.get_device_name(device)}"
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None, None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return kb * 1024 // ranks, "this machine" + (f" / {ranks} ranks" if ranks > 1 else "")


def check_sizes(cfg, device, world):
    """Refuse, before anything is built, a run whose caches and weights cannot fit (one line, the
    estimate's parts), a --topk above the vocabulary; warn when positions pass the model's
    max_position_embeddings."""
    parts, margs = memory_needed(cfg, device, world)
    if cfg.dump and cfg.topk > margs.vocab_size:
        raise BadInput(f"--topk {cfg.topk}: must lie in [1, the vocabulary's {margs.vocab_size} ids]")
    free, where = memory_free(device)
    slots = cache_slots(cfg)
    if parts and free is not None and sum(parts.values()) > free:
        why = (f"--context-len {max(cfg.context_len)}" if max(cfg.context_len) > cfg.prompt_len + cfg.max_new_tokens
               else f"--prompt-len {cfg.prompt_len} + --max-new-tokens {cfg.max_new_tokens}")
        raise BadInput(f"{why}, batch {cfg.batch_size}: needs about {sum(parts.values()) / 1e9:.1f} GB of memory ("
                       + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items() if v >= 1e8)
                       + f"), {where} has {free / 1e9:.1f} GB free: ask for fewer tokens or a smaller batch")
    if slots > margs.max_position_embeddings:
        tpm.print0(f"warning: positions reach {slots}, past the model's max_position_embeddings "
                   f"{margs.max_position_embeddings}: its RoPE was not made for them, so the timings hold but "
                   "the tokens mean little")


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
    stamps = []
    with tqdm(total=warmup + reps, desc=desc, disable=desc is None or not is_rank0(), leave=False) as bar:
        for _ in range(warmup):
            fn()
            bar.update()
        for _ in range(reps):
            a = clock.stamp()
            fn()
            stamps.append((a, clock.stamp()))
            bar.update()
    clock.sync()
    return Timing([clock.ms(a, b) for a, b in stamps])


def phase_label(key, graph):
    """A progress bar's name for a GraphKey: the phase, its attention mode, the tokens a row reads
    (key.tokens, never the cache slots), eager or graph."""
    what = {"decode_step": "decode step", "verify": f"verify ({key.mode} attention)",
            "draft_extend": "draft extend", "draft": "draft",
            "allreduce": "all-reduces"}.get(key.phase, key.phase)
    unit = "head step" if key.phase == "draft" else "token"  # a draft step reads one token
    return f"timing {what}, {key.tokens} {unit}{'s' if key.tokens != 1 else ''}, " \
        f"{'graph' if graph else 'eager'}"


class PhaseTimer:
    """verify.generate calls mark(name) at the end of each phase. A phase lasts from the previous
    mark to its own, and `host` from a cycle's last mark to the next cycle's "start" (the host
    read and the host's own work), so in every cycle the phases add up to the cycle, start to start."""

    def __init__(self, clock):
        self.clock, self.marks = clock, []

    def mark(self, name):
        self.marks.append((name, self.clock.stamp()))

    def per_cycle(self):
        """[{phase: ms, ..., "host": ms, "cycle": ms}] per cycle; the last has no host nor cycle."""
        self.clock.sync()
        cycles = []
        for (n0, t0), (n1, t1) in zip(self.marks, self.marks[1:]):
            if n0 == "start":
                cycles.append({})
            cycles[-1]["host" if n1 == "start" else n1] = self.clock.ms(t0, t1)
        starts = [t for n, t in self.marks if n == "start"]
        for c, a, b in zip(cycles, starts, starts[1:]):
            c["cycle"] = self.clock.ms(a, b)
        return cycles

    def phases(self):
        """Each phase's Timing over the cycles."""
        cycles = self.per_cycle()
        names = [n for n in cycles[0] if n not in ("host", "cycle")] + ["host", "cycle"] if cycles else []
        med = {n: Timing([c[n] for c in cycles if n in c]) for n in names if any(n in c for c in cycles)}
        if "cycle" not in med and cycles:  # one cycle only: it is the sum of its phases
            med["cycle"] = Timing([sum(cycles[0].values())])
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
    """Distinct routed experts per MoE layer in one call of fn(*inputs) (recorded by hooks on the
    routers; a shared expert's slot in the fused launch, id E, is not a routed expert)."""
    seen = []

    def count(router, inputs, out):
        seen.append(out[0][out[0] < router.args.n_routed_experts].unique().numel())
    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in target.layers if isinstance(layer.mlp, model.MoE)]
    fn(*inputs)
    for h in hooks:
        h.remove()
    return seen


def component_bytes(target, distinct, kv_slots, batch, tokens):
    """{component: bytes} one forward of `batch` rows of `tokens` new tokens must move: weights as
    stored (routed experts: only the `distinct` ones reached, per MoE layer), the latent cache of
    kv_slots positions per row, and only the embedding rows looked up."""
    out = dict.fromkeys(COMPONENTS, 0)
    # a shared expert folded into the fused MoE launch (kernels "shared_expert") runs there: its
    # bytes go with the routed experts' (its time does too)
    folded = tuple(f"layers.{i}.mlp.shared_experts." for i, layer in enumerate(target.layers)
                   if isinstance(layer.mlp, kernels.SharedExpertInLaunch))
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
            out["routed_experts" if name.startswith(folded) else "shared_mlp"] += nbytes
    moe = [layer.mlp.experts for layer in target.layers if isinstance(layer.mlp, model.MoE)]
    out["routed_experts"] += sum(n * experts.expert_bytes() for experts, n in zip(moe, distinct))
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
    core; MLA_METHODS and apply_rope name the math inside it that is no module."""
    if isinstance(module, model.RMSNorm):   # with a residual, its add too
        return "elementwise"
    if isinstance(module, model.MLA):
        return "attn_core"
    if ".self_attn." in name:   # q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj
        return "attn_proj"
    kinds = {model.Router: "router", model.Experts: "routed_experts", model.MLP: "shared_mlp",
             model.MoE: "elementwise", model.Block: "elementwise"}  # the routed + shared sum
    for kind, component in kinds.items():
        if isinstance(module, kind):
            return component
    return "embed_head" if name in ("embed_tokens", "lm_head") else None


# MLA's methods whose math is projections, not the attention core: the q / kv down projections
# (a GEMM over stacked weights with --kernels fused_proj; project_sum, kernels.py's, with the layer's
# input add and norm inside it), and decode mode's absorbed kv_b_proj; and the attention after the
# projections (attend), which kernels.InputNormInQKVA calls from the layer, outside MLA's own call. The
# kernels' merge_absorb_output (attention + norm_gemv, one row) also merges the attention's parts in
# W_uv's launch: a projection by its bytes (W_uv's 1 MB a layer against ~80 KB of partials)
MLA_METHODS = {"project": "attn_proj", "project_sum": "attn_proj", "attend": "attn_core",
               "absorb_query": "attn_proj", "absorb_output": "attn_proj", "merge_absorb_output": "attn_proj"}


def scope(component):
    """A profiler range that puts the kernels launched inside it under `component`. It exists
    only while a profiler records, never under torch.compile, and adds no device work."""
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function("component:" + component)


def scoped(fn, component):
    def call(*args, **kwargs):
        with scope(component):
            return fn(*args, **kwargs)
    return call


@contextmanager
def component_scopes(target):
    """While profiling: each module's forward inside a range named by its component (hooks), MLA's
    MLA_METHODS and model.apply_rope (elementwise) wrapped in ranges of theirs; all removed after."""
    active, handles, wrapped = [], [], []

    def enter(component):
        def hook(module, inputs):
            active.append(scope(component))
            active[-1].__enter__()
        return hook

    def leave(module, inputs, output):
        active.pop().__exit__(None, None, None)
    for name, m in target.named_modules():
        component = component_of(name, m)
        if component:
            handles += [m.register_forward_pre_hook(enter(component)), m.register_forward_hook(leave)]
        if isinstance(m, model.MLA):
            for method, part in MLA_METHODS.items():
                if hasattr(m, method):                                 # project_sum, merge_absorb_output: swaps' only
                    setattr(m, method, scoped(getattr(m, method), part))   # an instance attribute, deleted after
                    wrapped.append((m, method))
    rope, model.apply_rope = model.apply_rope, scoped(model.apply_rope, "elementwise")
    try:
        yield
    finally:
        model.apply_rope = rope
        for h in handles:
            h.remove()
        for m, method in wrapped:
            delattr(m, method)


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
    parts, n_kernels = dict.fromkeys(COMPONENTS, 0.0), 0
    ours = ("component:", "profiler::")  # our ranges and their enter/exit ops: not kernels
    for e in prof.events():
        if e.device_type != DeviceType.CPU or e.name.startswith("profiler::"):
            continue
        if gpu:  # the kernels (and copies) this op launched; our ranges' GPU projections are not kernels
            launched = [k for k in e.kernels if not k.name.startswith(ours)]
            us, names = sum(k.duration for k in launched), [k.name for k in launched]
            n_kernels += len(launched)
        elif e.name.startswith("component:"):  # on the CPU a range's own time is Python, not an op
            continue
        else:
            us, names = e.self_cpu_time_total, ()
            n_kernels += not e.cpu_children
        if us:
            parts[component_at(e, names)] += us / 1e3 / calls
    if gpu:
        device_kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        total, n_kernels = sum(e.time_range.elapsed_us() for e in device_kernels), len(device_kernels)
        if sum(parts.values()) < 0.95 * total / 1e3 / calls:  # kernels no aten op launched (Triton's:
            # the profiler links them to no CPU event; measured on the H200, 2026-11-29)
            parts = parts_by_device_ranges(prof, calls) or parts
    else:
        total = sum(e.self_cpu_time_total for e in prof.key_averages() if not e.key.startswith(ours))
    return dict(parts_ms=parts, kernel_ms=total / 1e3 / calls, kernels=n_kernels // calls)


def parts_by_device_ranges(prof, calls):
    """{component: ms} with each kernel under the innermost of our ranges around it on the device
    timeline (a range's GPU projection spans the kernels launched inside it): this also places
    kernels that no aten op launched, as Triton's, which the profiler links to no op. None when
    the profile has no device ranges."""
    from torch.autograd import DeviceType
    gpu_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    ranges = [(e.time_range.start, e.time_range.end, e.name.removeprefix("component:")) for e in gpu_events
              if e.is_user_annotation and e.name.startswith("component:")]
    if not ranges:
        return None
    parts = dict.fromkeys(COMPONENTS, 0.0)
    for k in gpu_events:
        if k.is_user_annotation or k.name.startswith(("component:", "profiler::")):
            continue
        t = k.time_range.start
        around = [(end - start, name) for start, end, name in ranges if start <= t < end]
        name = "allreduce" if "allreduce" in k.name.lower().replace("_", "") else min(around)[1] if around else "other"
        parts[name] += k.time_range.elapsed_us() / 1e3 / calls
    return parts


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
# The timing run, in the order of its output: build, the phases in isolation (with where their
# time goes and their floors), end to end, collectives, torch.compile, the cost model; report.py
# prints what they measured.

@dataclass
class Bench:
    """What the stages share: the models, the clock, the graph runner and the run's settings."""
    cfg: argparse.Namespace    # run.py's settled configuration (settle)
    target: model.Transformer
    head: Eagle3Draft
    how: str                   # what the target is, for the header
    clock: Clock
    runner: CudaGraphs | None
    fill: torch.Tensor = None  # [B, C'] ids prefilled into the cache (random, or held-out text for the trained
                               # pair), C' the longest context or the prompt length, whichever is longer
    aux: torch.Tensor = None   # [B, C, 3D] the target's EAGLE-3 states along `fill`

    @property
    def gpu(self):
        return self.target.device.type == "cuda"

    @property
    def k(self):
        return self.cfg.speculative_num_steps

    @property
    def modes(self):  # verify's attention modes timed, in the model's words (FLAG_WORD: in names)
        return self.cfg.attention_modes

    @property
    def graph_opts(self):
        return {"both": [False, True], "on": [True], "off": [False]}[self.cfg.cuda_graph]

    @property
    def best(self):  # the fastest variant: graph when captured; the cost model's attention mode
        return "graph" if self.graph_opts[-1] else "eager", "decode" if "decode" in self.modes else self.modes[0]

    def verify_name(self, mode):  # an isolated verify's name in the tables and JSON: the flag's word
        return f"verify/{FLAG_WORD[mode]}"

    def positions(self, ctx, T):  # [B, T]: T new tokens after ctx cached ones
        return ctx + torch.arange(T, device=self.target.device).expand(self.cfg.batch_size, T)

    def timed(self, key, fn, *inputs, graph):
        call = (lambda: self.runner.run(key, fn, *inputs)) if graph else (lambda: fn(*inputs))
        return median_ms(self.clock, call, self.cfg.reps, desc=phase_label(key, graph))


def prepare(cfg, device):
    """Build the models and fill their caches up to the longest context (random ids; held-out
    text for the trained pair)."""
    torch.manual_seed(cfg.seed)
    target, head, how = build(cfg, device, getattr(torch, cfg.dtype))
    b = Bench(cfg, target, head, how, Clock(device), CudaGraphs(device) if cfg.cuda_graph != "off" else None)
    B, C = cfg.batch_size, max(cfg.context_len)
    g = torch.Generator().manual_seed(cfg.seed)
    L = max(C, cfg.prompt_len)
    b.fill = (torch.tensor(train.heldout_prompts(B, L)) if cfg.trained_pair  # text like its training data
              else torch.randint(0, target.args.vocab_size, (B, L), generator=g)).to(device)
    last = torch.full((B,), C - 1, device=device)
    with tqdm(total=2 * C, desc=f"filling the caches: target and head, {C} tokens", unit="token",
              disable=not is_rank0() or C <= PREFILL_CHUNK, leave=False) as bar:
        _, b.aux = prefill_target(target, b.fill[:, :C], last, capture_aux=True, progress=bar.update)
        prefill_draft(head, b.fill[:, :C], b.aux, last, progress=bar.update)  # its output is not used
    return b


def phase_calls(b, ctx):
    """The isolated phases at ctx cached tokens: {name: (graph key, fn, inputs)}. Only their shapes
    matter for timing, so the inputs are deliberately arbitrary: the decode step and the verify
    re-read prefilled ids at new positions; the draft extend reads those ids unshifted (draft.py
    pairs token t+1 with state t) beside target states captured at other positions; the draft
    step starts from that extend's output (a chain of num_steps 2: one head step). The target
    reads the slots in use (kv_bucket), as verify.generate does, so the plain phases share its
    graphs."""
    k, B, t = b.k, b.cfg.batch_size, b.target
    pos1, posv = b.positions(ctx, 1), b.positions(ctx, k + 1)
    kv1, kvv = kv_bucket(ctx + 1, t.max_seq_len), kv_bucket(ctx + k + 1, t.max_seq_len)
    kvd = kv_bucket(ctx + 2 * k + 1, t.max_seq_len)  # the draft's reads, as in generate (its chain runs ahead)
    step_tok, vtok = b.fill[:, ctx - 1:ctx], b.fill[:, ctx - k - 1:ctx]
    aux, last = b.aux[:, ctx - k - 1:ctx], torch.full((B,), k, device=t.device)
    calls = {"decode_step": (GraphKey("decode_step", "decode", B, 1, kv1),
                             partial(t, mode="decode", kv_len=kv1), (step_tok, pos1))}
    for mode in b.modes:
        calls[b.verify_name(mode)] = (GraphKey("verify", mode, B, k + 1, kvv),
                                      partial(t, mode=mode, capture_aux=True, kv_len=kvv), (vtok, posv))
    calls["draft_extend"] = (GraphKey("draft_extend", None, B, k + 1, kvd),
                             partial(b.head.extend, kv_len=kvd), (vtok, posv, aux, last))
    first, g = b.head.extend(vtok, posv, aux, last, kv_len=kvd)
    calls["draft_step"] = (GraphKey("draft", None, B, 1, kvd),
                           partial(b.head.chain, num_steps=2, kv_len=kvd), (first, g, pos1[:, 0] + k))
    if b.cfg.speculative_eagle_topk > 1:
        calls.update(tree_calls(b, ctx))
    return calls


def tree_calls(b, ctx):
    """The tree's phases beside the chain's: the verify of its N nodes after ctx cached tokens
    (each attention mode; a tree the head drafts from arbitrary inputs, as phase_calls' are) and
    the head's expansion (S - 1 passes of K rows)."""
    K, S, N = b.cfg.speculative_eagle_topk, b.k, b.cfg.speculative_num_draft_tokens
    B, t, head = b.cfg.batch_size, b.target, b.head
    kvt, kvd = kv_bucket(ctx + N, t.max_seq_len), kv_bucket(ctx + N + (S - 1) * K, t.max_seq_len)
    vtok, posv = b.fill[:, ctx - S - 1:ctx], b.positions(ctx - S - 1, S + 1)
    last = torch.full((B,), S, device=t.device)
    logits, g = head.extend_logits(vtok, posv, b.aux[:, ctx - S - 1:ctx], last, kv_len=kvd)
    expand = partial(head.tree, topk=K, num_steps=S, num_nodes=N, kv_len=kvd)
    tree = expand(vtok[:, -1], logits, g, posv[:, -1])
    start = torch.full((B,), ctx, device=t.device)
    inputs = (tree.tokens, ctx + tree.depths, start.unsqueeze(1) + torch.arange(N, device=t.device),
              tree_visible(tree.parents, start, kvt))
    calls = {f"{b.verify_name(mode)} tree": (GraphKey("verify_tree", mode, B, N, kvt),
                                             partial(tree_forward, t, mode=mode, kv_len=kvt), inputs)
             for mode in b.modes}
    calls["draft_tree"] = (GraphKey("draft_tree", None, B, (S - 1) * K, kvd), expand,
                           (vtok[:, -1], logits, g, posv[:, -1]))
    return calls


def time_phases(b, ctx, graph, suffix=""):
    """Median ms of each isolated phase at ctx cached tokens, eager or replayed from its graph."""
    name = ("graph" if graph else "eager") + suffix
    return {f"{phase}/{name}": b.timed(key, fn, *inputs, graph=graph)
            for phase, (key, fn, inputs) in phase_calls(b, ctx).items()}


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
    B = b.cfg.batch_size
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
    graph, mode = b.graph_opts[-1], b.best[1]
    B, t, sweep = b.cfg.batch_size, b.target, {}
    for T in range(1, 7):
        if ctx < T:
            break
        kv, vt, pos = kv_bucket(ctx + T, t.max_seq_len), b.fill[:, ctx - T:ctx], b.positions(ctx, T)
        kvd = kv_bucket(ctx + 2 * T - 1, t.max_seq_len)  # as generate's draft extend for num_steps T - 1
        sweep[T] = dict(
            verify=b.timed(GraphKey("verify", mode, B, T, kv),
                           partial(t, mode=mode, capture_aux=True, kv_len=kv), vt, pos, graph=graph),
            draft_extend=b.timed(GraphKey("draft_extend", None, B, T, kvd),
                                 partial(b.head.extend, kv_len=kvd), vt, pos, b.aux[:, ctx - T:ctx],
                                 torch.full((B,), T - 1, device=t.device), graph=graph))
    return sweep


def run_generate(b, draft, mode, graph):
    """One generate() call on the random prompts, with device events at each phase of each cycle."""
    a, timer = b.cfg, PhaseTimer(b.clock)
    b.clock.sync()
    t0 = time.perf_counter()
    tree = a.speculative_eagle_topk > 1
    res = generate(b.target, draft, b.fill[:, :a.prompt_len].cpu(), max_new_tokens=a.max_new_tokens, num_steps=b.k,
                   attention_mode=mode, use_graphs=graph, temperature=a.temperature, seed=a.seed, eos_id=-1,
                   graphs=b.runner if graph else None, simulate_accept_len=a.simulate_accept_len if draft else None,
                   timer=timer, topk=a.speculative_eagle_topk if tree else None,
                   num_draft_tokens=a.speculative_num_draft_tokens if tree else None)
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
    runs = len(b.graph_opts) * (1 + len(b.modes))
    bar = tqdm(total=2 * runs, desc="end to end", unit="run", disable=not is_rank0(), leave=False)

    def twice(name, draft, mode, graph):  # the first run captures the graphs; the second is timed
        bar.set_description(f"end to end: {name}")
        for _ in range(2):
            out = run_generate(b, draft, mode, graph)
            bar.update()
        return out
    with bar:
        for graph in b.graph_opts:
            name = f"baseline/{'graph' if graph else 'eager'}"
            e2e[name], base = twice(name, None, "decode", graph)
        for graph in b.graph_opts:
            for mode in b.modes:
                name = f"eagle3/{FLAG_WORD[mode]}/{'graph' if graph else 'eager'}"
                e2e[name], res = twice(name, b.head, mode, graph)
                same = sum(x == y for r, p in zip(res.tokens, base.tokens) for x, y in zip(r, p))
                agreement[name] = same / max(1, sum(len(p) for p in base.tokens))
    # greedy and the model's own routing: uniform routing picks experts by a token's place in the forward
    same_model = b.cfg.temperature == 0 and not b.cfg.simulate_accept_len and b.target.routing == "model"
    return e2e, agreement if same_model else None


def collectives(b, r):
    """Real TP only: what one all-reduce of T tokens' hidden rows costs, in us, by T, three ways:
    interleaved, the figure that predicts a real step: n = 2 x layers all-reduces in one CUDA graph,
    each of the output of a GEMV as long as the compute between two all-reduces of this run's
    decode step (its time / n, at the copy bandwidth), minus the same graph without them; back to
    back: n in a row in a graph (each then pays its whole latency, which compute otherwise hides
    in part); eager: separate launches, host included. Then the simulated twin (twin_phases)."""
    t, n, B = b.target, 2 * b.target.args.num_hidden_layers, b.cfg.batch_size
    D, variant = t.args.hidden_size, b.best[0]
    gap_ms = r["phases_ms"][f"decode_step/{variant}"] / n
    cols = max(D, round(gap_ms * 1e-3 * (r["bandwidth_GBps"] or 0) * 1e9 / (D * t.dtype.itemsize)))
    w = torch.randn(D, cols, device=t.device).to(t.dtype) / cols ** 0.5
    out = dict(us_each={}, gemv_MB=w.numel() * w.element_size() / 1e6, per_forward=n,
               implementation=t.tp.describe())

    def gemvs(x, reduce, w=w):
        for _ in range(n):
            y = F.linear(x, w)  # [B T, D], as a row-parallel projection's partial sums
            y = t.tp.all_reduce(y) if reduce else y
        return y

    def in_a_row(buf):
        for _ in range(n):
            buf = t.tp.all_reduce(buf)
        return buf

    def between_compute(name, T, w):
        x = torch.randn(B * T, w.shape[1], device=t.device).to(t.dtype)
        both = b.timed(GraphKey(name + "+allreduce", None, B, T), partial(gemvs, reduce=True, w=w),
                       x, graph=True)
        alone = b.timed(GraphKey(name, None, B, T), partial(gemvs, reduce=False, w=w), x, graph=True)
        return (both - alone) * 1e3 / n

    us = out["us_each"]
    for T in sorted({1, 2, 4, 6, b.k + 1}):
        buf = torch.zeros(B * T, D, dtype=t.dtype, device=t.device)
        us[f"eager/{T}"] = median_ms(b.clock, lambda: t.tp.all_reduce(buf), b.cfg.reps) * 1e3
        if b.runner is None:
            continue
        key = GraphKey("allreduce", None, B, T)
        us[f"back_to_back/{T}"] = b.timed(key, in_a_row, buf, graph=True) * 1e3 / n
        us[f"interleaved/{T}"] = between_compute("gemv", T, w)
    if b.runner is not None:  # T = 1 after a GEMV 8 times shorter: how much the gap matters
        us["interleaved_short_gemv/1"] = between_compute("gemv_short", 1, w[:, :max(D, cols // 8)])
        out.update(twin_phases(b, r, n))
    out["for_simulated_rank_us"] = us.get("interleaved/1")  # what --allreduce-us should get
    return out


def twin_phases(b, r, n):
    """The decode step and the verify again, captured with every layer's TP swapped for a SIMULATED
    rank's (collectives skipped: what `--simulate-tp N` builds, on this rank's very weights), then
    put back: real minus twin, over n, is what an all-reduce cost inside this step (the logits'
    all-gather and the embedding's all-reduce counted in). The twin's graphs live in a runner of
    their own (the keys are the real phases')."""
    twin = dataclasses.replace(b.target.tp, simulated=True, one_shot=None)
    modules = [m for m in [*b.target.modules(), *b.head.modules()]
               if isinstance(getattr(m, "tp", None), tpm.TP)]
    real, runner = [m.tp for m in modules], b.runner
    try:
        for m in modules:
            m.tp = twin
        b.runner = CudaGraphs(b.target.device)
        phases = time_phases(b, b.cfg.context_len[0], True, "+twin")
    finally:
        for m, tp in zip(modules, real):
            m.tp = tp
        b.runner = runner
    out = dict(twin_phases_ms=phases, real_minus_twin_us={})
    for name in ("decode_step", *(b.verify_name(mode) for mode in b.modes)):
        diff = r["phases_ms"][f"{name}/graph"] - phases[f"{name}/graph+twin"]
        out["real_minus_twin_us"][name] = diff * 1e3 / n
    return out


def compiled(b, ctx, result):
    """The captured phases again with torch.compile fusing each layer (last: it changes the
    modules). The compiled layers' graphs live in a runner of their own: the keys are the same."""
    try:
        kernels.compile_layers(b.target)
        kernels.compile_head(b.head)
        b.runner = CudaGraphs(b.target.device)
        result["contexts"][ctx]["phases_ms"].update(time_phases(b, ctx, True, "+compile"))
        key, fn, inputs = phase_calls(b, ctx)["decode_step"]
        result["kernels_per_decode_step_compiled"] = count_kernels(partial(fn, *inputs))
    except Exception as e:  # an optional measurement: say why it is missing, keep the rest
        result["compile_error"] = f"{type(e).__name__}: {e}"[:500]
        tpm.print0(f"torch.compile variant failed: {result['compile_error']}")


def modelled_allreduce(b):
    """MODELLED all-reduce ms per target forward and per draft forward (2 a layer) for a simulated
    rank given --allreduce-us; None otherwise."""
    x = b.cfg.allreduce_us
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
    tree = tree_cost(r, b, base, host, ar, cm) if b.cfg.speculative_eagle_topk > 1 else None
    for name, v in r["e2e"].items():  # against the baseline with the same graph setting
        if name.startswith("eagle3"):
            plain = r["e2e"][f"baseline/{name.split('/')[-1]}"]
            v["speedup_measured"] = v["tok_per_s"] / plain["tok_per_s"]
            v["speedup_predicted"] = v["accept_len_mean"] * plain["phases_ms"]["cycle"] / v["phases_ms"]["cycle"]
    return dict(plain_step_ms=base, steps=cm, **({"tree": tree} if tree else {}))


def tree_cost(r, b, base, host, ar, chains):
    """The tree's cycle, as cost_model's: draft extend over the deepest path + the expansion +
    the verify of its N nodes + accept + host [+ modelled all-reduces]; its break-even accepted
    length, and how many times the chain of num_steps' accepted length it must accept to beat it
    (the ratio of the two cycles: the same tokens a millisecond)."""
    (variant, mode), ph, sweep = b.best, r["phases_ms"], r["verify_sweep_ms"]
    K, S, N = b.cfg.speculative_eagle_topk, b.k, b.cfg.speculative_num_draft_tokens
    D = min(S, N - 1)
    extend = sweep[D + 1]["draft_extend"] if D + 1 in sweep else ph[f"draft_extend/{variant}"]
    cyc = (extend + ph[f"draft_tree/{variant}"] + ph[f"{b.verify_name(mode)} tree/{variant}"] + ph["accept"]
           + host + ar["target_forward_ms"] + S * ar["draft_forward_ms"])
    out = dict(topk=K, num_steps=S, num_draft_tokens=N, cycle_ms=cyc, break_even_accept_len=cyc / base)
    if S in chains:
        out.update(chain_cycle_ms=chains[S]["cycle_ms"], accept_ratio_to_beat_chain=cyc / chains[S]["cycle_ms"])
    return out


def header_of(b):
    t, a = b.target, b.cfg
    group, fp8 = t.args.int4_group_size, t.args.fp8_block
    quant_note = (f" (routed experts INT4, group {group})" if group else
                  f" (routed experts FP8 e4m3, {fp8[0]}x{fp8[1]} blocks)" if fp8 else "")
    routing = "routing SIMULATED uniform" if t.routing == "uniform" else "routing: the model's router"
    ar = modelled_allreduce(b)
    return (f"target: {b.how}, {t.args.num_hidden_layers} layers, {t.args.n_routed_experts} routed experts, "
            f"{t.tp.describe()}, {a.dtype}{quant_note}, moe {moe_note(t)}, kernels {','.join(t.kernels) or 'none'}"
            + (f" (the head's: {','.join(b.head.kernels) or 'none'})" if b.head is not None else "") + ", "
            f"{routing} | batch {a.batch_size}, prompt {a.prompt_len}, cached "
            f"{'/'.join(map(str, a.context_len))} (isolated phases), num_steps {b.k} | "
            f"{torch.cuda.get_device_name(t.device) if b.gpu else f'CPU, {torch.get_num_threads()} thread(s)'}, "
            f"torch {torch.__version__}" + (" | acceptance SIMULATED" if a.simulate_accept_len is not None else "")
            + (f" | all-reduces MODELLED at {ar['us_each']:g} us" if ar else ""))


def moe_note(t):
    """Which MoE path runs: with "fused", for which token counts."""
    experts = next((layer.mlp.experts for layer in t.layers if isinstance(layer.mlp, model.MoE)), None)
    if t.moe_impl != "fused" or experts is None:
        return t.moe_impl
    grouped_above = kernels.grouped_mm_available(t.device, t.dtype) and not experts.quantized
    return "fused Triton kernel" + (f" (grouped above {experts.FUSED_MAX_TOKENS} tokens)" if grouped_above else "")


def bench_main(cfg, device, world):
    b = prepare(cfg, device)
    header = header_of(b)
    tpm.print0(wrap(header, "", "  "))
    env = dict(device=torch.cuda.get_device_name(device) if b.gpu else "cpu", torch=torch.__version__,
               world_size=world, simulated_tp=cfg.simulate_tp if b.target.tp.simulated else None, dtype=cfg.dtype,
               int4_group_size=b.target.args.int4_group_size, fp8_block=b.target.args.fp8_block,
               moe_impl=b.target.moe_impl,
               kernels=list(b.target.kernels), draft_kernels=list(b.head.kernels) if b.head is not None else None,
               routing=b.target.routing,
               simulated_routing=b.target.routing == "uniform", seed=cfg.seed,
               simulated_acceptance=cfg.simulate_accept_len is not None, target=b.how, config=vars(cfg),
               weights="trained tiny pair" if cfg.trained_pair else "checkpoints" if cfg.model_path else "random",
               cpu_count=os.cpu_count())
    bandwidth = copy_bandwidth(b.clock, device) if b.gpu else None
    r = dict(env=env, bandwidth_GBps=bandwidth, contexts={c: isolated(b, c, bandwidth) for c in cfg.context_len})
    first = cfg.context_len[0]
    r["phases_ms"] = r["contexts"][first]["phases_ms"]
    key, fn, inputs = phase_calls(b, first)[b.verify_name(b.modes[0])]
    logits = fn(*inputs)[0]
    gen = None if cfg.temperature == 0 else torch.Generator(device).manual_seed(0)
    r["phases_ms"]["accept"] = median_ms(b.clock, lambda: accept(logits, inputs[0][:, 1:], cfg.temperature, gen), cfg.reps)
    r["verify_sweep_ms"] = verify_sweep(b, first)
    r["e2e"], r["greedy_agreement_with_plain"] = ({}, None) if cfg.skip_e2e else end_to_end(b)
    r["floors"] = legacy_floors(r["contexts"][first], bandwidth)
    r["allreduce_measured"] = collectives(b, r) if b.target.tp.communicates else None
    r["allreduce_modelled"] = modelled_allreduce(b)
    if cfg.compile:
        compiled(b, first, r)
    r["cost_model"] = cost_model(r, b)
    if b.gpu:
        env["gpu_mem_peak_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
        env["gpu_mem_peak_eager_GB"] = r["contexts"][first].get("gpu_mem_peak_eager_GB")
        env["weights_GB"] = sum(p.numel() * p.element_size() for p in b.target.parameters()) / 1e9
        env["routed_experts_GB"] = sum(p.numel() * p.element_size() for n, p in b.target.named_parameters()
                                       if ".mlp.experts." in n) / 1e9
        r["kernels_per_decode_step"] = r["contexts"][first]["components"]["decode_step"]["kernels"]
    env["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # over the last minute
    r["warnings"], r["spread_ms"] = timing_warnings(r), spreads(r)
    r["answer"] = answer(r, b) + verdict(r)
    if is_rank0():
        report(r, b)
    line = json.dumps(r) + "\n"
    if is_rank0() and cfg.json == "-":
        print(line, end="", flush=True)
    elif is_rank0() and cfg.json:
        baseline.write_whole(cfg.json, lambda f: f.write(line.encode()))
    return r


def print_refusal(e):
    """One line on stderr, no traceback; returns the exit status. A flag is the same on every
    rank, so under torchrun rank 0 alone says it and fails (the other ranks exit quietly with
    status 0, before it, so that torchrun's report names one failure: rank 0, exit code 2); a
    checkpoint may fail on one rank only, so each rank that refuses one says so, tagged."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and isinstance(e, checkpoint.CheckpointError):
        print(f"run.py: error: [rank {rank}] {e}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(f"run.py: error: {e}", file=sys.stderr, flush=True)
    if world > 1 and rank == 0:
        time.sleep(1.0)  # let the other ranks leave first: torchrun then reports rank 0's failure alone
    return 2 if rank == 0 else 0


def cli(argv=None):
    """The command line: main's exit status; a refusal in one line (status 2); Ctrl-C in one line
    (status 130, the shell's for SIGINT; an output file is written whole or not at all)."""
    status = 2
    try:
        status = main(argv)
    except (BadInput, checkpoint.CheckpointError, NotImplementedError) as e:
        status = print_refusal(e)
    except KeyboardInterrupt:
        status = 130
        if int(os.environ.get("RANK", 0)) == 0:
            tqdm.write("run.py: interrupted (Ctrl-C); no output file written", file=sys.stderr)
    finally:  # every rank leaves the group together (gloo aborts a rank whose peer exits first)
        if dist.is_initialized():
            dist.destroy_process_group()
    return status


@torch.no_grad()
def main(argv=None):
    """Returns the exit status (0, or 1 when --compare fails); a flag, file or checkpoint the run
    cannot use raises BadInput or checkpoint.CheckpointError, which the command line prints as one line."""
    args = parse_args(argv)
    if args.compare:
        with refusal():
            return baseline.compare_main(args)
    rank, world, device = tpm.init_distributed()
    cfg = settle(args, device, world)
    check_sizes(cfg, device, world)
    if cfg.dump:
        target, head, how = build(cfg, device, getattr(torch, cfg.dtype))
        with refusal("--dump: "):
            return baseline.dump_main(cfg, target, head, how)
    bench_main(cfg, device, world)
    return 0


@contextmanager
def refusal(prefix=""):
    """The baseline's ValueErrors (a file or a request it cannot use) as BadInput: one line, status 2."""
    try:
        yield
    except ValueError as e:
        raise BadInput(prefix + str(e)) from None


if __name__ == "__main__":
    sys.exit(cli())
