"""The timing run: build the target and the head, time each phase alone (eager and captured),
the verify sweep, the plain and speculative loops end to end, the collectives of real TP, and
with --distinct-sweep the verify across distinct experts (routing_sweep).

Device work is timed with CUDA events after warm-up, each time a median that keeps its
repetitions (report.Timing); on a CPU, whose ops run synchronously, a clock is honest. Every
stage returns a dataclass; measure() assembles them into one Result, which report.py prints and
writes as the --json line (report.as_json). components.py says where a phase's time goes and what
it could not go below; run.py is the command line that settles the configuration (cfg) first.
"""
import argparse
import dataclasses
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import kernels
import model
import routing
import tp as tpm
import train
from components import (CostModel, ModelledAllreduce, SweepCliffs, collectives_per_forward,
                        component_bytes, cost_model, count_kernels, draft_bytes,
                        modelled_allreduce, optional, profile_components, routed_distinct,
                        sweep_cliffs)
from draft import Eagle3Draft, draft_preset, set_target_aux_layers
from graphs import CudaGraphs, GraphKey
from report import Timing, answer, spreads, timing_warnings, verdict
from verify import (PREFILL_CHUNK, Probe, accept_chain, accept_tree, generate, kv_bucket,
                    prefill_draft, prefill_target, tree_forward)

# a real TP rank seeds every tensor whole on its CPU and keeps its slice (so TP N holds the same
# model as TP 1) while its shard stays under this many parameters; a bigger one draws its slice
# on the device
MAX_PARAMS_SEEDED_WHOLE = 5e8
# the run's names and JSON keys keep --speculative-attention-mode's word for an attention path
FLAG_WORD = {"extend": "prefill", "decode": "decode"}


def settle_defaults(cfg, gpu):
    """The defaults that depend on the device (run.settle fills them in): lengths, dtype,
    repetitions, routing, the verify sweep's tokens, kernels, and one thread for timing on a CPU."""
    if not gpu and not cfg.dump and not os.environ.get("OMP_NUM_THREADS"):
        # timing on a CPU: one thread, unless asked. The toy model gains nothing from more, and
        # threads spinning on cores that other jobs share slow a busy machine many times over
        torch.set_num_threads(1)
    defaults = dict(prompt_len=256 if gpu else 16, max_new_tokens=64 if gpu else 24,
                    dtype="bfloat16" if gpu else "float32", reps=20)
    for name, value in defaults.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    cfg.routing = cfg.routing or ("model" if cfg.model_path or cfg.trained_pair or cfg.dump
                                  else "uniform")
    cfg.context_len = cfg.context_len or [cfg.prompt_len]
    cfg.verify_sweep_tokens = verify_sweep_tokens(cfg, gpu)
    if cfg.kernels is None:  # the fast twins where they run (each tested equal to its plain twin)
        fast = gpu and cfg.dtype in ("bfloat16", "float16", "float32") and kernels.HAVE_TRITON
        cfg.kernels = "all" if fast else "none"
    cfg.kernels = cfg.kernels if cfg.kernels in ("all", "none") else cfg.kernels.split(",")


def cache_slots(cfg):
    """KV cache slots a row needs: the prompt and output, or the longest context and the tokens
    the verify sweep writes after it (its most: cfg.verify_sweep_tokens, sweep_tokens), and the
    draft chain's lookahead (a tree's: its N verified slots, or its deepest path and the head's
    (S - 1) K scratch slots past it, as verify.generate)."""
    k, K = cfg.speculative_num_steps, cfg.speculative_eagle_topk
    sweep, N = max(cfg.verify_sweep_tokens), cfg.speculative_num_draft_tokens
    ahead = 2 * k + 2 if K == 1 else max(2 * k + 2, max(N, min(k, N - 1) + (k - 1) * K) + 2)
    return max(cfg.prompt_len + cfg.max_new_tokens, max(cfg.context_len) + sweep) + ahead


def random_target_args(cfg):
    """The preset's ModelArgs with --quant and --routed-experts applied."""
    quant = {None: {}, "none": dict(quantization_config=None),
             "int4": dict(quantization_config="int4"), "fp8": dict(quantization_config="fp8")}
    margs = checkpoint.preset(cfg.preset, **quant[cfg.quant])
    if cfg.routed_experts is not None:
        margs.n_routed_experts = cfg.routed_experts
    return margs


def random_draft_args(target):
    """A random head's DraftArgs: the tiny one for the tiny target, else Kimi-K2's."""
    tiny = target.args.hidden_size == checkpoint.PRESETS["tiny"]["hidden_size"]
    dargs = draft_preset("tiny" if tiny else "kimi-k2")
    if max(dargs.aux_layer_ids or [0]) >= target.args.num_hidden_layers:  # Kimi's: a shallower
        dargs.eagle_config = None  # EAGLE-3's default layers of this target instead
    return dargs


def build(args, device, dtype):
    """The target and the head, loaded or random. Returns (target, head, description)."""
    tp = (tpm.TP.simulate(args.simulate_tp) if args.simulate_tp > 1
          else tpm.TP.from_env(args.allreduce))
    target, how = build_target(args, device, dtype, tp)
    kernels.accelerate(target, args.kernels, moe=args.moe_impl)   # the fast paths, from outside
    # --moe-adaptive: FP8's entry of the fused MoE's rule (kernels.moe.ADAPTIVE_MIN_TOKENS), this
    # build's flag, none without it (the rule is the process's: a build sets it or clears it)
    kernels.moe.ADAPTIVE_MIN_TOKENS.pop("fp8", None)
    if args.moe_adaptive is not None:
        kernels.moe.ADAPTIVE_MIN_TOKENS["fp8"] = args.moe_adaptive
    if args.draft_path:
        head = checkpoint.load_draft(args.draft_path, target)
    elif args.dump:  # a dump without a draft checkpoint is plain greedy
        head = None
    else:
        dargs = random_draft_args(target)
        set_target_aux_layers(target, dargs)
        head = checkpoint.init_random_draft(Eagle3Draft(dargs, target), args.seed + 1,
                                            rank_local=tp.simulated)
    if head is not None:
        kernels.accelerate_draft(head, args.kernels)   # the head's fast paths, as the target's
    return target, head, how


