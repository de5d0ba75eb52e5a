"""What run.py's timing run prints, and how far to trust it.

Timing is a median that keeps its repetitions (its spread, and whether it is noisy). The report
prints, per context length, the isolated phases against their floors and the component table
(where a decode step's and a verify's time goes); then the verify sweep against its floors and
its cliffs; then the end-to-end loops, the cost model, memory and collectives; then warnings
about figures that cannot be (noise), and the answer in words with a verdict on what this run's
acceptance means. Everything here reads the timing.Result that timing.measure returns and the
Bench it ran on; as_json turns the Result into the --json line; `python report.py tables A.json
B.json ...` puts several runs' lines in one markdown table (tables), `python report.py phases`
makes one GPU run's phase and component tables (phases) and `python report.py sweep` their verify
sweeps side by side (sweep), as BENCHMARKS.md shows them; `python report.py sweep-plot` draws the
sweeps (sweep_plot), `python report.py routed` sets their routed experts against their floor
across routings (routed). Nothing here times anything.

The --json line is as_json(timing.Result): each dataclass a dict of its fields, each Timing its
median in ms, integer keys as strings. Its verify sweep, `verify_sweep_ms`, maps the tokens a row
T (run.py's settled `verify_sweep_tokens`: 1 to 6 on a CPU; on a GPU 1 to 8, 10, 12, 16, 20, 24,
28 and 32 while the batch's forward holds at most 32 tokens; or --sweep-tokens; always with 1 to
num_steps + 1) to
    {"verify": ms, "draft_extend": ms (up to 8 tokens, or num_steps + 1 where more; absent above),
     "distinct_experts": routed experts a MoE layer reaches (the mean over the layers),
     "floor_ms": the verify's bytes over the copy bandwidth (null without a GPU),
     "components": {component: ms} of a profiled eager verify, as the component table's (a
     GPU's run: with floors; absent on a CPU),
     "routed_floor_ms": the routed experts component's floor (a GPU's run; absent on a CPU)};
`sweep_cliffs` checks it against its floors (components.sweep_cliffs; null without floors):
    {"rule": in words, "checked": [[T1, T2], ...] neighbouring points,
     "cliffs": [{"tokens": [T1, T2], "added_ms": ms, "allowed_ms": ms,
                 "grew": {component: ms} the components whose time grew most}, ...] those that
     break it}.
"""
import dataclasses
import json
import os
import statistics
import sys
import textwrap

import torch

import baseline
import checkpoint
import kernels
import model
from components import COMPONENTS, cliff_allowed_ms, collectives_per_forward, modelled_allreduce
from verify import simulated_center


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


