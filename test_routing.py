"""routing.py: SIMULATED distinct experts, routing traces, SGLang's per-token dumps, the probe's
router. CPU, seconds (one test in Triton's interpreter, one on a GPU)."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest
import torch

import baseline
import checkpoint
import kernels
import model
import routing
import run
import timing
from testing import assert_close, CPU_ENV, HERE
from verify import tree_forward


@pytest.mark.parametrize("E,K", [(16, 4), (384, 8), (8, 8)])
def test_distinct_ids_reach_exactly_D_at_every_T(E, K):
    g = torch.Generator().manual_seed(0)
    for T in range(1, 9):
        low, high = routing.distinct_range(T, K, E)
        for D in range(low, high + 1):
            ids = routing.distinct_ids(T, K, D, E, g)
            assert ids.shape == (T, K) and ids.dtype == torch.int64
            assert ids.unique().numel() == D, (T, D)
            assert all(row.unique().numel() == K for row in ids), (T, D)  # K different a token
            assert 0 <= ids.min() and ids.max() < E
            load = torch.bincount(ids.flatten())
            assert load[load > 0].max() - load[load > 0].min() <= 1     # spread evenly


def test_distinct_ids_refuse_D_outside_range():
    for T, K, E, D in [(4, 8, 384, 7), (4, 8, 384, 33), (1, 8, 384, 9), (8, 8, 16, 17)]:
        with pytest.raises(ValueError, match=r"outside \[\d+, \d+\]"):
            routing.distinct_ids(T, K, D, E)
    with pytest.raises(ValueError, match="outside"):
        routing.DistinctChoice(400, 384, 8)


def test_distinct_at_its_top_is_uniform_routing():
    """D = min(T x K, E) with no generator is model.Router's SIMULATED uniform choice."""
    args = checkpoint.preset("tiny")
    router = model.Router(args, None, torch.float32, routing="uniform")
    for T in (1, 3, 4, 5):
        ids = torch.zeros(T, args.num_experts_per_tok, dtype=torch.long)
        D = min(T * args.num_experts_per_tok, args.n_routed_experts)
        assert torch.equal(routing.distinct_ids(T, args.num_experts_per_tok, D,
                                                args.n_routed_experts), router.uniform_choice(ids))


def test_distinct_choice_keeps_one_tensor_a_shape_and_decode_keeps_top_k():
    choose = routing.DistinctChoice(24, 384, 8, seed=3)
    verify = choose(0, torch.zeros(4, 8, dtype=torch.long))
    assert verify.unique().numel() == 24 and choose(0, torch.ones(4, 8, dtype=torch.long)) is verify
    assert choose(0, torch.zeros(1, 8, dtype=torch.long)).unique().numel() == 8


def test_uniform_distinct():
    assert routing.uniform_distinct(384, 8, 1) == pytest.approx(8)
    assert routing.uniform_distinct(16, 4, 4) == pytest.approx(16 * (1 - 0.75 ** 4))
    g = torch.Generator().manual_seed(0)   # against draws: T tokens, K of N each without repeats
    draws = [torch.cat([torch.randperm(64, generator=g)[:8] for _ in range(4)]).unique().numel()
             for _ in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(routing.uniform_distinct(64, 8, 4), rel=0.01)


def random_trace(layers=3, tokens=50, E=384, K=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
                        for _ in range(layers)])


def test_trace_round_trips_and_the_cursor_replays_in_order(tmp_path):
    ids = random_trace()
    path = tmp_path / "trace.npz"
    routing.save_trace(path, ids, 384, 8, sequence_lengths=[20, 30], note="test")
    with np.load(path) as f:
        assert f["routing_ids"].dtype == np.int16 and f["routing_ids"].shape == (3, 50, 8)
    t = routing.read_trace(path, 384, 8)
    assert torch.equal(t.ids, ids) and t.sequence_lengths == [20, 30] and t.note == "test"
    cursor = routing.TraceCursor(t.ids)
    got = [cursor.take(1), cursor.take(4), cursor.take(4 * 12)]   # a step, a verify, a wrap
    assert torch.equal(got[0], ids[:, :1]) and torch.equal(got[1], ids[:, 1:5])
    assert torch.equal(got[2], ids[:, torch.arange(5, 53) % 50])
    assert torch.equal(cursor.take(2), ids[:, 3:5])                  # cycling on


def test_trace_cursor_repeats_layers_and_renames_onto_a_smaller_rank():
    ids = random_trace(layers=2, tokens=10)
    cursor = routing.TraceCursor(ids, layers=5, onto=64)
    window = cursor.take(4)
    assert window.shape == (5, 4, 8) and window.max() < 64
    for layer in range(5):
        original = ids[layer % 2, :4]
        assert window[layer].unique().numel() == original.unique().numel()
        same = original.unsqueeze(-1).unsqueeze(-1) == original      # which pairs share an expert
        assert torch.equal(same, window[layer].unsqueeze(-1).unsqueeze(-1) == window[layer])
    with pytest.raises(ValueError, match="reaches 32 experts in layer 0; the rank has 16"):
        routing.TraceCursor(routing.distinct_ids(4, 8, 32, 384).unsqueeze(0), onto=16).take(4)
    full = routing.TraceCursor(routing.distinct_ids(4, 8, 32, 384).unsqueeze(0), onto=16,
                               saturate=True).take(4)               # all the rank's experts
    assert full.unique().numel() == 16 and all(row.unique().numel() == 8 for row in full[0])