def build_target(args, device, dtype, tp):
    """The target, loaded or random (a size the TP does not divide was refused before:
    run.check_sizes, memory_needed). Returns (target, description)."""
    max_seq_len = cache_slots(args)
    if args.model_path:
        target = checkpoint.load_target(args.model_path, args.batch_size, max_seq_len, device,
                                        dtype, tp, routing=built_routing(args))
        if not args.trained_pair:
            return target, f"loaded {args.model_path}"
        return target, ("the trained tiny pair (checkpoints/tiny-stdlib, made by train.py from "
                        "bytes of Python stdlib source"
                        + ("" if args.dump else "; prompts: held-out stdlib source")
                        + "; --random-weights for random ones)")
    margs = random_target_args(args)
    if args.routed_experts is not None:
        tpm.print0(f"memory override: {args.routed_experts} of "
                   f"{checkpoint.preset(args.preset).n_routed_experts} routed experts "
                   "per layer kept")
    target = model.Transformer(margs, args.batch_size, max_seq_len, device, dtype, tp,
                               routing=built_routing(args))
    params = sum(p.numel() for p in target.parameters())
    whole = tp.world_size == 1 or (not tp.simulated and params < MAX_PARAMS_SEEDED_WHOLE)
    checkpoint.init_random(target, args.seed, rank_local=not whole)
    init = "seeded whole, same at any TP" if whole else "rank-local init"
    return target, f"random {args.preset} ({init})"


def memory_needed(cfg, device, world):
    """Bytes one rank will hold at its peak, by part: the target and the head built on the meta
    device (their weights, KV caches and RoPE tables, exactly, without allocating them), and the
    largest transient: one prefill chunk of extend attention (scores and probabilities [B, T, H,
    S] in float32, keys and values expanded [B, S, H, d], logits [B, T, V] in float32), with the
    plain `gather` MoE each of its tokens' K experts' weights gathered [B T, K, 3, I, D], and the
    EAGLE-3 states kept along the cache fill [B, S, 3D]. Returns (parts, the target's ModelArgs,
    the head's DraftArgs), or (None, ModelArgs, the ValueError) where a size does not fit the TP or
    the head does not fit the target."""
    margs = (checkpoint.read_target_args(cfg.model_path) if cfg.model_path
             else random_target_args(cfg))
    tp = tpm.TP.simulate(max(cfg.simulate_tp, world))
    dtype, meta = getattr(torch, cfg.dtype), torch.device("meta")
    B, slots = cfg.batch_size, cache_slots(cfg)
    try:
        target = model.Transformer(margs, B, slots, meta, dtype, tp)
        dargs = (checkpoint.read_draft_args(cfg.draft_path) if cfg.draft_path
                 else random_draft_args(target))
        set_target_aux_layers(target, dargs)
        own = bool(cfg.draft_path) and \
            "embed_tokens.weight" in checkpoint.checkpoint_files(cfg.draft_path)
        head = Eagle3Draft(dargs, target, own_embedding=own)
    except ValueError as e:  # a size the TP does not divide, a head that does not fit
        return None, margs, e
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    # a view (a layer's cache in the target's stacked caches) holds no bytes of its own
    owned = lambda tensors: [t for t in tensors if t._base is None]  # noqa: E731
    fill = max(max(cfg.context_len), cfg.prompt_len)
    T, H, a = min(PREFILL_CHUNK, fill), margs.num_attention_heads // tp.world_size, margs
    parts = {"weights": size(target.parameters()) + size(head.parameters()),
             "KV caches": size(owned(target.buffers())) + size(owned(head.buffers())),
             "one prefill chunk": B * T * H * fill * 4 * 2 + B * T * a.vocab_size * 4
             + B * fill * H * (a.qk_nope_head_dim + a.v_head_dim) * dtype.itemsize,
             "gathered expert weights": B * T * a.num_experts_per_tok * 3
             * (a.moe_intermediate_size // tp.world_size) * a.hidden_size * dtype.itemsize
             if kernels.pick_moe(cfg.moe_impl, device, dtype) == "gather" else 0,
             "EAGLE-3 states": B * fill * 3 * a.hidden_size * dtype.itemsize}
    return parts, margs, dargs


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

    def hold(self, cycles):
        """The GPU spins `cycles` clock cycles (torch.cuda._sleep); what the host issues meanwhile
        waits behind it."""
        if self.cuda:
            torch.cuda._sleep(cycles)


# GPU clock cycles held a timed call (about 1 ms at H200's 1.98 GHz): more than the host takes to
# issue any replayed phase, so it queues all of them while the GPU spins (Clock.hold)
HOLD_CYCLES_PER_CALL = 2_000_000


def median_ms(clock, fn, reps, warmup=3, desc=None, before=None, hold=False):
    """fn's median over reps timed calls after warmup; before() (when given) runs ahead of every
    call, outside its timed span. hold: the timed calls wait on the GPU behind a spin until the
    host has issued them all, so each span is the GPU's time for its call, as in the loop, where
    a replayed phase waits behind the one before it; without it a small graph's span is the time
    the host takes to issue it (eager calls take no hold: the loop pays their issue too)."""
    stamps = []
    hide = desc is None or not is_rank0()
    with tqdm(total=warmup + reps, desc=desc, disable=hide, leave=False) as bar:
        for _ in range(warmup):
            if before:
                before()
            fn()
            bar.update()
        if hold:
            clock.hold(HOLD_CYCLES_PER_CALL * reps)
        for _ in range(reps):
            if before:
                before()
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
            "draft_extend": "draft extend", "draft": "draft", "accept_chain": "acceptance",
            "accept_tree": "tree acceptance", "allreduce": "all-reduces"}.get(key.phase, key.phase)
    unit = "head step" if key.phase == "draft" else "token"  # a draft step reads one token
    return f"timing {what}, {key.tokens} {unit}{'s' if key.tokens != 1 else ''}, " \
        f"{'graph' if graph else 'eager'}"


class PhaseTimer:
    """verify.generate calls mark(name) at the end of each phase. A phase lasts from the previous
    mark to its own, and `host` from a cycle's last mark to the next cycle's "start" (the host
    read and the host's own work), so in every cycle the phases add up to the cycle, start to
    start. generate gets its mark in a verify.Probe."""

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
        names = ([n for n in cycles[0] if n not in ("host", "cycle")] + ["host", "cycle"]
                 if cycles else [])
        med = {n: Timing([c[n] for c in cycles if n in c]) for n in names
               if any(n in c for c in cycles)}
        if "cycle" not in med and cycles:  # one cycle only: it is the sum of its phases
            med["cycle"] = Timing([sum(cycles[0].values())])
        return med


