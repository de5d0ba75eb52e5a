"""Time every phase of EAGLE-3 speculative decoding on a Kimi-K2 target, and say when it pays.

    torchrun --nproc-per-node 8 run.py      # real TP 8 (NCCL)
    python run.py                           # one GPU: one SIMULATED rank of TP 8; CPU: tiny model

Answers the background story's question with separate measurements: the attention path of
verify (prefill = extend-style, decode = absorbed MLA) and graph capture (eager, CUDA graph) are
two independent switches, timed in all four combinations. Device work is timed with CUDA events
after warm-up (medians); host clocks are read only after a synchronize. Forced acceptance
(--simulate-accept-len) is labelled SIMULATED everywhere it appears.
"""
import argparse
import json
import statistics
import sys
import time
from functools import partial

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
                   "default on one GPU with bf16 kimi-k2: 128; all 384 with --quant int4)")
    p.add_argument("--quant", choices=["none", "int4"], help="random weights in this layout: int4 = routed "
                   "experts packed as Kimi-K2-Thinking / K2.5 ship them (default: the preset's)")
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, help="must be steps + 1 with topk 1")
    p.add_argument("--speculative-attention-mode", choices=["prefill", "decode", "both"], default="both")
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
    p.add_argument("--json", help="also write the final JSON line here")
    return p.parse_args(argv)


def settle(args, device, world):
    """Fill in device-dependent defaults and check the speculative flags as SGLang does."""
    gpu = device.type == "cuda"
    if args.speculative_eagle_topk != 1:
        sys.exit(f"--speculative-eagle-topk {args.speculative_eagle_topk}: only 1 (chain drafting) is implemented")
    want = args.speculative_num_steps + 1
    if args.speculative_num_draft_tokens not in (None, want):
        tpm.print0(f"note: --speculative-num-draft-tokens {args.speculative_num_draft_tokens} adjusted to "
                   f"{want} (= num_steps + 1 with topk 1)")
    args.speculative_num_draft_tokens = want
    args.preset = args.preset or ("kimi-k2" if gpu else "tiny")
    args.cuda_graph = args.cuda_graph or ("both" if gpu else "off")
    if args.compile and not gpu:
        sys.exit("--compile times the captured phases: it needs a CUDA GPU")
    if args.cuda_graph != "off" and not gpu:
        sys.exit("--cuda-graph on/both needs a CUDA GPU; use --cuda-graph off on CPU")
    big = args.preset.startswith("kimi-k2") and not args.model_path
    if args.simulate_tp is None:
        args.simulate_tp = 8 if big and gpu and world == 1 else 1
    if args.model_path and args.quant:
        sys.exit("--quant sets the layout of random weights; a checkpoint's config.json says its own")
    int4 = args.quant == "int4" or args.quant is None and args.preset == "kimi-k2.5"
    if args.routed_experts is None and big and gpu and not int4:
        args.routed_experts = 128  # bf16: 384 experts are 2.3x one H200; INT4 ones fit
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
        quant = {None: {}, "none": dict(quantization_config=None), "int4": dict(quantization_config="int4")}
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

@torch.no_grad()
def main(argv=None):
    rank, world, device = tpm.init_distributed()
    args = settle(parse_args(argv), device, world)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    clock = Clock(device)
    target, head, how = build(args, device, dtype, world)
    k, B, P = args.speculative_num_steps, args.batch_size, args.prompt_len
    modes = ["prefill", "decode"] if args.speculative_attention_mode == "both" else [args.speculative_attention_mode]
    graph_opts = {"both": [False, True], "on": [True], "off": [False]}[args.cuda_graph]
    sim = bool(args.simulate_accept_len)
    group = target.args.int4_group_size
    quant_note = f" (routed experts INT4, group {group})" if group else ""
    header = (f"target: {how}, {target.args.num_hidden_layers} layers, {target.args.n_routed_experts} routed experts, "
              f"{target.tp.describe()}, {args.dtype}{quant_note}, moe {target.moe_impl} | batch {B}, prompt {P}, "
              f"num_steps {k} | {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
              f"torch {torch.__version__}" + (" | acceptance SIMULATED" if sim else ""))
    tpm.print0(header)
    result = dict(env=dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           torch=torch.__version__, world_size=world, simulated_tp=args.simulate_tp if target.tp.simulated else None,
                           dtype=args.dtype, int4_group_size=group, moe_impl=target.moe_impl, seed=args.seed, simulated_acceptance=sim,
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
    if target.tp.communicates:
        comm = {}
        for T in (1, k + 1):
            buf = torch.zeros(B * T * target.args.hidden_size, dtype=dtype, device=device)
            comm[T] = median_ms(clock, lambda: dist.all_reduce(buf), args.reps) * 2 * target.args.num_hidden_layers
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
        print(f"\nGPU memory: weights {r['env']['weights_GB']:.1f} GB, peak allocated {r['env']['gpu_mem_peak_GB']:.1f} GB "
              f"(eager phases only: {r['env'].get('gpu_mem_peak_eager_GB', float('nan')):.1f} GB)")
        print(f"kernels per eager decode step: {r.get('kernels_per_decode_step')}"
              + (f", with torch.compile: {r['kernels_per_decode_step_compiled']}" if "kernels_per_decode_step_compiled" in r else ""))
    if r.get("allreduce_ms_per_forward"):
        print(f"\nall-reduce per forward (2 per layer): {r['allreduce_ms_per_forward']}")
    if r.get("greedy_agreement_with_plain"):
        print(f"\ngreedy speculative vs plain token agreement: {r['greedy_agreement_with_plain']}")
    print()


if __name__ == "__main__":
    main()
