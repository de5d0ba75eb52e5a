"""Tensor parallelism (tp.py): CPU ranks' threads, the all-reduces (NCCL's and the one-shot over
torch's symmetric memory), and real TP 2 on two GPUs.

Tests marked `multi_gpu` run under torchrun, each rank the same tests in the same order:
    torchrun --nproc-per-node 2 -m pytest -q test_tp.py -m multi_gpu
Elsewhere those skip, saying why; the refusal on gloo and the size rule run on any machine.
"""
import json
import os
from datetime import timedelta
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import checkpoint
import run
import timing
import tp
import train
from checkpoint import init_random, init_random_draft, load_draft
from draft import draft_preset, Eagle3Draft
from graphs import CudaGraphs
from model import Transformer
from testing import (assert_close, captured_calls, eager_without_pdl, flat, ONE_THREAD,
                     ranks_stderr, run_py, run_ranks, run_steps, step_inputs, tiny, TRITON_DEVICE)
from tp import TP
from verify import generate


# ---------------------------------------------------------------------------------------------
# CPU ranks: threads, rank-local random weights, a swap's own all-reduce

def _threads():
    return torch.get_num_threads()


def test_cpu_ranks_share_the_cores(monkeypatch):
    """A CPU rank takes OMP_NUM_THREADS threads if set, else its share of the cores, not torch's
    default of all of them (which oversubscribes a small machine many times over); spawned ranks
    apply it although torch started before the variable was read. run.py times the CPU on one
    thread unless OMP_NUM_THREADS asks for more."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert tp.cpu_threads_per_rank(2) == max(1, os.cpu_count() // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert tp.cpu_threads_per_rank(2) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run_ranks(2, _threads) == 1
    monkeypatch.delenv("OMP_NUM_THREADS")  # a timing run on the CPU: one thread unless asked
    torch.set_num_threads(2)
    run.settle(run.parse_args([]), torch.device("cpu"), 1)
    assert torch.get_num_threads() == 1


def _o_proj_gemv_at_tp2():
    """This rank's o_proj (row-parallel: its slice of the input columns) plain and swapped for
    kernels' GemvRowParallel, on 1 and O_PROJ_GEMV_MAX_ROWS rows (the GEMV's) and one row more
    (cuBLAS's), each all-reduced, and the product of the whole weight. On a machine with CUDA both
    ranks run on its first GPU (gloo all-reduces CUDA tensors through the host)."""
    import kernels
    t = TP.from_env()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g).to(TRITON_DEVICE)
    x = torch.randn(kernels.O_PROJ_GEMV_MAX_ROWS + 1, 128, generator=g).to(TRITON_DEVICE)
    cols = slice(t.rank * 64, (t.rank + 1) * 64)
    plain = tp.RowParallelLinear(128, 64, t, "o_proj").to(TRITON_DEVICE)
    fast = kernels.swap(tp.RowParallelLinear(128, 64, t, "o_proj").to(TRITON_DEVICE),
                        kernels.GemvRowParallel)
    with torch.no_grad():
        for m in (plain, fast):
            m.weight.copy_(w[:, cols])
        rows = (1, kernels.O_PROJ_GEMV_MAX_ROWS, kernels.O_PROJ_GEMV_MAX_ROWS + 1)
        return [(plain(x[:n, cols]), fast(x[:n, cols]), x[:n] @ w.T) for n in rows]


@pytest.mark.triton
def test_o_proj_gemv_all_reduces_across_real_ranks_as_row_parallel():
    """norm_gemv on o_proj runs a collective of its own (the all-reduce after its GEMV): at real
    TP 2 (gloo; on a CPU the GEMV in Triton's interpreter) it equals tp.RowParallelLinear, and
    both the whole weight's product, at every row count."""
    for plain, fast, whole in run_ranks(2, _o_proj_gemv_at_tp2):
        assert_close(plain, whole, 1e-5, f"RowParallelLinear at TP 2, {len(whole)} rows")
        assert_close(fast, plain, 1e-5, f"GemvRowParallel vs RowParallelLinear, {len(whole)} rows")


def _faster_verify_on_two_ranks():
    """timing.faster_verify where the ranks' timings disagree: rank 0 timed decode attention's
    verify faster, rank 1 extend's; every rank's choice, gathered."""
    rank = dist.get_rank()
    b = SimpleNamespace(graph_opts=[False], modes=["extend", "decode"],
                        verify_name=lambda mode: f"verify/{timing.FLAG_WORD[mode]}")
    phases = {"verify/prefill/eager": 1.0 if rank else 2.0, "verify/decode/eager": 1.5}
    chosen = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, timing.faster_verify(b, phases))
    return chosen


def test_cost_models_attention_mode_is_rank_0s_on_every_rank():
    """Under real TP every rank prices (and sweeps) the attention mode rank 0 timed faster, though
    its own timings would pick the other one: the ranks time one shape."""
    assert run_ranks(2, _faster_verify_on_two_ranks) == [("eager", "decode")] * 2


def _rank_local_model():
    """This rank's tiny target drawn rank-locally (as timing.py draws a shard too big to seed
    whole), and the experts its routers chose in a prefill."""
    m = init_random(Transformer(tiny(), 3, 32, dtype=torch.float32), 0, rank_local=True)
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, i, out: chosen.append(out[0]))
             for layer in m.layers if hasattr(layer.mlp, "gate")]
    prefill, prefill_pos, _, _ = step_inputs(256)
    m(prefill, prefill_pos, "extend")
    for h in hooks:
        h.remove()
    gathered = {}
    for name, t in [*m.state_dict().items(), *((f"ids {i}", c) for i, c in enumerate(chosen))]:
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t.contiguous())
        gathered[name] = parts
    split = {n for n, p in m.named_parameters()
             if p.shard_dim is not None or hasattr(p, "block_index")}
    return gathered, split