def as_json(x):
    """A result as the --json line holds it: a dataclass as a dict of its fields (a field marked
    OMIT_NONE left out while None), dicts and lists walked, Timings kept (JSON writes a Timing as
    its median)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: as_json(getattr(x, f.name)) for f in dataclasses.fields(x)
                if getattr(x, f.name) is not None or not f.metadata.get("omit_none")}
    if isinstance(x, dict):
        return {k: as_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [as_json(v) for v in x]
    return x


def json_line(r):
    return json.dumps(as_json(r)) + "\n"


def header(b):
    """The run's first line (wrapped): the target, its TP, dtype, MoE path, kernels and routing;
    the batch, lengths and num_steps (and the temperature where it samples); the device; what is
    SIMULATED or MODELLED."""
    t, a = b.target, b.cfg
    group, fp8 = t.args.int4_group_size, t.args.fp8_block
    quant_note = (f" (routed experts INT4, group {group})" if group else
                  f" (routed experts FP8 e4m3, {fp8[0]}x{fp8[1]} blocks)" if fp8 else "")
    routing = routing_label(b)
    ar = modelled_allreduce(b)
    head_kernels = (f" (the head's: {','.join(b.head.kernels) or 'none'})" if b.head is not None
                    else "")
    device = (torch.cuda.get_device_name(t.device) if b.gpu
              else f"CPU, {torch.get_num_threads()} thread(s)")
    text = (f"target: {b.how}, {t.args.num_hidden_layers} layers, {t.args.n_routed_experts} routed "
            f"experts, {t.tp.describe()}, {a.dtype}{quant_note}, moe {moe_note(t)}, kernels "
            f"{','.join(t.kernels) or 'none'}{head_kernels}, {routing} | batch {a.batch_size}, "
            f"prompt {a.prompt_len}, cached {'/'.join(map(str, a.context_len))} (isolated "
            f"phases), num_steps {b.k}"
            + (f", sampling at temperature {a.temperature:g}" if a.temperature > 0 else "")
            + f" | {device}, torch {torch.__version__}"
            + (" | acceptance SIMULATED" if a.simulate_accept_len is not None else "")
            + (f" | collectives MODELLED at {ar.us_each:g} us" if ar else ""))
    return wrap(text, "", "  ")


def moe_note(t):
    """Which MoE path runs: with "fused", for which token counts (and FP8's adaptive variant,
    run.py --moe-adaptive)."""
    experts = next((layer.mlp.experts for layer in t.layers if isinstance(layer.mlp, model.MoE)),
                   None)
    if t.moe_impl != "fused" or experts is None:
        return t.moe_impl
    grouped_above = kernels.grouped_mm_available(t.device, t.dtype) and not experts.quantized
    adaptive = kernels.moe.ADAPTIVE_MIN_TOKENS.get("fp8") if t.args.fp8_block else None
    return ("fused Triton kernel"
            + (f" (grouped above {experts.FUSED_MAX_TOKENS} tokens)" if grouped_above else "")
            + (f" (adaptive variant from {adaptive} tokens)" if adaptive else ""))


def answer(r, b):
    """The run's answer in a few plain sentences (what the README's story needed to know)."""
    return (verify_answer(r, b) + cost_answer(r, b) + tree_answer(r) + sweep_answer(r, b)
            + simulated_note(r, b))


def verify_answer(r, b):
    """What verify costs against a decode step, and which components make the difference."""
    (variant, model_mode), k, ctx = b.best, b.k, b.cfg.context_len[0]
    name = b.verify_name(model_mode)  # "verify/prefill" or "verify/decode", as the tables say
    mode = name.split("/")[1]
    c, ar = r.contexts[ctx], modelled_ms(r)
    dec, ver = c.phases_ms[f"decode_step/{variant}"] + ar, c.phases_ms[f"{name}/{variant}"] + ar
    d, v = (c.components[p] for p in ("decode_step", name))
    extra = sorted(((v.parts_ms[n] - d.parts_ms[n], n) for n in COMPONENTS), reverse=True)
    more, top = v.kernel_ms - d.kernel_ms, []
    for x, n in extra[:3]:  # the largest parts of the extra kernel time, until they make 60% of it
        if x <= 0 or top and sum(y for y, _ in top) >= 0.6 * more:
            break
        top.append((x, n))
    unit = "kernels" if b.gpu else "ops (CPU time)"
    noise = ": below 1, which cannot be (a verify does a decode step's work and more): noise."
    lines = [f"Verify of k+1 = {k + 1} tokens ({mode} attention, {variant}, {ctx} cached tokens) "
             f"costs {ver / dec:.2f} decode steps ({ver:.2f} vs {dec:.2f} ms"
             + (", collectives MODELLED" if ar else "") + ")" + (noise if ver < dec else ".")]
    gaps = (ver - dec) - more
    if not (more > 0 and top):
        return lines + [f"Its {unit} take no longer ({v.kernel_ms:.2f} vs {d.kernel_ms:.2f} ms "
                        "summed): the difference is launches and gaps."]
    where = "inside the graph" if variant == "graph" else "between ops"
    rest = (f"launches and gaps {where} make the other {gaps:+.2f} ms." if gaps >= 0 else
            f"yet the timed runs differ by only {ver - dec:.2f} ms (the profiled run and the timed "
            "ones disagree: noise, or ops that overlap).")
    mostly = ", ".join(f"{COMPONENTS[n]} +{x:.2f} ms" for x, n in top)
    return lines + [f"Its {unit} take {more:.2f} ms more ({v.kernel_ms:.2f} vs {d.kernel_ms:.2f} "
                    f"ms summed), mostly {mostly}; {rest}"]


def modelled_ms(r):
    """MODELLED all-reduce ms per target forward (0 where none are modelled)."""
    return r.allreduce_modelled.target_forward_ms if r.allreduce_modelled else 0.0


def cost_answer(r, b):
    """At which accepted length the chain of num_steps pays, and what ~2 tokens a cycle give."""
    k, cm = b.k, r.cost_model.steps.get(b.k)
    if not cm:
        return [f"EAGLE-3 with num_steps {k}: {untimed_chain(k, r.cost_model.steps)}."]
    at2 = 2 * r.cost_model.plain_step_ms / cm.cycle_ms
    be, modelled = cm.break_even_accept_len, bool(modelled_ms(r))
    pays = (f"pays above {be:.2f} accepted tokens per cycle" if 1 <= be <= k + 1 else
            f"cannot pay here ({be:.2f} plain steps a cycle; a cycle accepts at most {k + 1} "
            "tokens)" if be > k + 1 else
            f"looks cheaper than the plain step it contains ({be:.2f}), which cannot be: noise")
    notes = [note for note, on in (("slower than plain decoding", at2 < 1),
                                   ("collectives MODELLED", modelled)) if on]
    return [f"EAGLE-3 with num_steps {k} {pays} (bonus included: a {cm.cycle_ms:.2f} ms "
            f"cycle against a {r.cost_model.plain_step_ms:.2f} ms plain step"
            + (", collectives MODELLED" if modelled else "") + ").",
            f"At the README story's ~2 tokens per cycle it would give {at2:.2f}x"
            + (f" ({'; '.join(notes)})." if notes else ".")]


def untimed_chain(k, steps):
    """Why the cost model has no cycle of num_steps k: its steps ({num_steps: ...}, keys as ints
    or as the JSON's strings) stop short of it."""
    priced = sorted(map(int, steps))
    upto = (f"the cost model prices num_steps {priced[0]} to {priced[-1]}" if priced else
            "the cost model prices no chain")
    return (f"not timed ({upto}: the verify sweep has no verify and draft extend of {k + 1} "
            "tokens)")


def simulated_note(r, b):
    """What in this run is SIMULATED or MODELLED, in one sentence."""
    tp = b.target.tp
    modelled = r.allreduce_modelled is not None   # (at --allreduce-us 0 too, as the header)
    rank = f"one SIMULATED rank of TP {tp.world_size}" + (
        f", collectives MODELLED at {b.cfg.allreduce_us:g} us" if modelled else
        ", collectives not counted (--allreduce-us X models them)")
    notes = [note for note, on in (
        ("routing SIMULATED uniform (random weights route unlike a trained router)",
         b.target.routing == "uniform"),
        (routing_label(b), b.target.routing in ("distinct", "trace")),
        (rank, tp.simulated),
        ("acceptance SIMULATED", bool(b.cfg.simulate_accept_len)),
        ("CPU op times, not a GPU's", not b.gpu)) if on]
    return ["Simulated or modelled here: " + "; ".join(notes) + "."] if notes else []


def print_phases(r, ctx, c, b):
    bw = r.bandwidth_GBps
    floors = (f"; x floor: bytes that must move / {bw:.0f} GB/s measured" if bw
              else "; floors need a GPU")
    print("\n" + wrap(f"phase times at {ctx} cached tokens, isolated (ms: median [min lower-upper "
                      f"quartile max] of {r.env.config['reps']} repetitions{floors}; distinct "
                      f"experts: per MoE layer{routing_suffix(b)})", "", ""))
    for name, ms in c.phases_ms.items():
        phase = name.rsplit("/", 1)[0] if "/" in name else name
        floor, experts = c.floors_ms.get(phase), c.distinct_experts.get(phase)
        print((f"  {name:30s} {ms:9.3f} {fmt_spread(ms):31s}"
               + (f"   {ms / floor:5.1f}x floor {floor:.3f}" if floor else "")
               + (f"   {experts:5.1f} distinct experts" if experts is not None
                  else "")).rstrip())   # what chose them: in the header (routing_suffix)


def routing_suffix(b):
    """What chose the experts that a distinct-expert count counts, where not the model's router:
    ' (SIMULATED uniform)', ' (SIMULATED distinct)', ' (TRACE)' or ''."""
    return {"uniform": " (SIMULATED uniform)", "distinct": " (SIMULATED distinct)",
            "trace": " (TRACE)"}.get(b.target.routing, "")


LABEL, W = 54, 9  # the component table's label and column widths


def print_components(r, ctx, c, b):
    """Where the time goes at one context: a table for the chain's verifies and, with a tree, one
    for the tree's (each within 120 columns); the MODELLED all-reduces under them."""
    unit, bw = "kernel" if b.gpu else "CPU op", r.bandwidth_GBps
    print(f"\nwhere the time goes at {ctx} cached tokens: ms per forward of summed {unit} time in "
          "a profiled eager run\nof the same shapes, by component; floor: the bytes the component "
          "must move" + (" / bandwidth, in ms" if bw else ", in MB (a GPU turns them into ms)"))
    if not b.gpu:
        print("(on a CPU the profiler's own cost per op makes the summed op time exceed the timed "
              "phase: read the parts as shares,\nand the difference row (launches, gaps) as too "
              "low)")
    verifies = [p for p in c.components if p.startswith("verify/")]
    chain = [p for p in verifies if not p.endswith(" tree")]
    tree = [p for p in verifies if p.endswith(" tree")]
    for group, titles in ((chain, ("verify", "verify - decode")),
                          (tree, ("verify tree", "tree - decode"))):
        if group:
            component_table(r, c, b, group, titles)
    ar = r.allreduce_modelled
    if ar:
        n = collectives_per_forward(b.target.args.num_hidden_layers)
        print(f"  collectives MODELLED, not in the rows above: {n} (2 x layers + 2) x "
              f"{ar.us_each:g} us = {ar.target_forward_ms:.2f} ms per forward")


def component_table(r, c, b, verifies, titles):
    """Rows: components, then totals; columns: the decode step and its floor, each verify of
    `verifies` (one per attention mode) and their floor, verify - decode."""
    comps, bw, variant = c.components, r.bandwidth_GBps, b.best[0]
    unit, floor = ("kernel", "floor ms") if b.gpu else ("CPU op", "floor MB")

    def floor_of(phase, n):
        nbytes = c.bytes[phase][n] if n else sum(c.bytes[phase].values())
        return nbytes / bw / 1e6 if bw else nbytes / 1e6

    def row(label, dec, alone, each):
        values = ([dec, alone[0]] + [each(p) for p in verifies] + [alone[1]]
                  + [each(p) - dec for p in verifies])
        print(f"  {label:{LABEL}s}" + "".join(f"{x:{W}.3f}" if isinstance(x, float)
                                              else f"{str(x):>{W}s}" for x in values))
    modes = [p.split("/")[1].removesuffix(" tree") for p in verifies]
    groups = [("decode step", ["ms", floor]), (titles[0], modes + [floor]), (titles[1], modes)]
    print(f"  {'':{LABEL}s}" + "".join(f"{g:^{W * len(cols)}s}" for g, cols in groups))
    print(f"  {'':{LABEL}s}" + "".join(f"{h:>{W}s}" for _, cols in groups for h in cols))
    dec, first = comps["decode_step"], verifies[0]
    for n, label in COMPONENTS.items():
        row(label, dec.parts_ms[n], (floor_of("decode_step", n), floor_of(first, n)),
            lambda p: comps[p].parts_ms[n])
    row(f"summed {unit} time", dec.kernel_ms,
        (floor_of("decode_step", None), floor_of(first, None)), lambda p: comps[p].kernel_ms)
    totals = {p: c.phases_ms[f"{p}/{variant}"] for p in comps}
    row(f"{'captured' if variant == 'graph' else 'eager'} total (median)", totals["decode_step"],
        ("", ""), totals.get)
    gap = {p: totals[p] - comps[p].kernel_ms for p in comps}
    row("difference (launches, gaps" + (" inside the graph)" if variant == "graph" else ", host)"),
        gap["decode_step"], ("", ""), gap.get)
    if variant == "graph" and min(gap.values()) < 0:
        print("  (a difference below 0: in the graph each Triton kernel starts in its "
              "predecessor's tail\n   (programmatic dependent launch); the profile ran them "
              "eager, one after another)")
    row("kernels" if b.gpu else "leaf ops", dec.kernels, ("", ""), lambda p: comps[p].kernels)
    ex = c.distinct_experts
    row("distinct experts per MoE layer" + routing_suffix(b), ex["decode_step"], ("", ""), ex.get)


def print_e2e(r, b):
    if not r.e2e:
        return
    sim, k = b.cfg.simulate_accept_len, b.k
    print("\nend to end: tok/s (one generate call, its prefill included); the cycle in ms, median "
          "[min lower-upper\nquartile max]; its phases in ms, each the median over the cycles (so "
          "they need not add up to the\ncycle's median); accepted tokens per cycle, bonus "
          "included, as kept"
          + (" (SIMULATED)" if sim is not None else ""))
    if sim is not None:
        print("  SIMULATED acceptance: each row's accepted length in each cycle is "
              f"round(clamp(N(c, 1), 1, {k + 1}))\n  with c = {simulated_center(sim, k):.2f}, the "
              f"center that makes its mean --simulate-accept-len {sim} (the clamp\n  alone pulls "
              "the mean to the middle); the tokens are not the model's")
    for name, v in r.e2e.items():
        cycle = v.phases_ms.get("cycle")
        spread = f" {fmt_spread(cycle, 2)}" if isinstance(cycle, Timing) else ""
        speedup = (f"  speedup {v.speedup_measured:.2f}x (predicted {v.speedup_predicted:.2f}x)"
                   if v.speedup_measured is not None else "")
        print(f"  {name:22s} {v.tok_per_s:8.1f} tok/s  cycle {cycle or 0:.2f}{spread}{speedup}")
        print(f"  {'':22s} " + ", ".join(f"{p} {t:.2f}" for p, t in v.phases_ms.items()
                                         if p != "cycle"))
        if v.accept_len_mean is not None:
            hist = " ".join(f"{n}:{c}" for n, c in enumerate(v.accept_len_hist, 1))
            kept = sum(n * c for n, c in enumerate(v.accept_len_hist, 1))
            cycles = "cycles" if b.cfg.batch_size == 1 else "row-cycles"   # a row's cycle each
            print(f"  {'':22s} accept len {v.accept_len_mean:.2f}: {cycles} by length {hist} = "
                  f"{kept} tokens (+ {v.tokens - kept} from the prefill)")


def print_sweep(r, b):
    """The verify sweep: each point's time, its floor and the distinct experts it reaches; then
    the cliff check (components.sweep_cliffs), each point that breaks it named, within 100
    columns."""
    sweep, bw = r.verify_sweep_ms, r.bandwidth_GBps
    if not sweep:
        return
    (variant, mode), ctx = b.best, b.cfg.context_len[0]
    floors = f"x floor: bytes that must move / {bw:.0f} GB/s" if bw else "floors need a GPU"
    print("\n" + wrap(f"verify sweep at {ctx} cached tokens, batch {b.cfg.batch_size} "
                      f"({b.verify_name(mode)}, {variant}; ms, medians; {floors}; distinct "
                      f"experts: per MoE layer{routing_suffix(b)}):", "", "  ", width=100))
    print(f"  {'tokens a row':>12s} {'verify':>9s} {'floor':>9s} {'x floor':>8s} "
          f"{'distinct experts':>17s} {'draft extend':>13s}   (* noisy)")
    for T, p in sweep.items():
        floor = p.floor_ms
        print((f"  {T:12d} {p.verify:8.3f}{star(p.verify)} "
               + (f"{floor:9.3f} {p.verify / floor:7.2f}x " if floor else f"{'-':>9s} {'-':>8s} ")
               + f"{p.distinct_experts:17.1f} "
               + (f"{p.draft_extend:12.3f}{star(p.draft_extend)}" if p.draft_extend is not None
                  else f"{'-':>13s}")).rstrip())
    print(wrap(cliff_line(r.sweep_cliffs), "  ", "    ", width=100))


def cliff_line(check):
    """The cliff check in one paragraph: the rule, and the points that break it (or none)."""
    if check is None:
        return ("no cliff check: it compares each added token's time with its floor's increment, "
                "and the floors need a GPU's bandwidth")
    if not check.cliffs:
        first, last = check.checked[0][0], check.checked[-1][1]
        return f"no cliff from {first} to {last} tokens a row: {check.rule}"
    return (f"{len(check.cliffs)} cliff(s), where {check.rule} fails (tokens a row: added ms > "
            "allowed ms, and the components that grew most in a profiled eager verify): "
            + "; ".join(f"{c.tokens[0]}->{c.tokens[1]}: +{c.added_ms:.2f} > {c.allowed_ms:.2f}"
                        + _grew(c) for c in check.cliffs))


def _grew(cliff):
    """' (component +ms, ...)' for a cliff's components that grew most, or '' without them."""
    if not cliff.grew:
        return ""
    return " (" + ", ".join(f"{k.replace('_', ' ')} {v:+.2f}" for k, v in cliff.grew.items()) + ")"


def tree_answer(r):
    """The tree's sentence: its cycle, its break-even, what it must accept to beat the chain, and
    what it accepted (end to end, SIMULATED if so)."""
    t = r.cost_model.tree
    if not t:
        return []
    K, S, N = t.topk, t.num_steps, t.num_draft_tokens
    line = (f"A tree of topk {K}, {S} steps, {N} draft tokens: a {t.cycle_ms:.2f} ms cycle, "
            f"break-even {t.break_even_accept_len:.2f} accepted tokens per cycle"
            + (", collectives MODELLED" if modelled_ms(r) else ""))
    if t.chain_cycle_ms is not None:
        line += (f"; it pays over the chain of {S} ({t.chain_cycle_ms:.2f} ms) where it accepts "
                 f"more than {t.accept_ratio_to_beat_chain:.2f}x the chain's accepted length")
    spec = [v for n, v in r.e2e.items() if n.startswith("eagle3")]
    if spec:
        line += (f"; end to end it accepted {spec[0].accept_len_mean:.2f}"
                 + (" (SIMULATED)" if spec[0].simulated else ""))
    return [line + "."]


def priced(b):
    """The variant and the verify the cost model prices (Bench.best), and why that verify."""
    variant, mode = b.best
    why = f" whose verify of {b.k + 1} timed faster" if len(b.modes) > 1 else ", the only one timed"
    return f"{variant}, {b.verify_name(mode).split('/')[1]} attention{why}"


def print_cost_model(r, b):
    cm = r.cost_model
    ar = "; collectives MODELLED" if r.allreduce_modelled else ""
    print("\n" + wrap(f"cost model ({priced(b)}{ar}): plain step {cm.plain_step_ms:.2f} ms; cycle "
                      "and break-even accepted length per num_steps", "", "  "))
    for steps, c in cm.steps.items():
        sp = " ".join(f"{t}:{s:.2f}x" for t, s in c.speedup_at.items())
        print(f"  num_steps {steps}: cycle {c.cycle_ms:.2f} ms, break-even "
              f"{c.break_even_accept_len:.2f} | speedup at accept len {sp}")
    if b.k not in cm.steps:
        print(f"  num_steps {b.k} (this run's): {untimed_chain(b.k, cm.steps)}")
    if cm.tree:
        t = cm.tree
        print(f"  tree of topk {t.topk}, num_steps {t.num_steps}, {t.num_draft_tokens} draft "
              f"tokens: cycle {t.cycle_ms:.2f} ms, break-even {t.break_even_accept_len:.2f}")


def print_extras(r, b):
    env = r.env
    if env.gpu_mem_peak_GB is not None:
        print(f"\nGPU memory: weights {env.weights_GB:.1f} GB (routed experts "
              f"{env.routed_experts_GB:.1f}), peak allocated {env.gpu_mem_peak_GB:.1f} GB"
              + (f" (before any CUDA graph: {env.gpu_mem_peak_eager_GB:.1f} GB)"
                 if env.gpu_mem_peak_eager_GB is not None else ""))
        print(f"kernels per eager decode step: {r.kernels_per_decode_step}"
              + (f", with torch.compile: {r.kernels_per_decode_step_compiled}"
                 if r.kernels_per_decode_step_compiled is not None else ""))
    comm = r.allreduce_measured
    if comm:
        print_allreduce(comm, b)
    line = agreement_line(r, b)
    if line:
        print("\n" + line)


def print_allreduce(comm, b):
    """Real TP's all-reduces (timing.collectives): one of T tokens a row reduces B x T hidden rows
    at batch B, as a forward's does."""
    us, k1, B = comm.us_each, b.k + 1, b.cfg.batch_size
    rows = "one token's hidden row" if B == 1 else f"{B} hidden rows (one token a row, batch {B})"
    per = f"{B} x T hidden rows" if B > 1 else "T hidden rows"
    print(f"\nall-reduce, us each, by tokens a row T ({per} each; {comm.implementation}):")
    for how in ("interleaved", "back_to_back", "eager"):
        row = ", ".join(f"{key.split('/')[1]}: {v:.1f}" for key, v in us.items()
                        if key.split("/")[0] == how)
        if row:
            print(f"  {how.replace('_', ' ')}: {row}")
    if "interleaved/1" in us:
        print(f"  interleaved = each after a {comm.gemv_MB:.3g} MB GEMV (as long as this decode "
              "step's compute between two all-reduces), minus the GEMVs alone; after one 8x "
              f"shorter: {us['interleaved_short_gemv/1']:.1f} (T = 1)")
        print(f"measured between compute: {us['interleaved/1']:.1f} us per all-reduce of {rows}: "
              "give it to a simulated rank as --allreduce-us, for the decode "
              f"step and the verify of {k1} alike, each collective of a forward at it (on 2 H200s "
              "it predicted the decode step within 2.1% and the verify within 1.0%; "
              "BENCHMARKS.md)")
    twin = comm.real_minus_twin_us
    if twin:
        print("real minus its SIMULATED twin (this rank's weights, collectives skipped), per "
              f"collective of the {comm.per_forward} a forward runs: "
              + ", ".join(f"{name} {v:.1f} us" for name, v in twin.items()))


def agreement_line(r, b):
    ag = r.greedy_agreement_with_plain
    if not ag:
        return None if not r.e2e or b.target.routing == "model" else wrap(
            f"greedy speculative vs plain output: not compared, since {routing_label(b)} "
            "gives a token its experts by its place in the forward"
            + (" and the trace's order" if b.target.routing == "trace" else "")
            + ", so a verify and a decode step compute different functions (--routing model "
            "compares them)", "", "  ")
    shares = ", ".join(f"{name.removeprefix('eagle3/')} {x:.0%}" for name, x in ag.items())
    if all(x == 1 for x in ag.values()):
        meaning = "identical, as lossless greedy speculative decoding must be"
    else:
        meaning = ("verify reads k+1 tokens where plain decoding reads one, so the reductions run "
                   f"in another order; in {b.cfg.dtype}"
                   + (" on random weights, whose logits over the whole vocabulary nearly tie,"
                                        if not b.cfg.model_path else ",")
                   + " that flips an argmax now and then and the sequences part from there. It "
                   "measures rounding, not correctness: exact equality is tested in float64 "
                   "(test_equivalence.py)")
    return wrap("greedy speculative output vs plain greedy output, share of tokens equal: "
                f"{shares} ({meaning})",
                "", "  ")


def report(r, b):
    """The tables, the warnings and the answer (the header was printed at the start)."""
    for ctx, c in r.contexts.items():
        print_phases(r, ctx, c, b)
        print_components(r, ctx, c, b)
    print_sweep(r, b)
    print_e2e(r, b)
    print_cost_model(r, b)
    print_routing_sweep(r)
    print_extras(r, b)
    for w in r.warnings:
        print("\n" + wrap(f"warning: {w}", "", "  "))
    print("\nthe answer:\n" + "\n".join(wrap(line, "  ", "    ") for line in r.answer) + "\n")


def wrap(text, first, rest, width=110):
    """One paragraph of the report in lines of at most `width` characters."""
    return textwrap.fill(text, width, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


# ---------------------------------------------------------------------------------------------
# How far to trust the numbers: spreads, warnings, and the verdict after the answer

def _entries(v):
    """(key, value) of a dict, or of a list by its items' D (--distinct-sweep's points) or index."""
    if isinstance(v, dict):
        return v.items()
    return ((f"D={x['distinct']}" if isinstance(x, dict) and "distinct" in x else str(i), x)
            for i, x in enumerate(v))


def spreads(tree):
    """The same nesting as `tree` (a result, or its as_json), keeping only its Timings, each as its
    spread() (for the JSON); a list's items keyed by _entries."""
    out = {}
    for key, v in _entries(as_json(tree)):
        if isinstance(v, Timing):
            out[key] = v.spread()
        elif isinstance(v, (dict, list)) and (sub := spreads(v)):
            out[key] = sub
    return out


def named_timings(tree, path="", seen=None):
    """(name, Timing) for every Timing in the result, named as the tables name them, each once
    (the first context's phases appear twice in the result)."""
    seen = set() if seen is None else seen
    for key, v in _entries(tree):
        name = (path if key in ("phases_ms", "e2e") else f"{path}sweep T="
                if key == "verify_sweep_ms" else f"{path}{key}/")
        if isinstance(v, Timing) and id(v) not in seen:
            seen.add(id(v))
            yield name.rstrip("/"), v
        elif isinstance(v, (dict, list)):
            yield from named_timings(v, name, seen)


def timing_warnings(r):
    """What not to trust in these numbers: noisy timings, and derived figures that cannot be."""
    out = []
    noisy = [(name, t) for name, t in named_timings(as_json(r)) if t.noisy]
    if noisy:
        out.append(noise_warning(noisy, r.env.load_average, r.env.cpu_count, r.env.world_size))
    env = r.env
    if env.device == "cpu" and env.world_size > 1:
        out.append(f"{env.world_size} CPU ranks share this machine's cores, and each waits in "
                   "gloo's all-reduce for the others, so that wait counts as all-reduce time: "
                   "figures here contradict each other (an all-reduce longer than a forward, a "
                   "verify cheaper than a decode step, phases that outlast their cycle). Under "
                   "torchrun a CPU shows that TP runs (the tests hold TP 2 equal to TP 1); time "
                   "on GPUs")
    cycles = [(int(s), c.cycle_ms) for s, c in r.cost_model.steps.items()]
    shorter = [f"num_steps {s2} {c2:.2f} ms < num_steps {s1} {c1:.2f} ms"
               for (s1, c1), (s2, c2) in zip(cycles, cycles[1:]) if c2 < c1]
    if shorter:
        out.append(f"the cost model's cycle shrinks with more draft steps ({'; '.join(shorter)}), "
                   "though each step adds work: noise in the verify sweep")
    for steps, c in r.cost_model.steps.items():
        be, most = c.break_even_accept_len, int(steps) + 1
        if not 1 <= be <= most:
            out.append(f"num_steps {steps}: break-even {be:.2f} accepted tokens per cycle, outside "
                       f"[1, {most}]: "
                       + ("a cycle measured cheaper than the plain step it contains, which cannot "
                          "be (noise)" if be < 1
                          else f"a cycle costs more than {most} plain steps, so it cannot pay "
                          "here, unless it is noise"))
    for name, v in r.e2e.items():
        alone = r.phases_ms.get(f"decode_step/{name.split('/')[-1]}")
        loop = v.phases_ms.get("decode_step")
        far = alone and loop and max(alone, loop) > 2 * min(alone, loop)
        if name.startswith("baseline/") and far:
            out.append(f"the plain decode step takes {alone:.3f} ms alone and {loop:.3f} ms inside "
                       f"the loop ({name}): the same work, so one of them is noise")
        measured, predicted = v.speedup_measured, v.speedup_predicted
        if predicted is not None and max(measured, predicted) > 1.5 * min(measured, predicted):
            out.append(f"{name}: measured speedup {measured:.2f}x but {predicted:.2f}x predicted "
                       "from its own phases: the wall clock (one generate call, its prefill "
                       "included) and the cycles' medians disagree")
    out += profile_warnings(r)
    sweep = {t: v.verify for t, v in (r.verify_sweep_ms or {}).items()}
    inverted = [f"{t1} tokens {sweep[t1]:.3f} ms > 1.5 x {t2} tokens {sweep[t2]:.3f} ms"
                for t1 in sweep for t2 in sweep if t1 < t2 and sweep[t1] > 1.5 * sweep[t2]]
    if inverted:
        out.append("verify costs less with more tokens "
                   f"({'; '.join(inverted[:3])}{'; ...' if len(inverted) > 3 else ''}), which "
                   "cannot be: noise")
    return out


def profile_warnings(r):
    """A profiled phase whose summed kernel time exceeds the timed phase itself (GPU runs; on a
    CPU the profiler's cost per op always does that, print_components says so)."""
    out = []
    if r.env.device == "cpu":   # there always: the profiler's own cost per op (print_components)
        return out
    for ctx, c in r.contexts.items():
        over = []
        for phase, prof in c.components.items():
            timed = c.phases_ms.get(f"{phase}/graph") or c.phases_ms.get(f"{phase}/eager")
            if timed and prof.kernel_ms > timed:
                over.append(f"{phase} {prof.kernel_ms:.2f} > {timed:.2f} ms")
        if over:
            out.append(f"at {ctx} cached tokens the profiled run's summed kernel time exceeds the "
                       f"timed phase ({'; '.join(over)}): kernels that overlap in a graph, not "
                       "work the phase does; read the component table's parts as shares, and its "
                       "difference row (launches, gaps) as too low")
    return out


SHORT_MS = 1.0  # a phase under this is short: the clock's and the scheduler's jitter weigh on it


def noise_warning(noisy, load, cores, ranks=1):
    """Which noisy timings are short phases, and whether the machine was busy (load average above
    its cores) while the rest were timed; noisy: [(name, Timing)]; ranks: the run's processes."""
    short = [n for n, t in noisy if t < SHORT_MS]
    long_ = [n for n, t in noisy if t >= SHORT_MS]

    def names(ns):
        return ", ".join(ns[:4]) + (f" and {len(ns) - 4} more" if len(ns) > 4 else "")
    parts = []
    if short:
        parts.append(f"short phases (under {SHORT_MS:g} ms, where microseconds of jitter count): "
                     f"{names(short)}")
    if long_:
        if load is None:
            why = "other work on the machine"
        elif cores and load > cores:
            why = f"the machine was busy (load average {load:.1f} on {cores} cores)"
        else:
            why = (f"load average {load:.1f} on {cores} cores, no more tasks than cores: a burst "
                   "of another process, the CPU's clock, memory"
                   + (", or waits between ranks" if ranks > 1 else ""))
        parts.append(f"longer ones: {names(long_)}: {why}")
    return (f"{len(noisy)} timing(s) vary by more than {NOISY_IQR:.0%} of their median between "
            "repetitions (interquartile range; marked noisy in the phase table, * in the sweeps): "
            + "; ".join(parts) + ". More --reps, a quiet machine and "
            "one thread a process (OMP_NUM_THREADS=1) steady them.")


def verdict(r):
    """After the answer: what this run's own acceptance means, and how far to trust its numbers."""
    spec = {n: v for n, v in r.e2e.items() if n.startswith("eagle3")}
    lines = []
    if spec:
        best = max(spec, key=lambda n: spec[n].speedup_measured)
        accept_len, speedup = spec[best].accept_len_mean, spec[best].speedup_measured
        if r.env.simulated_acceptance:
            lines.append(simulated_verdict(r, spec[best], best))
        elif accept_len < 1.5:
            lines.append(f"The draft accepted almost nothing ({accept_len:.2f} tokens per cycle, "
                         "bonus included; 1.00 means every draft rejected), "
                         f"{LOW_ACCEPT[r.env.weights]}: the measured speedup ({speedup:.2f}x, "
                         f"{best}) says only what speculation's overhead costs. For a trained "
                         "draft's speedup read the cost model or run with --simulate-accept-len.")
        else:
            lines.append(f"The draft accepted {accept_len:.2f} tokens per cycle (bonus included): "
                         f"measured speedup {speedup:.2f}x ({best}).")
    if r.warnings:
        lines.append("Some timings are noisy or contradict each other (warnings above): treat "
                     "these figures as rough.")
    if r.env.device == "cpu":
        lines.append("On a CPU the toy model's time is per-operation overhead: the numbers show "
                     "how the phases fit together, not what a GPU serving Kimi-K2 would see "
                     "(BENCHMARKS.md has H200 numbers).")
    return lines


LOW_ACCEPT = {  # why a draft accepts almost nothing, by where the weights came from (run.py's env)
    "random": "as random weights do (the trained tiny pair runs only as the tiny preset with "
              "none of --random-weights, --quant, --routed-experts, --simulate-tp)",
    "checkpoints": "with checkpoints loaded, on the timing run's prompts of random ids, where a "
              "trained head has little to predict (its acceptance on real prompts: --dump with "
              "--prompt-ids)",
    "trained tiny pair": "from the trained tiny pair, on held-out text: not what it measured at "
              "training (checkpoints/tiny-stdlib/recipe.json); --prompt-len or --max-new-tokens "
              "too small?",
}


def simulated_verdict(r, v, name):
    """What a SIMULATED acceptance drew, and why its mean is not exactly the length asked (the
    histogram counts a draw a row a cycle: row-cycles at batch above 1, as the e2e table says)."""
    asked, n = r.env.config["simulate_accept_len"], sum(v.accept_len_hist)
    cycles = "cycles" if r.env.config["batch_size"] == 1 else "row-cycles"
    lengths = [length for length, c in enumerate(v.accept_len_hist, 1) for _ in range(c)]
    se = statistics.stdev(lengths) / len(lengths) ** 0.5 if len(lengths) > 1 else float("nan")
    return (f"Acceptance was SIMULATED: asked {asked}, drawn {v.accept_len_mean:.2f} tokens per "
            f"cycle over {n} {cycles} (a mean of {n} draws spreads by about {se:.2f}; a row's last "
            "cycle counts only what max_new_tokens left it). The speedup "
            f"({v.speedup_measured:.2f}x, {name}) is what the measured phase costs give at that "
            "acceptance, not what this draft head achieves; the cost model gives it at any.")


def star(t):
    """A sweep cell's mark: '*' after a noisy Timing, else a space (its width kept)."""
    return "*" if isinstance(t, Timing) and t.noisy else " "


def fmt_spread(t, digits=3):
    mn, q1, _, q3, mx = t.spread()
    return (f"[{mn:.{digits}f} {q1:.{digits}f}-{q3:.{digits}f} {mx:.{digits}f}]"
            + (" noisy" if t.noisy else ""))


# ---------------------------------------------------------------------------------------------
# Routing: its label, and the answer across distinct experts (--distinct-sweep)

def routing_label(b):
    """What chose the experts, as the header and the notes say it."""
    t, cfg = b.target, b.cfg
    if t.routing == "uniform":
        return "routing SIMULATED uniform"
    if t.routing == "distinct":
        return (f"routing SIMULATED distinct (D = {cfg.distinct_experts} experts a MoE layer in "
                f"a forward; a decode step's top-{t.args.num_experts_per_tok})")
    if t.routing == "trace":
        tr = b.trace
        onto = (f", each window renamed onto the rank's {tr['renamed_onto']} of its "
                f"{tr['n_experts']} experts (one reaching more: all {tr['renamed_onto']})"
                if tr["renamed_onto"] else "")
        layers = (f", its {tr['layers']} layers repeated over {tr['model_moe_layers']}"
                  if tr["layers"] != tr["model_moe_layers"] else "")
        return (f"routing TRACE ({tr['path']}: {tr['tokens']} tokens{layers}{onto}"
                + (f"; {tr['note']}" if tr["note"] else "") + ")")
    return "routing: the model's router"


def verify_tokens(s):
    """A RoutingSweep's verify in words: its tokens a row, and at batch > 1 those of the forward."""
    a_row = s.num_steps + 1
    return f"verify of {a_row} tokens" + (f" a row ({s.tokens} in the forward)"
                                          if s.tokens != a_row else "")


def print_routing_sweep(r):
    """The verify across distinct experts, one line a D (within 100 columns)."""
    s = r.routing_sweep
    if not s:
        return
    ar = " + collectives MODELLED" if r.allreduce_modelled else ""
    print("\n" + wrap(f"{verify_tokens(s)} across distinct experts a MoE layer "
                      f"(SIMULATED distinct; {s.mode} attention, {s.variant}{ar}; top-{s.top_k} "
                      f"of {s.experts} experts; plain step {s.plain_step_ms:.2f} ms; cycle and "
                      f"break-even of num_steps {s.num_steps})", "", "", width=100))
    print(f"  {'D':>5s} {'ran':>6s} {'verify ms':>10s} {'plain steps':>13s} {'cycle ms':>9s} "
          f"{'break-even':>11s}   (* noisy)")
    for p in s.points:
        print(f"  {p.distinct:5d} {p.distinct_ran:6.1f} {p.verify_ms:9.3f}{star(p.verify_ms)} "
              f"{p.plain_steps:13.2f} {p.cycle_ms:9.2f} {p.break_even_accept_len:11.2f}")
    print(f"  uniform's expectation for {s.tokens} tokens drawn independently: "
          f"{s.uniform_expectation:.1f} distinct\n  this run's routing ({s.run_routing}): "
          f"{s.run_distinct:.1f} distinct, verify {s.run_verify_ms:.3f} ms")


def sweep_answer(r, b):
    """At which D the accepted length a user expects pays: the SIMULATED one asked, else 2 and 3
    tokens a cycle (the README story's ~2; published Kimi-K2 EAGLE-3 heads accept 2.3-3.4)."""
    s = r.routing_sweep
    if not s or not s.points:
        return []
    asked = b.cfg.simulate_accept_len
    said = []
    for tau in [asked] if asked else [2.0, 3.0]:
        # the first D (ascending) whose break-even reaches tau, and the one before it
        fail = next((i for i, p in enumerate(s.points) if p.break_even_accept_len >= tau), None)
        first, last = s.points[0], s.points[-1]
        if fail == 0:
            where = (f"pays at no D (break-even {first.break_even_accept_len:.2f} already at D = "
                     f"{first.distinct})")
        elif fail is None:
            where = (f"pays at every D up to {last.distinct} (break-even "
                     f"{last.break_even_accept_len:.2f} there)")
        else:
            top, over = s.points[fail - 1], s.points[fail]
            where = (f"pays up to D = {top.distinct} (break-even {top.break_even_accept_len:.2f}; "
                     f"{over.break_even_accept_len:.2f} at D = {over.distinct})")
        said.append(f"{tau:g} accepted tokens a cycle" + (" (SIMULATED)" if asked else "")
                    + f" {where}")
    trace = b.trace if b.target.routing == "trace" else None
    mean = trace and trace.get("verify_distinct_mean")
    ran = (f"this run's routing ({s.run_routing}) reached {s.run_distinct:.1f} in its timed verify"
           + (f", the trace's windows of {trace['verify_tokens']} tokens {mean:.1f} on average"
              if mean is not None else ""))
    return [f"Across distinct experts a MoE layer (SIMULATED; {verify_tokens(s)}, "
            f"num_steps {s.num_steps}): " + "; ".join(said) + f". Uniform's expectation is "
            f"{s.uniform_expectation:.1f} of {s.experts}; {ran}."]


# ---------------------------------------------------------------------------------------------
# One table across runs (python report.py tables A.json B.json ...): a row per run.py --json file

TABLE_COLUMNS = ("batch", "format", "decode step ms (x floor)", "chain: verify ms (x floor)",
                 "chain: cycle ms, break-even", "tree: verify ms (x floor)",
                 "tree: cycle ms, break-even", "JSON")


def tables(paths):
    """A markdown table with a row per run.py --json file: its batch and weight format, the plain
    decode step, the chain's verify of num_steps + 1 tokens and the tree's of N nodes (those the
    cost model priced: graph where captured, the attention mode whose verify timed faster; in a
    file without cost_model.verify, decode attention where timed), each against its floor where
    the run had one (a GPU), and the cost model's cycle and break-even accepted length of each.

    The batch x format x chain of 4 / tree of 8 tables, on a GPU:

        for B in 1 2 4; do
            R="--cuda-graph on --skip-e2e --batch-size $B --speculative-num-steps 3
               --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
            python run.py $R --json benchmarks/shapes/batch${B}_bf16.json
            python run.py $R --quant fp8 --json benchmarks/shapes/batch${B}_fp8.json
            python run.py $R --preset kimi-k2.5 --json benchmarks/shapes/batch${B}_int4.json
        done
        python report.py tables benchmarks/shapes/batch{1,2,4}_{bf16,fp8,int4}.json

    Returns the table's lines; a file that is no run.py --json raises ValueError naming it."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for path in paths:
        r = read_run(path)
        if not {"phases_ms", "cost_model"} <= r.keys():
            raise ValueError(f"{path}: not a run.py --json file (no phases_ms, cost_model)")
        lines.append("| " + " | ".join(table_row(r, path)) + " |")
    return lines


def read_run(path):
    """A run.py --json file's line, read back: its last line (--json PATH writes only that line;
    a saved stdout of --json - ends with it), as routing.py plot reads it. A file that is missing,
    unreadable, binary, or does not end in such a line raises ValueError naming it in one line;
    what each table needs of the run, its caller checks."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError:
        lines = None
    if lines is None or b"\0" in data:   # (a .safetensors, an .npz, an image)
        raise ValueError(f"{path}: not a run.py --json file (not JSON text: binary, not UTF-8)")
    if not lines:
        raise ValueError(f"{path}: not a run.py --json file (empty)")
    try:
        r = json.loads(lines[-1])
    except json.JSONDecodeError as e:   # another format, a truncated line
        raise ValueError(f"{path}: not a run.py --json file (its last line is no JSON: "
                         f"{e.msg})") from None
    if not isinstance(r, dict) or not isinstance(r.get("env"), dict):
        raise ValueError(f"{path}: not a run.py --json file (no env)")
    return r


def table_row(r, path):
    """One run's cells (TABLE_COLUMNS); r: its --json line, read back."""
    env, ph = r["env"], r["phases_ms"]
    cfg, cm = env["config"], r["cost_model"]
    # the first context's floors: `floors` holds the same, except in files of an older layout
    first = (r.get("contexts") or {}).get(str(cfg["context_len"][0]), {})
    floors = first.get("floors_ms") or {}
    # the cost model's variant and verify; a file from before it named them: graph where
    # captured, decode attention where timed
    captured = any(name.endswith("/graph") for name in ph)
    variant = cm.get("variant") or ("graph" if captured else "eager")
    decode = "decode" in cfg.get("attention_modes", ["decode"])
    verify = cm.get("verify") or ("verify/decode" if decode else "verify/prefill")

    def timed(phase, what=""):
        ms, floor = ph.get(f"{phase}/{variant}"), floors.get(phase)
        if ms is None:
            return "-"
        return f"{ms:.3f}" + (f" ({ms / floor:.2f}x)" if floor else "") + what
    k = cfg["speculative_num_steps"]
    chain, tree = cm["steps"].get(str(k)), cm.get("tree")
    cells = [str(cfg["batch_size"]), weight_format(env), timed("decode_step"),
             timed(verify, f", {k + 1} tokens"),
             f"{chain['cycle_ms']:.2f}, {chain['break_even_accept_len']:.2f}" if chain else "-"]
    if tree:
        cells += [timed(f"{verify} tree", f", {tree['num_draft_tokens']} nodes, topk "
                                          f"{tree['topk']}"),
                  f"{tree['cycle_ms']:.2f}, {tree['break_even_accept_len']:.2f}"]
    else:
        cells += ["-", "-"]
    return cells + [f"`{path}`"]


# ---------------------------------------------------------------------------------------------
# One run's tables and several runs' verify sweeps, as BENCHMARKS.md sets them
# (python report.py phases A.json; python report.py sweep A.json B.json ...)

# components.COMPONENTS as BENCHMARKS.md names them, in its order ("other", at most 0.011 ms, left
# out; the all-reduce only where a run has one: a real TP run's, which in an eager profile includes
# its wait for the peers)
MD_COMPONENTS = {"attn_proj": "attention projections", "attn_core": "attention core",
                 "router": "router", "routed_experts": "routed experts (+ shared in the launch)",
                 "shared_mlp": "shared expert + dense MLP", "elementwise": "norms, residual, RoPE",
                 "embed_head": "embedding + lm_head", "allreduce": "all-reduce"}
PHASE_COLUMNS = (("decode step", "decode_step"), ("verify of {n}, decode attn", "verify/decode"),
                 ("verify of {n}, extend attn", "verify/prefill"),
                 ("draft extend", "draft_extend"), ("draft step", "draft_step"))


def phases(path):
    """A GPU run's two tables at its first context: its captured (else eager) phases against their
    floors, and where the time goes (component_table's rows: each component's profiled kernel time
    in the decode step and each verify beside the bytes it must move over the copy bandwidth), then
    the cost model's cycle and break-even at its num_steps.

        python run.py --preset kimi-k2.5 --speculative-num-steps 2 --cuda-graph on --skip-e2e \\
            --json benchmarks/int4_kimi-k2.5.json
        python report.py phases benchmarks/int4_kimi-k2.5.json

    Returns the lines; a file that is not a GPU run's raises ValueError naming it."""
    r, ctx = _gpu_run(path)
    ph, bw, k = r["phases_ms"], r["bandwidth_GBps"], r["env"]["config"]["speculative_num_steps"]
    variant = "graph" if any(name.endswith("/graph") for name in ph) else "eager"
    ms = {phase: ph[f"{phase}/{variant}"] for _, phase in PHASE_COLUMNS
          if f"{phase}/{variant}" in ph}
    floors = ctx["floors_ms"]
    cols = [(title.format(n=k + 1), phase) for title, phase in PHASE_COLUMNS if phase in ms]
    lines = ["| phase (" + ("CUDA graph" if variant == "graph" else "eager") + ") | "
             + " | ".join(t for t, _ in cols) + " |", "|---|" + "---:|" * len(cols),
             "| ms | " + " | ".join(f"{ms[p]:.3f}" for _, p in cols) + " |",
             "| floor ms | " + " | ".join(f"{floors[p]:.3f}" for _, p in cols) + " |",
             "| x floor | " + " | ".join(f"{ms[p] / floors[p]:.2f}x" for _, p in cols) + " |", ""]
    verifies = [p for _, p in cols if p.startswith("verify/") and p in ctx["components"]]
    lines += _md_components(ctx, ms, bw, verifies, variant) + [""]
    steps = r["cost_model"]["steps"]
    chain = steps.get(str(k))
    cost = (f"cycle {chain['cycle_ms']:.2f} ms, break-even {chain['break_even_accept_len']:.2f} "
            f"accepted tokens (num_steps {k})" if chain else
            f"num_steps {k}: {untimed_chain(k, steps)}")
    return lines + [f"{cost}; copy bandwidth {bw:.0f} GB/s"]


def _md_components(ctx, ms, bw, verifies, variant):
    """phases' component table: a row per MD_COMPONENTS, then the summed kernel time, the phase's
    time less it, the kernels and the distinct experts a MoE layer."""
    comps, nbytes = ctx["components"], ctx["bytes"]
    head = ["decode step", "floor"] + [
        "verify, " + ("decode attn" if v.endswith("decode") else "extend attn") for v in verifies
    ] + ["verify floor"]
    lines = ["| component (ms) | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    each = ["decode_step"] + verifies
    for name, label in MD_COMPONENTS.items():
        if name == "allreduce" and not any(comps[p]["parts_ms"].get(name) for p in each):
            continue
        row = ([comps["decode_step"]["parts_ms"][name], nbytes["decode_step"][name] / bw / 1e6]
               + [comps[v]["parts_ms"][name] for v in verifies]
               + [nbytes[verifies[0]][name] / bw / 1e6])
        lines.append(f"| {label} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    summed = [comps[p]["kernel_ms"] for p in each]
    floors = ctx["floors_ms"]
    lines.append("| summed kernel time | " + " | ".join(f"{x:.3f}" for x in [
        summed[0], floors["decode_step"], *summed[1:], floors[verifies[0]]]) + " |")
    return lines + [
        _blank_floor_row(f"{variant} minus summed kernels",
                         [f"{ms[p] - t:.3f}" for p, t in zip(each, summed)]),
        _blank_floor_row("kernels", [str(comps[p]["kernels"]) for p in each]),
        _blank_floor_row("distinct experts a MoE layer",
                         [f"{ctx['distinct_experts'][p]:g}" for p in each])]


def _blank_floor_row(label, cells):
    """A component-table row without floors: the decode step's cell, an empty floor, the
    verifies' cells, an empty floor."""
    return f"| {label} | {cells[0]} |  | " + " | ".join(cells[1:]) + " |  |"


def _gpu_run(path):
    """(the run, its first context) of a run.py --json file from a GPU with a component table;
    else ValueError naming the file."""
    r = read_run(path)
    ctx = (r.get("contexts") or {}).get(str(r["env"].get("config", {}).get("context_len", [0])[0]))
    if not (r.get("bandwidth_GBps") and ctx and ctx.get("floors_ms") and ctx.get("components")):
        raise ValueError(f"{path}: not a GPU run's --json with floors and a component table")
    return r, ctx


def sweep(paths):
    """The verify sweeps of GPU runs side by side: a row per tokens a row T that every file has, a
    column per file (its weight format), each point's ms and its x floor; then each file's steps
    over the no-cliff line (sweep_cliffs), with how much they add against what it allows.

        python report.py sweep benchmarks/bf16_128experts.json benchmarks/int4_kimi-k2.5.json \\
            benchmarks/fp8_384experts.json

    Returns the lines; a file without a sweep with floors raises ValueError naming it."""
    runs = [_read_sweep(path) for path in paths]
    lines = ["| T | " + " | ".join(f"{label} ms (x floor)" for label, *_ in runs) + " |",
             "|---:|" + "---:|" * len(runs)]
    for T in sorted(set.intersection(*(set(map(int, s)) for _, s, _, _ in runs))):
        cells = [f"{s[str(T)]['verify']:.2f} ({s[str(T)]['verify'] / s[str(T)]['floor_ms']:.2f}x)"
                 for _, s, _, _ in runs]
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    lines.append("")
    for label, _, cliffs, _ in runs:
        over = cliffs.get("cliffs", [])
        lines.append(f"- {label}: {len(over)} of {len(cliffs.get('checked', []))} steps over the "
                     "line" + (": " if over else "") + ", ".join(
                         f"{a}->{b} +{c['added_ms']:.3f} ms against {c['allowed_ms']:.3f}"
                         for c in over for a, b in [c["tokens"]]))
    return lines


def routed(paths):
    """The routed experts of verify sweeps against their own floor, a column group per run.py
    --json file (a GPU's run): the same weight format under different routings (--routing
    uniform, model, distinct or trace). A point's time is the routed_experts component of the
    profiled verify, its floor that component's bytes over the run's copy bandwidth, as the
    component table counts them (routed_floor_ms: the distinct experts a MoE layer reaches, and the
    shared expert where it rides in their launch); where a file was written before
    routed_floor_ms, every file's floor is the distinct experts times one expert's stored bytes in
    every MoE layer (the shared expert's time in its component, its bytes not in that floor), so
    that the columns compare alike. A launch that reads each distinct expert
    once keeps its x floor as tokens share experts; one that makes a pass a token-expert pair does
    not. The last column: the last run's x floor over the first's.

        U="--cuda-graph on --skip-e2e --speculative-attention-mode decode"
        for R in uniform model; do
            python run.py $U --routing $R --json benchmarks/routing/bf16_$R.json
            python run.py $U --quant fp8 --routing $R --json benchmarks/routing/fp8_$R.json
            python run.py $U --preset kimi-k2.5 --speculative-num-steps 2 --routing $R \\
                --json benchmarks/routing/int4_$R.json
        done
        python report.py routed benchmarks/routing/int4_{uniform,model}.json

    Returns the table's lines; a file that is not a GPU run's raises ValueError naming it."""
    runs = [_routed_points(path) for path in paths]
    own = all(floors[0] for _, points in runs for *_, floors in points.values())
    runs = [(label, {T: (verify, ms, ms / floors[0 if own else 1], experts)
                     for T, (verify, ms, experts, floors) in points.items()})
            for label, points in runs]
    labels = [label for label, _ in runs]
    runs = [(f"{label} ({os.path.basename(path)})" if labels.count(label) > 1 else label, points)
            for path, (label, points) in zip(paths, runs)]   # two runs alike: by their files
    head = ["tokens"] + [f"{label}: {col}" for label, _ in runs
                         for col in ("verify ms", "routed experts ms (x floor), experts")]
    if len(runs) > 1:
        head.append(f"x floor, {runs[-1][0]} / {runs[0][0]}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for T in sorted(set.intersection(*(set(points) for _, points in runs))):
        cells = [str(T)]
        for _, points in runs:
            verify, ms, x, experts = points[T]
            cells += [f"{verify:.3f}", f"{ms:.3f} ({x:.2f}x), {experts:.1f}"]
        if len(runs) > 1:
            cells.append(f"{runs[-1][1][T][2] / runs[0][1][T][2]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _routed_points(path):
    """(label: format and routing, {T: (verify ms, routed experts ms, distinct experts, floors)})
    of one run.py --json file from a GPU; floors: (routed_floor_ms or None, the distinct experts'
    bytes over the bandwidth) in ms."""
    r = read_run(path)
    env, cfg, sweep = r["env"], r["env"].get("config", {}), r.get("verify_sweep_ms") or {}
    E = env.get("n_routed_experts") or cfg.get("routed_experts")
    if E is None and cfg.get("preset") and not cfg.get("model_path"):
        E = checkpoint.preset(cfg["preset"]).n_routed_experts   # a file from before the field
    if not (E and env.get("routed_experts_GB") and r.get("bandwidth_GBps") and sweep
            and all("routed_experts" in (p.get("components") or {}) for p in sweep.values())):
        raise ValueError(f"{path}: not a GPU run's --json with a profiled verify sweep")
    expert_ms = env["routed_experts_GB"] / E / r["bandwidth_GBps"] * 1e3   # every MoE layer's
    points = {}
    for T, p in sweep.items():
        ms, experts = p["components"]["routed_experts"], p["distinct_experts"]
        points[int(T)] = (p["verify"], ms, experts, (p.get("routed_floor_ms"), experts * expert_ms))
    return f"{weight_format(env)} {env['routing']}", points


def weight_format(env):
    """The routed experts' format (INT4, FP8) or the model's dtype (bf16); a quantized model's
    dtype too where it is not bf16."""
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
    dtype = short.get(env["dtype"], env["dtype"])
    quant = "INT4" if env.get("int4_group_size") else "FP8" if env.get("fp8_block") else None
    return dtype if quant is None else quant + (f" ({dtype})" if dtype != "bf16" else "")


def check_figure_out(out):
    """A figure's --out before any work (ValueError naming it, one line): a file in a folder that
    takes one (baseline.check_writable), named with a suffix matplotlib writes, which picks the
    format (without one matplotlib would add .png to the name)."""
    from matplotlib.backend_bases import FigureCanvasBase

    import baseline
    baseline.check_writable("--out", out)
    kinds = FigureCanvasBase.get_supported_filetypes()
    if os.path.splitext(out)[1][1:].lower() not in kinds:
        rest = ", ".join(f".{k}" for k in sorted(kinds) if k not in ("png", "pdf", "svg"))
        raise ValueError(f"--out {out}: its suffix names no format matplotlib writes; end it in "
                         f".png, .pdf or .svg (or {rest})")


def save_figure(fig, out):
    """fig into `out` whole (baseline.write_whole), in the format its suffix names (checked by
    check_figure_out); ValueError naming --out where it cannot be written."""
    import baseline
    kind = os.path.splitext(out)[1][1:].lower()
    try:
        baseline.write_whole(out, lambda f: fig.savefig(f, format=kind, dpi=150))
    except OSError as e:   # the folder gone or no longer writable since the check
        raise ValueError(f"--out {out}: cannot write there ({e.strerror or e})") from None


def sweep_plot(paths, out):
    """The verify sweeps of run.py --json files from a GPU in one figure (needs matplotlib).

    One series a file, into `out`: left, verify ms against tokens a row with its floor dashed;
    right, what each added token costs beside what the no-cliff rule allows
    (components.cliff_allowed_ms), its breaks marked. matplotlib is not a requirement. Returns 0,
    or 2 with the reason on stderr."""
    try:
        runs = [_read_sweep(path) for path in paths]   # a bad file named with or without matplotlib
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        check_figure_out(out)
    except (ValueError, ImportError) as e:
        why = "needs matplotlib (pip install matplotlib)" if isinstance(e, ImportError) else e
        print(f"report.py sweep-plot: {why}", file=sys.stderr)
        return 2
    fig, (cost, step) = plt.subplots(1, 2, figsize=(11, 4))
    for label, sweep, cliffs, batch in runs:
        T = [int(t) for t in sweep]
        ms, floor = [p["verify"] for p in sweep.values()], [p["floor_ms"] for p in sweep.values()]
        line, = cost.plot(T, ms, "o-", ms=3, label=label)
        cost.plot(T, floor, "--", color=line.get_color(), lw=0.8)
        mid = [(a + b) / 2 for a, b in zip(T, T[1:])]
        per = [(b - a) / (tb - ta) for a, b, ta, tb in zip(ms, ms[1:], T, T[1:])]
        allowed = [cliff_allowed_ms(b - a, tb - ta, batch) / (tb - ta)
                   for a, b, ta, tb in zip(floor, floor[1:], T, T[1:])]
        step.plot(mid, per, "o-", ms=3, color=line.get_color(), label=label)
        step.plot(mid, allowed, ":", color=line.get_color(), lw=0.8)
        broken = {tuple(c["tokens"]) for c in cliffs.get("cliffs", [])}
        hits = [(m, p) for m, p, ta, tb in zip(mid, per, T, T[1:]) if (ta, tb) in broken]
        step.plot([m for m, _ in hits], [p for _, p in hits], "x", ms=8, color=line.get_color())
    cost.set(xlabel="tokens a row (T)", ylabel="verify ms", title="verify (dashed: its floor)")
    step.set(xlabel="tokens a row (between two points)", ylabel="ms an added token",
             title="an added token (dotted: the rule allows; x: over it)")
    for ax in (cost, step):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        save_figure(fig, out)
    except ValueError as e:
        print(f"report.py sweep-plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _read_sweep(path):
    """(weight format, verify_sweep_ms, sweep_cliffs, batch) of a run.py --json file; ValueError
    naming it where it has no sweep with floors."""
    r = read_run(path)
    sweep, batch = r.get("verify_sweep_ms"), r["env"].get("config", {}).get("batch_size")
    if not isinstance(sweep, dict) or not sweep or batch is None:
        raise ValueError(f"{path}: not a run.py --json file with a verify sweep")
    if any(not isinstance(p, dict) or p.get("floor_ms") is None for p in sweep.values()):
        raise ValueError(f"{path}: its sweep has no floors (a CPU run)")
    label = weight_format(r["env"]) + (f", batch {batch}" if batch > 1 else "")
    return label, sweep, r.get("sweep_cliffs") or {}, batch


def command_parser():
    import argparse
    p = argparse.ArgumentParser(prog="report.py", description="Tables across run.py --json files.")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name, maker):
        said = maker.__doc__.split("\n\n")[0].replace("%", "%%")
        return sub.add_parser(name, help=said, description=said)
    t = command("tables", tables)
    t.add_argument("json", nargs="+", help="run.py --json files, one row each, in this order")
    g = command("sweep-plot", sweep_plot)
    g.add_argument("json", nargs="+", help="run.py --json files from a GPU, one series each")
    g.add_argument("--out", required=True, help="the figure (.png, .svg, .pdf)")
    h = command("phases", phases)
    h.add_argument("json", help="a run.py --json file from a GPU")
    w = command("sweep", sweep)
    w.add_argument("json", nargs="+", help="run.py --json files from a GPU, a column each")
    e = command("routed", routed)
    e.add_argument("json", nargs="+", help="run.py --json files from a GPU, one column group "
                   "each, in this order")
    return p


def main(argv=None):
    """`python report.py COMMAND ...`: the tables printed (or the figure written), exit status 0; a
    file it cannot use, one line and 2; stdout closed early, quiet and CLOSED_PIPE."""
    args = command_parser().parse_args(argv)
    try:
        if args.command == "sweep-plot":
            status = sweep_plot(args.json, args.out)
        else:
            status = print_tables(args.command, args.json)
        sys.stdout.flush()   # a closed pipe found here, not in the flush at exit
        return status
    except BrokenPipeError:
        return baseline.closed_stdout()


def print_tables(command, paths):
    makers = {"routed": routed, "phases": phases, "sweep": sweep, "tables": tables}
    try:
        print("\n".join(makers[command](paths)))
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as err:
        print(f"report.py {command}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