def test_a_mismatched_trace_is_refused_in_one_line(tmp_path):
    path = tmp_path / "trace.npz"
    routing.save_trace(path, random_trace(), 384, 8)
    for E, K in [(128, 8), (384, 6)]:
        with pytest.raises(ValueError) as e:
            routing.read_trace(path, E, K)
        assert "\n" not in str(e.value) and "384 experts, top-8" in str(e.value)
        assert f"top-{K} of {E}" in str(e.value)
    with pytest.raises(ValueError, match="outside 0 ... 15"):
        routing.save_trace(tmp_path / "bad.npz", random_trace(E=384), 16, 8)


def write_sglang_dump(path, passes, n_layers, physical_to_logical):
    """A file as SGLang's expert-distribution recorder writes it in per_token mode: torch.save of
    {"records": [one dict a forward pass], "last_physical_to_logical_map": [layers, physical]},
    each record's "topk_ids_of_layer" int32 [all layers, tokens of the pass, 8], -1 where a layer
    routed nothing. passes: (forward_mode, physical ids [MoE layers, tokens, 8]); layer 0 dense."""
    records = []
    for i, (mode, ids) in enumerate(passes):
        n = ids.shape[1]
        full = torch.full((n_layers, n, 8), -1, dtype=torch.int32)
        full[1:] = ids
        records.append(dict(forward_pass_id=i, rank=0, gatherer_key="primary",
                            input_ids=list(range(n)), positions=list(range(n)),
                            extend_seq_lens=[n] if mode == 1 else None, forward_mode=mode,
                            topk_ids_of_layer=full, misc_objects=[],
                            global_physical_count=torch.zeros(n_layers, 20, dtype=torch.int32)))
    torch.save(dict(records=records, last_physical_to_logical_map=physical_to_logical), path)


def test_an_sglang_per_token_dump_reads(tmp_path):
    E, P, L = 16, 20, 3                          # 16 logical experts, 4 of them redundant copies
    to_logical = torch.cat([torch.arange(E), torch.tensor([3, 5, 7, 9])]).expand(L, P).clone()
    g = torch.Generator().manual_seed(0)
    logical = [torch.stack([torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(n)])
                            for _ in range(L - 1)]) for n in (6, 1, 1)]   # prefill, 2 decodes
    physical = [x.clone() for x in logical]
    physical[1][physical[1] == 3] = 16           # a copy of expert 3 served this token
    physical[2][physical[2] == 9] = 19
    path = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    write_sglang_dump(path, [(1, physical[0]), (2, physical[1]), (2, physical[2])], L, to_logical)
    t = routing.read_sglang(path, E, 8)
    assert torch.equal(t.ids, torch.cat(logical, dim=1))   # MoE layers only, logical, in order
    out = tmp_path / "trace.npz"
    assert routing.main(["convert-sglang", str(path), "--out", str(out), "--n-experts", "16",
                         "--top-k", "8"]) is None
    assert torch.equal(routing.read_trace(out, E, 8).ids, t.ids)
    with pytest.raises(ValueError, match="top-8; the model routes top-4"):
        routing.read_sglang(path, E, 4)
    with pytest.raises(ValueError, match="onto 16 logical experts; the model has 384"):
        routing.read_sglang(path, 384, 8)
    # per_pass mode writes records without per-token ids; a recording of no traffic, none
    torch.save(dict(records=[dict(forward_pass_id=0, global_physical_count=torch.zeros(L, P))],
                    last_physical_to_logical_map=to_logical), tmp_path / "per_pass.pt")
    torch.save(dict(records=[], last_physical_to_logical_map=to_logical), tmp_path / "empty.pt")
    for name, why in (("per_pass.pt", "no per-token ids"), ("empty.pt", "no forward pass")):
        with pytest.raises(ValueError, match=why):
            routing.read_sglang(tmp_path / name, E, 8)


def test_trace_choice_fills_one_buffer_a_shape():
    ids = random_trace(layers=2, tokens=10)
    choice = routing.TraceChoice(routing.TraceCursor(ids, layers=3), "cpu")
    choice.advance(4)
    first = choice.choice(2, torch.zeros(4, 8, dtype=torch.long))
    assert torch.equal(first, ids[0, :4])
    choice.advance(4)                                  # the same tensor, the next tokens in it
    assert choice.choice(2, torch.zeros(4, 8, dtype=torch.long)).data_ptr() == first.data_ptr()
    assert torch.equal(first, ids[0, 4:8]) and torch.equal(choice.choice(1, first), ids[1, 4:8])