def test_rank_local_random_weights_keep_replicated_parameters_equal_on_every_rank():
    """Real TP 2 (gloo) with weights drawn rank-locally: each split parameter's slices differ (a
    slice of its own a rank), each replicated one (router, norms, q_a, kv_a) is the same on both
    ranks, and so the ranks route every token to the same experts."""
    gathered, split = run_ranks(2, _rank_local_model)
    assert split and any(not n.startswith("ids") and n not in split for n in gathered)
    for name, (a, b) in gathered.items():
        if name in split:
            assert not torch.equal(a, b), f"{name}: the same slice on both ranks"
        else:
            assert torch.equal(a, b), f"{name}: replicated, but differs between ranks"


# ---------------------------------------------------------------------------------------------
# The all-reduces: the size rule, the refusal on gloo, measured under real TP, and real TP 2
# on two GPUs (marked multi_gpu)

@pytest.fixture(scope="module")
def tp_gpu_world():
    """The NCCL group of the two ranks (a short timeout: a rank that fails must not hang its peer
    for NCCL's default 10 minutes), and a TP object for each all-reduce."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=timedelta(seconds=90), device_id=device)
    return {name: TP.from_env(name) for name in tp.ALLREDUCES}


def test_one_shot_fits_small_float_messages():
    """Decode and verify messages take the one-shot path; prefill-sized ones, dtypes the kernel
    lacks and sizes off its 16-byte vectors go to NCCL."""
    fits = partial(tp.one_shot_fits, max_bytes=tp.ONE_SHOT_MAX_BYTES)
    assert fits(6 * 7168, 2, torch.bfloat16) and fits(64 * 7168, 2, torch.bfloat16)
    assert fits(1 * 64, 4, torch.float32)
    assert not fits(74 * 7168, 2, torch.bfloat16)        # 1.06 MB > 1 MiB
    assert not fits(256 * 7168, 2, torch.bfloat16)       # a prefill
    assert not fits(64, 8, torch.float64) and not fits(3, 2, torch.bfloat16)


def test_one_shot_allreduce_is_refused_on_gloo():
    """Symmetric memory needs CUDA GPUs under NCCL: on gloo ranks `run.py --allreduce one-shot`
    (`TP.from_env("one-shot")` inside) refuses in one line that names what is missing and what
    the run has, said once. (NCCL's choice, gloo's all-reduce here, builds and runs on the same
    ranks: test_run_py_measures_allreduces_under_real_tp.)"""
    with pytest.raises(ValueError, match="choose from nccl, one-shot"):
        TP.from_env("ring")
    out = run_py("--allreduce", "one-shot", "--skip-e2e", "--reps", "1", ranks=2, env=ONE_THREAD)
    errors = [line for line in out.stderr.splitlines() if line.startswith("run.py: error:")]
    # the same on every rank: said once
    assert out.returncode != 0 and len(errors) == 1, ranks_stderr(out)
    assert errors[0] == ("run.py: error: one-shot all-reduce: needs torch's symmetric memory on "
                         "CUDA GPUs under NCCL; this run has gloo on cpu (use the NCCL "
                         "all-reduce)"), errors[0]


def test_run_py_measures_allreduces_under_real_tp(tmp_path):
    """A real TP 2 run (gloo) times the all-reduce at 1, 2, 4 and 6 tokens, eager (no graphs on a
    CPU: the interleaved and back-to-back figures and the simulated twin need them)."""
    path = tmp_path / "r.json"
    out = run_py("--skip-e2e", "--reps", "1", "--speculative-attention-mode", "decode", "--json",
                 str(path),
                 ranks=2, env=ONE_THREAD)
    assert out.returncode == 0, ranks_stderr(out)
    m = json.loads(path.read_text())["allreduce_measured"]
    assert set(m["us_each"]) == {f"eager/{T}" for T in (1, 2, 4, 6)}
    assert m["per_forward"] == 2 * 8 + 2   # the embedding's all-reduce, 2 a layer, the gather
    assert all(v > 0 for v in m["us_each"].values())
    assert m["implementation"] == "TP 2, rank 0, gloo all-reduce"
    assert ("all-reduce, us each, by tokens a row T (T hidden rows each; TP 2, rank 0, gloo "
            "all-reduce):") in out.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("allreduce", tp.ALLREDUCES)
def test_tp_gpu_graph_replay_equals_eager_without_host_sync(tp_gpu_world, allreduce):
    """TP 2 on two GPUs, bf16: every captured shape replays equal to eager (run without
    programmatic dependent launch), on its capture's inputs and on others, and neither eager nor
    capture nor replay syncs with the host, with either all-reduce."""
    tpo = tp_gpu_world[allreduce]
    assert (tpo.one_shot is not None) == (allreduce == "one-shot") and tpo.world_size == 2
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=64, device="cuda",
                                     dtype=torch.bfloat16, tp=tpo), 0)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 1)
    calls, runner, results = captured_calls(target, head), CudaGraphs("cuda"), []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for key, fn, inputs in calls:
            eager = flat(eager_without_pdl(fn, *inputs))
            runner.run(key, fn, *inputs)                              # capture
            results.append((key, eager, flat(runner.run(key, fn, *inputs))))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # then replayed on other tokens at other positions (the same on both ranks: a seeded CPU draw)
    for key, fn, inputs in captured_calls(target, head, P=15, seed=1):
        results.append((key, flat(eager_without_pdl(fn, *inputs)),
                        flat(runner.run(key, fn, *inputs))))
    for key, eager, graphed in results:
        assert_close(graphed, eager, 0.0, f"TP 2 {allreduce}: graph vs eager {key}")


@pytest.mark.multi_gpu
@pytest.mark.parametrize("allreduce", tp.ALLREDUCES)
def test_tp_gpu_speculative_equals_plain_greedy(tp_gpu_world, allreduce):
    """The trained pair at TP 2 in float32 with the model's own routing, verify and draft from CUDA
    graphs: speculative tokens equal plain greedy ones decoded eagerly (no graphs), drafts
    accepted, in both attention modes."""
    target = checkpoint.load_target(train.TARGET_DIR, 3, 128, "cuda", torch.float32,
                                    tp=tp_gpu_world[allreduce])
    head = load_draft(train.DRAFT_DIR, target)
    assert target.routing == "model" and target.tp.world_size == 2
    prompts = [p[:n] for p, n in zip(train.heldout_prompts(3, 32), (32, 17, 25))]
    plain = generate(target, None, prompts, max_new_tokens=40, eos_id=-1, use_graphs=False).tokens
    for mode in ("extend", "decode"):
        res = generate(target, head, prompts, max_new_tokens=40, num_steps=3, attention_mode=mode,
                       use_graphs=True, eos_id=-1)
        assert res.tokens == plain, (allreduce, mode)
        accepted = res.accepted[res.accepted >= 0].float().mean().item()
        assert accepted > 0.5, f"{allreduce} {mode}: {accepted:.2f} drafts accepted a cycle"


@pytest.mark.multi_gpu
def test_tp_gpu_one_shot_equals_nccl(tp_gpu_world):
    """Each rank's own random partial sums: the one-shot sum equals NCCL's within bf16 rounding at
    1-6 Kimi-sized rows (and exactly in float32), eager and replayed from a graph; a message over
    the limit goes to NCCL; the tiny model's float32 logits agree."""
    one, nccl = tp_gpu_world["one-shot"], tp_gpu_world["nccl"]
    g = torch.Generator("cuda").manual_seed(100 + dist.get_rank())
    runner, got = CudaGraphs("cuda"), []
    for T, dtype in [(1, torch.bfloat16), (2, torch.bfloat16), (4, torch.bfloat16),
                     (6, torch.bfloat16),
                     (4, torch.float32), (80, torch.bfloat16)]:
        x = torch.randn(1, T, 7168, device="cuda", generator=g).to(dtype)
        ref = nccl.all_reduce(x.clone())
        replayed = runner.run(("sum", T, dtype), one.all_reduce, torch.zeros_like(x))  # capture
        replayed = runner.run(("sum", T, dtype), one.all_reduce, x)
        got.append((T, dtype, one.one_shot.fits(x), one.all_reduce(x.clone()), replayed, ref))
    for T, dtype, fits, eager, replayed, ref in got:
        assert fits == (T < 80), (T, fits)
        tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
        torch.testing.assert_close(eager, ref, **tol, msg=f"one-shot vs NCCL, {T} rows {dtype}")
        torch.testing.assert_close(replayed, ref, **tol,
                                   msg=f"one-shot in a graph vs NCCL, {T} rows")
    logits = {}
    for name, tpo in tp_gpu_world.items():
        m = init_random(Transformer(tiny(), 3, 32, device="cuda", dtype=torch.float32, tp=tpo), 5)
        logits[name] = run_steps(m)
    assert_close(logits["one-shot"], logits["nccl"], 1e-5, "tiny model at TP 2, one-shot vs NCCL")