def is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def copy_bandwidth(clock, device):
    """GB/s of a 1 GiB device copy (read + write): the floors' bandwidth."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = median_ms(clock, lambda: y.copy_(x), 10)
    return 2 * x.numel() / ms / 1e6  # GB/s, read + write


# ---------------------------------------------------------------------------------------------
# The results: what each stage returns; Result is the --json line (report.as_json)

@dataclass
class Context:
    """The isolated phases at one context length, and where their time goes."""
    phases_ms: dict          # {"phase/variant": Timing}
    distinct_experts: dict = field(default_factory=dict)  # {phase: experts a MoE layer reaches}
    bytes: dict = field(default_factory=dict)             # {phase: {component: bytes}}
    components: dict = field(default_factory=dict)        # {phase: ComponentProfile}
    floors_ms: dict = field(default_factory=dict)         # {phase: ms, None without a GPU}
    gpu_mem_peak_eager_GB: float | None = optional()


@dataclass
class SweepPoint:
    """Verify of T tokens a row, and draft extend of T up to draft_extend_tokens (what a cycle of
    num_steps T - 1 pays); the distinct routed experts the verify reaches, its floor, and (a GPU's,
    with floors) where a profiled eager verify's time goes ({component: ms}, as the component
    table's)."""
    verify: Timing
    draft_extend: Timing | None = optional()
    distinct_experts: float | None = None   # a MoE layer's, the mean over the layers
    floor_ms: float | None = None           # the verify's bytes over the copy bandwidth (a GPU's)
    components: dict | None = optional()
    # the routed experts component's floor, its bytes as the component table counts them: the
    # distinct experts, and the shared expert where it rides in their launch (a GPU's)
    routed_floor_ms: float | None = optional()


@dataclass
class E2ERun:
    """One generate() call end to end; its cycle's phases (PhaseTimer)."""
    tok_per_s: float
    wall_s: float
    tokens: int
    cycles: int
    phases_ms: dict          # {phase: Timing over the cycles}
    accept_len_mean: float | None = optional()   # speculative runs: accepted tokens per cycle
    accept_len_hist: list | None = optional()    # (row, cycle)s by accepted length 1 .. k + 1
    simulated: bool | None = optional()
    speedup_measured: float | None = optional()  # set by the cost model
    speedup_predicted: float | None = optional()


@dataclass
class MeasuredAllreduce:
    """Real TP: one all-reduce's cost (collectives), and the step against its SIMULATED twin."""
    us_each: dict            # {"how/T": us}, T tokens a row: B x T hidden rows reduced
    gemv_MB: float
    per_forward: int         # collectives a real forward runs (components.collectives_per_forward)
    implementation: str
    for_simulated_rank_us: float | None = None   # what --allreduce-us should get
    twin_phases_ms: dict | None = optional()
    real_minus_twin_us: dict | None = optional()


@dataclass
class Env:
    """Where and how the run ran (the GPU fields only on a GPU)."""
    device: str
    torch: str
    world_size: int
    simulated_tp: int | None
    dtype: str
    int4_group_size: int | None
    fp8_block: list | None
    moe_impl: str
    kernels: list
    draft_kernels: list | None
    routing: str
    simulated_routing: bool
    seed: int
    simulated_acceptance: bool
    target: str
    config: dict             # run.py's settled configuration
    weights: str             # "trained tiny pair", "checkpoints" or "random"
    cpu_count: int | None
    load_average: float | None = None   # over the last minute, at the end of the run
    gpu_mem_peak_GB: float | None = optional()         # allocated, past the bandwidth probe
    gpu_mem_peak_eager_GB: float | None = optional()   # the same before any graph was captured
    weights_GB: float | None = optional()
    routed_experts_GB: float | None = optional()
    n_routed_experts: int | None = optional()          # a MoE layer's routed experts, this run's
    distinct_experts_asked: int | None = optional()    # --routing distinct's D
    routing_trace: dict | None = optional()             # --routing trace: the file and its mapping


@dataclass
class Result:
    """Every number of a timing run; contexts and phases_ms share the first context's dict."""
    env: Env
    bandwidth_GBps: float | None
    contexts: dict           # {context length: Context}
    phases_ms: dict = None   # the first context's phases, "accept" added
    floors: dict = None      # the first context's floors_ms
    verify_sweep_ms: dict = None            # {T: SweepPoint}
    sweep_cliffs: SweepCliffs | None = None  # the sweep against its floors (None without them)
    e2e: dict = field(default_factory=dict)  # {"baseline/graph", "eagle3/decode/graph": E2ERun}
    greedy_agreement_with_plain: dict | None = None
    allreduce_measured: MeasuredAllreduce | None = None
    allreduce_modelled: ModelledAllreduce | None = None
    cost_model: CostModel = None
    kernels_per_decode_step: int | None = optional()
    kernels_per_decode_step_compiled: int | None = optional()
    compile_error: str | None = optional()
    warnings: list = field(default_factory=list)
    spread_ms: dict = field(default_factory=dict)  # each Timing's spread, nested as the result
    answer: list = field(default_factory=list)
    routing_sweep: "RoutingSweep | None" = optional()   # --distinct-sweep


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
    # [B, C'] ids prefilled into the cache (random, or held-out text for the trained pair), C' the
    # longest context or the prompt length, whichever is longer
    fill: torch.Tensor = None
    aux: torch.Tensor = None   # [B, C, 3D] the target's EAGLE-3 states along `fill`
    # (variant, attention mode) the sweep, the cost model and the answer use: graph where captured,
    # and the mode whose verify of num_steps + 1 timed faster (measure sets it: faster_verify)
    best: tuple = None
    routing_choice: object = None   # routing "distinct" or "trace": routing.py's choice
    feed: "TraceFeed | None" = None  # routing "trace": advances the trace before each forward
    trace: dict = None               # routing "trace": the file and how it maps (Env)

    @property
    def gpu(self):
        return self.target.device.type == "cuda"

    @property
    def k(self):
        return self.cfg.speculative_num_steps

    @property
    def profile_calls(self):  # a component table's profiled calls: up to --reps of them on a CPU
        return None if self.gpu else min(3, self.cfg.reps)

    @property
    def modes(self):  # verify's attention modes timed, in the model's words (FLAG_WORD: in names)
        return self.cfg.attention_modes

    @property
    def graph_opts(self):
        return {"both": [False, True], "on": [True], "off": [False]}[self.cfg.cuda_graph]

    def verify_name(self, mode):  # an isolated verify's name in the tables and JSON: flag words
        return f"verify/{FLAG_WORD[mode]}"

    def positions(self, ctx, T):  # [B, T]: T new tokens after ctx cached ones
        return ctx + torch.arange(T, device=self.target.device).expand(self.cfg.batch_size, T)

    def timed(self, key, fn, *inputs, graph):
        call = (lambda: self.runner.run(key, fn, *inputs)) if graph else (lambda: fn(*inputs))
        if self.feed is None or not self.feed.routes(fn):
            return median_ms(self.clock, call, self.cfg.reps, desc=phase_label(key, graph),
                             hold=graph)
        # the trace advanced before each call, outside its timed span; no hold: advance waits on
        # the previous call's copy, so the host stays one call ahead (these are target forwards,
        # each long enough for the host to issue the next)
        with self.feed.held():
            return median_ms(self.clock, call, self.cfg.reps, desc=phase_label(key, graph),
                             before=partial(self.feed.choice.advance, inputs[0].numel()))