def test_distinct_curve_counts_windows_inside_each_sequence():
    ids = torch.tensor([[[0, 1], [1, 2], [5, 6], [5, 6]]])         # one layer, 4 tokens, K 2
    assert routing.distinct_curve(ids, 8, 2) == {1: 2.0, 2: (3 + 4 + 2) / 3}
    assert routing.distinct_curve(ids, 8, 2, sequence_lengths=[2, 2]) == {1: 2.0, 2: 2.5}


def reference_kimi_routing(x, weight, bias, top_k, scaling):
    """Kimi-K2's router (n_group 1), written out: sigmoid scores, top-k of scores + bias, the
    chosen unbiased scores normalized and scaled."""
    scores = torch.sigmoid(x.double() @ weight.double().T)
    ids = (scores + bias.double()).topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) * scaling


def test_the_probe_routes_as_kimi_k2_and_its_recorder_sees_the_routers_choice():
    args = routing.probe_args()
    kimi = checkpoint.preset("kimi-k2")
    for key in routing.KIMI_ROUTING:
        assert getattr(args, key) == getattr(kimi, key), key
    assert (args.n_routed_experts, args.num_experts_per_tok, args.n_group) == (384, 8, 1)
    args.num_hidden_layers = 2                                      # one dense, one MoE layer
    torch.manual_seed(0)
    target = model.Transformer(args, 1, 16, dtype=torch.float32)
    for p in target.parameters():
        p.data.normal_(0, 0.05)
    router = routing.routers(target)[0]
    seen = []
    router.register_forward_hook(lambda m, inputs, out: seen.append((inputs[0], out)))
    recorder = routing.RoutingRecorder(target)
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        target(tokens, torch.arange(16).unsqueeze(0))
    (x, (ids, weights)), = seen
    ref_ids, ref_w = reference_kimi_routing(x, router.weight, router.e_score_correction_bias, 8,
                                            args.routed_scaling_factor)
    assert torch.equal(ids, ref_ids) and torch.allclose(weights.double(), ref_w, atol=1e-6)
    assert torch.equal(recorder.pop(), ids.unsqueeze(0))


def test_balance_bias_moves_towards_the_mean():
    args = routing.probe_args()
    args.num_hidden_layers = 2
    target = model.Transformer(args, 1, 4, dtype=torch.float32)
    router = routing.routers(target)[0]
    router.e_score_correction_bias.data.zero_()
    ids = torch.arange(8).repeat(4, 1).unsqueeze(0)                  # experts 0..7 take all
    routing.balance_bias(target, ids, 0.01)
    bias = router.e_score_correction_bias
    assert torch.all(bias[:8] == -0.01) and torch.all(bias[8:] == 0.01)


def test_load_spread():
    ids = torch.tensor([[[0, 1], [0, 2], [0, 3]]])                  # expert 0 thrice, 4 unused
    spread = routing.load_spread(ids, 5)
    assert spread["layers"][0] == dict(max_over_min=None, cv=pytest.approx(
        torch.tensor([3.0, 1, 1, 1, 0]).std().item() / 1.2), unused=1)
    assert routing.load_spread(ids, 4)["mean"]["max_over_min"] == 3.0


# ---------------------------------------------------------------------------------------------
# The routings through the model, the timing run and the dump

def routed_ids(target, tokens, positions):
    """The routers' ids of one forward: [MoE layers, tokens, K]."""
    recorder = routing.RoutingRecorder(target)
    with torch.no_grad():
        target(tokens, positions)
    ids = recorder.pop()
    recorder.remove()
    return ids


def assert_distinct(ids, D, K, what):
    for layer, layer_ids in enumerate(ids):
        assert layer_ids.unique().numel() == D, f"{what}: layer {layer}"
        assert all(row.unique().numel() == K for row in layer_ids), f"{what}: layer {layer}"


def tiny_target(dtype=torch.float32, seed=4, batch=1):
    return checkpoint.init_random(model.Transformer(checkpoint.preset("tiny"), batch, 32,
                                                    dtype=dtype), seed)


def test_distinct_routing_reaches_exactly_D_in_every_layer_of_a_forward_at_every_T():
    target = tiny_target()
    E, K = target.args.n_routed_experts, target.args.num_experts_per_tok
    for T in range(1, 7):
        tokens, positions = torch.randint(0, 256, (1, T)), torch.arange(T).unsqueeze(0)
        low, high = routing.distinct_range(T, K, E)
        for D in range(low, high + 1):
            target.set_routing("distinct", routing.DistinctChoice(D, E, K, seed=T))
            assert_distinct(routed_ids(target, tokens, positions), D, K, f"T {T}, D {D}")
    target.set_routing("model")
    assert all(r.choice is None for r in routing.routers(target))
    with pytest.raises(ValueError, match="take a choice"):
        target.set_routing("distinct")


def first_router_calls(target, tokens, positions):
    """Each MoE layer's router (ids, weights) of one forward; the first layer's input is the same
    whatever the routing, so its weights compare across routings."""
    calls = []
    hooks = [r.register_forward_hook(lambda m, args, out: calls.append(out))
             for r in routing.routers(target)]
    with torch.no_grad():
        target(tokens, positions)
    for h in hooks:
        h.remove()
    return calls


