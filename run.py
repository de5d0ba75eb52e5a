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
be converted to; --compare judges where two such files disagree (README: "Checking an engine
against this reference").

Exit status: 0 done; 1 --compare found a difference past its thresholds; 2 the input cannot be used
(a flag, a file, a checkpoint), said in one line on stderr.
"""
import argparse
import json
import math
import os
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

import checkpoint
import kernels
import model
import tp as tpm
import train
from draft import Eagle3Draft, draft_preset, set_target_aux_layers
from graphs import CudaGraphs
from verify import ATTENTION_MODES, accept, generate, kv_bucket, prefill_draft, prefill_target


# bf16 Kimi-K2 on one GPU, as one simulated TP-8 rank: 384 routed experts weigh 259 GB there, 1.8x
# an H200's 141 GB; 128 of them, 89 GB with the rest of the rank, leave room for the cache and graphs
BF16_EXPERTS_ON_ONE_GPU = 128
# a real TP rank seeds every tensor whole on its CPU and keeps its slice (so TP N holds the same model
# as TP 1) while its shard stays under this many parameters; a bigger one draws its slice on the device
MAX_PARAMS_SEEDED_WHOLE = 5e8


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
    p.add_argument("--model-path", help="HF DeepseekV3 / Kimi-K2 checkpoint folder (else --preset)")
    p.add_argument("--draft-path", help="SpecForge / SGLang EAGLE-3 checkpoint folder (else the trained tiny "
                   "pair's head on a CPU, or a random head)")
    p.add_argument("--random-weights", action="store_true", help="with the tiny preset: a random target and "
                   "head instead of the trained pair in checkpoints/tiny-stdlib (train.py), the tiny default")
    p.add_argument("--preset", choices=sorted(model.PRESETS), help="random target to build: kimi-k2 (GPU only), "
                   "kimi-k2.5 (INT4 experts, GPU only), tiny (a toy with every feature; default on CPU)")
    p.add_argument("--simulate-tp", type=int, help="build one SIMULATED rank of TP N (default on one GPU "
                   "with kimi-k2: 8)")
    p.add_argument("--routed-experts", type=int, help="keep N routed experts per layer of a random target "
                   "(memory override; default on one GPU with bf16 kimi-k2: 128; all 384 with --quant int4 or fp8)")
    p.add_argument("--quant", choices=["none", "int4", "fp8"], help="random weights in this layout: int4 = routed "
                   "experts packed as Kimi-K2-Thinking / K2.5 ship them; fp8 = routed experts in FP8 e4m3 with "
                   "128x128 block scales as Kimi-K2-Instruct ships them (the rest dequantized, as at load) "
                   "(default: the preset's)")
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft tokens proposed per cycle, k "
                   "(verify reads k + 1 tokens; default %(default)s)")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="draft branches per step; only 1 "
                   "(chain drafting) is implemented")
    p.add_argument("--speculative-num-draft-tokens", type=int, help="tokens verified per cycle; with topk 1 "
                   "always num_steps + 1 (another value is adjusted, with a note)")
    p.add_argument("--speculative-attention-mode", choices=["prefill", "decode", "both"],
                   help="attention path of verify: prefill (keys and values expanded) or decode (absorbed "
                   "MLA); default: both (timing), prefill (--dump)")
    p.add_argument("--cuda-graph", choices=["on", "off", "both"], help="replay captured CUDA graphs; default: "
                   "both on a GPU, off on CPU (graphs need CUDA)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (default %(default)s)")
    p.add_argument("--prompt-len", type=int, help="tokens in each random prompt (default 256 on a GPU, 16 on CPU)")
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
                   "(kernels.py; grouped above 256 tokens for unquantized experts) (auto: fused on a GPU with Triton, else grouped; "
                   "CPU: gather)")
    p.add_argument("--kernels", help="fast twins in place of the plain code (Triton kernels, and "
                   "fused_proj: stacked-weight GEMMs): 'all', 'none' or a comma list of " + ",".join(model.KERNELS)
                   + " (default: all on a CUDA GPU with Triton and a bf16/fp16/fp32 model, else none)")
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
                   "labelled MODELLED (~15-20 on NVLink, ~35 over PCIe at TP 8; a torchrun run prints the X it "
                   "measured in a CUDA graph)")
    p.add_argument("--json", help="also write the final JSON line here")
    b = p.add_argument_group("correctness baseline (README: Checking an engine against this reference)")
    b.add_argument("--dump", metavar="PATH", help="write greedy output and top-K log-probabilities of the "
                   "--prompt-ids to this .npz (speculative, with drafts and accepted counts, when --draft-path "
                   "is given); no timing")
    b.add_argument("--prompt-ids", metavar="FILE", help="for --dump: one JSON list of token ids per line")
    b.add_argument("--topk", type=int, help="for --dump: log-probabilities kept per position (default 20)")
    b.add_argument("--compare", nargs=2, metavar=("A.npz", "B.npz"), help="judge dump B against reference A "
                   "(no model, no GPU); exit status 1 past the thresholds below, 2 if the files cannot be compared")
    b.add_argument("--max-logprob-diff", type=float, default=MAX_LOGPROB_DIFF, help="largest |log p_A - log p_B| "
                   "over ids in both top-K lists, on positions both runs read the same tokens; also how far "
                   "below A's top-1 B's token may be where the outputs part (default %(default)s)")
    b.add_argument("--min-top1-agreement", type=float, default=MIN_TOP1_AGREEMENT, help="share of those "
                   "positions, all rows together, whose top-1 ids agree (default %(default)s)")
    b.add_argument("--max-accept-diff", type=float, default=MAX_ACCEPT_DIFF, help="largest difference in drafts "
                   "accepted per cycle (mean over all rows' cycles), when both files have 'accepted' "
                   "(default %(default)s)")
    return p


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
    if args.speculative_eagle_topk != 1:
        raise BadInput(f"--speculative-eagle-topk {args.speculative_eagle_topk}: only 1 (chain drafting) is implemented")
    k, sim = args.speculative_num_steps, args.simulate_accept_len
    if sim is not None and not 1 <= sim <= k + 1:
        raise BadInput(f"--simulate-accept-len {sim}: must lie in [1, num_steps + 1 = {k + 1}] (accepted "
                       "tokens per cycle, the bonus token included)")
    if args.compare and (args.dump or args.model_path or args.draft_path):
        raise BadInput("--compare reads two dump files and builds no model: drop --dump, --model-path, --draft-path")
    for flag, value in (("--prompt-ids", args.prompt_ids), ("--topk", args.topk)):
        if value is not None and not args.dump:
            raise BadInput(f"{flag} is for --dump (the correctness baseline); the timing run uses random prompts")
    if args.model_path and (args.quant or args.routed_experts or args.preset):
        raise BadInput("--quant, --routed-experts and --preset shape random weights; a checkpoint's "
                       "config.json says its own")
    if args.random_weights and (args.model_path or args.draft_path):
        raise BadInput("--random-weights replaces the trained tiny pair; with --model-path / --draft-path the "
                       "checkpoints are used: drop one")
    if args.dump and (args.context_len or args.skip_e2e or args.compile):
        raise BadInput("--context-len, --skip-e2e and --compile shape the timing run; --dump times nothing")


def uses_trained_pair(args):
    """The tiny preset with nothing else asked of it runs the trained pair (train.py)."""
    other = (args.model_path or args.draft_path or args.random_weights or args.quant
             or args.routed_experts is not None or (args.simulate_tp or 1) > 1)
    return args.preset == "tiny" and not other


def settle(args, device, world):
    """Fill in device-dependent defaults (None means the default; 0 is a value) and check the
    flags that depend on the device, the speculative ones as SGLang does."""
    gpu = device.type == "cuda"
    if args.dump:
        settle_dump(args)
    args.speculative_attention_mode = args.speculative_attention_mode or "both"
    want = args.speculative_num_steps + 1
    if args.speculative_num_draft_tokens not in (None, want):
        tpm.print0(f"note: --speculative-num-draft-tokens {args.speculative_num_draft_tokens} adjusted to "
                   f"{want} (= num_steps + 1 with topk 1)")
    args.speculative_num_draft_tokens = want
    args.preset = args.preset or ("kimi-k2" if gpu else "tiny")
    args.trained_pair = uses_trained_pair(args)
    if args.trained_pair:
        args.model_path, args.draft_path = train.TARGET_DIR, train.DRAFT_DIR
    big = args.preset.startswith("kimi-k2") and not args.model_path
    if big and not gpu:
        raise BadInput(f"--preset {args.preset}: a random Kimi-K2 needs a GPU (hundreds of GB in memory); "
                       "on CPU use --preset tiny (the default) or --model-path")
    args.cuda_graph = args.cuda_graph or ("both" if gpu else "off")
    if args.compile and (not gpu or args.cuda_graph == "off"):
        raise BadInput("--compile times the captured phases: it needs a CUDA GPU and --cuda-graph on or both")
    if args.cuda_graph != "off" and not gpu:
        raise BadInput(f"--cuda-graph {args.cuda_graph}: CUDA graphs need a CUDA GPU; use --cuda-graph off on CPU")
    if args.simulate_tp is None:
        args.simulate_tp = 8 if big and gpu and world == 1 else 1
    if args.simulate_tp > 1 and world > 1:
        raise BadInput(f"--simulate-tp {args.simulate_tp} is for a single process; under torchrun the TP is real")
    quantized = args.quant in ("int4", "fp8") or args.quant is None and args.preset == "kimi-k2.5"
    if args.routed_experts is None and big and gpu and not quantized and not args.dump:
        args.routed_experts = BF16_EXPERTS_ON_ONE_GPU  # INT4 and FP8 experts all fit
    if not gpu and not args.dump and not os.environ.get("OMP_NUM_THREADS"):
        # timing on a CPU: one thread, unless asked. The toy model gains nothing from more, and
        # threads spinning on cores that other jobs share made a busy 2-core machine 10x slower
        torch.set_num_threads(1)
    defaults = dict(prompt_len=256 if gpu else 16, max_new_tokens=64 if gpu else 24,
                    dtype="bfloat16" if gpu else "float32", reps=20)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.routing = args.routing or ("model" if args.model_path or args.dump else "uniform")
    args.context_len = args.context_len or [args.prompt_len]
    if args.kernels is None:  # the fast twins where they run (each tested equal to its plain twin)
        fast = gpu and kernels.HAVE_TRITON and args.dtype in ("bfloat16", "float16", "float32")
        args.kernels = "all" if fast else "none"
    args.kernels = args.kernels if args.kernels in ("all", "none") else args.kernels.split(",")
    check_device_flags(args, device)
    return args


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
    unknown = [] if isinstance(args.kernels, str) else sorted(set(args.kernels) - set(model.KERNELS))
    if unknown:
        raise BadInput(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(model.KERNELS)}, all or none")
    if args.kernels not in ("none", ["fused_proj"]):   # fused_proj is plain torch
        try:
            kernels.check_available(device)
        except RuntimeError as e:
            raise BadInput(f"--kernels {','.join(args.kernels) if isinstance(args.kernels, list) else args.kernels}: "
                           f"{e}") from None
    if args.routed_experts is not None and not args.model_path:
        m = model.preset(args.preset)
        if not m.num_experts_per_tok <= args.routed_experts <= m.n_routed_experts or args.routed_experts % m.n_group:
            raise BadInput(f"--routed-experts {args.routed_experts}: {args.preset} needs between "
                           f"{m.num_experts_per_tok} (experts per token) and {m.n_routed_experts}, a multiple of "
                           f"n_group {m.n_group}")
    if args.moe_impl == "fused" and not model.fused_moe_available(device, getattr(torch, args.dtype)):
        raise BadInput(f"--moe-impl fused: the Triton kernel does not run {args.dtype} on {device.type} here (it "
                       "needs Triton and a CUDA GPU, and bf16, fp16 or fp32); use --moe-impl gather or auto")
    if args.moe_impl == "grouped" and not model.grouped_mm_available(device, getattr(torch, args.dtype)):
        raise BadInput(f"--moe-impl grouped: torch._grouped_mm does not run {args.dtype} on {device.type} here; "
                       "use --moe-impl gather or auto")


def build(args, device, dtype, world):
    """The target and the head, loaded or random. Returns (target, head, description)."""
    tp = tpm.TP.simulate(args.simulate_tp) if args.simulate_tp > 1 else tpm.TP.from_env()
    k = args.speculative_num_steps
    sweep = 6  # the isolated phases write up to 6 tokens after the longest context
    max_seq_len = max(args.prompt_len + args.max_new_tokens, max(args.context_len) + sweep) + 2 * k + 2
    if args.model_path:
        target = checkpoint.load_target(args.model_path, args.batch_size, max_seq_len, device, dtype, tp,
                                        moe_impl=args.moe_impl, routing=args.routing, kernels=args.kernels)
        how = f"loaded {args.model_path}"
        if args.trained_pair:
            how = ("the trained tiny pair (checkpoints/tiny-stdlib, made by train.py from bytes of Python stdlib "
                   "source" + ("" if args.dump else "; prompts: held-out stdlib source") + "; --random-weights for "
                   "random ones)")
    else:
        quant = {None: {}, "none": dict(quantization_config=None), "int4": dict(quantization_config="int4"),
                 "fp8": dict(quantization_config="fp8")}
        margs = model.preset(args.preset, **quant[args.quant])
        if args.routed_experts is not None:
            tpm.print0(f"memory override: {args.routed_experts} of {margs.n_routed_experts} routed experts per layer kept")
            margs.n_routed_experts = args.routed_experts
        try:
            target = model.Transformer(margs, args.batch_size, max_seq_len, device, dtype, tp, moe_impl=args.moe_impl,
                                       routing=args.routing, kernels=args.kernels)
        except ValueError as e:  # a size the TP does not divide
            raise BadInput(f"--preset {args.preset} at TP {tp.world_size}: {e}") from None
        whole = tp.world_size == 1 or not tp.simulated and sum(p.numel() for p in target.parameters()) < MAX_PARAMS_SEEDED_WHOLE
        checkpoint.init_random(target, args.seed, rank_local=not whole)
        how = f"random {args.preset} ({'seeded whole, same at any TP' if whole else 'rank-local init'})"
    if args.draft_path:
        head = checkpoint.load_draft(args.draft_path, target)
    elif args.dump:  # a dump without a draft checkpoint is plain greedy
        head = None
    else:
        tiny = target.args.hidden_size == model.PRESETS["tiny"]["hidden_size"]
        dargs = draft_preset("tiny" if tiny else "kimi-k2")
        if max(dargs.aux_layer_ids or [0]) >= target.args.num_hidden_layers:  # Kimi's ids, a shallower target
            dargs.eagle_config = None  # EAGLE-3's default layers of this target instead
        set_target_aux_layers(target, dargs)
        head = checkpoint.init_random_draft(Eagle3Draft(dargs, target), args.seed + 1, rank_local=tp.simulated)
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


class Timing(float):
    """A median in ms that keeps its repetitions: it prints, computes and serializes as the
    median; spread() and noisy say how far to trust it."""

    def __new__(cls, samples):
        samples = sorted(samples)
        t = super().__new__(cls, statistics.median(samples))
        t.samples = samples
        return t

    def spread(self):
        """[min, lower quartile, median, upper quartile, max]"""
        s = self.samples
        q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else s * 3
        return [s[0], q1, float(self), q3, s[-1]]

    @property
    def noisy(self):
        """The middle half of the repetitions spans more than NOISY_IQR of the median (ignoring
        spans under NOISE_FLOOR_MS: a launch's jitter, too small to change a conclusion)."""
        _, q1, med, q3, _ = self.spread()
        return q3 - q1 > max(NOISY_IQR * med, NOISE_FLOOR_MS)


NOISY_IQR = 0.25
NOISE_FLOOR_MS = 0.05


def median_ms(clock, fn, reps, warmup=3, desc=None):
    for _ in range(warmup):
        fn()
    stamps = []
    for _ in tqdm(range(reps), desc=desc, disable=desc is None or not is_rank0(), leave=False):
        a = clock.stamp()
        fn()
        stamps.append((a, clock.stamp()))
    clock.sync()
    return Timing([clock.ms(a, b) for a, b in stamps])


def phase_label(key, graph):
    """A progress bar's name for a CudaGraphs key: the phase, its attention path, tokens, eager or graph."""
    name, *rest = key
    what = {"decode": "decode step", "verify": f"verify ({rest[0]} attention)", "draft_extend": "draft extend",
            "draft_chain": "draft step", "allreduce": "all-reduce"}.get(name, name)
    tokens = f", {rest[-1]} token{'s' if rest[-1] != 1 else ''}" if name in ("verify", "draft_extend") else ""
    return f"timing {what}{tokens}, {'graph' if graph else 'eager'}"


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


COMPONENTS = {  # the rows of the component table, in order
    "attn_core": "attention core (scores, softmax, values, cache write)",
    "attn_proj": "attention projections (q/kv down, up, o_proj)",
    "router": "router (scores, selection, weights)",
    "routed_experts": "routed experts (+ the shared one if in the launch)",
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
    # a shared expert folded into the fused MoE launch (kernels "shared_expert") runs there: its
    # bytes go with the routed experts' (its time does too)
    folded = tuple(f"layers.{i}.mlp.shared_experts." for i, layer in enumerate(target.layers)
                   if getattr(layer.mlp, "shared_in_launch", False))
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
# The correctness baseline: dump what the model says; judge any engine's dump against it.
# Entry points: settle_dump (the dump's own flags), dump_main and compare_main, which return the
# exit status to main; a file or flag they cannot use raises BadInput (status 2).
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
DUMP_TOPK = 20


def settle_dump(args):
    """--dump records the model's own greedy answers in one configuration: refuse what would
    change them, read the prompts, and size the run to them."""
    refuse = {"--simulate-tp": (args.simulate_tp or 1) > 1, "--routed-experts": args.routed_experts is not None,
              "--simulate-accept-len": args.simulate_accept_len is not None, "--temperature": args.temperature != 0,
              "--cuda-graph both": args.cuda_graph == "both", "--speculative-attention-mode both":
              args.speculative_attention_mode == "both", "--prompt-len": args.prompt_len is not None,
              "--batch-size": args.batch_size != 1, "--routing uniform": args.routing == "uniform"}
    for flag, bad in refuse.items():
        if bad:
            raise BadInput(f"--dump records the model's own greedy answers to --prompt-ids in one configuration: "
                           f"drop {flag}")
    if not args.prompt_ids:
        raise BadInput("--dump needs --prompt-ids FILE (one JSON list of token ids per line)")
    try:
        args.prompts = read_prompt_ids(args.prompt_ids)
    except (OSError, ValueError) as e:
        raise BadInput(f"--prompt-ids: {e}") from None
    args.batch_size, args.prompt_len = len(args.prompts), max(len(p) for p in args.prompts)
    args.simulate_tp, args.cuda_graph = 1, args.cuda_graph or "off"
    args.speculative_attention_mode = args.speculative_attention_mode or "prefill"
    args.topk = DUMP_TOPK if args.topk is None else args.topk


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
            if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
                raise ValueError(f"{path} line {i}: expected a non-empty JSON list of token ids (integers >= 0), "
                                 f"got {line.strip()[:80]}")
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


@torch.no_grad()
def dump(target, head, prompts, max_new_tokens, num_steps=3, topk=DUMP_TOPK, attention_mode="prefill",
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
        logits, _ = target(seqs[:, s:s + chunk], positions[:, s:s + chunk], "extend")
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
        k = check("draft_ids", "iu", [B, C, "k"])[2]
        if "accepted" in d and (d["accepted"] > k).any():
            b, c = np.argwhere(d["accepted"] > k)[0]
            raise ValueError(f"{name}: accepted[{b}, {c}] = {d['accepted'][b, c]} drafts, more than the k = {k} "
                             "that draft_ids says each cycle verified")
    return B, P, N


def load_dump(path):
    """A dump's arrays. A file that is not a readable .npz (missing, not a zip, truncated, holding
    pickled objects) raises BadInput naming it."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise BadInput(f"{path}: {e.strerror}") from None
    if magic != b"PK\x03\x04":  # an .npz is a zip archive of .npy files
        raise BadInput(f"{path} is not an .npz file (a zip of numpy arrays): it starts with {magic!r}")
    try:
        with np.load(path) as f:
            return {key: f[key] for key in f.files}
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise BadInput(f"{path} holds an object (pickled) array; a dump holds only int, float and str "
                           "arrays") from None
        raise BadInput(f"{path} is a corrupt .npz: {e}") from None
    except Exception as e:  # a truncated archive: zipfile.BadZipFile, EOFError, zlib.error, OSError
        raise BadInput(f"{path} is a truncated or corrupt .npz ({type(e).__name__}: {e})") from None


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


def judge_divergence(a, b, row, max_logprob_diff):
    """Where a row's greedy outputs first differ, B's token must be one that A could have chosen
    on a near-tie that another reduction order flips: in A's top-K at that position and at most
    max_logprob_diff below A's top-1 (the pattern of vLLM's check_logprobs_close). Returns None
    (no divergence, or a near-tie) or the failure, naming the row, the position, both tokens and
    their log-probabilities."""
    r, j = row["row"], row["diverge"]
    if j is None:
        return None
    t = row["prompt_len"] - 1 + j                                   # the position that chose output j
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
        f"{tok} {'absent' if lp is None else f'{lp:.4f}'}" for tok, lp in zip((tok_a, tok_b), in_b)) + ")"
    if ids[0] < 0 or lp_a is None:
        return f"{where}: A chose {tok_a}, B chose {tok_b}, and A's top-K there does not hold {tok_a} to judge by"
    if lp_b is None:
        return f"{where}: A chose {tok_a} (log p {lp_a:.4f}), B chose {tok_b}, which is not in A's top-{len(ids)}{b_view}"
    gap = float(lps[0]) - lp_b
    if gap > max_logprob_diff:
        return (f"{where}: A chose {tok_a} (log p {lp_a:.4f}), B chose {tok_b} (log p {lp_b:.4f} in A, {gap:.4f} "
                f"below A's top-1 > --max-logprob-diff {max_logprob_diff}){b_view}")
    return None


def compare(a, b, names=("A", "B"), max_logprob_diff=MAX_LOGPROB_DIFF, min_top1_agreement=MIN_TOP1_AGREEMENT,
            max_accept_diff=MAX_ACCEPT_DIFF):
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
                             f"{list(b[key].shape)}: not dumps of the same prompts and max_new_tokens")
    if (a["prompt_ids"] != b["prompt_ids"]).any():
        row = int(np.argwhere(a["prompt_ids"] != b["prompt_ids"])[0, 0])
        raise ValueError(f"prompt_ids differ in row {row}: not dumps of the same prompts")
    if "draft_ids" in a and "draft_ids" in b and a["draft_ids"].shape[2] != b["draft_ids"].shape[2]:
        raise ValueError(f"draft_ids: {names[0]} drafts k = {a['draft_ids'].shape[2]} tokens a cycle, {names[1]} "
                         f"k = {b['draft_ids'].shape[2]}: not runs with the same num_steps")
    rows = [compare_row(a, b, r) for r in range(len(a["prompt_ids"]))]
    fail = []
    for row in rows:
        row["divergence_failure"] = judge_divergence(a, b, row, max_logprob_diff)
        fail += [row["divergence_failure"]] if row["divergence_failure"] else []
    seen = sum(r["positions"] for r in rows)
    report = dict(rows=rows, top1_agreement=sum(r["top1_agree"] for r in rows) / seen if seen else math.nan,
                  max_logprob_diff=max(r["max_logprob_diff"] for r in rows), accept_diff=None, failures=fail)
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
    head = (f"{'row':>4} {'prompt':>6} {'out A/B':>9} {'diverge@':>8} {'judged':>8} {'top-1 agree':>17} "
            f"{'max|dlogp|':>10} {'@pos':>5}")
    print("\n" + head + (f" {'accepted/cycle A/B':>18} {'differ@cycle':>12}" if accept else ""))

    def dash(x):
        return "-" if x is None else x
    for r in report["rows"]:
        share = r["top1_agree"] / r["positions"] if r["positions"] else math.nan
        judged = "-" if r["diverge"] is None else "FAIL" if r["divergence_failure"] else "near-tie"
        line = (f"{r['row']:>4} {r['prompt_len']:>6} {'%d/%d' % r['out_len']:>9} {dash(r['diverge']):>8} {judged:>8} "
                f"{'%d/%d' % (r['top1_agree'], r['positions']):>11} {share:5.3f} {r['max_logprob_diff']:>10.2e} "
                f"{dash(r['at']):>5}")
        if accept:
            line += f" {'%.2f/%.2f' % r['accepted_per_cycle']:>18} {dash(r['accept_differs_at']):>12}"
        print(line)
    accept_line = "" if report["accept_diff"] is None else \
        f", drafts accepted per cycle (bonus token not counted) differ by {report['accept_diff']:.3f}"
    print(f"\nall rows: top-1 agreement {report['top1_agreement']:.4f}, max |logprob diff| "
          f"{report['max_logprob_diff']:.3g}{accept_line}")
    print("FAIL: " + "; ".join(report["failures"]) if report["failures"] else "PASS")


def compare_main(args):
    """--compare: returns 0 (pass) or 1 (a divergence or a threshold failed); files that cannot be
    compared raise BadInput (status 2)."""
    a, b = (load_dump(path) for path in args.compare)
    try:
        report = compare(a, b, args.compare, args.max_logprob_diff, args.min_top1_agreement, args.max_accept_diff)
    except ValueError as e:
        raise BadInput(str(e)) from None
    print_comparison(report, args.compare, [str(d["meta"]) if "meta" in d else None for d in (a, b)])
    return 1 if report["failures"] else 0


def dump_main(args, device, world):
    """--dump: writes the file (rank 0) and returns 0."""
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
        raise BadInput(f"--dump: {e}") from None
    if is_rank0():
        with open(args.dump, "wb") as f:  # np.savez on a name would append ".npz" to other names
            np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
        print("wrote " + args.dump + ": " + ", ".join(f"{k} {list(v.shape)}" for k, v in arrays.items()), flush=True)
        if head is not None:
            print("accepted counts the drafts accepted per cycle, not the target's bonus token (SGLang's accept "
                  "length minus 1)", flush=True)
    return 0


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
    fill: torch.Tensor = None  # [B, C'] ids prefilled into the cache (random, or held-out text for the trained
                               # pair), C' the longest context or the prompt length, whichever is longer
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
        return median_ms(self.clock, call, self.args.reps, desc=phase_label(key, graph))


def prepare(args, device, world):
    """Build the models and fill their caches up to the longest context (random ids; held-out
    text for the trained pair)."""
    torch.manual_seed(args.seed)
    target, head, how = build(args, device, getattr(torch, args.dtype), world)
    b = Bench(args, target, head, how, Clock(device), CudaGraphs(device) if args.cuda_graph != "off" else None)
    B, C = args.batch_size, max(args.context_len)
    g = torch.Generator().manual_seed(args.seed)
    L = max(C, args.prompt_len)
    b.fill = (torch.tensor(train.heldout_prompts(B, L)) if args.trained_pair  # text like its training data
              else torch.randint(0, target.args.vocab_size, (B, L), generator=g)).to(device)
    last = torch.full((B,), C - 1, device=device)
    _, b.aux = prefill_target(target, b.fill[:, :C], last, capture_aux=True)
    prefill_draft(head, b.fill[:, :C], b.aux, last)  # fills the draft's cache (its output is not used)
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
    group, fp8 = t.args.int4_group_size, t.args.fp8_block
    quant_note = (f" (routed experts INT4, group {group})" if group else
                  f" (routed experts FP8 e4m3, {fp8[0]}x{fp8[1]} blocks)" if fp8 else "")
    routing = "routing SIMULATED uniform" if t.routing == "uniform" else "routing: the model's router"
    ar = modelled_allreduce(b)
    return (f"target: {b.how}, {t.args.num_hidden_layers} layers, {t.args.n_routed_experts} routed experts, "
            f"{t.tp.describe()}, {a.dtype}{quant_note}, moe {moe_note(t)}, kernels {','.join(t.kernels) or 'none'}, "
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
    grouped_above = experts.grouped_ok and not experts.quantized
    return "fused Triton kernel" + (f" (grouped above {experts.FUSED_MAX_TOKENS} tokens)" if grouped_above else "")


def bench_main(args, device, world):
    b = prepare(args, device, world)
    header = header_of(b)
    tpm.print0(header)
    env = dict(device=torch.cuda.get_device_name(device) if b.gpu else "cpu", torch=torch.__version__,
               world_size=world, simulated_tp=args.simulate_tp if b.target.tp.simulated else None, dtype=args.dtype,
               int4_group_size=b.target.args.int4_group_size, fp8_block=b.target.args.fp8_block,
               moe_impl=b.target.moe_impl,
               kernels=list(b.target.kernels), routing=b.target.routing,
               simulated_routing=b.target.routing == "uniform", seed=args.seed,
               simulated_acceptance=args.simulate_accept_len is not None, target=b.how, config=vars(args))
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
        env["routed_experts_GB"] = sum(p.numel() * p.element_size() for n, p in b.target.named_parameters()
                                       if ".mlp.experts." in n) / 1e9
        r["kernels_per_decode_step"] = r["contexts"][first]["components"]["decode_step"]["kernels"]
    r["warnings"], r["spread_ms"] = timing_warnings(r), spreads(r)
    r["answer"] = answer(r, b) + verdict(r)
    report(r, b)
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
        be = cm["break_even_accept_len"]
        pays = (f"pays above {be:.2f} accepted tokens per cycle" if 1 <= be <= k + 1 else
                f"cannot pay here ({be:.2f} plain steps a cycle; a cycle accepts at most {k + 1} tokens)"
                if be > k + 1 else f"looks cheaper than the plain step it contains ({be:.2f}), which cannot be: noise")
        lines += [f"EAGLE-3 with num_steps {k} {pays} (bonus included: a {cm['cycle_ms']:.2f} ms cycle against a "
                  f"{r['cost_model']['plain_step_ms']:.2f} ms plain step).",
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
    print(f"\nphase times at {ctx} cached tokens, isolated (ms: median [min lower-upper quartile max] of "
          f"{r['env']['config']['reps']} repetitions" + (
        f"; x floor: bytes that must move / {bw:.0f} GB/s measured" if bw else "; floors need a GPU") + ")")
    for name, ms in c["phases_ms"].items():
        phase = name.rsplit("/", 1)[0] if "/" in name else name
        floor, experts = c["floors_ms"].get(phase), c["distinct_experts"].get(phase)
        print(f"  {name:30s} {ms:9.3f} {fmt_spread(ms):34s}" + (f"   {ms / floor:5.1f}x floor {floor:.3f}" if floor else "")
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
    sim, k = b.args.simulate_accept_len, b.k
    print("\nend to end: tok/s | per-cycle phases (ms, median over the cycles) and the cycle's spread | accepted "
          f"tokens per cycle, bonus included: mean, and cycles by length{' (SIMULATED)' if sim is not None else ''}")
    if sim is not None:
        print(f"  SIMULATED acceptance: each cycle draws each row's accepted length from a normal around "
              f"--simulate-accept-len {sim} (sd 1), rounded and clamped to 1..{k + 1}; the tokens are not the model's")
    for name, v in r["e2e"].items():
        phases = " ".join(f"{p}={t:.2f}" for p, t in v["phases_ms"].items())
        extra = ""
        if "accept_len_mean" in v:
            hist = " ".join(f"{n}:{c}" for n, c in enumerate(v["accept_len_hist"], 1))
            extra = (f" | accept len {v['accept_len_mean']:.2f}, cycles by length {hist}"
                     f" | speedup {v['speedup_measured']:.2f}x (predicted {v['speedup_predicted']:.2f}x)")
        cycle = v["phases_ms"].get("cycle")
        spread = f" {fmt_spread(cycle, 2)}" if isinstance(cycle, Timing) else ""
        print(f"  {name:24s} {v['tok_per_s']:9.1f} tok/s | {phases}{spread}{extra}")


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
        print(f"\nGPU memory: weights {env['weights_GB']:.1f} GB (routed experts {env['routed_experts_GB']:.1f}), "
              f"peak allocated {env['gpu_mem_peak_GB']:.1f} GB"
              + (f" (eager phases only: {env['gpu_mem_peak_eager_GB']:.1f} GB)"
                 if env.get("gpu_mem_peak_eager_GB") is not None else ""))
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


def report(r, b):
    """The tables, the warnings and the answer (the header was printed at the start)."""
    if not is_rank0():
        return
    for ctx, c in r["contexts"].items():
        print_phases(r, ctx, c)
        print_components(r, ctx, c, b)
    print_e2e(r, b)
    print_cost_model(r)
    print_extras(r, b)
    for w in r["warnings"]:
        print(f"\nwarning: {w}")
    print("\nthe answer:\n" + "\n".join(f"  {line}" for line in r["answer"]) + "\n")


# ---------------------------------------------------------------------------------------------
# How far to trust the numbers: spreads, warnings, and the verdict after the answer

def spreads(tree):
    """The same nesting as `tree`, keeping only its Timings, each as its spread() (for the JSON)."""
    out = {}
    for key, v in tree.items():
        if isinstance(v, Timing):
            out[key] = v.spread()
        elif isinstance(v, dict) and (sub := spreads(v)):
            out[key] = sub
    return out


def named_timings(tree, path="", seen=None):
    """(name, Timing) for every Timing in the result, named as the tables name them, each once
    (the first context's phases appear twice in the result)."""
    seen = set() if seen is None else seen
    for key, v in tree.items():
        name = path if key in ("phases_ms", "e2e") else f"{path}sweep T=" if key == "verify_sweep_ms" else f"{path}{key}/"
        if isinstance(v, Timing) and id(v) not in seen:
            seen.add(id(v))
            yield name.rstrip("/"), v
        elif isinstance(v, dict):
            yield from named_timings(v, name, seen)


def timing_warnings(r):
    """What not to trust in these numbers: noisy timings, and derived figures that cannot be."""
    out = []
    noisy = [name for name, t in named_timings(r) if t.noisy]
    if noisy:
        out.append(f"{len(noisy)} timing(s) vary by more than {NOISY_IQR:.0%} of their median between repetitions "
                   f"(interquartile range; marked noisy): {', '.join(noisy[:5])}{' and more' if len(noisy) > 5 else ''}. "
                   "The machine is busy or the phase short: run on a quiet machine, with more --reps, one thread a "
                   "process (OMP_NUM_THREADS=1)")
    for steps, c in r["cost_model"]["steps"].items():
        be, most = c["break_even_accept_len"], int(steps) + 1
        if not 1 <= be <= most:
            out.append(f"num_steps {steps}: break-even {be:.2f} accepted tokens per cycle, outside [1, {most}]: "
                       + ("a cycle measured cheaper than the plain step it contains, which cannot be (noise)" if be < 1
                          else f"a cycle costs more than {most} plain steps, so it cannot pay here, unless it is noise"))
    for name, v in r["e2e"].items():
        alone, loop = r["phases_ms"].get(f"decode_step/{name.split('/')[-1]}"), v["phases_ms"].get("decode")
        if name.startswith("baseline/") and alone and loop and max(alone, loop) > 2 * min(alone, loop):
            out.append(f"the plain decode step takes {alone:.3f} ms alone and {loop:.3f} ms inside the loop "
                       f"({name}): the same work, so one of them is noise")
        if "speedup_predicted" in v and max(v["speedup_measured"], v["speedup_predicted"]) > \
                1.5 * min(v["speedup_measured"], v["speedup_predicted"]):
            out.append(f"{name}: measured speedup {v['speedup_measured']:.2f}x but {v['speedup_predicted']:.2f}x "
                       "predicted from its own phases: the wall clock and the phase timings disagree (noise)")
    sweep = {t: v["verify"] for t, v in r.get("verify_sweep_ms", {}).items()}
    inverted = [f"{t1} tokens {sweep[t1]:.3f} ms > 1.5 x {t2} tokens {sweep[t2]:.3f} ms"
                for t1 in sweep for t2 in sweep if t1 < t2 and sweep[t1] > 1.5 * sweep[t2]]
    if inverted:
        out.append(f"verify costs less with more tokens ({'; '.join(inverted[:3])}{'; ...' if len(inverted) > 3 else ''}), "
                   "which cannot be: noise")
    return out


def verdict(r):
    """After the answer: what this run's own acceptance means, and how far to trust its numbers."""
    spec = {n: v for n, v in r["e2e"].items() if n.startswith("eagle3")}
    lines = []
    if spec:
        best = max(spec, key=lambda n: spec[n]["speedup_measured"])
        accept_len, speedup = spec[best]["accept_len_mean"], spec[best]["speedup_measured"]
        if r["env"]["simulated_acceptance"]:
            lines.append(f"Acceptance was SIMULATED at {accept_len:.2f} tokens per cycle: the speedup ({speedup:.2f}x, "
                         f"{best}) is what the measured phase costs give at that acceptance, not what this draft head "
                         "achieves.")
        elif accept_len < 1.5:
            lines.append(f"The draft accepted almost nothing ({accept_len:.2f} tokens per cycle, bonus included; 1.00 "
                         f"means every draft rejected), as random weights do: the measured speedup ({speedup:.2f}x, "
                         f"{best}) says only what speculation's overhead costs. For a trained draft's speedup read the "
                         "cost model, run with --simulate-accept-len, or load checkpoints (--model-path, --draft-path; "
                         "on a CPU, the default without --random-weights is a trained tiny pair).")
        else:
            lines.append(f"The draft accepted {accept_len:.2f} tokens per cycle (bonus included): measured speedup "
                         f"{speedup:.2f}x ({best}).")
    if r["warnings"]:
        lines.append("Some timings are noisy or contradict each other (warnings above): treat these figures as rough.")
    if r["env"]["device"] == "cpu":
        lines.append("On a CPU the toy model's time is per-operation overhead: the numbers show how the phases fit "
                     "together, not what a GPU serving Kimi-K2 would see (BENCHMARKS.md has H200 numbers).")
    return lines


def fmt_spread(t, digits=3):
    mn, q1, _, q3, mx = t.spread()
    return f"[{mn:.{digits}f} {q1:.{digits}f}-{q3:.{digits}f} {mx:.{digits}f}]" + (" noisy" if t.noisy else "")


def print_refusal(e):
    """One line on stderr, no traceback; under torchrun each rank that refuses says which it is."""
    rank = f"[rank {dist.get_rank()}] " if dist.is_initialized() else ""
    print(f"run.py: error: {rank}{e}", file=sys.stderr, flush=True)


@torch.no_grad()
def main(argv=None):
    """Returns the exit status (0, or 1 when --compare fails); a flag, file or checkpoint the run
    cannot use raises BadInput or checkpoint.CheckpointError, which the command line prints as one line."""
    args = parse_args(argv)
    if args.compare:
        return compare_main(args)
    rank, world, device = tpm.init_distributed()
    args = settle(args, device, world)
    if args.dump:
        return dump_main(args, device, world)
    bench_main(args, device, world)
    return 0


if __name__ == "__main__":
    status = 2
    try:
        status = main()
    except (BadInput, checkpoint.CheckpointError, NotImplementedError) as e:
        print_refusal(e)
    finally:  # every rank leaves the group together (gloo aborts a rank whose peer exits first)
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(status)