@pytest.mark.multi_gpu
@pytest.mark.triton
@pytest.mark.parametrize("allreduce", tp.ALLREDUCES)
def test_tp_gpu_kernels_equal_tp1_plain(tp_gpu_world, allreduce):
    """Every kernel on (kernels.accelerate "all", the fused MoE) at TP 2 on two GPUs, float32, with
    either all-reduce: each rank's logits of a prefill and a step in both attention modes
    (run_steps' random tokens) equal those of the plain TP 1 model (no kernels, the gather MoE)
    with the same seeded weights, within 1e-4 of the largest."""
    import kernels
    fast = init_random(Transformer(tiny(), 3, 32, device="cuda", dtype=torch.float32,
                                   tp=tp_gpu_world[allreduce]), 5)
    kernels.accelerate(fast, "all", moe="fused")
    assert fast.tp.world_size == 2 and fast.kernels == kernels.KERNELS
    plain = init_random(Transformer(tiny(), 3, 32, device="cuda", dtype=torch.float32, tp=TP()),
                        5)
    want = run_steps(plain)
    # float32, not bf16 (whose rounding can flip a near-tied expert choice, moving logits by O(1)
    # in a random model): the kernels and TP 2's partial sums only reorder float32 sums, which
    # moves the logits by about 1e-6 of the largest (1.3e-6 with 2 layers, the kernels in
    # Triton's CPU interpreter on 2 gloo ranks); 1e-4 of it leaves room for the GPU's orders,
    # while a wrong slice, slot or all-reduce moves logits by O(1)
    assert_close(run_steps(fast), want, 1e-4 * want.abs().max().item(),
                 f"TP 2 with every kernel ({allreduce}) vs TP 1 plain")