def faster_verify(b, phases):
    """Bench.best from the isolated phases at the first context: graph where captured, and of the
    attention modes timed the one whose verify of num_steps + 1 tokens took less in that variant
    (decode on a tie); rank 0's choice on every rank (under real TP the ranks time one shape)."""
    variant = "graph" if b.graph_opts[-1] else "eager"
    best = [(variant, min(b.modes, key=lambda mode: (phases[f"{b.verify_name(mode)}/{variant}"],
                                                     mode != "decode")))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(best, src=0)
    return best[0]


def prepare(cfg, device):
    """Build the models and fill their caches up to the longest context (random ids; held-out
    text for the trained pair)."""
    torch.manual_seed(cfg.seed)
    target, head, how = build(cfg, device, getattr(torch, cfg.dtype))
    runner = CudaGraphs(device) if cfg.cuda_graph != "off" else None
    b = Bench(cfg, target, head, how, Clock(device), runner)
    B, C = cfg.batch_size, max(cfg.context_len)
    g = torch.Generator().manual_seed(cfg.seed)
    L = max(C, cfg.prompt_len)
    b.fill = (torch.tensor(train.heldout_prompts(B, L)) if cfg.trained_pair  # like its training
              else torch.randint(0, target.args.vocab_size, (B, L), generator=g)).to(device)
    last = torch.full((B,), C - 1, device=device)
    with tqdm(total=2 * C, desc=f"filling the caches: target and head, {C} tokens", unit="token",
              disable=not is_rank0() or C <= PREFILL_CHUNK, leave=False) as bar:
        _, b.aux = prefill_target(target, b.fill[:, :C], last, capture_aux=True,
                                  progress=bar.update)
        prefill_draft(head, b.fill[:, :C], b.aux, last, progress=bar.update)  # output not used
    set_timing_routing(b)
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
    kvd = kv_bucket(ctx + 2 * k + 1, t.max_seq_len)  # the draft's, as generate's (its chain: ahead)
    step_tok, vtok = b.fill[:, ctx - 1:ctx], b.fill[:, ctx - k - 1:ctx]
    aux, last = b.aux[:, ctx - k - 1:ctx], torch.full((B,), k, device=t.device)
    calls = {"decode_step": (GraphKey("decode_step", "decode", B, 1, kv1),
                             partial(t, mode="decode", kv_len=kv1), (step_tok, pos1))}
    for mode in b.modes:
        calls[b.verify_name(mode)] = (GraphKey("verify", mode, B, k + 1, kvv),
                                      partial(t, mode=mode, capture_aux=True, kv_len=kvv),
                                      (vtok, posv))
    calls["draft_extend"] = (GraphKey("draft_extend", None, B, k + 1, kvd),
                             partial(b.head.extend, kv_len=kvd), (vtok, posv, aux, last))
    first, g = b.head.extend(vtok, posv, aux, last, kv_len=kvd)
    calls["draft_step"] = (GraphKey("draft", None, B, 1, kvd),
                           partial(b.head.chain, num_steps=2, kv_len=kvd),
                           (first, g, pos1[:, 0] + k))
    if b.cfg.speculative_eagle_topk > 1:
        calls.update(tree_calls(b, ctx))
    return calls


def sample_tree(b, ctx):
    """A tree the head drafts from arbitrary inputs after ctx cached tokens (as phase_calls'
    inputs are), the expansion that drafted it and that expansion's inputs."""
    K, S, N = b.cfg.speculative_eagle_topk, b.k, b.cfg.speculative_num_draft_tokens
    B, t, head = b.cfg.batch_size, b.target, b.head
    kvd = kv_bucket(ctx + N + (S - 1) * K + 1, t.max_seq_len)   # as verify.generate's kv_draft
    vtok, posv = b.fill[:, ctx - S - 1:ctx], b.positions(ctx - S - 1, S + 1)
    last = torch.full((B,), S, device=t.device)
    logits, g = head.extend_logits(vtok, posv, b.aux[:, ctx - S - 1:ctx], last, kv_len=kvd)
    expand = partial(head.tree, topk=K, num_steps=S, num_nodes=N, kv_len=kvd)
    inputs = (vtok[:, -1], logits, g, posv[:, -1])
    return expand(*inputs), expand, inputs


def tree_verify_inputs(b, ctx, tree):
    """The verify of a tree's N nodes written after ctx cached tokens: (the slots it reads,
    tree_forward's inputs: the tree's tokens, parents and depths, the root's slot per row)."""
    t = b.target
    kvt = kv_bucket(ctx + tree.tokens.shape[1], t.max_seq_len)
    start = torch.full((b.cfg.batch_size,), ctx, device=t.device)
    return kvt, (tree.tokens, tree.parents, tree.depths, start)


def tree_calls(b, ctx):
    """The tree's phases beside the chain's: the verify of its N nodes after ctx cached tokens
    (each attention mode; sample_tree's tree) and the head's expansion (S - 1 passes of K rows)."""
    K, S, N = b.cfg.speculative_eagle_topk, b.k, b.cfg.speculative_num_draft_tokens
    B, t = b.cfg.batch_size, b.target
    tree, expand, expand_inputs = sample_tree(b, ctx)
    kvt, inputs = tree_verify_inputs(b, ctx, tree)
    calls = {f"{b.verify_name(mode)} tree": (GraphKey("verify_tree", mode, B, N, kvt),
                                             partial(tree_forward, t, mode=mode, kv_len=kvt),
                                             inputs)
             for mode in b.modes}
    calls["draft_tree"] = (GraphKey("draft_tree", None, B, (S - 1) * K,
                                    expand.keywords["kv_len"]), expand, expand_inputs)
    return calls


def time_tree_accept(b, ctx):
    """The tree's acceptance beside its timed phases, as the loop runs it (verify.tree_cycle):
    accept_tree (the walk, the tokens emitted) on a tree verify's logits, replayed from its graph
    where the run's last graph setting is on and the walk greedy, else eager, then the accepted
    path's cache move (Transformer.move_cache, eager). The moves stay within the tree's scratch
    slots."""
    cfg, t, tree = b.cfg, b.target, sample_tree(b, ctx)[0]
    D = min(b.k, cfg.speculative_num_draft_tokens - 1)
    kvt, inputs = tree_verify_inputs(b, ctx, tree)
    logits = tree_forward(t, *inputs, mode=b.modes[0], kv_len=kvt)[0]
    gen = None if cfg.temperature == 0 else torch.Generator(t.device).manual_seed(0)
    walk = partial(accept_tree, max_depth=D, temperature=cfg.temperature, generator=gen)
    tokens, parents, depths, start = inputs
    args = (logits, tokens, parents, depths,
            torch.zeros(cfg.batch_size, dtype=torch.bool, device=t.device))   # no row done
    key = GraphKey("accept_tree", None, cfg.batch_size, tokens.shape[1])
    first = start.unsqueeze(1)
    along = first + torch.arange(D + 1, device=t.device)
    graph = b.graph_opts[-1] and cfg.temperature == 0

    def work():
        path = (b.runner.run(key, walk, *args) if graph else walk(*args))[1]
        t.move_cache(first + path, along)
    return median_ms(b.clock, work, cfg.reps, desc=phase_label(key, graph), hold=graph)


def time_phases(b, ctx, graph, suffix=""):
    """Median ms of each isolated phase at ctx cached tokens, eager or replayed from its graph."""
    name = ("graph" if graph else "eager") + suffix
    return {f"{phase}/{name}": b.timed(key, fn, *inputs, graph=graph)
            for phase, (key, fn, inputs) in phase_calls(b, ctx).items()}


def isolated(b, ctx, bandwidth):
    """One context: the phases eager and/or captured; for the decode step and each verify, the
    distinct experts a MoE layer reaches, the bytes each component must move and where the kernel
    time goes (a profiled eager run of the same shapes); the floors of every phase."""
    out = Context(phases_ms={})
    for graph in b.graph_opts:
        out.phases_ms.update(time_phases(b, ctx, graph))
        if b.gpu and not graph:
            out.gpu_mem_peak_eager_GB = torch.cuda.max_memory_allocated(b.target.device) / 1e9
    B = b.cfg.batch_size
    for phase, (_, fn, inputs) in phase_calls(b, ctx).items():
        T = inputs[0].shape[1] if inputs[0].dim() == 2 else 1  # the draft step's input is d_1 [B]
        if phase == "draft_tree":   # S - 1 head passes of K rows each (at least its KV so far)
            K, S = b.cfg.speculative_eagle_topk, b.k
            nbytes = (S - 1) * draft_bytes(b.head, ctx + 1, B, with_fc=False, tokens=K)
        elif phase.startswith("draft"):
            nbytes = draft_bytes(b.head, ctx + T, B, with_fc=phase == "draft_extend", tokens=T)
        else:
            distinct = routed_distinct(b.target, fn, inputs)
            out.distinct_experts[phase] = statistics.mean(distinct) if distinct else 0.0
            parts = component_bytes(b.target, distinct, ctx + T, B, T)
            out.bytes[phase], nbytes = parts, sum(parts.values())
            out.components[phase] = profile_components(b.target, partial(fn, *inputs), b.gpu,
                                                       b.profile_calls)
        out.floors_ms[phase] = nbytes / bandwidth / 1e6 if bandwidth else None
    return out


# The verify sweep's tokens a row by default. On a GPU: 1 to 8 each (the chains), then 10, 12 and
# every 4 to 32 (trees, and chains times a batch), while the batch's forward holds at most
# SWEEP_MAX_FORWARD tokens; on a CPU 1 to 6, the cost model's chains (num_steps 1 to 5). The run's
# own chains, 1 to num_steps + 1, join them always (verify_sweep_tokens). Draft extend is timed up
# to SWEEP_DRAFT_EXTEND tokens (chains of num_steps up to 7), or num_steps + 1 where more.
SWEEP_TOKENS = (*range(1, 9), 10, 12, 16, 20, 24, 28, 32)
SWEEP_TOKENS_CPU = tuple(range(1, 7))
SWEEP_MAX_FORWARD = 32
SWEEP_DRAFT_EXTEND = 8


def sweep_tokens(gpu, batch):
    """The verify sweep's default tokens a row on a GPU or a CPU, at this batch."""
    if not gpu:
        return list(SWEEP_TOKENS_CPU)
    return [T for T in SWEEP_TOKENS if T == 1 or batch * T <= SWEEP_MAX_FORWARD]


def verify_sweep_tokens(cfg, gpu):
    """The verify sweep's tokens a row (settle_defaults sets them as cfg.verify_sweep_tokens):
    --sweep-tokens, else the device's default (sweep_tokens; a dump times nothing, so the CPU's
    short sweep only sizes its cache: cache_slots; those past the first context, whose last T
    cached tokens a verify of T re-reads, left out), and always 1 to num_steps + 1, the chains
    the cost model prices up to the run's own (run.py refuses --sweep-tokens past that context)."""
    asked = cfg.sweep_tokens or [T for T in sweep_tokens(gpu and not cfg.dump, cfg.batch_size)
                                 if T <= cfg.context_len[0]]
    return sorted({*asked, *range(1, cfg.speculative_num_steps + 2)})


def draft_extend_tokens(b):
    """The most tokens the sweep times draft extend at: SWEEP_DRAFT_EXTEND, or num_steps + 1."""
    return max(SWEEP_DRAFT_EXTEND, b.k + 1)


def verify_sweep(b, ctx, bandwidth):
    """Verify of each of cfg.verify_sweep_tokens T tokens at ctx cached tokens, in the cost model's
    variant and attention mode (Bench.best), with the distinct experts it reaches (an eager call
    counts them), its floor and (with floors: what the cliff check names) its component profile (a
    profiled eager call), as isolated's; and draft extend of T up to draft_extend_tokens: what a
    cycle of num_steps T - 1 pays. Inputs as in phase_calls. Returns {T: SweepPoint}."""
    graph, mode = b.graph_opts[-1], b.best[1]
    B, t, sweep = b.cfg.batch_size, b.target, {}
    for T in b.cfg.verify_sweep_tokens:
        if ctx < T:
            break
        kv, vt, pos = kv_bucket(ctx + T, t.max_seq_len), b.fill[:, ctx - T:ctx], b.positions(ctx, T)
        fn = partial(t, mode=mode, capture_aux=True, kv_len=kv)
        distinct = routed_distinct(t, fn, (vt, pos))
        parts = component_bytes(t, distinct, ctx + T, B, T)
        sweep[T] = SweepPoint(
            verify=b.timed(GraphKey("verify", mode, B, T, kv), fn, vt, pos, graph=graph),
            distinct_experts=statistics.mean(distinct) if distinct else 0.0,
            floor_ms=sum(parts.values()) / bandwidth / 1e6 if bandwidth else None,
            components=(profile_components(t, partial(fn, vt, pos), b.gpu, b.profile_calls).parts_ms
                        if bandwidth else None),
            routed_floor_ms=parts["routed_experts"] / bandwidth / 1e6 if bandwidth else None)
        if T <= draft_extend_tokens(b):
            kvd = kv_bucket(ctx + 2 * T - 1, t.max_seq_len)  # generate's, num_steps T - 1
            sweep[T].draft_extend = b.timed(
                GraphKey("draft_extend", None, B, T, kvd), partial(b.head.extend, kv_len=kvd), vt,
                pos, b.aux[:, ctx - T:ctx], torch.full((B,), T - 1, device=t.device), graph=graph)
    return sweep


def run_generate(b, draft, mode, graph):
    """One generate() call on the random prompts, with device events at each phase of each cycle
    (a PhaseTimer in the loop's Probe, with the SIMULATED acceptance if asked)."""
    a, timer = b.cfg, PhaseTimer(b.clock)
    probe = Probe(timer.mark, a.simulate_accept_len if draft else None)
    b.clock.sync()
    t0 = time.perf_counter()
    tree = draft is not None and a.speculative_eagle_topk > 1   # plain decoding: no tree
    res = generate(b.target, draft, b.fill[:, :a.prompt_len].cpu(), max_new_tokens=a.max_new_tokens,
                   num_steps=b.k, attention_mode=mode, use_graphs=graph,
                   temperature=a.temperature, seed=a.seed, eos_id=-1,
                   graphs=b.runner if graph else None, probe=probe,
                   topk=a.speculative_eagle_topk if tree else None,
                   num_draft_tokens=a.speculative_num_draft_tokens if tree else None)
    b.clock.sync()
    wall = time.perf_counter() - t0
    n = sum(len(t) for t in res.tokens)
    out = E2ERun(n / wall, wall, n, res.cycles, timer.phases())
    if draft is not None:
        live = res.accepted[res.accepted >= 0]
        out.accept_len_mean = (live.float().mean().item() + 1) if live.numel() else 0.0
        out.accept_len_hist = torch.bincount(live + 1, minlength=b.k + 2)[1:].tolist()
        out.simulated = res.simulated
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
    # greedy and the model's own routing (uniform routing picks experts by a token's place in the
    # forward)
    same_model = (b.cfg.temperature == 0 and not b.cfg.simulate_accept_len
                  and b.target.routing == "model")
    return e2e, agreement if same_model else None


def collectives(b, r):
    """Real TP only: what one all-reduce of T tokens a row (B x T hidden rows at batch B, as a
    forward's) costs, in us, by T, three ways:
    interleaved, the figure that predicts a real step: n = 2 x layers all-reduces in one CUDA graph,
    each of the output of a GEMV as long as the compute between two all-reduces of this run's
    decode step (its time / n, at the copy bandwidth), minus the same graph without them; back to
    back: n in a row in a graph (each then pays its whole latency, which compute otherwise hides
    in part); eager: separate launches, host included. Then the simulated twin (twin_phases), over
    the collectives_per_forward a real forward runs."""
    t, n, B = b.target, 2 * b.target.args.num_hidden_layers, b.cfg.batch_size
    D, variant = t.args.hidden_size, b.best[0]
    gap_ms = r.phases_ms[f"decode_step/{variant}"] / n
    cols = max(D, round(gap_ms * 1e-3 * (r.bandwidth_GBps or 0) * 1e9 / (D * t.dtype.itemsize)))
    w = torch.randn(D, cols, device=t.device).to(t.dtype) / cols ** 0.5
    out = MeasuredAllreduce({}, w.numel() * w.element_size() / 1e6,
                            collectives_per_forward(t.args.num_hidden_layers), t.tp.describe())

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
        alone = b.timed(GraphKey(name, None, B, T), partial(gemvs, reduce=False, w=w), x,
                        graph=True)
        return (both - alone) * 1e3 / n

    us = out.us_each
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
        out.twin_phases_ms, out.real_minus_twin_us = twin_phases(b, r, out.per_forward)
    out.for_simulated_rank_us = us.get("interleaved/1")  # what --allreduce-us should get
    return out


def twin_phases(b, r, n):
    """The decode step and the verify again, captured with every layer's TP swapped for a SIMULATED
    rank's (collectives skipped: what `--simulate-tp N` builds, on this rank's very weights), then
    put back: real minus twin, over n (collectives_per_forward: the embedding's all-reduce, two a
    layer, the logits' all-gather), is what a collective cost inside this step. The twin's graphs
    live in a runner of their own (the keys are the real phases'). Returns the twin's phases and
    {phase: us}."""
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
    names = ("decode_step", *(b.verify_name(mode) for mode in b.modes))
    return phases, {name: (r.phases_ms[f"{name}/graph"] - phases[f"{name}/graph+twin"]) * 1e3 / n
                    for name in names}


def compiled(b, ctx, result):
    """The captured phases again with torch.compile fusing each layer (last: it changes the
    modules). The compiled layers' graphs live in a runner of their own: the keys are the same."""
    try:
        kernels.compile_layers(b.target)
        kernels.compile_head(b.head)
        b.runner = CudaGraphs(b.target.device)
        result.contexts[ctx].phases_ms.update(time_phases(b, ctx, True, "+compile"))
        key, fn, inputs = phase_calls(b, ctx)["decode_step"]
        result.kernels_per_decode_step_compiled = count_kernels(partial(fn, *inputs))
    except Exception as e:  # an optional measurement: say why it is missing, keep the rest
        result.compile_error = f"{type(e).__name__}: {e}"[:500]
        tpm.print0(f"torch.compile variant failed: {result.compile_error}")


def environment(b, world):
    """The Env of a run on Bench b (the GPU's memory is added at the end: gpu_memory)."""
    cfg, t = b.cfg, b.target
    weights = ("trained tiny pair" if cfg.trained_pair else "checkpoints" if cfg.model_path
               else "random")
    return Env(device=torch.cuda.get_device_name(t.device) if b.gpu else "cpu",
               torch=torch.__version__, world_size=world,
               simulated_tp=cfg.simulate_tp if t.tp.simulated else None, dtype=cfg.dtype,
               int4_group_size=t.args.int4_group_size, fp8_block=t.args.fp8_block,
               moe_impl=t.moe_impl, kernels=list(t.kernels),
               draft_kernels=list(b.head.kernels) if b.head is not None else None,
               routing=t.routing, simulated_routing=t.routing in ("uniform", "distinct"),
               seed=cfg.seed,
               simulated_acceptance=cfg.simulate_accept_len is not None, target=b.how,
               config=vars(cfg), weights=weights, cpu_count=os.cpu_count(),
               **routing_env(b))


def gpu_memory(b, r):
    """The GPU's peak memory and the weights' bytes, into r.env."""
    t, env, first = b.target, r.env, b.cfg.context_len[0]
    env.gpu_mem_peak_GB = torch.cuda.max_memory_allocated(t.device) / 1e9
    env.gpu_mem_peak_eager_GB = r.contexts[first].gpu_mem_peak_eager_GB
    env.weights_GB = sum(p.numel() * p.element_size() for p in t.parameters()) / 1e9
    env.routed_experts_GB = sum(p.numel() * p.element_size() for n, p in t.named_parameters()
                                if ".mlp.experts." in n) / 1e9
    env.n_routed_experts = t.args.n_routed_experts


def time_accept(b, ctx):
    """The chain's acceptance of a verify's logits, alone, as the loop runs it
    (verify.accept_chain; replayed from its graph where the run's last graph setting is on and
    the acceptance greedy, else eager)."""
    cfg = b.cfg
    key, fn, inputs = phase_calls(b, ctx)[b.verify_name(b.modes[0])]
    logits, drafts = fn(*inputs)[0], inputs[0][:, 1:]
    gen = None if cfg.temperature == 0 else torch.Generator(b.target.device).manual_seed(0)
    take = partial(accept_chain, temperature=cfg.temperature, generator=gen)
    done = torch.zeros(cfg.batch_size, dtype=torch.bool, device=b.target.device)
    return b.timed(GraphKey("accept_chain", None, cfg.batch_size, drafts.shape[1] + 1), take,
                   logits, drafts, done, graph=b.graph_opts[-1] and cfg.temperature == 0)


def measure(b, world):
    """The whole timing run on a prepared Bench, in the order of its output; returns the Result
    with its warnings, spreads and answer (report.py prints it)."""
    cfg, first = b.cfg, b.cfg.context_len[0]
    bandwidth = copy_bandwidth(b.clock, b.target.device) if b.gpu else None
    if b.gpu:   # the peaks that gpu_memory reports leave out the bandwidth probe's 2 GiB
        torch.cuda.reset_peak_memory_stats(b.target.device)
    r = Result(environment(b, world), bandwidth,
               {c: isolated(b, c, bandwidth) for c in cfg.context_len})
    r.phases_ms, r.floors = r.contexts[first].phases_ms, r.contexts[first].floors_ms
    b.best = faster_verify(b, r.phases_ms)   # before the sweep, which times its mode
    r.phases_ms["accept"] = time_accept(b, first)
    if cfg.speculative_eagle_topk > 1:
        r.phases_ms["tree_accept"] = time_tree_accept(b, first)
    r.verify_sweep_ms = verify_sweep(b, first, bandwidth)
    r.sweep_cliffs = sweep_cliffs(r.verify_sweep_ms, cfg.batch_size)
    if not cfg.skip_e2e:
        r.e2e, r.greedy_agreement_with_plain = end_to_end(b)
    r.allreduce_measured = collectives(b, r) if b.target.tp.communicates else None
    r.allreduce_modelled = modelled_allreduce(b)
    r.cost_model = cost_model(r, b)
    if cfg.distinct_sweep:
        r.routing_sweep = routing_sweep(b, r)
    if cfg.compile:   # last: it compiles the model's layers in place
        compiled(b, first, r)
    if b.gpu:
        gpu_memory(b, r)
        r.kernels_per_decode_step = r.contexts[first].components["decode_step"].kernels
    r.env.load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    r.warnings, r.spread_ms = timing_warnings(r), spreads(r)
    r.answer = answer(r, b) + verdict(r)
    return r


# ---------------------------------------------------------------------------------------------
# Routing for timing (routing.py): "distinct" (SIMULATED) and "trace" (TRACE), put in after the
# caches are filled; the answer across distinct experts (--distinct-sweep)

def built_routing(cfg):
    """The routing a target is built with: distinct and trace start after the caches are filled
    (set_timing_routing); until then the router's own choice."""
    return cfg.routing if cfg.routing in ("model", "uniform") else "model"


def set_timing_routing(b):
    """Routing "distinct" or "trace" put into the target's routers (model.Transformer.set_routing).
    A trace is advanced before each forward of the target of up to the most tokens a timed one
    reads: by Bench.timed outside the timed span, elsewhere (the profiled runs, the end-to-end
    loops) by a TraceFeed before each eager forward and each graph replay."""
    cfg, t = b.cfg, b.target
    E, K = t.args.n_routed_experts, t.args.num_experts_per_tok
    if cfg.routing == "distinct":
        b.routing_choice = routing.DistinctChoice(cfg.distinct_experts, E, K, seed=cfg.seed)
    elif cfg.routing == "trace":
        full = E if cfg.model_path else checkpoint.preset(cfg.preset).n_routed_experts
        trace = routing.read_trace(cfg.routing_trace, full, K)   # (run.py checked it fits)
        layers = sum(isinstance(layer.mlp, model.MoE) for layer in t.layers)
        cursor = routing.TraceCursor(trace.ids, layers, onto=E if E < full else None,
                                     saturate=True)
        b.routing_choice = routing.TraceChoice(cursor, t.device)
        most = cfg.batch_size * max(cfg.speculative_num_draft_tokens, b.k + 1,
                                    *cfg.verify_sweep_tokens)
        b.feed = TraceFeed(b.routing_choice, t, b.runner, most)
        T = cfg.batch_size * (b.k + 1)
        mean = routing.distinct_curve(trace.ids, full, T, trace.sequence_lengths).get(T)
        b.trace = dict(path=cfg.routing_trace, note=trace.note, layers=trace.ids.shape[0],
                       tokens=trace.ids.shape[1], n_experts=full, model_moe_layers=layers,
                       renamed_onto=E if E < full else None, verify_tokens=T,
                       verify_distinct_mean=mean)
    else:
        return
    t.set_routing(cfg.routing, b.routing_choice)


class TraceFeed:
    """routing "trace" outside Bench.timed: advances the TraceChoice by a forward's tokens before
    each eager forward of the target (a forward pre-hook; not while a graph captures) and before
    each graph replay of the runner (its before_replay), for forwards of up to `most` tokens
    (longer ones, prefills, keep the router's own choice). held(): off, while Bench.timed
    advances it itself."""

    def __init__(self, choice, target, runner, most):
        self.choice, self.target, self.most, self.off = choice, target, most, False
        target.register_forward_pre_hook(self.before_forward)
        if runner is not None:
            runner.before_replay = self.before_replay

    def routes(self, fn):
        """Whether fn runs the target's forward: a partial of the target itself or of tree_forward
        on it (not a partial that holds the target for another use, such as its cache move)."""
        return isinstance(fn, partial) and (fn.func is self.target or (
            fn.func is tree_forward and bool(fn.args) and fn.args[0] is self.target))

    def advance(self, tokens):
        if not self.off and tokens.numel() <= self.most:
            self.choice.advance(tokens.numel())

    def before_forward(self, module, args):
        if not (module.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.advance(args[0])

    def before_replay(self, fn, inputs):
        if self.routes(fn):
            self.advance(inputs[0])

    @contextmanager
    def held(self):
        self.off = True
        try:
            yield
        finally:
            self.off = False


def routing_env(b):
    """The Env's fields that say which routing ran, beyond its name."""
    if b.cfg.routing == "distinct":
        return dict(distinct_experts_asked=b.cfg.distinct_experts)
    if b.cfg.routing == "trace":
        return dict(routing_trace=b.trace)
    return {}


@dataclass
class RoutingPoint:
    """The verify at D distinct experts a MoE layer (SIMULATED), and what a cycle then costs."""
    distinct: int               # D asked
    distinct_ran: float         # distinct experts a MoE layer, counted in one forward
    verify_ms: Timing           # the verify alone (+ MODELLED all-reduces where modelled)
    plain_steps: float          # verify_ms / the cost model's plain step (RoutingSweep's)
    cycle_ms: float             # the cost model's cycle of num_steps with this verify
    break_even_accept_len: float


@dataclass
class RoutingSweep:
    """The verify timed (the cost model's attention mode and variant) across distinct experts,
    D = top-k ... min(tokens x top-k, experts) (routing.sweep_points), against the plain step.
    The cycle is the cost model's for num_steps with its verify swapped for this one."""
    tokens: int                 # tokens a verify forward reads: batch x (num_steps + 1)
    top_k: int
    experts: int                # routed experts on the rank
    uniform_expectation: float  # routing.uniform_distinct: tokens drawn independently
    num_steps: int
    variant: str                # "graph" or "eager"
    mode: str                   # verify's attention, the flag's word
    plain_step_ms: float        # the cost model's (+ MODELLED all-reduces where modelled)
    run_routing: str            # the run's own routing, and its verify (ms, distinct experts)
    run_verify_ms: float
    run_distinct: float
    points: list                # [RoutingPoint], D ascending


def routing_sweep(b, r):
    """The verify of the cost model's num_steps timed at each D of routing.sweep_points, then the
    run's routing put back. Needs the cost model (its plain step and cycle)."""
    (variant, mode), k, ctx, t = b.best, b.k, b.cfg.context_len[0], b.target
    cm = r.cost_model.steps.get(k)
    if cm is None or k + 1 not in r.verify_sweep_ms:
        return None
    E, K = t.args.n_routed_experts, t.args.num_experts_per_tok
    key, fn, inputs = phase_calls(b, ctx)[b.verify_name(mode)]
    tokens = inputs[0].numel()
    ar = r.allreduce_modelled.target_forward_ms if r.allreduce_modelled else 0.0
    rest = cm.cycle_ms - r.verify_sweep_ms[k + 1].verify          # the cycle without its verify
    out = RoutingSweep(tokens, K, E, routing.uniform_distinct(E, K, tokens), k, variant,
                       FLAG_WORD[mode], r.cost_model.plain_step_ms, t.routing,
                       r.phases_ms[f"{b.verify_name(mode)}/{variant}"] + ar,
                       r.contexts[ctx].distinct_experts[b.verify_name(mode)], [])
    try:
        for D in routing.sweep_points(tokens, K, E):
            t.set_routing("distinct", routing.DistinctChoice(D, E, K, seed=b.cfg.seed))
            name = key._replace(phase=f"{key.phase} distinct {D}")
            ms = b.timed(name, fn, *inputs, graph=variant == "graph")
            ran = statistics.mean(routed_distinct(t, fn, inputs))
            cycle = rest + ms
            out.points.append(RoutingPoint(D, ran, Timing([v + ar for v in ms.samples]),
                                           (ms + ar) / out.plain_step_ms, cycle,
                                           cycle / out.plain_step_ms))
    finally:
        t.set_routing(b.cfg.routing, b.routing_choice)
    return out
