"""Where the time of a forward goes, by component, and what it could not go below: the floors
and the cost model.

Component attribution: a profiled eager run of a phase's shapes, each op's (or kernel's) time
under the innermost component range around it (component_scopes puts ranges around each
module's forward from outside the model, by hooks, and takes them off after). Floors: the bytes
a component must move (component_bytes, draft_bytes) over the measured copy bandwidth. The cost
model: a speculative cycle's cost from the isolated phases, its break-even accepted length and
its speedup at each accepted length. The verify sweep against its floors: no cliff where a token
is added (sweep_cliffs). Nothing here times a phase: timing.py does, and hands its medians in.
"""
import statistics
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

import kernels
import model

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

# a result field that the JSON leaves out when it is None (report.as_json)
OMIT_NONE = {"omit_none": True}


def optional():
    return field(default=None, metadata=OMIT_NONE)


@dataclass
class ComponentProfile:
    """Where one eager call's device kernels (GPU) or ops' own CPU time (CPU) went."""
    parts_ms: dict        # {component: ms}, each op under the innermost component range around it
    kernel_ms: float      # all kernels summed, independently of that attribution
    kernels: int          # kernels (GPU) or leaf ops (CPU) per call


def routed_distinct(target, fn, inputs):
    """Distinct routed experts per MoE layer in one call of fn(*inputs) (recorded by hooks on the
    routers; a shared expert's slot in the fused launch, id E, is not a routed expert)."""
    seen = []

    def count(router, inputs, out):
        seen.append(out[0][out[0] < router.args.n_routed_experts].unique().numel())
    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in target.layers
             if isinstance(layer.mlp, model.MoE)]
    try:
        fn(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def component_bytes(target, distinct, kv_slots, batch, tokens):
    """{component: bytes} one forward of `batch` rows of `tokens` new tokens must move: weights as
    stored (routed experts: only the `distinct` ones reached, per MoE layer), the latent cache of
    kv_slots positions per row, and only the embedding rows looked up."""
    out = dict.fromkeys(COMPONENTS, 0)
    # a shared expert folded into the fused MoE launch (kernels "shared_expert") runs there: its
    # bytes go with the routed experts' (its time does too), where it rides in for this many
    # tokens (beside quantized experts up to moe_gemv.SHARED_MAX_TOKENS)
    x = target.embed_tokens.weight.new_empty(batch * tokens, 0)   # the MoE's rows, as shaped
    folded = tuple(f"layers.{i}.mlp.shared_experts." for i, layer in enumerate(target.layers)
                   if isinstance(layer.mlp, kernels.SharedExpertInLaunch)
                   and layer.mlp.paths(x)[1])
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
    out["attn_core"] = (len(target.layers) * batch * kv_slots
                        * (a.kv_lora_rank + a.qk_rope_head_dim)
                        * target.dtype.itemsize)
    return out


def draft_bytes(head, kv_slots, batch, with_fc, tokens=1):
    """The bytes one head pass must move: its weights (fc only where it runs: the extend), the
    embedding rows of its batch x tokens (a checkpoint's own embedding table is not read whole)
    and the key-value cache of kv_slots. d2t, the draft-to-target id map, is not counted: a pass
    gathers one entry a row of it."""
    total = sum(p.numel() * p.element_size() for n, p in head.named_parameters()
                if (with_fc or not n.startswith("fc.")) and n != "d2t"
                and not n.startswith("embed_tokens."))
    attn, elem = head.midlayer.self_attn, head.norm.weight.element_size()
    kv = 2 * batch * kv_slots * attn.n_local_kv_heads * attn.head_dim
    return total + (kv + batch * tokens * head.args.hidden_size) * elem


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
# (a GEMM over stacked weights with --kernels fused_proj; project_sum, the kernels', with the
# layer's input add and norm inside it), and decode mode's absorbed kv_b_proj; and the attention
# after the projections (attend), which kernels.InputNormInQKVA calls from the layer, outside MLA's
# own call. The kernels' merge_absorb_output (attention + norm_gemv, one row) also merges the
# attention's parts in W_uv's launch: a projection by its bytes (W_uv's 1 MB a layer against
# ~80 KB of partials)
MLA_METHODS = {"project": "attn_proj", "project_sum": "attn_proj", "attend": "attn_core",
               "absorb_query": "attn_proj", "absorb_output": "attn_proj",
               "merge_absorb_output": "attn_proj"}
# The MoE's: kernels.SharedExpertInLaunch runs the shared expert alone (past SHARED_MAX_TOKENS)
# from its own method, with the shared MLP's weights but not its forward
MOE_METHODS = {"shared_alone": "shared_mlp"}


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
    """While profiling: each module's forward inside a range named by its component (hooks),
    MLA's MLA_METHODS, the MoE's MOE_METHODS and model.apply_rope (elementwise) wrapped in ranges
    of theirs; all removed after."""
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
            handles += [m.register_forward_pre_hook(enter(component)),
                        m.register_forward_hook(leave)]
        methods = (MLA_METHODS if isinstance(m, model.MLA)
                   else MOE_METHODS if isinstance(m, model.MoE) else {})
        for method, part in methods.items():
            if hasattr(m, method):  # project_sum, merge_absorb_output, shared_alone: the swaps'
                # only; an instance attribute, deleted after
                setattr(m, method, scoped(getattr(m, method), part))
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
    return next((n.removeprefix("component:") for n in chain if n.startswith("component:")),
                "other")


def kineto_profile(cpu, gpu):
    """torch's profiler (kineto) recording CPU ops and/or CUDA kernels, as torch.profiler.profile
    runs it, but without that wrapper's start, whose `hasattr(torch, "_inductor")` imports the
    compiler (seconds, in every run that profiles)."""
    from torch.autograd.profiler import profile
    return profile(use_cpu=cpu, use_device="cuda" if gpu else None, use_kineto=True)


def profile_components(target, fn, gpu, calls=None):
    """Where one eager call of fn goes, by component: {component: ms} of the device kernels it
    launches (GPU) or of its ops' own CPU time (CPU), each put under the innermost component range
    around the op that launched it; "kernel_ms" sums all kernels independently of that
    attribution; "kernels": kernels (GPU) or leaf ops (CPU) per call. The kernels launch without
    programmatic dependent launch here (kernels.common.pdl_off): with it a kernel's programs start
    early and wait, and the profiler would count the wait as that kernel's time."""
    from torch.autograd import DeviceType
    calls = calls or (1 if gpu else 3)  # kernel times are steady; CPU op times are not
    with kernels.common.pdl_off():
        fn()
        with component_scopes(target), kineto_profile(cpu=True, gpu=gpu) as prof:
            for _ in range(calls):
                fn()
            if target.device.type == "cuda":
                torch.cuda.synchronize()
    ours = ("component:", "profiler::")  # our ranges and their enter/exit ops: not kernels
    parts, n_kernels = parts_by_ops(prof, gpu, calls, ours)
    if gpu:
        device_kernels = [e for e in prof.function_events
                          if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        total = sum(e.time_range.elapsed_us() for e in device_kernels)
        n_kernels = len(device_kernels)
        if sum(parts.values()) < 0.95 * total / 1e3 / calls:  # kernels no aten op launched
            # (Triton's: the profiler links them to no CPU event)
            parts = parts_by_device_ranges(prof, calls) or parts
    else:
        total = sum(e.self_cpu_time_total for e in prof.key_averages()
                    if not e.key.startswith(ours))
    return ComponentProfile(parts, total / 1e3 / calls, n_kernels // calls)


def parts_by_ops(prof, gpu, calls, ours):
    """{component: ms} with each op's kernels (GPU) or own CPU time (CPU) under the innermost
    component range around the op, and the kernels (or leaf ops) counted."""
    from torch.autograd import DeviceType
    parts, n_kernels = dict.fromkeys(COMPONENTS, 0.0), 0
    for e in prof.function_events:
        if e.device_type != DeviceType.CPU or e.name.startswith("profiler::"):
            continue
        if gpu:  # the kernels (and copies) this op launched; our ranges' projections are not
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
    return parts, n_kernels


def parts_by_device_ranges(prof, calls):
    """{component: ms} with each kernel under the innermost of our ranges around it on the device
    timeline (a range's GPU projection spans the kernels launched inside it): this also places
    kernels that no aten op launched, as Triton's, which the profiler links to no op. None when
    the profile has no device ranges."""
    from torch.autograd import DeviceType
    gpu_events = [e for e in prof.function_events if e.device_type == DeviceType.CUDA]
    ranges = [(e.time_range.start, e.time_range.end, e.name.removeprefix("component:"))
              for e in gpu_events if e.is_user_annotation and e.name.startswith("component:")]
    if not ranges:
        return None
    parts = dict.fromkeys(COMPONENTS, 0.0)
    for k in gpu_events:
        if k.is_user_annotation or k.name.startswith(("component:", "profiler::")):
            continue
        t = k.time_range.start
        around = [(end - start, name) for start, end, name in ranges if start <= t < end]
        name = ("allreduce" if "allreduce" in k.name.lower().replace("_", "")
                else min(around)[1] if around else "other")
        parts[name] += k.time_range.elapsed_us() / 1e3 / calls
    return parts


def count_kernels(fn):
    """Device kernels (and copies) one eager call launches: what a CUDA graph replays as nodes."""
    fn()
    with kineto_profile(cpu=False, gpu=True) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)


# ---------------------------------------------------------------------------------------------
# The cost model

def collectives_per_forward(layers):
    """The collectives a real TP rank runs in one forward of `layers` decoder layers (tp.py): the
    embedding's all-reduce (its rows split by vocabulary), two a layer (attention's o_proj, the
    MLP's or MoE's down, routed and shared summed first) and the logits' all-gather."""
    return 2 * layers + 2


@dataclass
class ModelledAllreduce:
    """MODELLED collectives of a SIMULATED rank (--allreduce-us), each at us_each:
    collectives_per_forward of the target's layers a target forward, of 1 a draft forward."""
    us_each: float
    target_forward_ms: float
    draft_forward_ms: float


NO_ALLREDUCE = ModelledAllreduce(0.0, 0.0, 0.0)


@dataclass
class CycleCost:
    """A chain of num_steps s: its cycle, the accepted length at which it pays, its speedup."""
    cycle_ms: float
    break_even_accept_len: float
    speedup_at: dict      # {accepted length: speedup over the plain step}


@dataclass
class TreeCost:
    """The tree's cycle and break-even, and what it must accept to beat the chain of num_steps."""
    topk: int
    num_steps: int
    num_draft_tokens: int
    cycle_ms: float
    break_even_accept_len: float
    chain_cycle_ms: float | None = optional()
    accept_ratio_to_beat_chain: float | None = optional()


@dataclass
class CostModel:
    plain_step_ms: float
    steps: dict           # {num_steps: CycleCost}
    tree: TreeCost | None = optional()
    variant: str | None = None   # the phases' variant it adds: "graph" or "eager"
    verify: str | None = None    # the verify it prices, as the phases name it: "verify/decode" ...


def modelled_allreduce(b):
    """MODELLED collective ms per target forward and per draft forward for a simulated rank
    given --allreduce-us (collectives_per_forward, each at that many us); None otherwise."""
    x = b.cfg.allreduce_us
    if x is None or not b.target.tp.simulated:
        return None
    return ModelledAllreduce(x, collectives_per_forward(b.target.args.num_hidden_layers) * x / 1e3,
                             collectives_per_forward(1) * x / 1e3)


def loop_overheads(r, variant, loop="eagle3"):
    """A loop's per-cycle commit and host time (medians over its runs of this graph setting: the
    speculative ones, or loop "baseline"; 0 without end-to-end runs): what a cycle pays beside its
    timed phases."""
    runs = [v for n, v in (r.e2e or {}).items()
            if n.startswith(loop) and n.endswith("/" + variant)]
    return tuple(statistics.median(v.phases_ms.get(p, 0.0) for v in runs) if runs else 0.0
                 for p in ("commit", "host"))


def cost_model(r, b):
    """cycle(s) = draft extend(s+1) + (s-1) draft steps + verify(s+1) + accept + commit + host
    [+ modelled collectives: 1 target and s draft forwards]; break-even accepted length = cycle /
    plain step, the plain loop's cycle (its step, commit and host) where it ran at the context
    the phases were timed at, else the isolated decode step plus the plain loop's commit and host
    where it ran (each cycle pays its loop's). s from 1 while the sweep has verify
    and draft extend of s + 1 tokens, all in b.best's variant and attention mode (the sweep's).
    r: the timing.Result so far; sets each speculative run's measured and predicted speedups."""
    variant, mode = b.best
    ph, ar = r.phases_ms, r.allreduce_modelled or NO_ALLREDUCE
    same_context = b.cfg.context_len[0] == b.cfg.prompt_len
    if r.e2e and same_context:
        base = r.e2e[f"baseline/{variant}"].phases_ms["cycle"]
    else:
        base = ph[f"decode_step/{variant}"] + sum(loop_overheads(r, variant, "baseline"))
    base += ar.target_forward_ms
    commit, host = loop_overheads(r, variant)
    sweep, cm, s = r.verify_sweep_ms, {}, 1
    while s + 1 in sweep and sweep[s + 1].draft_extend is not None:
        cyc = (sweep[s + 1].draft_extend + (s - 1) * ph[f"draft_step/{variant}"]
               + sweep[s + 1].verify + ph["accept"] + commit + host + ar.target_forward_ms
               + s * ar.draft_forward_ms)
        cm[s] = CycleCost(cyc, cyc / base, {tau: tau * base / cyc for tau in range(1, s + 2)})
        s += 1
    tree = (tree_cost(r, b, base, commit + host, ar, cm) if b.cfg.speculative_eagle_topk > 1
            else None)
    for name, v in r.e2e.items():  # against the baseline with the same graph setting
        if name.startswith("eagle3"):
            plain = r.e2e[f"baseline/{name.split('/')[-1]}"]
            v.speedup_measured = v.tok_per_s / plain.tok_per_s
            v.speedup_predicted = (v.accept_len_mean * plain.phases_ms["cycle"]
                                   / v.phases_ms["cycle"])
    return CostModel(base, cm, tree, variant, b.verify_name(mode))


def tree_cost(r, b, base, overhead, ar, chains):
    """The tree's cycle, as cost_model's: draft extend over the deepest path + the expansion +
    the verify of its N nodes (its mask built inside) + the tree's acceptance
    (timing.time_tree_accept: its walk and the tokens emitted, a graph's replay where the run's
    graphs are on and the walk greedy, then the accepted path's cache move) + overhead (the loop's
    commit and host) [+ modelled all-reduces]; its break-even accepted length, and how many times
    the chain of num_steps' accepted length it must accept to beat it (the ratio of the two
    cycles: the same tokens a millisecond)."""
    (variant, mode), ph, sweep = b.best, r.phases_ms, r.verify_sweep_ms
    K, S, N = b.cfg.speculative_eagle_topk, b.k, b.cfg.speculative_num_draft_tokens
    D = min(S, N - 1)
    point = sweep.get(D + 1)
    extend = (point.draft_extend if point and point.draft_extend is not None
              else ph[f"draft_extend/{variant}"])
    cyc = (extend + ph[f"draft_tree/{variant}"] + ph[f"{b.verify_name(mode)} tree/{variant}"]
           + ph["tree_accept"] + overhead + ar.target_forward_ms + S * ar.draft_forward_ms)
    out = TreeCost(K, S, N, cyc, cyc / base)
    if S in chains:
        out.chain_cycle_ms = chains[S].cycle_ms
        out.accept_ratio_to_beat_chain = cyc / chains[S].cycle_ms
    return out


# ---------------------------------------------------------------------------------------------
# The verify sweep against its floors: no cliff

CLIFF_FLOOR_RATIO = 1.3   # an added token may cost this many times its floor's increment
CLIFF_SLACK_MS = 0.05     # plus this much a token the forward adds
CLIFF_MAX_TOKENS = 32     # checked from 1 to this many tokens a row
CLIFF_COMPONENTS = 2      # a cliff names this many components, those that grew most


@dataclass
class Cliff:
    """Two neighbouring points of the verify sweep whose added time exceeds what the rule allows."""
    tokens: list          # [T1, T2], tokens a row
    added_ms: float       # verify(T2) - verify(T1)
    allowed_ms: float     # CLIFF_FLOOR_RATIO x (floor(T2) - floor(T1)) + slack x B (T2 - T1)
    # the components whose profiled time grew most from T1 to T2, {component: ms}, largest first
    # (CLIFF_COMPONENTS of them; where both points have a profile)
    grew: dict | None = optional()


@dataclass
class SweepCliffs:
    """The sweep checked point to point: each added token costs at most CLIFF_FLOOR_RATIO times
    its floor's increment plus CLIFF_SLACK_MS a token of the forward (B rows: B a row's token)."""
    rule: str
    checked: list         # [[T1, T2], ...] the neighbouring points compared
    cliffs: list          # [Cliff] those that break the rule


def cliff_allowed_ms(floor_added_ms, tokens_added, batch):
    """What the rule lets tokens_added more tokens a row cost, their floor grown by floor_added_ms
    (B rows: B tokens of the forward a row's token)."""
    return CLIFF_FLOOR_RATIO * floor_added_ms + CLIFF_SLACK_MS * batch * tokens_added


def sweep_cliffs(sweep, batch):
    """The verify sweep {T: SweepPoint} against its floors, neighbouring points up to
    CLIFF_MAX_TOKENS; None without floors (they need a GPU's bandwidth)."""
    points = sorted(T for T, p in sweep.items() if p.floor_ms is not None and T <= CLIFF_MAX_TOKENS)
    if len(points) < 2:
        return None
    rule = (f"each added token costs at most {CLIFF_FLOOR_RATIO:g}x its floor's increment + "
            f"{CLIFF_SLACK_MS * 1e3:g} us" + (f" (a token of the forward: {batch} rows)"
                                             if batch > 1 else ""))
    out = SweepCliffs(rule, [], [])
    for t1, t2 in zip(points, points[1:]):
        a, z = sweep[t1], sweep[t2]
        added = float(z.verify) - float(a.verify)
        allowed = cliff_allowed_ms(z.floor_ms - a.floor_ms, t2 - t1, batch)
        out.checked.append([t1, t2])
        if added > allowed:
            out.cliffs.append(Cliff([t1, t2], added, allowed,
                                   grown_components(a.components, z.components)))
    return out


def grown_components(before, after):
    """The CLIFF_COMPONENTS components whose time grew most from one profile ({component: ms}) to
    the next, largest first; None unless both exist."""
    if not before or not after:
        return None
    growth = {c: after.get(c, 0.0) - before.get(c, 0.0) for c in COMPONENTS}
    return dict(sorted(growth.items(), key=lambda kv: -kv[1])[:CLIFF_COMPONENTS])