def test_a_choice_replaces_the_experts_not_their_weights():
    """model.Router under a choice made outside ("distinct", "trace"): the chosen ids, and in
    column j the weight of the router's own j-th pick, the same as without the choice."""
    args = checkpoint.preset("tiny")
    router = checkpoint.init_random(model.Transformer(args, 1, 8), 3).layers[-1].mlp.gate
    E, K = args.n_routed_experts, args.num_experts_per_tok
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, args.hidden_size, generator=g)
    own_ids, own_w = router(x)
    picked = torch.rand(6, E, generator=g).argsort(1)[:, :K]
    router.routing, router.choice = "distinct", lambda ids: picked
    ids, w = router(x)
    assert torch.equal(ids, picked) and not torch.equal(ids, own_ids)
    assert torch.equal(w, own_w)


@pytest.mark.triton
def test_distinct_routing_through_the_router_kernel():
    """kernels.RouterKernel under a choice made outside ("distinct", as "trace"): the choice's ids
    and the weights the plain router gives them (those of its own picks, column by column), in
    every layer. On the CPU interpreter the tiny model keeps 3 of its 8 layers (a dense one, then
    2 MoE layers: the first and one whose input the choice has changed); the GPU runs all 8."""
    from testing import TRITON_DEVICE
    layers = 8 if TRITON_DEVICE.type == "cuda" else 3
    build = partial(model.Transformer, checkpoint.preset("tiny", num_hidden_layers=layers), 1, 32,
                    TRITON_DEVICE, torch.float32, aux_layer_ids=(0, 1, 2) if layers == 3 else None)
    target, plain = checkpoint.init_random(build(), 4), checkpoint.init_random(build(), 4)
    kernels.accelerate(target, ["router"], moe="gather")
    assert all(isinstance(r, kernels.RouterKernel) for r in routing.routers(target))
    E, K = target.args.n_routed_experts, target.args.num_experts_per_tok
    cases = [(T, D) for T in range(1, 7) for D in sorted({K, (K + min(T * K, E)) // 2,
                                                          min(T * K, E)})]
    for T, D in cases:
        tokens = torch.randint(0, 256, (1, T), device=TRITON_DEVICE)
        positions = torch.arange(T, device=TRITON_DEVICE).unsqueeze(0)
        for m in (target, plain):
            m.set_routing("distinct", routing.DistinctChoice(D, E, K, seed=T))
        got, want = (first_router_calls(m, tokens, positions) for m in (target, plain))
        for layer, ((ids, w), (plain_ids, plain_w)) in enumerate(zip(got, want)):
            assert torch.equal(ids, plain_ids), f"T {T}, D {D}, layer {layer}"
            assert_close(w, plain_w, 1e-5, f"T {T}, D {D}, layer {layer}: the weights")
        assert_distinct(routed_ids(target, tokens, positions), D, K, f"kernel, T {T}, D {D}")


def timing_bench(argv):
    """run.py's timing run prepared (models built, caches filled, the routing put in), on CPU."""
    cfg = run.settle(run.parse_args(argv), torch.device("cpu"), 1)
    run.check_sizes(cfg, torch.device("cpu"), 1)
    return timing.prepare(cfg, torch.device("cpu"))


def test_a_trace_replays_exactly_in_the_timed_forwards(tmp_path):
    """Each timed forward (warm-ups too) takes the trace's next tokens, in order, cycling; a
    forward outside the timing (a profile, the loops) takes the next ones too; the trace's layers
    repeat over the model's MoE layers."""
    ids = random_trace(layers=2, tokens=13, E=16, K=4, seed=5)
    path = tmp_path / "trace.npz"
    routing.save_trace(path, ids, 16, 4)
    b = timing_bench(["--routing", "trace", "--routing-trace", str(path), "--reps", "2"])
    L = len(routing.routers(b.target))
    want = ids[torch.arange(L) % 2]
    recorder = routing.RoutingRecorder(b.target)
    calls = timing.phase_calls(b, b.cfg.context_len[0])
    for phase in ("verify/decode", "decode_step"):
        key, fn, inputs = calls[phase]
        b.timed(key, fn, *inputs, graph=False)              # 3 warm-ups and 2 timed calls
        fn(*inputs)                                         # outside the timing: advanced too
    got = recorder.pop()
    recorder.remove()
    T = b.k + 1
    order = torch.arange(6 * T + 6) % 13
    assert torch.equal(got, want[:, order]), "the forwards' ids are not the trace's, in order"
    assert b.routing_choice.advanced == 6 * T + 6


def test_the_trees_acceptance_takes_no_trace_tokens(tmp_path):
    """Timing the tree's acceptance (accept_tree and the cache move, 5 calls) advances the trace by
    nothing, where the tree's verify before it (tree_forward, eager, once) takes its N nodes'
    tokens a row; a partial of tree_forward or of the target itself routes, one that holds the
    target for another use (its cache move) does not."""
    ids = random_trace(layers=2, tokens=13, E=16, K=4, seed=5)
    path = tmp_path / "trace.npz"
    routing.save_trace(path, ids, 16, 4)
    tree = ["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]
    b = timing_bench(["--routing", "trace", "--routing-trace", str(path), "--reps", "2", *tree])
    before = b.routing_choice.advanced
    assert timing.time_tree_accept(b, b.cfg.context_len[0]) > 0
    assert b.routing_choice.advanced - before == b.cfg.batch_size * 4
    t = b.target
    assert b.feed.routes(partial(t, mode="decode")) and b.feed.routes(partial(tree_forward, t))
    assert not b.feed.routes(partial(type(t).move_cache, t))


def test_distinct_routing_in_the_timing_run_and_its_sweep():
    b = timing_bench(["--routing", "distinct", "--distinct-experts", "6", "--reps", "1"])
    K = b.target.args.num_experts_per_tok
    for phase, D in (("verify/decode", 6), ("decode_step", K)):
        key, fn, inputs = timing.phase_calls(b, b.cfg.context_len[0])[phase]
        recorder = routing.RoutingRecorder(b.target)
        b.timed(key, fn, *inputs, graph=False)
        got = recorder.pop()
        recorder.remove()
        n = inputs[0].numel()
        for call in got.split(n, dim=1):
            assert_distinct(call, D, K, phase)


def test_a_dumps_routing_is_the_routers_own_choice():
    target = tiny_target(torch.float64, seed=6, batch=2)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    d = baseline.dump(target, None, prompts, 5, topk=3, recorder=routing.RoutingRecorder)
    t = routing.Trace(torch.from_numpy(d["routing_ids"].astype(np.int64)), int(d["n_experts"]),
                      int(d["top_k"]), d["sequence_lengths"].tolist())
    assert t.ids.shape[0] == len(routing.routers(target)) and t.top_k == 4
    start = 0
    for row, (p, out, n) in enumerate(zip(prompts, d["output_ids"], t.sequence_lengths)):
        # every row as far as its top-K positions: its prompt and output but the last token
        seq = (p + [x for x in out.tolist() if x >= 0])[:-1]
        assert n == len(seq)
        own = routed_ids(target, torch.tensor([seq]), torch.arange(n).unsqueeze(0))
        assert torch.equal(t.ids[:, start:start + n], own), f"row {row}"
        start += n
    assert start == t.ids.shape[1]
    alone = baseline.dump(target, None, prompts[1:], 5, topk=3, recorder=routing.RoutingRecorder)
    assert alone["sequence_lengths"].tolist() == d["sequence_lengths"].tolist()[1:], \
        "a row's routing depends on the other prompts of the dump"


@pytest.mark.gpu
@pytest.mark.parametrize("kernels_on", ["none", pytest.param("all", marks=pytest.mark.triton)])
def test_distinct_and_trace_routing_replay_in_cuda_graphs_as_eager(kernels_on):
    """Captured, a forward routes as eager does (eager run without programmatic dependent launch),
    with nothing syncing the host in the replay: distinct at D (its ids kept from the eager call),
    and a trace at each window that TraceChoice.advance wrote before the replay, outside the
    graph."""
    from functools import partial

    from graphs import CudaGraphs
    from testing import eager_without_pdl, gpu_models
    target, _ = gpu_models(torch.float32, B=1, kernels_on=kernels_on)
    E, K = target.args.n_routed_experts, target.args.num_experts_per_tok
    tokens = torch.randint(0, 256, (1, 4), device="cuda")
    positions = torch.arange(8, 12, device="cuda").unsqueeze(0)
    fn, runner = partial(target, mode="decode", kv_len=16), CudaGraphs("cuda")

    def replayed(key):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return runner.run(key, fn, tokens, positions).logits
        finally:
            torch.cuda.set_sync_debug_mode("default")
    target.set_routing("distinct", routing.DistinctChoice(6, E, K))
    eager = eager_without_pdl(fn, tokens, positions).logits
    runner.run("distinct", fn, tokens, positions)                   # captured
    assert torch.equal(replayed("distinct"), eager), "distinct routing: graph vs eager"
    choice = routing.TraceChoice(routing.TraceCursor(random_trace(2, 12, E, K),
                                                     len(routing.routers(target))), "cuda")
    target.set_routing("trace", choice)
    outs = []
    for window in range(3):
        choice.cursor.at = 4 * window
        choice.advance(4)
        eager = eager_without_pdl(fn, tokens, positions).logits
        if window == 0:
            runner.run("trace", fn, tokens, positions)              # captured
        choice.cursor.at = 4 * window
        choice.advance(4)
        outs.append(replayed("trace"))
        assert torch.equal(outs[-1], eager), f"trace window {window}: graph vs eager"
    assert not torch.equal(outs[0], outs[1]), "the replay did not read the advanced window"


# ---------------------------------------------------------------------------------------------
# routing.py's command line: the figure, refusals

def refused(argv, capsys):
    """routing.main(argv)'s exit status and its stderr lines (a parser's refusal exits)."""
    try:
        status = routing.main(argv)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err.strip().splitlines()


def test_the_figure_draws_from_a_sweep_or_says_in_one_line_what_it_needs(tmp_path, capsys):
    points = [dict(distinct=D, distinct_ran=D, verify_ms=2 + D / 8, plain_steps=0.5 + D / 16,
                   cycle_ms=3 + D / 8, break_even_accept_len=0.75 + D / 16) for D in (8, 16, 32)]
    sweep = dict(tokens=4, top_k=8, experts=128, uniform_expectation=29.1, num_steps=3,
                 variant="graph", mode="decode", plain_step_ms=4.0, run_routing="uniform",
                 run_verify_ms=6.0, run_distinct=32, points=points)
    path, out = tmp_path / "r.json", tmp_path / "fig.png"
    path.write_text(json.dumps(dict(env=dict(dtype="bfloat16"), routing_sweep=sweep)) + "\n")
    # a file written before the key was plain_steps names it decode_steps
    older = dict(sweep, points=[{("decode_steps" if k == "plain_steps" else k): v
                                 for k, v in p.items()} for p in points])
    (tmp_path / "older.json").write_text(json.dumps(dict(env=dict(dtype="float32"),
                                                         routing_sweep=older)) + "\n")
    status = routing.main(["plot", str(path), str(tmp_path / "older.json"), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    # a file without the sweep is named first, with or without matplotlib
    (tmp_path / "bad.json").write_text(json.dumps(dict(env=dict(dtype="bfloat16"))) + "\n")
    status_bad, err_bad = refused(["plot", str(tmp_path / "bad.json"), "--out", str(out)], capsys)
    assert status_bad == 2 and len(err_bad) == 1, err_bad
    assert "has no routing_sweep (run.py --distinct-sweep)" in err_bad[0], err_bad
    if importlib.util.find_spec("matplotlib") is None:
        assert status == 2 and err == ["routing.py plot: needs matplotlib (pip install matplotlib)"]
    else:
        assert status == 0 and out.stat().st_size > 0, err
        status, err = refused(["plot", str(out), "--out", str(out)], capsys)
        assert status == 2 and len(err) == 1, err
        assert ": not a run.py --json file (not JSON text: binary" in err[0], err
        nowhere = tmp_path / "none" / "fig.png"
        for out, said in ((nowhere, f"cannot write there (no folder {tmp_path}/none)"),
                          (tmp_path, "cannot write there (is a folder)"),
                          (tmp_path / "fig.txt", "its suffix names no format matplotlib writes; "
                                                 "end it in .png, .pdf or .svg (or "),
                          (tmp_path / "fig", "its suffix names no format matplotlib writes")):
            status, err = refused(["plot", str(path), "--out", str(out)], capsys)
            assert status == 2 and len(err) == 1, (out, err)
            assert err[0].startswith(f"routing.py plot: error: --out {out}: {said}"), err
        assert sorted(os.listdir(tmp_path)) == ["bad.json", "fig.png", "older.json", "r.json"]
        assert routing.main(["plot", str(path), "--out", str(tmp_path / "fig.svg")]) == 0
        assert capsys.readouterr().out == f"wrote {tmp_path}/fig.svg\n"
        assert (tmp_path / "fig.svg").read_text().startswith("<?xml")


def test_routing_py_refuses_a_missing_or_foreign_file_and_an_unknown_command_in_one_line(
        tmp_path, capsys):
    """curve on a missing file or on a file that is no trace, convert-sglang on a missing file or
    on bytes torch.load cannot read, an unknown command and none: one line naming the problem,
    exit status 2, no traceback; --help lists each command with what it does."""
    (tmp_path / "junk.pt").write_bytes(b"junk")
    (tmp_path / "run.json").write_text("{}\n")
    for argv, words in ((["curve", str(tmp_path / "none.npz")], "No such file or directory"),
                        (["curve", str(tmp_path / "run.json")], "is not an .npz file"),
                        (["convert-sglang", str(tmp_path / "none.pt"), "--out",
                          str(tmp_path / "t.npz")], "No such file"),
                        (["convert-sglang", str(tmp_path / "junk.pt"), "--out",
                          str(tmp_path / "t.npz")], "torch.load cannot read it"),
                        (["bogus"], "unknown command 'bogus'"), ([], "a command is required")):
        try:
            status = routing.main(argv)
        except SystemExit as e:
            status = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and words in err[-1] and "error:" in err[-1], (argv, err)
    assert not (tmp_path / "t.npz").exists()
    assert routing.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in routing.COMMANDS), listed


def test_the_probe_refuses_its_flags_and_an_out_it_cannot_write_before_training(
        tmp_path, capsys, monkeypatch):
    """probe: --steps, --threads below 1 or above the CPUs, --minutes not above 0, a negative bias
    rate or router learning-rate scale, an --out that is a file or lies under one, and --quick
    into the committed probe's folder are refused in one line (status 2) before any training and
    leave no folder; 0 for --bias-rate (no correction) and --router-lr-scale (frozen routers) is
    taken as given, not as the default."""
    monkeypatch.setattr(routing, "train_probe", lambda *a: pytest.fail("the probe trained"))
    (tmp_path / "file").write_text("")
    out = ["--out", str(tmp_path / "new" / "probe")]
    for argv, said in (
            (out + ["--steps", "0"], "--steps 0: must be at least 1"),
            (out + ["--threads", "0"], "--threads 0: must be at least 1"),
            (out + ["--threads", str(os.cpu_count() + 1)],
             f"--threads {os.cpu_count() + 1}: this machine has {os.cpu_count()} CPUs; give at "
             f"most {os.cpu_count()}"),
            (out + ["--minutes", "0"], "--minutes 0.0: must be above 0"),
            (out + ["--minutes", "-1"], "--minutes -1.0: must be above 0"),
            (out + ["--bias-rate", "-0.1"], "--bias-rate -0.1: must be at least 0 and finite"),
            (out + ["--router-lr-scale", "inf"],
             "--router-lr-scale inf: must be at least 0 and finite"),
            (["--out", str(tmp_path / "file")],
             f"--out {tmp_path}/file: cannot write there (a file, not a folder)"),
            (["--quick", "--out", os.path.join(HERE, "benchmarks", ".", "routing")],
             f"--out {HERE}/benchmarks/./routing: --quick would replace the committed probe "
             "with a smoke test; give another --out"),
            (["--out", str(tmp_path / "file" / "probe")],
             f"--out {tmp_path}/file/probe: cannot write there (Not a directory)")):
        status, err = refused(["probe", *argv], capsys)
        assert (status, err) == (2, [f"routing.py probe: error: {said}"]), (argv, err)
    assert sorted(os.listdir(tmp_path)) == ["file"]
    p = routing.probe_parser()
    cfg = routing.probe_config(p, p.parse_args(["--out", "x", "--bias-rate", "0",
                                                "--router-lr-scale", "0", "--steps", "5"]))
    assert (cfg["bias_rate"], cfg["router_lr_scale"], cfg["steps"]) == (0, 0, 5)
    assert routing.probe_config(p, p.parse_args(["--out", "x"])) == routing.PROBE_TRAIN


def test_the_probe_interrupted_says_one_line_and_leaves_no_folder(tmp_path):
    """Ctrl-C while the probe trains, as a user presses it: exit status 130, one line, no
    traceback, and the folders it made for --out gone."""
    p = subprocess.Popen([sys.executable, "-u", os.path.join(HERE, "routing.py"), "probe",
                          "--quick", "--out", "new/probe"], cwd=tmp_path, env=CPU_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "new").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)   # into the imports of the training, or its steps
    while p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            assert time.time() < deadline, "the probe did not stop"
    said = [line for line in err.replace("\r", "\n").splitlines()
            if line.strip() and "router probe:" not in line]
    assert p.returncode == 130 and "Traceback" not in err, (p.returncode, err[-2000:])
    assert said == ["routing.py probe: interrupted; nothing written, new removed"], err[-2000:]
    assert os.listdir(tmp_path) == []


def test_the_probe_moves_its_files_in_whole_or_leaves_out_as_it_was(tmp_path, monkeypatch):
    """The probe writes its three files in a work folder inside --out and renames them in at the
    end: a failure while writing them (here probe.md's text) leaves --out's earlier files as they
    were, and no work folder."""
    def failing(result):
        raise RuntimeError("no space left")
    out = tmp_path / "probe"
    out.mkdir()
    (out / "probe.json").write_text("earlier")
    monkeypatch.setattr(routing, "probe_markdown", failing)
    monkeypatch.setattr(routing, "PROBE_RECORD", dict(routing.PROBE_RECORD, sequences=2))
    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="no space left"):
            routing.main(["probe", "--steps", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)   # (the probe sets its --threads)
    assert os.listdir(out) == ["probe.json"] and (out / "probe.json").read_text() == "earlier"


def test_convert_sglang_refuses_bad_sizes_outputs_and_an_empty_trace(tmp_path, capsys):
    """convert-sglang: --n-experts below 1 and --top-k outside [1, n-experts] are refused as the
    flags they are; --out a folder or under a file in one line (status 2), no file written; a
    dump whose ids are all -1 is refused as an empty trace; --out without .npz is written and
    named at its path as given."""
    E, L = 16, 3
    to_logical = torch.arange(E).expand(L, E).clone()
    ids = torch.stack([torch.stack([torch.randperm(E)[:8] for _ in range(4)]) for _ in range(2)])
    write_sglang_dump(tmp_path / "d.pt", [(1, ids)], L, to_logical)
    write_sglang_dump(tmp_path / "none.pt", [(1, torch.full_like(ids, -1))], L, to_logical)
    (tmp_path / "file").write_text("")
    dump, sizes = str(tmp_path / "d.pt"), ["--n-experts", "16", "--top-k", "8"]
    for argv, said in (
            ([dump, "--out", "t.npz", "--n-experts", "0"], "--n-experts 0: must be at least 1"),
            ([dump, "--out", "t.npz", "--n-experts", "-5"], "--n-experts -5: must be at least 1"),
            ([dump, "--out", "t.npz", "--top-k", "0"],
             r"--top-k 0: must lie in [1, 384] (--n-experts)"),
            ([dump, "--out", "t.npz", "--n-experts", "4"],
             r"--top-k 8: must lie in [1, 4] (--n-experts)"),
            ([dump, "--out", str(tmp_path), *sizes],
             f"--out {tmp_path}: cannot write there (is a folder)"),
            ([dump, "--out", str(tmp_path / "file" / "t.npz"), *sizes],
             f"--out {tmp_path}/file/t.npz: cannot write there "),
            ([str(tmp_path / "none.pt"), "--out", str(tmp_path / "t.npz"), *sizes],
             f"{tmp_path}/none.pt: no token routed in every slot of a layer")):
        status, err = refused(["convert-sglang", *argv], capsys)
        assert status == 2 and len(err) == 1, (argv, err)
        assert err[0].startswith(f"routing.py convert-sglang: error: {said}"), (argv, err)
    assert sorted(os.listdir(tmp_path)) == ["d.pt", "file", "none.pt"]
    assert routing.main(["convert-sglang", dump, "--out", str(tmp_path / "t.txt"), *sizes]) is None
    assert capsys.readouterr().out.startswith(f"{tmp_path}/t.txt: 2 layers, 4 tokens")
    assert sorted(os.listdir(tmp_path)) == ["d.pt", "file", "none.pt", "t.txt"]
    assert torch.equal(routing.read_trace(tmp_path / "t.txt", E, 8).ids, ids.long())


def test_convert_sglang_refuses_a_record_whose_ids_are_no_3d_integer_tensor(tmp_path, capsys):
    """A record's topk_ids_of_layer as a list, as floats, or 2-D [tokens, 8] (no layer axis) is
    refused in one line naming the file, the record and what it holds; nothing written."""
    good = torch.randint(0, 16, (3, 5, 8), dtype=torch.int32)
    for ids, said in (([[0] * 8] * 5, "record 1's topk_ids_of_layer is a list, not a tensor"),
                      (good.float(), "record 1's topk_ids_of_layer is torch.float32, not integers"),
                      (good[0], "record 1's topk_ids_of_layer has shape [5, 8], not [layers, ")):
        path = tmp_path / "d.pt"
        torch.save(dict(records=[dict(topk_ids_of_layer=good), dict(topk_ids_of_layer=ids)]), path)
        status, err = refused(["convert-sglang", str(path), "--out", str(tmp_path / "t.npz"),
                               "--n-experts", "16"], capsys)
        assert status == 2 and len(err) == 1, err
        assert err[0].startswith(f"routing.py convert-sglang: error: {path}: {said}"), err
        assert not (tmp_path / "t.npz").exists()


def test_routing_py_ends_quietly_when_its_reader_closes_the_pipe(tmp_path, monkeypatch, capsys):
    """`routing.py curve TRACE | head -1`: exit status 141 as report.py's (128 + SIGPIPE), no
    traceback, nothing on stderr."""
    path = tmp_path / "trace.npz"
    routing.save_trace(path, random_trace(), 384, 8)
    read, write = os.pipe()
    os.close(read)
    with open(write, "w", buffering=1) as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert routing.main(["curve", str(path)]) == 141
        stdout.write("more\n" * 1000)   # into /dev/null now
    monkeypatch.undo()
    assert capsys.readouterr().err == ""


def test_curve_refuses_a_window_below_1_and_a_file_that_is_no_npz(tmp_path, capsys):
    """curve: --max-T 0 or below refused (not a header and nothing); a text file named as the
    file that is no .npz by its first bytes (as run.py --compare says it), not numpy's pickle
    message."""
    path = tmp_path / "trace.npz"
    routing.save_trace(path, random_trace(), 384, 8)
    for argv, said in (([str(path), "--max-T", "0"], "--max-T 0: must be at least 1"),
                       ([str(path), "--max-T", "-3"], "--max-T -3: must be at least 1"),
                       ([os.path.join(HERE, "README.md")],
                        f"{HERE}/README.md is not an .npz file (a zip of numpy arrays): it "
                        "starts with b'# EA'")):
        status, err = refused(["curve", *argv], capsys)
        assert (status, err) == (2, [f"routing.py curve: error: {said}"]), (argv, err)
    assert routing.main(["curve", str(path), "--max-T", "2"]) is None
    assert len(capsys.readouterr().out.splitlines()) == 3
    # past the longest sequence: the curve ends there, and a note says so
    routing.save_trace(path, random_trace(tokens=20), 384, 8, sequence_lengths=[12, 8])
    assert routing.main(["curve", str(path), "--max-T", "100000"]) is None
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + 12 and out.splitlines()[-1].startswith("T 12:"), out
    assert err == ("routing.py curve: note: --max-T 100000 is past the trace's longest sequence "
                   "(12 tokens); the curve stops at T 12\n"), err
    assert routing.main(["curve", str(path), "--max-T", "12"]) is None
    assert capsys.readouterr().err == ""
