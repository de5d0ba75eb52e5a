"""The command lines and what they print: run.py end to end on the CPU, its refusals, its report and
timing aids, the correctness baseline (--dump and --compare), train.py's folders, and the first
hour of a new user. run.py runs in a subprocess through testing.run_py, as a user runs it.
"""
import contextlib
import dataclasses
import fnmatch
import glob
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest
import torch
from torch.profiler import profile, ProfilerActivity

import baseline
import checkpoint
import kernels
import model
import components
import report
import routing
import run
import timing
import tp
import train
from checkpoint import (CheckpointError, init_random, init_random_draft, load_draft, load_target,
                        save_draft)
from draft import draft_preset, Eagle3Draft
from model import Transformer
from testing import (assert_close, CPU_ENV, edit_checkpoint, gpu_models, HERE, ONE_THREAD,
                     PlantedProposer, PROMPTS, reference_sequences, RUN_PY, run_py, run_ranks,
                     step_inputs, tiny, TRITON_DEVICE)
from verify import Probe, generate, kv_bucket, prefill_draft, prefill_target


# ---------------------------------------------------------------------------------------------
# run.py on the CPU: end to end (the report, the trained pair, the background's flags, trees),
# its phase timer, its refusals

# The run.py launches of the tests below and of the tree, verify-sweep, refusal, checkpoint, dump,
# 120-column and routing tests further down, each launched once for the module, two at a time on
# one thread each (CI's two cores, as run_py_at_once runs them): name -> run.py's flags. "{tmp}"
# is the module's folder (run_py_runs writes the files they read there), "{ckpt}" tiny_ckpt's
# checkpoint. --reps 1 or 2: the tests check no spread past 2 (on a CPU --reps also bounds a
# component table's profiled calls)
DUMP_FLAGS = ("--model-path", "{ckpt}", "--draft-path", "{tmp}/draft", "--prompt-ids",
              "{tmp}/p3.jsonl", "--max-new-tokens", "12", "--speculative-num-steps", "2",
              "--dtype", "float32")
RUN_PY_RUNS = {
    # first: trace_replay below waits for its file
    "dump_routing": ("--dump", "{tmp}/d.npz", "--prompt-ids", "{tmp}/p.jsonl",
                     "--max-new-tokens", "6", "--dump-routing"),
    # the background's setup: a simulated TP 2 rank, modelled all-reduces, two contexts
    "background": ("--simulate-tp", "2", "--allreduce-us", "35", "--speculative-num-steps", "2",
                   "--speculative-attention-mode", "decode", "--context-len", "8", "40",
                   "--skip-e2e", "--reps", "1", "--json", "-"),
    "background_refused": ("--allreduce-us", "35"),
    # random weights, the model's routing, e2e in both attention modes (spreads of 2 reps)
    "tiny": ("--json", "{tmp}/tiny.json", "--max-new-tokens", "20", "--speculative-num-steps", "2",
             "--batch-size", "2", "--routing", "model", "--random-weights", "--reps", "2"),
    "simulated": ("--simulate-accept-len", "2.5", "--max-new-tokens", "40", "--reps", "1",
                  "--json", "-"),
    "trained_pair": ("--json", "{tmp}/pair.json", "--max-new-tokens", "32",
                     "--speculative-num-steps", "3", "--batch-size", "2", "--reps", "1"),
    "tree": ("--json", "{tmp}/tree.json", "--max-new-tokens", "24", "--speculative-num-steps", "3",
             "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8",
             "--speculative-attention-mode", "decode", "--batch-size", "2", "--reps", "1"),
    # trees of 8 at batch 2 (fp32) and batch 4 (INT4 experts, bf16), isolated phases only
    **{name: ("--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
              "--speculative-num-draft-tokens", "8", "--skip-e2e", "--reps", "1",
              "--random-weights", *flags, "--json", f"{{tmp}}/{name}.json")
       for name, flags in (("sweep_b2", ("--batch-size", "2")),
                           ("sweep_b4_int4", ("--batch-size", "4", "--quant", "int4", "--dtype",
                                              "bfloat16")))},
    "lines": ("--random-weights", "--speculative-eagle-topk", "2", "--speculative-num-steps", "2",
              "--speculative-num-draft-tokens", "4", "--max-new-tokens", "8", "--reps", "1",
              "--json", "-"),
    "one_shot": ("--allreduce", "one-shot"),
    "help": ("--help",),
    "distinct": ("--routing", "distinct", "--distinct-experts", "6", "--distinct-sweep",
                 "--skip-e2e", "--reps", "1", "--sweep-tokens", "6", "--json", "-"),
    "dump_cli": (*DUMP_FLAGS, "--dump", "{tmp}/cli.npz"),
    # refusals
    "dump_temperature": (*DUMP_FLAGS, "--dump", "{tmp}/x.npz", "--temperature", "0.7"),
    "broken_checkpoint": ("--model-path", "{tmp}/bad"),
    "prompt_ids_outside": ("--dump", "{tmp}/outside.npz", "--prompt-ids", "{tmp}/outside.jsonl"),
    "distinct_17": ("--routing", "distinct", "--distinct-experts", "17"),
    "trace_of_another_model": ("--routing", "trace", "--routing-trace", "{tmp}/kimi.npz"),
    "too_big": ("--context-len", "10000000"),
    "tree_too_wide": ("--speculative-eagle-topk", "65", "--speculative-num-steps", "3",
                      "--speculative-num-draft-tokens", "8"),
}
# runs that read another run's output file, launched once that run has ended: name -> (that run,
# the flags)
RUN_PY_AFTER = {
    "trace_replay": ("dump_routing", ("--routing", "trace", "--routing-trace", "{tmp}/d.npz",
                                      "--skip-e2e", "--reps", "1", "--json", "-")),
}


@pytest.fixture(scope="module")
def run_py_runs(tmp_path_factory, tiny_ckpt):
    """RUN_PY_RUNS and RUN_PY_AFTER launched (two at a time, each of RUN_PY_AFTER queued once the
    run it reads has ended): name -> (CompletedProcess, the module's folder). Minutes on 2 CPU
    cores: every test that takes it is marked slow."""
    tmp, (ckpt, _) = tmp_path_factory.mktemp("run_py_runs"), tiny_ckpt
    (tmp / "p.jsonl").write_text("[10, 20, 30, 40, 50]\n[7, 8, 9]\n")   # dump_routing's prompts
    (tmp / "p3.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS[3]) + "\n")
    (tmp / "outside.jsonl").write_text("[1, 2, 3]\n[1, 2, 999]\n")   # 999: past the 256 ids
    target = load_target(ckpt, max_batch_size=3, max_seq_len=32, dtype=torch.float32)
    save_draft(init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 2), tmp / "draft")
    shutil.copytree(ckpt, tmp / "bad")
    (tmp / "bad" / "config.json").write_text('{\n  "hidden_size": 64,\n  "vocab_size": ,\n}')
    routing.save_trace(tmp / "kimi.npz", torch.zeros(2, 5, 8, dtype=torch.long), 384, 8)

    def launch(pool, flags):
        return pool.submit(run_py, *(a.format(tmp=tmp, ckpt=ckpt) for a in flags), env=ONE_THREAD)
    with ThreadPoolExecutor(2) as pool:
        runs = {name: launch(pool, flags) for name, flags in RUN_PY_RUNS.items()}
        for name, (first, flags) in RUN_PY_AFTER.items():
            runs[first].result()
            runs[name] = launch(pool, flags)
        return {name: run.result() for name, run in runs.items()}, tmp


def ran(run_py_runs, name):
    """The CompletedProcess of RUN_PY_RUNS[name] (or RUN_PY_AFTER's), asserted to have exited 0."""
    done = run_py_runs[0][name]
    flags = RUN_PY_RUNS[name] if name in RUN_PY_RUNS else RUN_PY_AFTER[name][1]
    assert done.returncode == 0, f"run.py {' '.join(flags)}: {done.stderr[-2000:]}"
    return done


@pytest.mark.slow
def test_run_py_cli_background_flags_on_cpu(run_py_runs):
    """The flags of the background's own setup, on the tiny model: a simulated rank with modelled
    all-reduces, SIMULATED uniform routing (the default on random weights), phases at two context
    lengths, no end-to-end loops."""
    out, bad = ran(run_py_runs, "background").stdout, run_py_runs[0]["background_refused"]
    r = json.loads(out.strip().splitlines()[-1])
    out = " ".join(out.split())  # the report wraps its long lines
    assert set(r["contexts"]) == {"8", "40"} and r["e2e"] == {}
    for c in r["contexts"].values():  # batch 1, K 4 of 16 experts: one token 4, the 3 verified 12
        assert c["distinct_experts"] == {"decode_step": 4.0, "verify/decode": 12.0}
    # a real rank's collectives a forward: the embedding's all-reduce, 2 a layer, the logits'
    # all-gather (8 layers; the head's 1)
    assert r["allreduce_modelled"] == dict(us_each=35.0, target_forward_ms=(2 * 8 + 2) * 35 / 1e3,
                                           draft_forward_ms=4 * 35 / 1e3)
    assert "collectives MODELLED at 35 us" in out and "routing SIMULATED uniform" in out
    assert "ms plain step, collectives MODELLED)." in out   # the answer's cost sentence
    assert abs(r["cost_model"]["plain_step_ms"] - r["phases_ms"]["decode_step/eager"] - 0.63) < 1e-9
    assert bad.returncode != 0 and "--allreduce-us" in bad.stderr and "SIMULATED" in bad.stderr


@pytest.mark.slow
def test_run_py_cli_tiny(run_py_runs):
    """run.py's CPU defaults end to end (the GPU is hidden, so this is the CPU run on any machine),
    but 2 repetitions a phase (a spread needs no more). It asserts what holds by construction, not
    relations between noisy medians: every phase present and positive, each timing's spread
    ordered around its median, the component table's parts adding up to its summed op time, the
    answer printed."""
    stdout, sim = ran(run_py_runs, "tiny").stdout, ran(run_py_runs, "simulated")
    r = json.loads((run_py_runs[1] / "tiny.json").read_text())
    stdout = " ".join(stdout.split())  # the report wraps its long lines
    assert r["env"]["simulated_acceptance"] is False
    assert all(v is None for v in r["floors"].values())
    assert stdout.count("target: random tiny") == 1 and "the answer:" in stdout and \
        "accepted almost nothing" in stdout
    for name, ms in r["phases_ms"].items():
        lo, q1, med, q3, hi = r["spread_ms"]["phases_ms"][name]
        assert 0 < lo <= q1 <= med <= q3 <= hi and med == ms, (name,
                                                               r["spread_ms"]["phases_ms"][name])
    for mode in ("prefill", "decode"):
        assert f"verify/{mode}/eager" in r["phases_ms"]
        v = r["e2e"][f"eagle3/{mode}/eager"]
        assert set(v["phases_ms"]) == {"verify", "accept", "draft_extend", "draft", "commit",
                                       "host", "cycle"}
        assert all(t > 0 for t in v["phases_ms"].values()), v["phases_ms"]
        assert 1 <= v["accept_len_mean"] <= 3 and sum(v["accept_len_hist"]) > 0
    assert r["greedy_agreement_with_plain"] == {"eagle3/prefill/eager": 1.0,
                                                "eagle3/decode/eager": 1.0}
    assert set(r["cost_model"]["steps"]) == {"1", "2", "3", "4",
                                             "5"} and isinstance(r["warnings"], list)
    # the cost model and the sweep price the attention mode whose verify of 3 timed faster
    verify = {m: r["phases_ms"][f"verify/{m}/eager"] for m in ("prefill", "decode")}
    faster = min(verify, key=verify.get)
    assert r["cost_model"]["verify"] == f"verify/{faster}" and r["cost_model"]["variant"] == "eager"
    assert f"(verify/{faster}, eager;" in stdout and \
        f"cost model (eager, {faster} attention whose verify of 3 timed faster)" in stdout
    table = r["contexts"]["16"]
    assert r["env"]["routing"] == "model" and all(1 <= n <= 16
                                                  for n in table["distinct_experts"].values())
    for phase in ("decode_step", "verify/prefill", "verify/decode"):
        c = table["components"][phase]
        assert abs(sum(c["parts_ms"].values()) - c["kernel_ms"]) <= 0.05 * c["kernel_ms"], \
            (phase, c)
        assert set(c["parts_ms"]) == set(report.COMPONENTS) and \
            sum(table["bytes"][phase].values()) > 0
    assert "decode steps" in r["answer"][0] and "EAGLE-3 with num_steps 2" in " ".join(r["answer"])
    assert "2 tokens per cycle" in " ".join(r["answer"]) and \
        "SIMULATED" not in " ".join(r["answer"])
    sim = sim.stdout
    r = json.loads(sim.strip().splitlines()[-1])
    sim = " ".join(sim.split())
    assert "SIMULATED acceptance: each row's accepted length" in sim and \
        r["env"]["simulated_acceptance"] is True
    assert "Acceptance was SIMULATED: asked 2.5, drawn" in sim
    assert 1.8 <= r["e2e"]["eagle3/decode/eager"]["accept_len_mean"] <= 3.2


@pytest.mark.slow
def test_run_py_cli_trained_pair(run_py_runs):
    """run.py's CPU default is the trained tiny pair: the header says so, the draft accepts (real
    acceptance, not SIMULATED), and speculative output equals plain greedy."""
    stdout = ran(run_py_runs, "trained_pair").stdout
    r = json.loads((run_py_runs[1] / "pair.json").read_text())
    assert "target: the trained tiny pair" in stdout and "trained tiny pair" in r["env"]["target"]
    assert r["env"]["routing"] == "model" and r["env"]["simulated_acceptance"] is False
    for mode in ("prefill", "decode"):
        v = r["e2e"][f"eagle3/{mode}/eager"]
        assert 1.8 <= v["accept_len_mean"] <= 4 and sum(v["accept_len_hist"]) > 0, v
        # the histogram counts the tokens kept: all but the first of each row's, which the prefill
        # makes
        assert sum(n * c for n, c in enumerate(v["accept_len_hist"], 1)) == v["tokens"] - 2, v
    assert r["greedy_agreement_with_plain"] == {"eagle3/prefill/eager": 1.0,
                                                "eagle3/decode/eager": 1.0}
    assert "accepted almost nothing" not in stdout


def test_phase_timer_accounts_for_every_cycle():
    """In every cycle the phases that generate marks, and the host gap, add up to the cycle (start
    to start), each positive: what run.py's end-to-end table rests on. The last cycle has no next
    start, so no host gap nor total."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=torch.float32),
                         4)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 5)
    for draft, names in ((head, {"verify", "accept", "draft_extend", "draft", "commit"}),
                         (None, {"decode_step", "commit"})):
        timer = timing.PhaseTimer(timing.Clock(torch.device("cpu")))
        res = generate(target, draft, PROMPTS[3], max_new_tokens=10, num_steps=2,
                       probe=Probe(timer.mark))
        cycles = timer.per_cycle()
        assert len(cycles) == res.cycles and set(cycles[-1]) == names
        for c in cycles[:-1]:
            assert set(c) == names | {"host", "cycle"} and all(t > 0 for t in c.values()), c
            assert sum(t for n, t in c.items() if n != "cycle") == pytest.approx(c["cycle"],
                                                                                 rel=1e-9, abs=1e-9)
        whole = sorted(c["cycle"] for c in cycles[:-1])
        assert timer.phases()["cycle"].spread() == [whole[0],
                                                    *timer.phases()["cycle"].spread()[1:4],
                                                    whole[-1]]


def test_the_answer_says_where_collectives_are_modelled():
    """The answer's cost and tree sentences say collectives MODELLED where modelled ones add time
    (as the verify sentence does); at --allreduce-us 0 the note says MODELLED at 0 us, as the
    header does, not "not counted"."""
    NS = types.SimpleNamespace
    cm = components.CostModel(4.0, {2: components.CycleCost(9.0, 2.25, {})},
                              components.TreeCost(4, 2, 8, 10.0, 2.5))
    b = NS(k=2, gpu=True, cfg=NS(allreduce_us=35.0, simulate_accept_len=None),
           target=NS(routing="model", tp=tp.TP.simulate(8)))
    for us in (35.0, 0.0):
        b.cfg.allreduce_us = us
        r = NS(cost_model=cm, e2e={}, allreduce_modelled=components.ModelledAllreduce(
            us, 18 * us / 1e3, 4 * us / 1e3))
        said = report.cost_answer(r, b) + report.tree_answer(r)
        marked = [line for line in said if "collectives MODELLED" in line]
        assert len(marked) == (3 if us else 0), said
        assert f"collectives MODELLED at {us:g} us" in report.simulated_note(r, b)[0]
    assert said[1].endswith("it would give 0.89x (slower than plain decoding).")
    r.allreduce_modelled = None
    assert "collectives not counted" in report.simulated_note(r, b)[0]


def test_the_simulated_verdict_counts_row_cycles_at_batch_above_1():
    """The SIMULATED verdict's draws are the histogram's: a row a cycle, so row-cycles at batch 2
    (as the e2e table says), cycles at batch 1."""
    NS = types.SimpleNamespace
    v = NS(accept_len_hist=[1, 2, 3], accept_len_mean=2.33, speedup_measured=1.2)
    for batch, said in ((1, "over 6 cycles"), (2, "over 6 row-cycles")):
        r = NS(env=NS(config=dict(simulate_accept_len=2.5, batch_size=batch)))
        assert said in report.simulated_verdict(r, v, "eagle3/decode/eager")


def test_the_measured_all_reduce_says_how_many_rows_it_reduces(capsys):
    """Real TP's all-reduce of T tokens a row reduces B x T hidden rows at batch B: the lines say
    so (batch 1: one token's hidden row)."""
    NS = types.SimpleNamespace
    us = {"interleaved/1": 14.0, "interleaved/2": 15.0, "back_to_back/1": 18.0, "eager/1": 30.0,
          "interleaved_short_gemv/1": 12.0}
    comm = timing.MeasuredAllreduce(us, 1.5, 18, "nccl")
    for batch, rows in ((1, "one token's hidden row"),
                        (4, "4 hidden rows (one token a row, batch 4)")):
        report.print_allreduce(comm, NS(k=2, cfg=NS(batch_size=batch)))
        out = " ".join(capsys.readouterr().out.split())
        assert f"14.0 us per all-reduce of {rows}:" in out and "12.0 (T = 1)" in out, out
        assert ("by tokens a row T (4 x T hidden rows each; nccl)" if batch > 1 else
                "by tokens a row T (T hidden rows each; nccl)") in out, out


def test_report_warns_about_noise_and_figures_that_cannot_be():
    """timing_warnings and the verdict on made-up results: a spread past NOISY_IQR is flagged, a
    break-even outside [1, num_steps + 1], an isolated step far from the same step in the loop,
    and verify cheaper with more tokens are named (a noisy long phase by the machine's load, ranks'
    waits only with ranks); the verdict says what random weights measure."""
    T = report.Timing
    steady, noisy = T([10.0, 10.1, 10.2, 10.3]), T([5.0, 10.0, 20.0, 40.0])
    assert steady.spread() == pytest.approx([10.0, 10.075, 10.15, 10.225,
                                             10.3]) and not steady.noisy and noisy.noisy
    assert json.loads(json.dumps({"t": noisy})) == {"t": 15.0}  # serialized as the median
    env = {f.name: None for f in dataclasses.fields(timing.Env)}
    env = timing.Env(**dict(env, simulated_acceptance=False, device="cpu", world_size=1,
                            weights="random"))
    spec = timing.E2ERun(50.0, 1.0, 0, 0, dict(verify=T([12.0]), cycle=T([14.0])),
                         accept_len_mean=1.02,
                         speedup_measured=0.7, speedup_predicted=0.72)
    plain = timing.E2ERun(0.0, 1.0, 0, 0, dict(decode_step=T([3.0]), cycle=T([3.1])))
    r = timing.Result(env, None, {}, phases_ms={"decode_step/eager": noisy},
                      e2e={"baseline/eager": plain, "eagle3/decode/eager": spec},
                      cost_model=components.CostModel(3.1, {1: components.CycleCost(2.0, 0.6, {}),
                                                            3: components.CycleCost(14.0, 4.5,
                                                            {})}),
                      verify_sweep_ms={1: timing.SweepPoint(T([9.0]), None),
                                       2: timing.SweepPoint(T([4.0]), None)})
    w = "\n".join(report.timing_warnings(r))
    for words in ["1 timing(s) vary by more than 25%", "decode_step/eager",
                  "num_steps 1: break-even 0.60",
                  "cheaper than the plain step", "num_steps 3: break-even 4.50", "cannot pay here",
                  "takes 15.000 ms alone and 3.000 ms inside the loop",
                  "1 tokens 9.000 ms > 1.5 x 2 tokens 4.000 ms"]:
        assert words in w, (words, w)
    r.warnings = []
    v = " ".join(report.verdict(r))
    assert "accepted almost nothing (1.02 tokens per cycle" in v and "--simulate-accept-len" in v
    r.env.simulated_acceptance = True
    r.env.config = dict(simulate_accept_len=2.5, batch_size=1)
    spec.accept_len_mean, spec.accept_len_hist = 2.25, [1, 2, 1, 0]
    assert "Acceptance was SIMULATED: asked 2.5, drawn 2.25 tokens per cycle over 4 cycles " \
           "(a mean of 4 draws spreads by about 0.41" in " ".join(report.verdict(r))
    r.env.simulated_acceptance, r.env.weights = False, "checkpoints"
    spec.accept_len_mean = 1.02
    assert "with checkpoints loaded, on the timing run's prompts of random ids" in \
        " ".join(report.verdict(r))
    assert report.spreads(r)["phases_ms"]["decode_step/eager"] == noisy.spread()
    # a long noisy phase on a machine no busier than its cores: ranks' waits named only with ranks
    long_noisy = [("verify/eager", noisy)]
    assert "waits between ranks" not in report.noise_warning(long_noisy, 1.0, 2)
    assert "waits between ranks" in report.noise_warning(long_noisy, 2.0, 2, ranks=2)
    assert "the machine was busy (load average 3.0 on 2 cores)" in \
        report.noise_warning(long_noisy, 3.0, 2)


# run.py's nonsense flags, each with the message (a regular expression) that refuses it
AT_LEAST_1 = ["--max-new-tokens 0", "--max-new-tokens -5", "--prompt-len 0", "--reps 0",
              "--batch-size 0", "--speculative-num-steps -1", "--simulate-tp 0",
              "--topk 0 --dump x.npz"]
BAD_FLAGS = [(flags, f"{flags.split(' --dump')[0]}: must be at least 1")
             for flags in AT_LEAST_1] + [
    ("--max-new-tokens 1", r"--max-new-tokens 1: the timing run needs at least 2 \(the "
     "prefill makes the first token; a speculative cycle and a plain step need one more\\)"),
    ("--temperature -1", "--temperature -1.0: must be at least 0"),
    ("--temperature nan", "--temperature nan: must be at least 0"),
    ("--temperature inf", r"^--temperature inf: must be finite \(0: greedy\)$"),
    ("--speculative-num-steps 100",
     r"--speculative-num-steps 100: .* must be below --prompt-len \(16\)"),
    ("--simulate-accept-len 10", r"--simulate-accept-len 10.0: must lie in \[1, 4\]"),
    ("--simulate-accept-len 0", r"--simulate-accept-len 0.0: must lie in \[1"),
    ("--simulate-accept-len -1 --speculative-num-steps 2",
     r"--simulate-accept-len -1.0: must lie in \[1, 3\]"),
    ("--speculative-eagle-topk 0", "--speculative-eagle-topk 0: must be at least 1"),
    ("--speculative-eagle-topk 2",
     r"a tree needs --speculative-num-draft-tokens N, .* \(2 to 11 here\)"),
    ("--speculative-eagle-topk 2 --speculative-num-draft-tokens 12",
     r"--speculative-num-draft-tokens 12: a tree of topk 2 and 3 steps "
     r"holds 2 to .* = 11 tokens"),
    ("--speculative-eagle-topk 4 --speculative-num-draft-tokens 3 --simulate-accept-len 3.5",
     r"--simulate-accept-len 3.5: must lie in \[1, 3\]"),
    ("--prompt-ids p.jsonl", "--prompt-ids is for --dump"),
    ("--preset kimi-k2", "--preset kimi-k2: a random Kimi-K2 needs a GPU"),
    ("--cuda-graph on", "--cuda-graph on: CUDA graphs need a CUDA GPU"),
    ("--routed-experts 3", "--routed-experts 3: tiny needs between 4 .* and 16"),
    ("--moe-adaptive 0", "--moe-adaptive 0: a token count of 1 or more$"),
    ("--model-path ckpt --quant int4",
     "--quant, --routed-experts and --preset shape random weights"),
    ("--batch-size x", "argument --batch-size: invalid int value: 'x'"),
    ("--min-top1-agreement 2", r"--min-top1-agreement 2.0: must lie in \[0, 1\]"),
    ("--dump x.npz", "--dump needs --prompt-ids FILE"),
    ("--dump x.npz --prompt-ids p --temperature 0.5", "drop --temperature"),
    ("--dump x.npz --prompt-ids p --batch-size 2", "drop --batch-size"),
    ("--dump x.npz --prompt-ids nothere.jsonl", "^--prompt-ids nothere.jsonl: no such file$"),
    ("--random-weights --model-path ckpt", "--random-weights replaces the trained tiny pair"),
    ("--draft-path ckpt", "--draft-path needs --model-path: a head is trained for one target"),
    ("--json /nonexistent/r.json",
     r"--json /nonexistent/r.json: cannot write there \(no folder /nonexistent\)"),
    ("--json .", r"--json .: cannot write there \(is a folder\)"),
    ("--dump p.jsonl --prompt-ids ./p.jsonl",
     r"^--dump p.jsonl: is the --prompt-ids file the run reads; write it elsewhere$"),
    (f"--routing trace --routing-trace {HERE}/README.md --json {HERE}/README.md",
     "^--json .*/README.md: is the --routing-trace file the run reads; write it elsewhere$"),
    ("--dump /nonexistent/x.npz --prompt-ids p",
     "--dump /nonexistent/x.npz: cannot write there"),
    ("--dump x.npz --prompt-ids p --skip-e2e", "--dump times nothing"),
    ("--context-len 2", r"--context-len 2: the isolated verify re-reads 4 cached tokens"),
    ("--sweep-tokens 0", "argument --sweep-tokens: '0': comma-separated token counts of 1"),
    ("--sweep-tokens 2,x", "argument --sweep-tokens: '2,x': comma-separated token counts"),
    ("--batch-size 4 --sweep-tokens 8,100",
     "--sweep-tokens 100, --batch-size 4: 4 x 100 tokens a forward; .* at most 256 tokens"),
    ("--batch-size 300", "^--batch-size 300: 300 x 1 tokens a forward; .* at most 256"),
    ("--sweep-tokens 4,20,100 --skip-e2e", r"^--sweep-tokens 20,100: a verify of T tokens "
     r"re-reads the last T of the first context's 16 cached tokens \(--context-len, default "
     r"--prompt-len\); use at most 16$"),
    ("--sweep-tokens 4,20 --context-len 8 40",
     "^--sweep-tokens 20: .* first context's 8 cached tokens"),
    ("--dump x.npz --prompt-ids p --sweep-tokens 4", "--dump times nothing"),
    # flags the run does not read: given, not defaulted
    ("--dump x.npz --prompt-ids p --json r.json", "^--json shapes the timing run; --dump "),
    ("--dump x.npz --prompt-ids p --reps 5", "^--reps shapes the timing run; --dump times"),
    ("--dump x.npz --prompt-ids p --max-logprob-diff 3",
     "^--max-logprob-diff is a threshold of --compare; --dump writes a file to compare$"),
    ("--compare a.npz b.npz --json r.json",
     "^--compare reads two dump files and builds no model: drop --json$"),
    ("--compare a.npz b.npz --cuda-graph on --preset kimi-k2 --batch-size 2",
     "builds no model: drop --preset, --cuda-graph, --batch-size$"),
    ("--compare a.npz b.npz --topk 3", "builds no model: drop --topk$"),
    ("--topk 3", "^--topk is for --dump: the log-probabilities it keeps per position$"),
    ("--max-accept-diff 1", "^--max-accept-diff is a threshold of --compare A B"),
]


def test_run_py_refuses_bad_flags_before_building_anything(monkeypatch):
    """Each nonsense value is BadInput naming the flag, the value and what is allowed, raised by
    parse_args or settle (device-dependent ones are asked as on a CPU); none builds a model."""
    monkeypatch.setattr(timing, "build", lambda *a: pytest.fail("a model was built"))
    for flags, message in BAD_FLAGS:
        with pytest.raises(run.BadInput, match=message):
            run.settle(run.parse_args(flags.split()), torch.device("cpu"), 1)
    with monkeypatch.context() as m, pytest.raises(
            run.BadInput, match=r"^--moe-impl fused: the Triton kernel needs a CUDA GPU \(this "
                                r"run is on the CPU\)(, Triton \(not installed\))?; use "):
        m.setenv("TRITON_INTERPRET", "0")   # a CPU as a user's: no Triton interpreter
        _settled("--moe-impl fused")
    assert all(action.help for action in run.make_parser()._actions), "a flag without help text"
    seed = next(a.help for a in run.make_parser()._actions if a.dest == "seed")
    assert "the random prompt ids (the trained pair reads fixed held-out text)" in seed, seed
    cli = run_py("--max-new-tokens", "0")
    assert (cli.returncode, cli.stdout,
            cli.stderr) == (2, "", "run.py: error: --max-new-tokens 0: must be at least 1\n")


def test_run_py_header_names_the_temperature_where_it_samples():
    """The header's first line says the sampling temperature where --temperature is above 0, and
    nothing of it for greedy decoding."""
    cpu = torch.device("cpu")
    b = timing.prepare(_settled("--random-weights --temperature 0.7 --reps 1"), cpu)
    flat = " ".join(report.header(b).split())
    assert "num_steps 3, sampling at temperature 0.7 | CPU" in flat, flat
    b.cfg.temperature = 0.0
    assert "temperature" not in report.header(b)


@pytest.mark.slow
def test_run_py_names_a_broken_checkpoint_in_one_line(tiny_ckpt, tmp_path, run_py_runs,
                                                       monkeypatch):
    """run.py --model-path / --draft-path with a problem: the loader's CheckpointError, and from
    the command line (a copy of the checkpoint whose config.json is not JSON) one line on stderr,
    no traceback, exit status 2."""
    ckpt, _ = tiny_ckpt
    with pytest.raises(CheckpointError, match="no such file or folder"):
        run.main(["--model-path", str(tmp_path / "nothere"), "--max-new-tokens", "2"])
    with pytest.raises(CheckpointError, match="no such file or folder"):
        run.main(["--model-path", ckpt, "--draft-path", str(tmp_path / "nothere"),
                  "--max-new-tokens", "2"])
    # a --draft-path that is no EAGLE-3 head (the target's folder, a text file): named in settle,
    # before the target is built
    monkeypatch.setattr(timing, "build", lambda *a: pytest.fail("a model was built"))
    with pytest.raises(CheckpointError, match=r"config.json: architectures \['DeepseekV3"):
        _settled(f"--model-path {ckpt} --draft-path {ckpt}")
    with pytest.raises(CheckpointError, match="README.md line 1 column 1: not JSON"):
        _settled(f"--model-path {ckpt} --draft-path {HERE}/README.md")
    cli = run_py_runs[0]["broken_checkpoint"]
    want = (f"run.py: error: {run_py_runs[1] / 'bad' / 'config.json'} line 3 column 17: not JSON "
            "(Expecting value)\n")
    assert (cli.returncode, cli.stderr) == (2, want), (cli.returncode, cli.stderr)


@pytest.mark.slow
def test_run_py_cli_tree(run_py_runs):
    """run.py with SGLang's tree flags: the end-to-end rows draft the tree (said in a note), are
    lossless against plain greedy and accept; the isolated phases add the tree's verify (its
    distinct experts and components) and expansion."""
    stdout = ran(run_py_runs, "tree").stdout
    r = json.loads((run_py_runs[1] / "tree.json").read_text())
    assert "the end-to-end rows draft a tree (topk 4, num_steps 3, 8 draft tokens)" in stdout
    assert (r["env"]["config"]["speculative_eagle_topk"],
            r["env"]["config"]["speculative_num_draft_tokens"]) == (4, 8)
    v = r["e2e"]["eagle3/decode/eager"]
    assert 1.5 <= v["accept_len_mean"] <= 4 and \
        r["greedy_agreement_with_plain"] == {"eagle3/decode/eager": 1.0}
    assert {"verify/decode tree/eager", "draft_tree/eager"} <= set(r["phases_ms"])
    # a tree of 8 tokens reaches more than a chain's 4
    experts = r["contexts"]["16"]["distinct_experts"]
    assert experts["verify/decode tree"] >= experts["verify/decode"] >= experts["decode_step"]
    assert "verify tree" in stdout and \
        "A tree of topk 4, 3 steps, 8 draft tokens" in " ".join(r["answer"])
    tree = r["cost_model"]["tree"]
    assert tree["cycle_ms"] > 0 and tree["break_even_accept_len"] > 0 and \
        tree["accept_ratio_to_beat_chain"] > 0


@pytest.mark.slow
def test_run_py_cli_verify_sweep_and_tables(run_py_runs):
    """Trees of 8 on the CPU at batch 2 (fp32) and batch 4 (INT4 experts, bf16): each verify sweep
    point carries its distinct experts (SIMULATED uniform: K 4 of 16 experts a token, so
    min(16, 4 B T) for T tokens a row) and its floor (none without a GPU, and so no cliff check,
    said); the tree's acceptance is timed (tree_accept) and in its cycle; `python report.py tables`
    prints a row per JSON with the chain's and the tree's verify, cycle and break-even."""
    runs = {run_py_runs[1] / f"{name}.json": name for name in ("sweep_b2", "sweep_b4_int4")}
    for path, name in runs.items():
        stdout = ran(run_py_runs, name).stdout
        r = json.loads(path.read_text())
        B = r["env"]["config"]["batch_size"]
        assert r["env"]["config"]["verify_sweep_tokens"] == list(timing.SWEEP_TOKENS_CPU)
        sweep = r["verify_sweep_ms"]
        assert [int(T) for T in sweep] == list(timing.SWEEP_TOKENS_CPU)
        for T, point in sweep.items():
            assert point["verify"] > 0 and point["draft_extend"] > 0 and point["floor_ms"] is None
            assert "components" not in point, point   # profiled where floors exist (a GPU)
            assert point["distinct_experts"] == min(16, 4 * B * int(T)), (T, point)
        assert r["sweep_cliffs"] is None and "no cliff check" in " ".join(stdout.split())
        tree, ph = r["cost_model"]["tree"], r["phases_ms"]   # the tree's own acceptance timed
        assert ph["tree_accept"] > 0 and \
            tree["cycle_ms"] > ph["tree_accept"] + ph["draft_tree/eager"], (tree, ph)
    out = subprocess.run([sys.executable, "report.py", "tables", *map(str, runs)], cwd=HERE,
                         env=ONE_THREAD, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| batch | format | decode step") and \
        lines[1].startswith("|---|"), out
    for line, path, first in zip(lines[2:], runs, (["2", "fp32"], ["4", "INT4"])):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == first and cells[-1] == f"`{path}`", line
        assert cells[3].endswith(", 4 tokens") and cells[5].endswith(", 8 nodes, topk 4"), line
        assert all(float(x) > 0 for cell in (cells[4], cells[6]) for x in cell.split(", ")), line


# ---------------------------------------------------------------------------------------------
# The cost model, report.py's tables and figure, kernels.bench's refusal, the verify
# sweep's cliff check

def test_cost_model_cycles_add_the_loops_commit_and_host_and_follow_the_sweep():
    """components.cost_model by hand: cycle(s) = draft extend(s+1) + (s-1) draft steps +
    verify(s+1) + accept + the eagle3 loops' commit and host (medians over this graph setting's
    runs only); the plain step is the plain loop's cycle when the loop ran at the phases' context,
    else the isolated decode step plus that loop's commit and host; num_steps as far as the sweep
    times verify and draft extend."""
    from types import SimpleNamespace as NS
    sweep = {T: timing.SweepPoint(verify=1.0 + T, draft_extend=0.1 * T if T <= 8 else None)
             for T in (*range(1, 9), 10, 12)}

    def loop(cycle, commit, host):
        return NS(phases_ms=dict(cycle=cycle, commit=commit, host=host), tok_per_s=1.0,
                  accept_len_mean=1.0)
    e2e = {"baseline/graph": loop(4.0, 0.2, 0.3), "baseline/eager": loop(9.0, 0.5, 0.5),
           "eagle3/decode/graph": loop(5.0, 0.2, 0.3), "eagle3/prefill/graph": loop(5.0, 0.4, 0.5),
           "eagle3/decode/eager": loop(9.0, 5.0, 5.0)}
    r = NS(phases_ms={"decode_step/graph": 3.0, "draft_step/graph": 0.05, "accept": 0.1},
           allreduce_modelled=None, e2e=e2e, verify_sweep_ms=sweep)
    for context, base in ((256, 4.0), (4096, 3.0 + 0.2 + 0.3)):
        cfg = NS(context_len=[context], prompt_len=256, speculative_eagle_topk=1)
        b = NS(best=("graph", "decode"), cfg=cfg, verify_name=lambda mode: f"verify/{mode}")
        cm = components.cost_model(r, b)
        assert cm.plain_step_ms == base and sorted(cm.steps) == list(range(1, 8)), cm
        for s, c in cm.steps.items():   # commit 0.3 and host 0.4: the graph runs' medians
            want = 0.1 * (s + 1) + (s - 1) * 0.05 + 2.0 + s + 0.1 + 0.3 + 0.4
            assert abs(c.cycle_ms - want) < 1e-9 and abs(c.break_even_accept_len
                                                         - want / base) < 1e-9, (s, c)


def test_draft_bytes_read_embedding_rows_not_the_table():
    """components.draft_bytes: a head pass reads its weights (fc only in the extend; not d2t, of
    which it gathers an entry a row), the rows its tokens look up and its key-value cache; a head
    with its own embedding (a checkpoint's) reads no more than one that shares the target's."""
    import checkpoint
    import draft
    target = checkpoint.init_random(model.Transformer(checkpoint.preset("tiny"), 1, 16,
                                                      dtype=torch.float32), 0)
    shared, own = (draft.Eagle3Draft(draft.draft_preset("tiny"), target, own_embedding=o)
                   for o in (False, True))
    D, attn = shared.args.hidden_size, shared.midlayer.self_attn
    weights = sum(p.numel() * p.element_size() for n, p in shared.named_parameters()
                  if not n.startswith("fc.") and n != "d2t")
    for head in (shared, own):
        assert components.draft_bytes(head, 10, 2, with_fc=False, tokens=3) == \
            weights + 4 * (2 * 2 * 10 * attn.n_local_kv_heads * attn.head_dim + 2 * 3 * D)


def test_report_table_rows_take_floors_from_the_first_context():
    """`report.py tables` reads a run's floors from its first context's floors_ms, which every
    run.py --json file has; in files of an older layout `floors` held bytes and bandwidth, so a
    row read from `floors` would lose its x floor."""
    floors_ms = {"decode_step": 2.0, "verify/decode": 4.0}
    cost = dict(steps={"3": dict(cycle_ms=9.0, break_even_accept_len=2.5)})
    env = dict(dtype="bfloat16", config=dict(batch_size=1, context_len=[256],
                                             attention_modes=["decode"], speculative_num_steps=3))
    phases = {"decode_step/graph": 3.0, "verify/decode/graph": 8.0}
    for floors in (floors_ms, dict(bandwidth_GBps=4200.0, decode_step_ms=2.0, verify_ms=4.0)):
        r = dict(env=env, phases_ms=phases, floors=floors, cost_model=cost,
                 contexts={"256": dict(floors_ms=floors_ms)})
        cells = report.table_row(r, "run.json")
        assert cells[2:5] == ["3.000 (1.50x)", "8.000 (2.00x), 4 tokens", "9.00, 2.50"], cells


def test_report_sweep_plot_draws_gpu_sweeps_and_refuses_the_rest(tmp_path, capsys):
    """`report.py sweep-plot`: a sweep with floors (a GPU's, written here by hand, one cliff) is
    drawn where matplotlib is installed, and where it is not the refusal says so (it is not a
    requirement); a file that is no run.py --json and a CPU run's sweep (no floors) are refused by
    name, with exit status 2, in both cases."""
    def run_json(path, floors):
        sweep = {str(T): dict(verify=1.0 + 0.5 * T + (T > 2), distinct_experts=8 * T,
                              floor_ms=0.4 * T if floors else None) for T in (1, 2, 3, 4)}
        cliffs = dict(cliffs=[dict(tokens=[2, 3], added_ms=1.5, allowed_ms=0.57)])
        path.write_text(json.dumps(dict(env=dict(dtype="bfloat16", int4_group_size=32,
                                                 config=dict(batch_size=1)),
                                        verify_sweep_ms=sweep, sweep_cliffs=cliffs)) + "\n")
        return str(path)
    gpu, cpu = run_json(tmp_path / "gpu.json", True), run_json(tmp_path / "cpu.json", False)
    (tmp_path / "notes.txt").write_text("not json\n")
    out = tmp_path / "sweep.png"
    try:
        import matplotlib  # noqa: F401
        drawn = True
    except ImportError:
        drawn = False
    assert report.sweep_plot([gpu], str(out)) == (0 if drawn else 2)
    err = capsys.readouterr().err
    if drawn:
        assert out.stat().st_size > 1000, "the figure"
        nowhere = tmp_path / "none" / "sweep.png"
        for out, said in ((nowhere, f"cannot write there (no folder {tmp_path}/none)"),
                          (tmp_path, "cannot write there (is a folder)"),
                          (tmp_path / "sweep.txt", "its suffix names no format matplotlib "
                                                   "writes; end it in .png, .pdf or .svg (or ")):
            assert report.sweep_plot([gpu], str(out)) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"report.py sweep-plot: --out {out}: "
                                                       f"{said}"), err
        assert not (tmp_path / "sweep.txt").exists() and not (tmp_path / "none").exists()
    else:
        assert "needs matplotlib" in err and not out.exists(), err
    for path, why in ((cpu, "its sweep has no floors"),
                      (str(tmp_path / "notes.txt"), "not a run.py --json file")):
        assert report.sweep_plot([gpu, path], str(tmp_path / "no.png")) == 2
        err = capsys.readouterr().err
        assert f"{path}: {why}" in err, err
        assert not (tmp_path / "no.png").exists()


HEADLINE_JSON = ("bf16_128experts", "int4_kimi-k2.5", "fp8_384experts", "bf16_ctx32768")


@pytest.mark.slow
def test_report_phases_and_sweep_make_the_benchmarks_tables(tmp_path):
    """`report.py phases` and `report.py sweep` on the headline runs' JSON under benchmarks/, and
    `report.py tables` on the batch-and-tree runs', make BENCHMARKS.md's tables line for line
    (each table a block of the file as it stands: the tables and their JSON cannot drift apart);
    the sweep's cliff list counts what each file's sweep_cliffs holds. A CPU run's file (no
    floors, no component table) and a file that is no run.py --json are refused by name, exit
    status 2; `report.py tables` refuses a missing file and another JSON in one line."""
    bench = open(os.path.join(HERE, "BENCHMARKS.md")).read()
    paths = [os.path.join(HERE, "benchmarks", f"{name}.json") for name in HEADLINE_JSON]
    for path in paths:
        text = "\n".join(report.phases(path))
        phase_table, component_table, last = text.split("\n\n")
        for table in (phase_table, component_table):
            assert table in bench, f"{path}: its table is not in BENCHMARKS.md:\n{table}"
        assert last.startswith("cycle ") and "num_steps" in last
    lines = report.sweep(paths[:3])
    table = "\n".join(lines[:lines.index("")])
    assert table.count("\n") == 1 + 15 and table in bench, table
    for line, path in zip(lines[lines.index("") + 1:], paths):
        cliffs = report.read_run(path)["sweep_cliffs"]
        counted = f"{len(cliffs['cliffs'])} of {len(cliffs['checked'])} steps"
        assert line.split(": ")[1].startswith(counted), line
    batch = [os.path.join(HERE, "benchmarks", "shapes", f"batch{b}_{f}.json")
             for b in (1, 2, 4) for f in ("bf16", "fp8", "int4")]
    table = "\n".join(report.tables(batch)).replace(os.path.join(HERE, ""), "")
    assert table in bench, table
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(dict(env=dict(dtype="bfloat16", config=dict(
        batch_size=1, context_len=[64], speculative_num_steps=3)), phases_ms={},
        contexts={"64": dict(floors_ms={})}, bandwidth_GBps=None,
        verify_sweep_ms={"1": dict(verify=1.0, floor_ms=None)})) + "\n")
    (tmp_path / "notes.txt").write_text("not json\n")
    for command, why in (("phases", "not a GPU run's --json"),
                         ("sweep", "its sweep has no floors")):
        for path, reason in ((str(cpu), why), (str(tmp_path / "notes.txt"), "not a run.py")):
            out = subprocess.run([sys.executable, "report.py", command, path], cwd=HERE,
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 2 and f"report.py {command}: {path}: {reason}" in out.stderr, \
                (command, out.stderr)
    (tmp_path / "other.json").write_text("{}\n")
    for name, reason in (("none.json", "No such file"), ("other.json", "not a run.py --json file")):
        out = subprocess.run([sys.executable, "report.py", "tables", str(tmp_path / name)],
                             cwd=HERE, capture_output=True, text=True, timeout=120)
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(err) == 1 and reason in err[0], (name, out.stderr)


def cited_files(text):
    """The file names a markdown text quotes in backticks (`name.json`, `.npz`, `.png`, ...), each
    `{a,b}` expanded: what BENCHMARKS.md points a reader to."""
    names = []
    for quoted in re.findall(r"`([^`\s]+\.(?:json|npz|png|txt|md))`", text):
        parts = [p[1:-1].split(",") if p.startswith("{") else [p]
                 for p in re.split(r"(\{[^}]*\})", quoted)]
        names += ["".join(c) for c in itertools.product(*parts)]
    return names


def closed_pipe_stdout(monkeypatch):
    """sys.stdout a pipe whose reader has gone (`| head -1` after its line), line-buffered: the
    first line written meets BrokenPipeError, as a command's print does."""
    read, write = os.pipe()
    os.close(read)
    stdout = open(write, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", stdout)
    return stdout


def test_report_py_ends_quietly_when_its_reader_closes_the_pipe(monkeypatch, capsys):
    """`report.py tables ... | head -1`: exit status 141 (128 + SIGPIPE, a shell's for `yes |
    head -1`), nothing on stderr, stdout pointed at /dev/null so the flush at exit fails no more;
    each command's --help describes it as the list of commands does."""
    paths = [os.path.join(HERE, "benchmarks", "shapes", f"batch{b}_bf16.json") for b in (1, 2)]
    stdout = closed_pipe_stdout(monkeypatch)
    try:
        assert report.main(["tables", *paths]) == 141 == baseline.CLOSED_PIPE
        assert capsys.readouterr().err == ""
        stdout.write("more\n" * 1000)   # into /dev/null now
        stdout.flush()
    finally:
        stdout.close()
    monkeypatch.undo()
    first = report.tables.__doc__.split("\n\n")[0].split()[:6]
    with pytest.raises(SystemExit) as e:
        report.main(["tables", "--help"])
    assert e.value.code == 0 and " ".join(first) in " ".join(capsys.readouterr().out.split())


def test_every_file_benchmarks_md_names_is_in_the_repository():
    """Each JSON (or figure, trace, text) BENCHMARKS.md and benchmarks/README.md quote exists: a
    path from the root as written, a bare name (a table's rows name files under benchmarks/) once
    somewhere under benchmarks/ (a * in it as a glob). A renamed or dropped file fails here."""
    under = [os.path.relpath(p, HERE)
             for p in glob.glob(os.path.join(HERE, "benchmarks", "**", "*"), recursive=True)]
    missing = []
    for doc in ("BENCHMARKS.md", os.path.join("benchmarks", "README.md")):
        names = cited_files(open(os.path.join(HERE, doc)).read())
        assert len(names) > 10, (doc, names)
        for name in names:
            rooted = name.startswith(("benchmarks/", "docs/"))
            found = (glob.glob(os.path.join(HERE, name)) if rooted else
                     [p for p in under if fnmatch.fnmatch(p, "*/" + name)])
            if not found:
                missing.append(f"{doc}: {name}")
    assert not missing, missing


def test_report_names_a_file_that_is_no_json_text_in_one_short_line(tmp_path):
    """A binary file (a checkpoint's .safetensors, one not UTF-8) or an empty one given as a run.py
    --json file: one short line naming it, not the decoder's message and the bytes it holds."""
    weights = os.path.join(HERE, "checkpoints", "tiny-stdlib", "target", "model.safetensors")
    (tmp_path / "latin1.json").write_bytes(b"caf\xe9\n")
    (tmp_path / "empty.json").write_text("")
    for path, why in ((weights, "not JSON text: binary, not UTF-8"),
                      (str(tmp_path / "latin1.json"), "not JSON text: binary, not UTF-8"),
                      (str(tmp_path / "empty.json"), "empty")):
        with pytest.raises(ValueError) as e:
            report.read_run(path)
        assert str(e.value) == f"{path}: not a run.py --json file ({why})", str(e.value)[:300]


def test_report_routed_sets_routed_experts_against_their_floor_across_routings(tmp_path):
    """`report.py routed`: each point's routed experts component over its routed_floor_ms, or in a
    file without it its distinct experts' bytes
    (one expert in every MoE layer: routed_experts_GB / n_routed_experts over the bandwidth), a
    column group per file and the last file's x floor over the first's; written here by hand: 1 GB
    of 100 experts at 1000 GB/s is 0.01 ms an expert. A file written before n_routed_experts takes
    its preset's count. Two runs alike (format and routing) are told apart by their files. A CPU
    run (no bandwidth or components) and a file that is not JSON are refused by name, with exit
    status 2 on the command line."""
    def run_json(name, routing, points, E=100, preset=None):
        sweep = {str(T): dict(verify=v, distinct_experts=d, floor_ms=1.0,
                              components=dict(routed_experts=ms))
                 for T, (v, ms, d) in points.items()}
        env = dict(dtype="bfloat16", int4_group_size=32, routing=routing, routed_experts_GB=1.0,
                   config=dict(routed_experts=None, preset=preset, model_path=None))
        if E:
            env["n_routed_experts"] = E
        path = tmp_path / name
        path.write_text(json.dumps(dict(env=env, bandwidth_GBps=1000.0,
                                        verify_sweep_ms=sweep)) + "\n")
        return str(path)
    uniform = run_json("u.json", "uniform", {1: (2.0, 0.16, 8), 2: (3.0, 0.32, 16)})
    model = run_json("m.json", "model", {1: (2.1, 0.16, 8), 2: (3.1, 0.30, 10)})
    lines = report.routed([uniform, model])
    assert lines[0].startswith("| tokens | INT4 uniform: verify ms") and len(lines) == 4, lines
    assert lines[3] == "| 2 | 3.000 | 0.320 (2.00x), 16.0 | 3.100 | 0.300 (3.00x), 10.0 | 1.50 |"
    # two runs of one format and routing (a variant against another): labelled by their files
    other = run_json("m2.json", "model", {1: (2.2, 0.15, 8)})
    assert report.routed([model, other])[0].startswith(
        "| tokens | INT4 model (m.json): verify ms"), report.routed([model, other])[0]
    # preset kimi-k2: 384 experts, so 1 GB over them gives 2.604 us an expert
    old = run_json("old.json", "uniform", {1: (2.0, 0.16, 8)}, E=None, preset="kimi-k2")
    assert report.routed([old])[2] == "| 1 | 2.000 | 0.160 (7.68x), 8.0 |"
    # a point that carries its routed floor (the component table's bytes: the shared expert in
    # the launch too) is set against it: 0.16 ms over 0.1
    with_shared = json.loads(open(uniform).read())
    for T, floor in (("1", 0.1), ("2", 0.2)):
        with_shared["verify_sweep_ms"][T]["routed_floor_ms"] = floor
    (tmp_path / "s.json").write_text(json.dumps(with_shared) + "\n")
    assert report.routed([str(tmp_path / "s.json")])[2] == "| 1 | 2.000 | 0.160 (1.60x), 8.0 |"
    # beside a file without it, every file takes the distinct experts' floor (columns alike)
    assert report.routed([str(tmp_path / "s.json"), uniform])[2] == \
        "| 1 | 2.000 | 0.160 (2.00x), 8.0 | 2.000 | 0.160 (2.00x), 8.0 | 1.00 |"
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(dict(env=dict(config={}), verify_sweep_ms={"1": dict(verify=1.0)}))
                   + "\n")
    (tmp_path / "notes.txt").write_text("not json\n")
    for path, why in ((str(cpu), "not a GPU run's --json"),
                      (str(tmp_path / "notes.txt"), "not a run.py --json file")):
        with pytest.raises(ValueError, match=f"{re.escape(path)}: {why}"):
            report.routed([uniform, path])
        out = subprocess.run([sys.executable, "report.py", "routed", uniform, path], cwd=HERE,
                             capture_output=True, text=True)
        assert out.returncode == 2 and f"{path}: {why}" in out.stderr, out.stderr


def test_kernel_bench_refuses_a_machine_without_cuda_and_names_its_json_parts():
    """`python -m kernels.bench` without CUDA (here CUDA hidden, as on a CPU machine): its usage and
    one error line, exit status 2, no traceback; --json PATH gives each part of a run its file,
    with or without .json."""
    out = subprocess.run([sys.executable, "-m", "kernels.bench", "--moe"], cwd=HERE, env=CPU_ENV,
                         capture_output=True, text=True, timeout=120)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert err[-1] == ("python -m kernels.bench: error: times the kernels on a CUDA GPU, and this "
                       "machine has none"), err
    from kernels.bench import _with_part
    assert _with_part("out/k.json", "moe") == "out/k_moe.json"
    assert _with_part("out/k", "attention") == "out/k_attention.json"


def test_kernel_bench_json_holds_its_command(tmp_path, monkeypatch):
    """What `python -m kernels.bench --json PATH` writes holds the command that made it (here
    main parsed, CUDA faked present, the benchmark stubbed)."""
    from kernels import bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bench_align", lambda tokens: {"rows": [list(tokens)]})
    path = tmp_path / "align.json"
    bench.main(["--align", "--tokens", "4,8", "--json", str(path)])
    assert json.loads(path.read_text()) == {
        "rows": [[4, 8]], "command": f"python -m kernels.bench --align --tokens 4,8 --json {path}"}


def test_kernel_bench_refuses_modes_together_and_a_json_it_cannot_write_before_cuda(tmp_path,
                                                                                  capsys):
    """`python -m kernels.bench`'s flags are checked before it asks for CUDA and before any
    timing (so here on the CPU too): two modes at once are named, --json where no file can be
    written, a bad --tp; one error line, exit status 2."""
    from kernels import bench
    for argv, said in (
            (["--moe", "--router"], "--moe and --router: each runs its own benchmark; give one"),
            (["--small", "--draft", "--align"], "--small and --draft and --align: each runs"),
            (["--mla-blocks", "--pdl", "--preset", "kimi-k2.5"], "--pdl and --mla-blocks: each"),
            (["--precision", "--moe"], "--moe and --precision: each runs its own benchmark"),
            (["--router", "--json", str(tmp_path / "none" / "r.json")],
             f"--json {tmp_path}/none/r.json: cannot write there (no folder {tmp_path}/none)"),
            (["--json", str(tmp_path)], f"--json {tmp_path}: cannot write there (is a folder)"),
            (["--moe", "--tp", "3"], "--tp 3: one of 1, 2, 4, 8")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err[-1].startswith(
            f"python -m kernels.bench: error: {said}"), (argv, err)
    assert os.listdir(tmp_path) == []


def test_verify_sweep_points():
    """The sweep's tokens a row: on a GPU 1 to 8, 10, 12, then every 4 to 32 while the batch's
    forward holds 32 tokens, on a CPU 1 to 6, or those of --sweep-tokens with the run's own chains
    (1 to num_steps + 1), and the cache holds them."""
    assert timing.sweep_tokens(True, 1) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 28, 32]
    assert timing.sweep_tokens(True, 2) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16]
    assert timing.sweep_tokens(True, 4) == list(range(1, 9))
    assert timing.sweep_tokens(True, 64) == [1]
    assert timing.sweep_tokens(False, 4) == list(range(1, 7))
    cfg = _settled("--random-weights --context-len 40")
    short = timing.cache_slots(cfg)
    cfg.verify_sweep_tokens = timing.sweep_tokens(True, 1)
    assert timing.cache_slots(cfg) == short + 32 - 6
    asked = _settled("--random-weights --context-len 40 --sweep-tokens 12,5,12 "
                     "--speculative-num-steps 2")
    assert asked.verify_sweep_tokens == [1, 2, 3, 5, 12]
    assert timing.cache_slots(asked) == timing.cache_slots(
        _settled("--random-weights --context-len 40 --speculative-num-steps 2")) + 12 - 6
    # the run's own chain joins the default sweep: the CPU's 1 to 6, a GPU's at batch 16 (1, 2)
    assert _settled("--random-weights --speculative-num-steps 6").verify_sweep_tokens == \
        list(range(1, 8))
    wide = types.SimpleNamespace(sweep_tokens=None, dump=None, batch_size=16,
                                 speculative_num_steps=3, context_len=[256])
    assert timing.verify_sweep_tokens(wide, gpu=True) == [1, 2, 3, 4]
    # the default leaves out what passes the first context (a verify re-reads its last T tokens)
    near = types.SimpleNamespace(sweep_tokens=None, dump=None, batch_size=1,
                                 speculative_num_steps=3, context_len=[6, 256])
    assert timing.verify_sweep_tokens(near, gpu=True) == list(range(1, 7))


def test_the_sweeps_cliff_check():
    """The cliff check passes a curve that adds 1.25x its floor's increment a token, names a
    planted cliff (and a gap of two tokens gets twice the slack, a batch of 2 twice again) within
    100 columns, with the components whose profiled time grew most where the points have
    profiles, and is None without floors."""
    T = report.Timing
    tokens = timing.sweep_tokens(True, 1)

    def sweep(planted=0.0, at=5, floors=True, profiles=False):
        def parts(t):   # the planted time in the router, a little growth everywhere
            return {c: 0.1 * t + (planted if c == "router" and t >= at else 0.0)
                    for c in components.COMPONENTS} if profiles else None
        return {t: timing.SweepPoint(T([3.0 + 0.5 * t + (planted if t >= at else 0.0)]),
                                     floor_ms=2.0 + 0.4 * t if floors else None,
                                     components=parts(t)) for t in tokens}
    linear = components.sweep_cliffs(sweep(), 1)
    assert linear.cliffs == [] and linear.checked == [list(p) for p in zip(tokens, tokens[1:])]
    assert "no cliff from 1 to 32 tokens a row" in report.cliff_line(linear)
    cliff = components.sweep_cliffs(sweep(planted=3.0), 1).cliffs
    assert [c.tokens for c in cliff] == [[4, 5]] and cliff[0].grew is None
    assert cliff[0].added_ms == pytest.approx(3.5) and cliff[0].allowed_ms == pytest.approx(0.57)
    named = components.sweep_cliffs(sweep(planted=3.0, profiles=True), 1)
    assert list(named.cliffs[0].grew) == ["router", "attn_core"]   # then the first of the ties
    assert named.cliffs[0].grew["router"] == pytest.approx(3.1)
    assert "4->5: +3.50 > 0.57 (router +3.10, attn core +0.10)" in " ".join(
        report.cliff_line(named).split())
    assert [c.tokens for c in components.sweep_cliffs(sweep(planted=0.2, at=10), 1).cliffs] == \
        [[8, 10]]   # 1.2 added, 1.3 x 0.8 + 2 x 0.05 = 1.14 allowed
    assert components.sweep_cliffs(sweep(planted=0.2, at=10), 2).cliffs == []   # 1.24 allowed
    assert components.sweep_cliffs(sweep(floors=False), 1) is None
    assert "need a GPU" in report.cliff_line(None)
    squares = {t: timing.SweepPoint(T([t * t]), floor_ms=0.0) for t in tokens}
    many = components.sweep_cliffs(squares, 1)
    text = report.wrap(report.cliff_line(many), "  ", "    ", width=100)
    assert len(many.cliffs) == 14 and "4->5: +9.00 > 0.05" in " ".join(text.split()) and \
        max(map(len, text.splitlines())) <= 100, text


def test_the_cost_model_prices_the_faster_verify():
    """Bench.best: graph where captured, and the attention mode whose verify of num_steps + 1
    took less in that variant (decode on a tie), whatever the eager times; the label says which."""
    b = types.SimpleNamespace(graph_opts=[False, True], modes=["extend", "decode"], k=3,
                              verify_name=lambda mode: f"verify/{timing.FLAG_WORD[mode]}")
    phases = {"verify/prefill/eager": 5.0, "verify/decode/eager": 1.0,
              "verify/prefill/graph": 2.0, "verify/decode/graph": 3.0}
    assert timing.faster_verify(b, phases) == ("graph", "extend")
    b.best = ("graph", "extend")
    assert report.priced(b) == "graph, prefill attention whose verify of 4 timed faster"
    phases["verify/decode/graph"] = 2.0
    assert timing.faster_verify(b, phases) == ("graph", "decode")
    b.graph_opts, b.modes = [False], ["extend"]
    assert timing.faster_verify(b, phases) == ("eager", "extend")
    b.best = ("eager", "extend")
    assert report.priced(b) == "eager, prefill attention, the only one timed"


def test_verify_sweep_prices_the_runs_own_chain_past_the_defaults(tmp_path):
    """num_steps 9 on the CPU: the sweep times verify and draft extend of 1 to 10 tokens (past the
    CPU's 6 and draft extend's 8), so the cost model prices the run's own chain; a file whose cost
    model lacks its num_steps is said to be not timed, in `report.py phases` and in the answer."""
    from types import SimpleNamespace as NS
    cfg = _settled("--random-weights --speculative-num-steps 9 --skip-e2e --reps 1")
    b = timing.prepare(cfg, torch.device("cpu"))
    b.best = ("eager", "decode")
    sweep = timing.verify_sweep(b, cfg.context_len[0], None)
    assert list(sweep) == list(range(1, 11)) and all(p.draft_extend > 0 for p in sweep.values())
    r = NS(phases_ms={"decode_step/eager": 3.0, "draft_step/eager": 0.05, "accept": 0.1},
           allreduce_modelled=None, e2e={}, verify_sweep_ms=sweep)
    cm = components.cost_model(r, b)
    assert sorted(cm.steps) == list(range(1, 10))
    path = os.path.join(HERE, "benchmarks", f"{HEADLINE_JSON[0]}.json")
    run_json = report.read_run(path)
    k = run_json["env"]["config"]["speculative_num_steps"]
    run_json["cost_model"]["steps"] = {s: c for s, c in run_json["cost_model"]["steps"].items()
                                       if int(s) < k}
    (tmp_path / "short.json").write_text(json.dumps(run_json) + "\n")
    last = report.phases(tmp_path / "short.json")[-1]
    assert last.startswith(f"num_steps {k}: not timed (the cost model prices num_steps 1 to "
                           f"{k - 1}: the verify sweep has no verify and draft extend of {k + 1} "
                           "tokens)"), last
    said = report.cost_answer(NS(cost_model=components.CostModel(3.0, {})), NS(k=k))
    assert said == [f"EAGLE-3 with num_steps {k}: not timed (the cost model prices no chain: the "
                    f"verify sweep has no verify and draft extend of {k + 1} tokens)."]


# ---------------------------------------------------------------------------------------------
# train.py: what --eval measures, and its command line

def test_train_measure_counts_the_cycles_outside_runs_apart():
    """train.measure's second figure: the cycles that emit more than a run of one byte going on
    (runs of spaces, which a degenerate target produces and the head guesses whole) left out."""
    prompts, outputs = [[1, 2]], [[3, 32, 32, 32, 32, 5]]   # the prefill emitted 3
    accepted = torch.tensor([[1], [1], [0], [-1]])           # [C, B]: 32 32 | 32 32 | 5 | done
    assert train.cycles_outside_runs(outputs, prompts, accepted) == [2, 1]


def test_train_py_writes_elsewhere_and_refuses_the_committed_pair(tmp_path, capsys):
    """train.py's default folder is not the committed pair; writing into the committed pair, into a
    folder it cannot write, measuring a folder with no pair, and --overwrite-committed where no
    flag names the committed pair are refused in one line, before any training (exit status 2,
    argparse's)."""
    default_out = train.parse_args(["--eval"]).out   # --eval: the default --out, no folder made
    assert os.path.realpath(default_out) != os.path.realpath(train.PAIR_DIR)
    assert train.parse_args(["--out",
                             str(tmp_path / "pair")]).threads == 1 and (tmp_path / "pair").is_dir()
    committed = os.path.join(HERE, "checkpoints", ".", "tiny-stdlib")
    assert train.parse_args(["--out", committed, "--overwrite-committed"]).overwrite_committed
    (tmp_path / "file").write_text("")
    for part in ("target", "eagle3"):
        (tmp_path / "pair" / part).mkdir()
    for argv, words in ((["--out", committed], "is the committed pair"),
                        (["--out", str(tmp_path / "file" / "pair")], "cannot write there"),
                        (["--eval", str(tmp_path)],
                         "no pair there"), (["--threads", "0"], "at least 1"),
                        (["--eval", "--threads", str(os.cpu_count() + 1)],
                         f"this machine has {os.cpu_count()} CPUs; give at most"),
                        (["--overwrite-committed"], f"--overwrite-committed: {train.OUT_DIR} is "
                         "not the committed pair; the flag applies only where --out or --eval "),
                        (["--overwrite-committed", "--out", str(tmp_path / "other")],
                         "is not the committed pair"),
                        (["--overwrite-committed", "--eval", str(tmp_path / "pair")],
                         "is not the committed pair")):
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and words in err[-1] and \
            err[-1].startswith("train.py: error:"), (argv, err)
    assert sorted(os.listdir(tmp_path)) == ["file", "pair"]   # nothing made for a refusal


def test_train_py_eval_reads_out_and_refuses_what_cannot_go_together(tmp_path, capsys):
    """train.py --out X --eval measures the pair in X (bare --eval: the committed pair); --out X
    --eval Y (two folders), --quick with --eval, and --quick into the committed pair are refused in
    one line, exit status 2."""
    pair = tmp_path / "pair"
    for part in ("target", "eagle3"):
        (pair / part).mkdir(parents=True)
    assert train.parse_args(["--out", str(pair), "--eval"]).eval == str(pair)
    assert train.parse_args(["--eval"]).eval == train.PAIR_DIR
    committed = os.path.join(HERE, "checkpoints", "tiny-stdlib")
    for argv, words in ((["--out", str(pair), "--eval", str(tmp_path)], "two folders"),
                        (["--quick", "--eval"], "--eval trains nothing"),
                        (["--quick", "--out", committed, "--overwrite-committed"], "a poor one")):
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and words in err[0], (argv, err)
        assert err[0].startswith("train.py: error:"), (argv, err)


def test_checkpoint_py_run_as_a_command_says_it_is_a_module(capsys):
    """`python checkpoint.py --help`: one line saying it is a module and where to go instead,
    exit status 2 (not silence and 0)."""
    import runpy
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(HERE, "checkpoint.py"), run_name="__main__")
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith("checkpoint.py is a module") and "run.py --model-path" in err and \
        "train.py" in err, err


def test_train_py_eval_names_a_pair_that_does_not_load_in_one_line(tmp_path, capsys):
    """--eval DIR without eagle3/ is refused with the flags; with a config.json that is no model's,
    the checkpoint's refusal is one line and exit status 2, as run.py's, not a traceback."""
    pair = tmp_path / "pair"
    (pair / "target").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--eval", str(pair)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"train.py: error: --eval {pair}: no pair there (no "
                                         "eagle3/ folder; train.py writes one with --out)"], err
    (pair / "eagle3").mkdir()
    (pair / "target" / "config.json").write_text("{}")
    assert train.main(["--eval", str(pair)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"train.py: error: {pair}/target/config.json: no "
                                               "vocab_size"), err


def test_train_py_refusal_and_ctrl_c_as_a_user_meets_them(tmp_path):
    """Run as a user runs it: a refusal is one line within 120 columns, exit status 2, no
    traceback. Ctrl-C once --quick has said what it does (its first line): one line, exit status
    130, no traceback, and the --out folders the run created, holding nothing finished, are gone."""
    train_py = os.path.join(HERE, "train.py")
    r = subprocess.run([sys.executable, train_py, "--out", "a", "--eval", "b"], cwd=tmp_path,
                       env=CPU_ENV, capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "two folders" in err[0], r.stderr
    assert len(err[0]) <= 120 and "Traceback" not in r.stderr
    run = subprocess.Popen([sys.executable, "-u", train_py, "--quick", "--out", "new/pair"],
                           cwd=tmp_path, env=CPU_ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    first = run.stdout.readline()
    out, err = interrupt(run)
    assert first.startswith("quick try:") and len(first.rstrip("\n")) <= 120, first
    assert run.returncode == 130 and "Traceback" not in err, (run.returncode, err)
    last = err.strip().splitlines()[-1]
    assert last == "train.py: interrupted; nothing finished, new removed", err
    assert not (tmp_path / "new").exists(), os.listdir(tmp_path)


def test_train_py_killed_leaves_no_half_pair(tmp_path):
    """train.py killed (SIGTERM, as `timeout` sends it) once its target is saved: --out holds no
    target/ without its eagle3/ (the pair is made in a work folder inside it and moved in at the
    end, train.install)."""
    out = tmp_path / "pair"
    run = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--quick", "--out",
                            str(out)], cwd=tmp_path, env=CPU_ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not glob.glob(str(out / "**" / "target" / "config.json"), recursive=True) + \
                glob.glob(str(out / ".train-*" / "target" / "config.json")):
            assert run.poll() is None and time.time() < deadline, "no target saved"
            time.sleep(0.02)
        run.terminate()
        run.wait(timeout=60)
    finally:
        run.kill()
    assert run.returncode == -signal.SIGTERM, run.returncode
    assert not {"target", "eagle3", "recipe.json"} & set(os.listdir(out)), os.listdir(out)


def test_train_install_moves_a_pair_in_whole_and_keeps_what_else_is_there(tmp_path):
    """install: the work folder's pair replaces the one in --out part by part; other files in
    --out stay; the work folder goes."""
    out, work = tmp_path / "out", tmp_path / "out" / ".train-x"
    for folder, tag in ((out, "old"), (work, "new")):
        for part in ("target", "eagle3"):
            (folder / part).mkdir(parents=True)
            (folder / part / "config.json").write_text(tag)
        (folder / "recipe.json").write_text(tag)
    (out / "notes.txt").write_text("mine")
    train.install(str(work), str(out))
    assert sorted(os.listdir(out)) == ["eagle3", "notes.txt", "recipe.json", "target"]
    assert [(out / p).read_text() for p in ("target/config.json", "eagle3/config.json",
                                            "recipe.json", "notes.txt")] == ["new"] * 3 + ["mine"]


@pytest.mark.slow
def test_train_py_quick_and_the_router_probe_train_to_the_end(tmp_path):
    """train.py --quick and routing.py probe --quick as a user runs them (at once, one thread each):
    both train with gradients through the KV caches that forward writes in place, step after step,
    and finish (exit status 0, no traceback). train.py saves the pair and measures it: the target's
    loss below a uniform guess over its 256 byte tokens, speculative output equal to plain greedy.
    The probe writes its trace and its report."""
    runs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), *argv], cwd=tmp_path,
                             env=CPU_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for script, argv in (("train.py", ["--quick", "--out", "pair"]),
                                 ("routing.py", ["probe", "--quick", "--out", "probe"]))]
    try:
        for run in runs:
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0 and "Traceback" not in err, (run.args, err[-2000:])
    finally:
        for run in runs:
            run.kill()                          # a no-op on one that ended
    recipe = json.loads((tmp_path / "pair" / "recipe.json").read_text())
    assert (tmp_path / "pair" / "target" / "model.safetensors").is_file()
    assert (tmp_path / "pair" / "eagle3").is_dir()
    assert recipe["target_final_loss"] < math.log(256) and recipe["speculative_equals_plain"]
    assert {"probe_trace.npz", "probe.json", "probe.md"} <= set(os.listdir(tmp_path / "probe"))


# ---------------------------------------------------------------------------------------------
# The correctness baseline: run.py --dump and --compare

def check_dump_layout(d, prompts, k):
    """The arrays mean what the README says: padding where it says, the teacher-forced top-1 along
    a greedy output is the token generated, and each cycle's accepted drafts are the output tokens
    they became, its first rejected draft is not."""
    for b, p in enumerate(prompts):
        out = d["output_ids"][b][d["output_ids"][b] >= 0]
        end = len(p) + len(out) - 1                     # positions < end predict a token of the row
        assert d["prompt_ids"][b, :len(p)].tolist() == p and \
            (d["prompt_ids"][b, len(p):] == -1).all()
        assert (d["output_ids"][b, len(out):] == -1).all()
        assert d["topk_ids"][b, len(p) - 1:end, 0].tolist() == out.tolist(), b
        assert (np.diff(d["topk_logprobs"][b, :end], axis=-1) <= 0).all()
        assert (d["topk_ids"][b, end:] == -1).all() and np.isnan(d["topk_logprobs"][b, end:]).all()
        # out[0] comes from the prefill; then each cycle emits its m accepted drafts and a bonus
        at = 1
        for m, drafts in zip(d["accepted"][b], d["draft_ids"][b]):
            if m < 0:
                assert (drafts == -1).all()
                continue
            want = out[at:at + m]
            assert drafts[:len(want)].tolist() == want.tolist(), (b, at, m)
            if m < k and at + m + 1 < len(out):  # a cycle the row went on after: not cut
                assert drafts[m] != out[at + m], (b, at, m)
            at += m + 1


def _dump_worker(seed):
    """The random tiny target and EAGLE-3 head (seeded whole: the same model at any TP), dumped."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=torch.float32),
                         seed)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    d = baseline.dump(target, head, PROMPTS[3], max_new_tokens=16, num_steps=2)
    return {key: torch.from_numpy(v) for key, v in d.items()}  # run_ranks' torch.load takes tensors


def test_dump_at_tp2_equals_tp1():
    ref = {key: v.numpy() for key, v in _dump_worker(31).items()}
    got = {key: v.numpy() for key, v in run_ranks(2, _dump_worker, 31).items()}
    check_dump_layout(ref, PROMPTS[3], 2)
    for key in ("prompt_ids", "output_ids", "topk_ids", "draft_ids", "accepted"):
        assert np.array_equal(got[key], ref[key]), key
    report = baseline.compare(ref, got, max_logprob_diff=1e-5, min_top1_agreement=1.0,
                              max_accept_diff=0.0)
    assert not report["failures"] and [r["diverge"] for r in report["rows"]] == [None] * 3, report


@pytest.fixture(scope="module")
def planted_dump():
    """A float32 dump whose drafts come from a proposer that knows the answer and errs by plan, so
    every accepted length 0..k occurs; k = 2."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=torch.float32),
                         32)
    plain = generate(target, None, PROMPTS[3], max_new_tokens=16).tokens
    proposer = PlantedProposer(reference_sequences(PROMPTS[3], plain, 32), 256,
                               lambda c, b: (c + b) % 3)
    d = baseline.dump(target, proposer, PROMPTS[3], max_new_tokens=16, num_steps=2)
    assert d["output_ids"].tolist() == [o + [-1] * (16 - len(o)) for o in plain]  # lossless
    return target, d


def test_compare_reports_a_planted_divergence(planted_dump, tmp_path, capsys):
    target, a = planted_dump
    check_dump_layout(a, PROMPTS[3], 2)
    b = {key: v.copy() for key, v in a.items()}
    row, j = 1, 5  # the runner-up wins at output index 5 of row 1, as a near-tie flip would
    t = len(PROMPTS[3][row]) - 1 + j                                    # the position that chose it
    b["output_ids"][row, j] = a["topk_ids"][row, t, 1]
    b["topk_ids"][row, t, :2] = a["topk_ids"][row, t, [1, 0]]  # the two ids swap log-probabilities
    report = baseline.compare(a, b)
    assert [r["diverge"] for r in report["rows"]] == [None, j, None]
    r = report["rows"][row]
    assert (r["positions"], r["top1_agree"], r["at"]) == (t + 1, t, t)
    lp = a["topk_logprobs"][row, t]
    assert r["max_logprob_diff"] == pytest.approx(lp[0] - lp[1])
    gap = a["topk_logprobs"][row, t, 0] - a["topk_logprobs"][row, t, 1]
    assert (r["divergence_failure"] is None) == (gap <= baseline.MAX_LOGPROB_DIFF), \
        (gap, r["divergence_failure"])
    # the CLI: the same table, status 0 within the thresholds, 1 past one, BadInput (2) for files
    # that do not fit
    for name, d in (("a", a), ("b", b), ("short", dict(a, topk_logprobs=a["topk_logprobs"][:, 1:])),
                    ("missing", {key: v for key, v in a.items() if key != "topk_ids"})):
        np.savez(tmp_path / f"{name}.npz", **d)

    def cli(*argv):
        code = run.main(["--compare", *(str(tmp_path / f"{x}.npz") for x in argv[:2]), *argv[2:]])
        return code, capsys.readouterr().out
    code, out = cli("a", "b", "--max-logprob-diff", str(gap + 0.01))
    line = next(x for x in out.splitlines() if x.split()[:1] == [str(row)])
    assert code == 0 and line.split()[3:5] == [str(j), "near-tie"] and "PASS" in out, out
    code, out = cli("a", "b", "--max-logprob-diff", str(gap + 0.01), "--min-top1-agreement", "1")
    assert code == 1 and "FAIL: top-1 agreement" in out, out
    # the flip is no longer a near-tie
    code, out = cli("a", "b", "--max-logprob-diff", str(gap - 0.01))
    assert max(len(line) for line in out.splitlines()) <= 120, out  # the FAIL summary wrapped
    out = " ".join(out.split())
    assert code == 1 and f"row {row}, output {j} (position {t})" in out and \
        "below A's top-1" in out, out
    with pytest.raises(run.BadInput,
                       match=r"topk_logprobs has shape \[3, 23, 20\], expected \[3, 24, 20\]"):
        cli("a", "short")
    with pytest.raises(run.BadInput, match="missing.npz has no array 'topk_ids'"):
        cli("missing", "a")


def test_compare_fails_an_engine_whose_output_is_wrong(planted_dump):
    """A divergence is judged, not only reported: a token outside A's top-K, a stop where A goes on,
    or every output replaced by one id fails, naming the row, the position and both tokens, even
    where top-1 agreement over the shared context stays high."""
    _, a = planted_dump

    def wrong(edit):
        b = {key: v.copy() for key, v in a.items()}
        edit(b["output_ids"])
        return baseline.compare(a, b)
    row, j = 2, 6
    t = len(PROMPTS[3][row]) - 1 + j
    outside = next(i for i in range(256) if i not in a["topk_ids"][row, t])
    report = wrong(lambda out: out.__setitem__((row, j), outside))
    assert report["top1_agreement"] > baseline.MIN_TOP1_AGREEMENT and \
        report["max_logprob_diff"] == 0
    want = f"row {row}, output {j} (position {t}): A chose {a['output_ids'][row, j]} (log p "
    assert len(report["failures"]) == 1 and want in report["failures"][0], report["failures"]
    assert f"B chose {outside}, which is not in A's top-20" in report["failures"][0]
    report = wrong(lambda out: out.__setitem__((row, slice(j, None)), -1))
    assert f"row {row}, output {j} (position {t}): B stops, A goes on with token " \
           f"{a['output_ids'][row, j]}" in report["failures"], report["failures"]
    report = wrong(lambda out: out.fill(5))
    judged = [r["divergence_failure"] for r in report["rows"]]
    assert all(f"row {r}, output " in f for r, f in enumerate(judged)), judged
    assert not baseline.compare(a, a, max_logprob_diff=0, min_top1_agreement=1,
                                max_accept_diff=0)["failures"]


def test_compare_refuses_files_it_cannot_read(planted_dump, tmp_path):
    """Not a zip, truncated, pickled objects, drafts of another k, more accepted than drafted: each
    BadInput naming the file; through run.py, one line on stderr and exit status 2."""
    _, a = planted_dump
    np.savez(tmp_path / "a.npz", **a)
    data = (tmp_path / "a.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(data[:len(data) // 2])
    (tmp_path / "text.npz").write_text("prompt_ids: [1, 2, 3]\n")
    np.savez(tmp_path / "pickled.npz", **dict(a, meta=np.array([{"engine": "x"}], dtype=object)))
    np.savez(tmp_path / "k3.npz",
             **dict(a, draft_ids=np.concatenate([a["draft_ids"], a["draft_ids"][..., :1]], -1)))
    over = a["accepted"].copy()
    over[1, 0] = 3
    np.savez(tmp_path / "over.npz", **dict(a, accepted=over))
    cases = {"truncated": "truncated.npz is a truncated or corrupt .npz",
             "text": "text.npz is not an .npz file",
             "pickled": r"pickled.npz holds an object \(pickled\) array",
             "nothere": "nothere.npz: No such file",
             "k3": "draft_ids: .* k = 2 tokens a cycle, .* k = 3: not runs with the same num_steps",
             "over": r"over.npz: accepted\[1, 0\] = 3 drafts, more than the k = 2"}
    for name, message in cases.items():
        with pytest.raises(run.BadInput, match=message):
            run.main(["--compare", str(tmp_path / "a.npz"), str(tmp_path / f"{name}.npz")])
    cli = run_py("--compare", str(tmp_path / "a.npz"), str(tmp_path / "truncated.npz"))
    assert cli.returncode == 2 and cli.stdout == "", (cli.returncode, cli.stdout)
    assert cli.stderr.count("\n") == 1 and cli.stderr.startswith("run.py: error: ") and \
        "truncated" in cli.stderr


def test_compare_refuses_a_logprob_that_is_not_finite(planted_dump):
    _, a = planted_dump
    b = {key: v.copy() for key, v in a.items()}
    b["topk_logprobs"][0, 2, 3] = np.nan   # NaN compares as "no difference": it must not pass
    with pytest.raises(ValueError, match=r"B: topk_logprobs\[0, 2, 3\] is not finite"):
        baseline.compare(a, b)


def test_compare_catches_a_draft_that_accepts_less(planted_dump):
    """The same target outputs (lossless), drafts from a random head instead of the planted ones."""
    target, a = planted_dump
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 33)
    b = baseline.dump(target, head, PROMPTS[3], max_new_tokens=16, num_steps=2)
    report = baseline.compare(a, b)
    assert np.array_equal(a["output_ids"], b["output_ids"]) and report["max_logprob_diff"] == 0
    assert report["accept_diff"] > baseline.MAX_ACCEPT_DIFF and \
        "drafts accepted per cycle" in report["failures"][0]


def conditioned_tiny(dtype, seed):
    """The tiny target and a random head as a bf16 checkpoint holds them (weights rounded to bf16),
    run in `dtype`, with the routed experts' outputs scaled by 0.1: a random MoE is chaotic in bf16
    (a near-tied routing choice flips and moves the hidden state as much as the whole layer), and
    the scaling keeps a flip small, so that bf16 against float32 measures the arithmetic."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=dtype), seed)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    for layer in target.layers[target.args.first_k_dense_replace:]:
        layer.mlp.experts.down_proj.mul_(0.1)
    for p in [*target.parameters(), *head.parameters()]:
        if p.is_floating_point():
            p.copy_(p.to(torch.bfloat16))
    return target, head


def test_bf16_dump_passes_the_default_thresholds_and_fails_tight_ones():
    dumps = [baseline.dump(*conditioned_tiny(dtype, 0), PROMPTS[3], max_new_tokens=16, num_steps=2)
             for dtype in (torch.float32, torch.bfloat16)]
    report = baseline.compare(*dumps)
    print(f"\nbf16 against float32: top-1 agreement {report['top1_agreement']:.3f}, "
          f"max |logprob diff| {report['max_logprob_diff']:.3f}, "
          f"diverge@ {[r['diverge'] for r in report['rows']]}")
    assert not report["failures"], report["failures"]
    tight = baseline.compare(*dumps, max_logprob_diff=1e-3, min_top1_agreement=1.0)
    assert any("--max-logprob-diff" in f for f in tight["failures"]), tight["failures"]


def test_dump_shows_its_progress_and_baseline_py_says_it_is_a_module(capsys):
    """A dump's two passes (generation, a cycle a step; the teacher-forced forward, a chunk a
    step) each show a tqdm bar on stderr; `python baseline.py` points to run.py, status 2."""
    baseline.dump(*conditioned_tiny(torch.float32, 0), PROMPTS[3], max_new_tokens=6, num_steps=2)
    err = capsys.readouterr().err
    assert "dump: generating" in err and "cycle" in err, err
    assert "dump: log-probabilities, teacher-forced" in err, err
    cli = subprocess.run([sys.executable, "baseline.py", "--help"], cwd=HERE, capture_output=True,
                         text=True, timeout=60)
    assert (cli.returncode, cli.stdout) == (2, ""), (cli.returncode, cli.stdout)
    assert cli.stderr == ("baseline.py: a module, not a command: use `python run.py --dump PATH "
                          "--prompt-ids FILE` or `python run.py --compare A.npz B.npz`\n")


@pytest.mark.slow
def test_dump_from_the_command_line_and_bad_input(tiny_ckpt, tmp_path, run_py_runs):
    """run.py --dump with a checkpoint, a draft and a prompt file (DUMP_FLAGS: the module's random
    draft of tiny_ckpt's target, PROMPTS[3]) writes what dump() returns."""
    (ckpt, _), tmp = tiny_ckpt, run_py_runs[1]
    target = load_target(ckpt, max_batch_size=3, max_seq_len=32, dtype=torch.float32)
    done = ran(run_py_runs, "dump_cli")
    # wrapped
    assert "dump: {" in done.stdout and max(map(len, done.stdout.splitlines())) <= 120, done.stdout
    cli = baseline.load_dump(tmp / "cli.npz")
    assert json.loads(str(cli["meta"]))["target"] == f"loaded {ckpt}"
    ref = baseline.dump(target, load_draft(tmp / "draft", target), PROMPTS[3],
                        max_new_tokens=12, num_steps=2,
                   chunk=5)  # the teacher-forced forward in chunks over the cache: the same answers
    report = baseline.compare(ref, cli, max_logprob_diff=1e-5, min_top1_agreement=1.0,
                              max_accept_diff=0.0)
    assert not report["failures"] and np.array_equal(ref["draft_ids"], cli["draft_ids"]), report
    # bad input names the problem
    with pytest.raises(ValueError, match="prompt row 1 has id 999 at position 2"):
        baseline.dump(target, None, [[5, 6], [7, 8, 999]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_seq_len 32"):
        baseline.dump(target, None, [[5] * 30], max_new_tokens=4)
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n{\"ids\": [3]}\n")
    with pytest.raises(ValueError, match="bad.jsonl line 2: expected a non-empty JSON list"):
        baseline.read_prompt_ids(tmp_path / "bad.jsonl")
    (tmp_path / "binary.jsonl").write_bytes(b"[1, \x8c]\n")
    for path, why in ((tmp_path / "binary.jsonl", "not UTF-8 text"),
                      (tmp_path, "a folder, not a file")):
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {why}$"):
            baseline.read_prompt_ids(path)
    bad = run_py_runs[0]["dump_temperature"]
    assert bad.returncode != 0 and "drop --temperature" in bad.stderr


# ---------------------------------------------------------------------------------------------
# Timing aids: simulated uniform routing, the component table, chunked prefill, kv buckets,
# random INT4 weights, --moe-adaptive, progress labels, the GPU held while timed calls are issued

def test_uniform_routing_is_balanced_distinct_and_weighted_as_the_model():
    m = init_random(Transformer(tiny(), 2, 32, dtype=torch.float64, routing="uniform"), 9)
    router = m.layers[1].mlp.gate
    assert all(layer.mlp.gate.routing == "uniform" for layer in m.layers[1:])
    E, K = m.args.n_routed_experts, m.args.num_experts_per_tok
    for N in (1, 3, 7, 11):  # fewer pairs than experts, and more (7 * 4 = 28 > 16)
        x = torch.randn(N, m.args.hidden_size, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(N))
        ids, weights = router(x)
        assert all(len(set(row)) == K
                   for row in ids.tolist()), f"a token got a repeated expert: {ids.tolist()}"
        counts = torch.bincount(ids.flatten(), minlength=E)
        assert counts.max() - counts.min() <= 1, f"uneven spread over experts: {counts.tolist()}"
        # the model's weights for those ids
        scores = torch.sigmoid(x @ router.weight.T).gather(1, ids)
        expect = scores / scores.sum(-1, keepdim=True) * m.args.routed_scaling_factor
        assert_close(weights, expect, 1e-12, "uniform routing weights vs the model's normalization")
    m.set_routing("model")
    model_ids, _ = router(x)
    assert not torch.equal(model_ids, ids), "set_routing('model') left the uniform choice in place"
    with pytest.raises(ValueError, match="routing must be"):
        m.set_routing("perfect")


def test_random_init_int4_is_zero_mean():
    m = init_random(Transformer(tiny(quantization_config="int4"), 1, 8), 3)
    q = model.unpack_int4(m.layers[1].mlp.experts.up_proj.weight_packed).double()
    assert q.min() == -7 and q.max() == 7, "q should be symmetric in [-7, 7]"
    assert abs(q.mean().item()) < 0.05, \
        f"random INT4 values have mean {q.mean().item():.3f}, not ~0"


def test_run_defaults_uniform_routing_for_random_weights_and_model_routing_for_a_checkpoint(
        tiny_ckpt):
    ckpt, _ = tiny_ckpt
    cpu = torch.device("cpu")
    for argv, want in ((["--random-weights"], "uniform"), (["--model-path", ckpt], "model"),
                       # []: the trained pair
                       (["--random-weights", "--routing", "model"], "model"), ([], "model")):
        args = run.settle(run.parse_args(argv + ["--dtype", "float64"]), cpu, 1)
        target, _, _ = timing.build(args, cpu, torch.float64)
        routers = {layer.mlp.gate.routing for layer in target.layers
                   if isinstance(layer.mlp, model.MoE)}
        assert args.routing == want and target.routing == want and routers == {want}, (argv,
        routers)
    assert load_target(ckpt, 1, 16).routing == "model"


def test_run_says_which_flag_drops_the_trained_pair(capsys):
    """--quant none is the tiny preset's own layout: the trained pair still. --quant int4,
    --routed-experts and --simulate-tp build random weights, said in one note naming the flag
    (none where --random-weights asked for them)."""
    cfg = _settled("--quant none")
    assert cfg.trained_pair and "note" not in capsys.readouterr().out
    for flags in ("--quant int4", "--routed-experts 8", "--simulate-tp 2"):
        assert not _settled(flags).trained_pair, flags
        said = capsys.readouterr().out.splitlines()
        assert said == [f"note: {flags} shapes random weights: a random tiny target and head, "
                        "not the trained pair (checkpoints/tiny-stdlib)"], said
    assert not _settled("--random-weights --quant int4").trained_pair
    assert "note" not in capsys.readouterr().out


def test_run_moe_adaptive_sets_the_rule_for_its_build_only(monkeypatch):
    """--moe-adaptive N puts FP8's entry in the fused MoE's rule (kernels.moe.ADAPTIVE_MIN_TOKENS)
    for the build, the rule then picks the adaptive variant from N tokens, and a later build
    without the flag clears it (the rule is module state; nothing carries over between runs)."""
    monkeypatch.setattr(kernels.moe, "ADAPTIVE_MIN_TOKENS", {})
    cpu = torch.device("cpu")
    for flags, want in (("--moe-adaptive 3", {"fp8": 3}), ("", {})):
        argv = f"--random-weights --quant fp8 --dtype float64 {flags}".split()
        timing.build(run.settle(run.parse_args(argv), cpu, 1), cpu, torch.float64)
        assert kernels.moe.ADAPTIVE_MIN_TOKENS == want, flags
        picks = [kernels.moe.gemv_rule("fp8", N, 8, 256) for N in (1, 2, 3, 32, 33)]
        adaptive = "adaptive" if want else "gemv"
        assert picks == ["gemv", "gemv", adaptive, adaptive, "dot"], (flags, picks)


def assert_parts_add_up(got, what):
    """A component table (components.profile_components) whose parts sum to its kernels' time
    within 5%, with time in every component these models run (all but the all-reduce's) and more
    than 100 kernels."""
    parts, total = got.parts_ms, got.kernel_ms
    assert abs(sum(parts.values()) - total) <= 0.05 * total, \
        f"{what}: parts {sum(parts.values()):.3f} vs kernels {total:.3f} ms"
    for c in ("attn_core", "attn_proj", "router", "routed_experts", "shared_mlp", "elementwise",
              "embed_head"):
        assert parts[c] > 0, f"{what}: nothing attributed to {c}: {parts}"
    assert got.kernels > 100


def test_component_table_adds_up_to_the_summed_op_time():
    """CPU: each op's own time goes to the innermost component around it; the parts must add up to
    the total counted independently (profiler.key_averages), and every component a forward of this
    model has must be seen."""
    m = init_random(Transformer(tiny(), 2, 48, dtype=torch.float32), 10)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(10))
    m(tokens, torch.arange(20).expand(2, 20))
    for mode in ("extend", "decode"):
        fn = partial(m, tokens[:, -4:], 20 + torch.arange(4).expand(2, 4), mode, kv_len=24)
        got = components.profile_components(m, fn, gpu=False, calls=2)
        assert_parts_add_up(got, mode)
        assert got.parts_ms["other"] < 0.1 * got.kernel_ms and got.parts_ms["allreduce"] == 0, \
            got.parts_ms
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks
               for mod in m.modules()), "hooks left behind"
    assert isinstance(components.scope("router"), contextlib.nullcontext), \
        "a scope outside profiling must cost nothing"
    assert model.apply_rope.__name__ == "apply_rope" and \
        "project" not in vars(m.layers[0].self_attn)


@pytest.mark.gpu
def test_component_table_adds_up_to_the_summed_kernel_time_on_the_gpu():
    target, _ = gpu_models()
    prefill, prefill_pos, step, step_pos = (t.cuda() for t in step_inputs(256))
    target(prefill, prefill_pos)
    got = components.profile_components(target, partial(target, step, step_pos, "decode",
                                                        kv_len=16), gpu=True)
    assert_parts_add_up(got, "decode")


@pytest.mark.triton
def test_component_table_puts_the_input_norm_in_qkva_under_the_projections(monkeypatch):
    """kernels.InputNormInQKVA runs the layer's projections and attention from the layer, outside
    MLA's own call: run.py's component ranges still put the GEMV with the input add and norm inside
    it (and the first layer's, with no residual) under the attention projections, and the attention
    under the attention core (CPU: one decode step of one row, the launches marked by a range of
    their own)."""
    device = TRITON_DEVICE
    m = init_random(Transformer(tiny(num_hidden_layers=2), 1, 24, device=device,
                                dtype=torch.float32), 10)
    kernels.accelerate(m, ("norm_gemv", "fused_proj", "add_rmsnorm"))
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(10)).to(device)
    m(tokens, torch.arange(20, device=device).expand(1, 20))

    def marked(*a, **k):
        with torch.profiler.record_function("norm_gemv" + ("+residual" if "residual" in k else "")):
            return kernels.norm_gemv(*a, **k)
    monkeypatch.setattr(kernels.launch, "norm_gemv", marked)
    with components.component_scopes(m), profile(activities=[ProfilerActivity.CPU]) as prof:
        m(tokens[:, -1:], torch.tensor([[20]], device=device), "decode", kv_len=24)
    where = {}
    for e in prof.events():
        if e.name.startswith("norm_gemv") or e.name == "aten::softmax":
            where.setdefault(e.name, set()).add(components.component_at(e))
    assert where["norm_gemv+residual"] == {"attn_proj"} and \
        where["aten::softmax"] == {"attn_core"}, where
    assert where["norm_gemv"] == {"attn_proj"}, where  # q_b, o_proj and layer 0's q_a + kv_a


def recorded_scopes(monkeypatch):
    """components.scope replaced, for one test, by a range that keeps the open components on a
    stack: returns the stack, whose last entry is the component a call runs in."""
    stack = []

    @contextlib.contextmanager
    def scope(component):
        stack.append(component)
        yield
        stack.pop()
    monkeypatch.setattr(components, "scope", scope)
    return stack


@pytest.mark.triton
def test_component_table_puts_the_merge_in_w_uv_under_the_projections(monkeypatch):
    """run.py's component ranges: with the attention kernel and norm_gemv, a one-row decode step
    merges the attention's parts in W_uv's launch (DecodeAttentionKernel.merge_absorb_output); that
    launch must sit inside an "attn_proj" range, as absorb_output's does, not in the attention
    core's."""
    device = TRITON_DEVICE
    m = init_random(Transformer(tiny(num_hidden_layers=2), 1, 32, device=device,
                                dtype=torch.float32), 0)
    kernels.accelerate(m, ("attention", "norm_gemv"))
    m(torch.arange(8, device=device)[None], torch.arange(8, device=device)[None])
    stack, seen, launch = recorded_scopes(monkeypatch), [], kernels.launch.mla_merge_absorb
    monkeypatch.setattr(kernels.launch, "mla_merge_absorb", lambda *a: seen.append(stack[-1])
                        or launch(*a))
    with components.component_scopes(m):
        m(torch.tensor([[8]], device=device), torch.tensor([[8]], device=device), "decode")
    assert seen == ["attn_proj"] * 2, seen
    assert "merge_absorb_output" not in vars(m.layers[0].self_attn), \
        "the wrapper must be removed after"


@pytest.mark.triton
def test_component_table_puts_the_shared_expert_alone_under_the_shared_mlp(monkeypatch):
    """Beside INT4 experts past SHARED_MAX_TOKENS (set to 1 here), kernels.SharedExpertInLaunch
    runs the shared expert from its own method (shared_alone), not the MLP's forward: its GEMMs
    and SwiGLU must still sit in a "shared_mlp" range, not in the MoE's ("elementwise")."""
    device = TRITON_DEVICE
    args = tiny(num_hidden_layers=2, moe_intermediate_size=64, quantization_config="int4")
    m = init_random(Transformer(args, 2, 32, device=device, dtype=torch.float32), 0)
    kernels.accelerate(m, ("shared_expert",), moe="fused")
    monkeypatch.setitem(kernels.moe_gemv.SHARED_MAX_TOKENS, "int4", 1)
    m(torch.arange(8, device=device).expand(2, 8), torch.arange(8, device=device).expand(2, 8))
    stack, seen = recorded_scopes(monkeypatch), []
    sh = m.layers[-1].mlp.shared_experts
    act = sh.act
    monkeypatch.setattr(sh, "act", lambda *a: seen.append(stack[-1]) or act(*a))
    with components.component_scopes(m):
        m(torch.tensor([[8], [9]], device=device), torch.tensor([[8], [8]], device=device),
          "decode")
    assert seen == ["shared_mlp"], seen
    assert "shared_alone" not in vars(m.layers[-1].mlp), "the wrapper must be removed after"


def test_component_bytes_count_what_a_forward_moves():
    m = init_random(Transformer(tiny(), 2, 48, dtype=torch.float32), 10)
    distinct = [5] * (m.args.num_hidden_layers - 1)
    parts = components.component_bytes(m, distinct, kv_slots=24, batch=2, tokens=3)
    a = m.args
    assert parts["routed_experts"] == 7 * 5 * 3 * a.hidden_size * a.moe_intermediate_size * 4
    assert parts["attn_core"] == 8 * 2 * 24 * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    # looked-up rows + lm_head
    assert parts["embed_head"] == (2 * 3 + a.vocab_size) * a.hidden_size * 4
    every = sum(p.numel() * 4 for n, p in m.named_parameters() if ".experts." not in n
                and "embed_tokens" not in n)
    assert (sum(parts.values()) - parts["routed_experts"] - parts["attn_core"]
            - 2 * 3 * a.hidden_size * 4 == every)


@pytest.mark.triton
def test_component_bytes_put_the_shared_expert_where_it_runs(monkeypatch):
    """kernels "shared_expert" beside INT4 experts: the shared expert's bytes count with the routed
    experts' where it rides in their launch (up to SHARED_MAX_TOKENS, set to 2 here), and with the
    shared MLP's where it runs alone; the total is the same."""
    args = tiny(num_hidden_layers=2, moe_intermediate_size=64, quantization_config="int4")
    m = init_random(Transformer(args, 2, 32, device=TRITON_DEVICE, dtype=torch.float32), 0)
    kernels.accelerate(m, ("shared_expert",), moe="fused")
    monkeypatch.setitem(kernels.moe_gemv.SHARED_MAX_TOKENS, "int4", 2)
    shared = sum(p.numel() * 4 for n, p in m.named_parameters() if ".shared_experts." in n)
    launch, alone = (components.component_bytes(m, [4], kv_slots=8, batch=1, tokens=T)
                     for T in (2, 3))
    per_token = m.embed_tokens.weight.shape[1] * 4     # the one looked-up row more at 3 tokens
    assert alone["shared_mlp"] - launch["shared_mlp"] == shared
    assert launch["routed_experts"] - alone["routed_experts"] == shared
    assert sum(alone.values()) - sum(launch.values()) == per_token


@pytest.mark.parametrize("B", [1, 3])
def test_chunked_prefill_equals_one_pass(B):
    """prefill_target and prefill_draft in chunks of 5 against one pass over the prompt: the
    logits at each row's last position, the EAGLE-3 states, the caches, the head's first draft.
    The chunked passes start from zeroed caches, so each chunk reads only what the chunks before
    it wrote."""
    target = init_random(Transformer(tiny(), 3, 48, dtype=torch.float64), 11)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 12)
    tokens = torch.randint(0, 256, (B, 23), generator=torch.Generator().manual_seed(B))
    last = torch.tensor([22, 9, 15][:B])  # rows of different lengths end in different chunks
    pos = torch.arange(23).expand(B, 23)
    whole_logits, whole_aux = target(tokens, pos, "extend", capture_aux=True)
    first, g = head.extend(tokens, pos, whole_aux, last)
    caches = [t[:B].clone() for layer in target.layers
              for t in (layer.self_attn.kv_cache, layer.self_attn.pe_cache)]
    attn = head.midlayer.self_attn
    head_caches = [t[:B].clone() for t in (attn.k_cache, attn.v_cache)]
    for t in (target.kv_caches, target.pe_caches, attn.k_cache, attn.v_cache):
        t.zero_()
    logits, aux = prefill_target(target, tokens, last, capture_aux=True, chunk=5)
    want = whole_logits.gather(1,
                               last.view(-1, 1, 1).expand(-1, 1, whole_logits.shape[-1])).squeeze(1)
    assert_close(logits, want, 1e-10, "chunked prefill logits at each row's last position")
    assert_close(aux, whole_aux, 1e-10, "chunked prefill EAGLE-3 states")
    again = [t[:B] for layer in target.layers
             for t in (layer.self_attn.kv_cache, layer.self_attn.pe_cache)]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-12)
               for a, b in zip(again, caches)), "cache differs after chunks"
    f2, g2 = prefill_draft(head, tokens, aux, last, chunk=5)
    assert torch.equal(f2, first) and torch.allclose(g2, g, rtol=0, atol=1e-10), \
        "chunked draft extend"
    assert all(torch.allclose(t[:B], c, rtol=0, atol=1e-12) for t, c in
               zip((attn.k_cache, attn.v_cache), head_caches)), "head cache differs after chunks"


def test_kv_bucket_covers_the_positions_with_little_to_spare():
    prev = 0
    for n in range(1, 70000, 37):
        kv = kv_bucket(n, 1 << 20)
        assert n <= kv <= max(n + 63, n * 1.125) and kv >= prev, (n, kv)
        prev = kv
    assert kv_bucket(5000, 4100) == 4100  # never past the cache
    # 8 buckets (graphs) per doubling
    assert len({kv_bucket(n, 1 << 20) for n in range(4097, 8193)}) == 8


def test_progress_labels_count_tokens_not_cache_slots():
    """The progress bar once printed a graph key's last element, the cache bucket, as the token
    count ("timing verify (extend attention), 320 tokens" for a verify of 4). Keys are GraphKeys
    now: in generate and in run.py's isolated phases a verify of k+1 tokens reads more cache
    slots than that, and its label says k+1 tokens, never the slots."""
    class Recorder:  # CudaGraphs.run's signature, run eager, keeping the keys
        def __init__(self):
            self.keys = []

        def run(self, key, fn, *inputs):
            self.keys.append(key)
            return fn(*inputs)
    k, cpu = 3, torch.device("cpu")
    target = init_random(Transformer(tiny(), 2, 160, dtype=torch.float32), 0)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 1)
    rec = Recorder()
    generate(target, head, [list(range(1, 90))] * 2, max_new_tokens=6, num_steps=k, graphs=rec)
    cfg = run.settle(run.parse_args(["--random-weights", "--context-len", "100",
                                     "--speculative-num-steps",
                                     str(k)]), cpu, 1)
    isolated = {name: key
                for name, (key, _, _) in timing.phase_calls(timing.prepare(cfg, cpu), 100).items()}
    verifies = [key for key in rec.keys if key.phase == "verify"] + [isolated["verify/prefill"],
                                                                      isolated["verify/decode"]]
    assert len(verifies) > 2 and {key.mode for key in verifies} == {"extend", "decode"}
    for key in verifies:
        label = timing.phase_label(key, graph=True)
        assert key.tokens == k + 1 and key.kv_len > k + 1 and f", {k + 1} tokens," in label, (key,
        label)
        assert str(key.kv_len) not in label, (key, label)
    assert ", 1 token," in timing.phase_label(isolated["decode_step"], graph=False)
    assert f", {k + 1} tokens," in timing.phase_label(isolated["draft_extend"], graph=False)
    assert {key.phase for key in rec.keys} == {"verify", "accept_chain", "draft_extend", "draft"}


def test_median_ms_holds_the_gpu_between_warmup_and_the_timed_calls():
    """hold=True (a replayed phase): after the warm-up calls and before the first timed call's
    stamp the clock holds the GPU HOLD_CYCLES_PER_CALL cycles a timed call, so the host issues
    every timed call while the GPU spins; hold=False (eager) holds nothing."""
    class Clock:
        def __init__(self):
            self.log, self.t = [], 0.0

        def stamp(self):
            self.log.append("stamp")
            self.t += 1.0
            return self.t

        def ms(self, a, b):
            return b - a

        def sync(self):
            self.log.append("sync")

        def hold(self, cycles):
            self.log.append(("hold", cycles))

    for hold in (True, False):
        clock = Clock()
        timing.median_ms(clock, lambda: clock.log.append("call"), 4, warmup=2, hold=hold)
        timed = ["stamp", "call", "stamp"] * 4
        held = [("hold", 4 * timing.HOLD_CYCLES_PER_CALL)] if hold else []
        assert clock.log == ["call"] * 2 + held + timed + ["sync"], clock.log


# ---------------------------------------------------------------------------------------------
# The first hour of a new user: quiet where nothing is news, one line where something is

def test_loading_says_what_it_skips_but_not_t2d(tiny_ckpt, tmp_path, capsys):
    """Every saved head carries t2d (SGLang's draft-vocabulary mask; d2t says the same): loading it
    says nothing. A target's MTP layer is news: one line names it."""
    ckpt, _ = tiny_ckpt
    target = load_target(ckpt, max_batch_size=1, max_seq_len=8, dtype=torch.float64)
    save_draft(init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 1), tmp_path / "head")
    capsys.readouterr()
    load_draft(tmp_path / "head", target)
    assert "skipping" not in capsys.readouterr().out
    edit_checkpoint(ckpt, tmp_path / "mtp",
                    lambda t: t.update({"model.layers.8.mlp.gate.weight": torch.zeros(2)}))
    load_target(tmp_path / "mtp", max_batch_size=1, max_seq_len=8, dtype=torch.float64)
    said = [line for line in capsys.readouterr().out.splitlines() if "skipping" in line]
    assert len(said) == 1 and "MTP" in said[0], said


def _settled(flags):
    return run.settle(run.parse_args(flags.split()), torch.device("cpu"), 1)


def test_run_py_refuses_sizes_before_building(monkeypatch, capsys):
    """check_sizes, before build: caches and weights past the free memory refused in one line that
    names the flag and the estimate's parts; --topk past the vocabulary refused; positions past
    max_position_embeddings (256 for tiny) warned once. The estimate's caches are the real ones."""
    monkeypatch.setattr(timing, "build", lambda *a: pytest.fail("a model was built"))
    with pytest.raises(run.BadInput,
                       match=r"--context-len 10000000, batch 1: needs about \d+\.\d GB of memory \("
                                           r"KV caches .*\), this machine has \d+\.\d GB free"):
        run.check_sizes(_settled("--context-len 10000000"), torch.device("cpu"), 1)
    monkeypatch.setattr(timing, "memory_free", lambda device: (10 ** 6, "this machine"))
    with pytest.raises(run.BadInput, match="--prompt-len 16 \\+ --max-new-tokens 24, batch 1"):
        run.check_sizes(_settled(""), torch.device("cpu"), 1)
    monkeypatch.undo()
    monkeypatch.setattr(timing, "build", lambda *a: pytest.fail("a model was built"))
    cfg = _settled("--random-weights --context-len 8")
    cfg.dump, cfg.topk = "x.npz", 1000  # as settle_dump leaves them (it reads a prompt file)
    with pytest.raises(run.BadInput,
                       match=r"--topk 1000: must lie in \[1, the vocabulary's 256 ids\]"):
        run.check_sizes(cfg, torch.device("cpu"), 1)
    capsys.readouterr()
    run.check_sizes(_settled("--random-weights --context-len 300"), torch.device("cpu"), 1)
    said = capsys.readouterr().out
    assert said.count("warning: positions reach") == 1 and \
        "max_position_embeddings 256" in said, said
    assert "the timings hold but the tokens mean little" in " ".join(said.split()), said
    cfg = _settled("--random-weights --context-len 300")
    cfg.dump, cfg.topk, cfg.prompts = "x.npz", 1, [[1]]  # a dump's warning: it times nothing
    run.check_sizes(cfg, torch.device("cpu"), 1)
    said = " ".join(capsys.readouterr().out.split())
    assert "so the dumped tokens and log-probabilities mean little" in said, said
    run.check_sizes(_settled("--random-weights"), torch.device("cpu"), 1)
    assert "warning" not in capsys.readouterr().out
    # --moe-adaptive for experts that are not FP8, named by their format (on a CPU: fp32)
    for flags, held in (("", "fp32"), ("--random-weights --quant int4", r"INT4 \(fp32\)")):
        with pytest.raises(run.BadInput, match=f"--moe-adaptive 4: for FP8 routed experts; this "
                                               f"target's are {held}"):
            run.check_sizes(_settled(f"--moe-adaptive 4 {flags}"), torch.device("cpu"), 1)
    run.check_sizes(_settled("--moe-adaptive 4 --random-weights --quant fp8"),
                    torch.device("cpu"), 1)
    parts, _, _ = timing.memory_needed(_settled("--random-weights --context-len 100"),
                                       torch.device("cpu"), 1)
    target = Transformer(tiny(), 1,
                         timing.cache_slots(_settled("--random-weights --context-len 100")))
    head = Eagle3Draft(draft_preset("tiny"), target)
    # the target's stacked caches (its layers hold views of them), the head's own buffers
    caches = sum(t.numel() * t.element_size()
                 for t in [target.kv_caches, target.pe_caches, target.rope, *head.buffers()])
    assert parts["KV caches"] == caches, (parts, caches)


def test_run_py_refuses_a_config_of_another_model(tmp_path):
    """A --model-path whose config.json names another model (architectures, or model_type where
    it has none) or leaves out a size is refused by name before the memory estimate, which would
    otherwise size Kimi-K2's defaults; the committed pair's config passes."""
    ours = checkpoint.read_config(os.path.join(HERE, "checkpoints", "tiny-stdlib", "target"))
    for name, cfg, message in [
            ("llama", {"model_type": "llama"}, "model_type 'llama' is not one of"),
            ("arch", dict(ours, architectures=["LlamaForCausalLM"]),
             r"architectures \['LlamaForCausalLM'\] is not one of"),
            ("size", {k: v for k, v in ours.items() if k != "hidden_size"},
             "no hidden_size: not a DeepSeek-V3 / Kimi-K2 config")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(checkpoint.CheckpointError,
                           match=f"{tmp_path / name}/config.json: {message}"):
            timing.memory_needed(_settled(f"--model-path {tmp_path / name}"),
                                 torch.device("cpu"), 1)
    assert checkpoint.target_args(ours).hidden_size == ours["hidden_size"]


def test_run_py_cli_interrupt_and_rank_refusals(monkeypatch, capsys):
    """The entry point: Ctrl-C anywhere is one line on stderr and status 130; a refused flag under
    torchrun is said by rank 0 alone (status 2; the other ranks exit 0 so that torchrun names one
    failure), a checkpoint refusal by each rank that meets it, tagged."""
    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(run, "main", interrupted)
    assert run.cli([]) == 130
    assert capsys.readouterr().err == "run.py: interrupted (Ctrl-C); no output file written\n"
    for rank, said, status in (("0", "run.py: error: --reps 0: must be at least 1\n", 2),
                               ("1", "", 0)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setattr(run, "main", run.__dict__["parse_args"])
        assert run.cli(["--reps", "0"]) == status
        assert capsys.readouterr().err == said, rank
        assert run.print_refusal(CheckpointError("ckpt: missing")) == 2
        assert capsys.readouterr().err == f"run.py: error: [rank {rank}] ckpt: missing\n"


def test_run_py_cli_stdout_closed_is_quiet_and_the_json_file_whole(monkeypatch, tmp_path):
    """`run.py ... | head -1`: the --json file is written before the report, and a stdout closed
    by its reader ends the run quietly with status 141 (no traceback)."""
    cfg = types.SimpleNamespace(json=str(tmp_path / "r.json"))
    monkeypatch.setattr(timing, "prepare", lambda cfg, device: types.SimpleNamespace(cfg=cfg))
    monkeypatch.setattr(timing, "measure", lambda b, world: "r")
    monkeypatch.setattr(timing, "is_rank0", lambda: True)
    monkeypatch.setattr(report, "header", lambda b: "header")
    monkeypatch.setattr(report, "json_line", lambda r: '{"r": 1}\n')

    def closed(r, b):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(report, "report", closed)
    with pytest.raises(BrokenPipeError):
        run.bench(cfg, None, 1)
    assert (tmp_path / "r.json").read_text() == '{"r": 1}\n'
    code = ("import sys, run\nrun.main = lambda argv=None: print('x' * 10 ** 6) or 0\n"
            "sys.exit(run.cli())")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=HERE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert (p.wait(timeout=60), err) == (141, ""), err[-2000:]


def interrupt(p, every=2.0, timeout=300):
    """Ctrl-C a child until it exits (CPython drops a KeyboardInterrupt raised inside a __del__ or
    a garbage-collection callback, as it would a user's first Ctrl-C there); its (stdout,
    stderr)."""
    deadline = time.time() + timeout
    while True:
        p.send_signal(signal.SIGINT)
        try:
            return p.communicate(timeout=every)
        except subprocess.TimeoutExpired:
            if time.time() > deadline:
                raise


def said_on(stderr):
    """stderr without its progress bars (tqdm redraws them after carriage returns)."""
    return [line for line in stderr.replace("\r", "\n").splitlines()
            if line.strip() and not any(u in line
                                        for u in ("it/s", "s/it", "token/s", "tensor/s", "run/s"))]


def test_run_py_cli_refuses_an_output_it_cannot_write():
    cli = run_py("--json", "/nonexistent/r.json", timeout=300)
    assert (cli.returncode, cli.stdout) == (2, "") and said_on(cli.stderr) == [
        "run.py: error: --json /nonexistent/r.json: cannot write there (no folder "
        "/nonexistent)"], cli.stderr


@pytest.mark.slow
def test_run_py_cli_refuses_a_size_the_machine_cannot_hold(run_py_runs):
    cli = run_py_runs[0]["too_big"]
    assert (cli.returncode, cli.stdout) == (2, "") and len(said_on(cli.stderr)) == 1, cli.stderr
    assert said_on(cli.stderr)[0].startswith(
        "run.py: error: --context-len 10000000, batch 1: needs about")


def test_run_py_cli_interrupted_says_one_line_and_leaves_no_file(tmp_path):
    """SIGINT (Ctrl-C) in the middle of a run: exit status 130, one line, no --json file (nor a
    temporary one)."""
    err, out = tmp_path / "err.txt", tmp_path / "r.json"
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, RUN_PY, "--random-weights", "--reps", "100000",
                              "--json", str(out)],
                             cwd=HERE, env=CPU_ENV, stdout=subprocess.DEVNULL, stderr=f)
        deadline = time.time() + 120
        while "timing" not in err.read_text() and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
    assert rc == 130 and said_on(err.read_text()) == [
        "run.py: interrupted (Ctrl-C); no output file written"], err.read_text()[-2000:]
    assert os.listdir(tmp_path) == ["err.txt"]


def test_run_py_cli_torchrun_refuses_a_flag_once():
    """Under torchrun (2 CPU ranks) a refused flag is said once, by rank 0, which alone fails."""
    out = run_py("--max-new-tokens", "0", ranks=2, env=ONE_THREAD)
    errors = [line for line in out.stderr.splitlines() if line.startswith("run.py: error:")]
    assert out.returncode != 0 and \
        errors == ["run.py: error: --max-new-tokens 0: must be at least 1"], out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr and "rank      : 1" not in out.stderr, out.stderr[-3000:]


def _refused(cli, message):
    """One line on stderr matching `message`, status 2, no traceback, nothing on stdout."""
    said = said_on(cli.stderr)
    assert cli.returncode == 2 and "Traceback" not in cli.stderr, (cli.returncode,
                                                                   cli.stderr[-2000:])
    assert len(said) == 1 and said[0].startswith("run.py: error: "), cli.stderr[-2000:]
    assert re.search(message, said[0]), (message, said[0])
    assert cli.stdout == "", cli.stdout


def test_run_py_refuses_an_output_folder_it_cannot_write_in(tmp_path):
    """--json and --dump: the folder checked by creating a file there, before anything runs (/proc
    is a folder that os.access calls writable and that holds no new file)."""
    _refused(run_py("--json", "/proc/x.json"),
             r"--json /proc/x.json: cannot write there \(folder /proc: ")
    _refused(run_py("--dump", "/proc/x.npz", "--prompt-ids", str(tmp_path / "p.jsonl")),
             r"--dump /proc/x.npz: cannot write there \(folder /proc: ")
    assert not [p for p in os.listdir(HERE) if p.startswith(".run-py-check-")]


@pytest.mark.slow
def test_run_py_refuses_a_tree_wider_than_the_draft_vocabulary(run_py_runs):
    """topk above the head's draft vocabulary (64 for the tiny pair): one line, before the build."""
    _refused(run_py_runs[0]["tree_too_wide"],
             r"--speculative-eagle-topk 65: above the draft head's vocabulary of 64 ids")


def test_run_py_names_offered_before_torch_are_the_stages_names():
    """run.py spells the presets, all-reduces and kernels its flags offer (so --help needs no
    torch); they are the names the stages take."""
    assert set(run.PRESETS) == set(checkpoint.PRESETS) and run.ALLREDUCES == tuple(tp.ALLREDUCES)
    assert run.KERNELS == tuple(kernels.KERNELS) and \
        run.DRAFT_KERNELS == tuple(kernels.DRAFT_KERNELS)


def test_run_py_answers_help_and_refusals_before_importing_torch():
    """--help and the flag refusals import no torch (seconds on a small CPU): the flags are parsed
    before the stages are imported. Time it: `time python run.py --help`."""
    code = ("import sys, run\n"
            "try:\n    run.cli(['--help'])\nexcept SystemExit as e:\n    print('help', e.code)\n"
            "print('refused', run.cli(['--max-new-tokens', '0']))\n"
            "print('torch imported', 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                         env=CPU_ENV)
    assert out.stdout.splitlines()[-3:] == ["help 0", "refused 2",
                                            "torch imported False"], out.stdout[-500:]
    assert "usage: " in out.stdout and \
        "run.py: error: --max-new-tokens 0: must be at least 1" in out.stderr


def test_run_py_ctrl_c_while_importing_is_one_line():
    """Ctrl-C while torch and the stages are still being imported: status 130, one line, no
    traceback."""
    p = subprocess.Popen([sys.executable, RUN_PY, "--random-weights"], cwd=HERE, env=CPU_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)   # past run.py's own imports (argparse, numpy), inside torch's
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, (p.returncode, err[-2000:])
    assert said_on(err) == ["run.py: interrupted (Ctrl-C); no output file written"], err[-2000:]


def test_train_py_ctrl_c_while_importing_is_one_line(tmp_path):
    """train.py's twin of the test above: Ctrl-C while torch loads is one line and status 130."""
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--quick", "--out",
                          str(tmp_path / "pair")], cwd=tmp_path, env=CPU_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)   # inside torch's import (or, on a fast machine, later: one line there too)
    out, err = interrupt(p)
    assert p.returncode == 130 and "Traceback" not in err, (p.returncode, err[-2000:])
    said = said_on(err)
    assert len(said) == 1 and said[0].startswith("train.py: interrupted"), err[-2000:]


@pytest.mark.slow
def test_run_py_refuses_prompt_ids_outside_the_vocabulary_before_building(run_py_runs):
    """--prompt-ids with an id past the vocabulary (256 for the tiny pair): one line tagged
    --prompt-ids, before the model is built (so no dump: line)."""
    _refused(run_py_runs[0]["prompt_ids_outside"],
             r"--prompt-ids .*outside.jsonl: line 2 holds id 999, outside the vocabulary's 256 ids")
    assert not (run_py_runs[1] / "outside.npz").exists()


@pytest.mark.slow
def test_run_py_lines_fit_120_columns_and_say_what_a_run_does(run_py_runs):
    """Every line run.py prints within 120 columns (a tree run's component tables, the
    --random-weights note) and on a CPU the profiler's cost as a note, not a warning; --allreduce
    one-shot refused in one process; a dump's tree note speaks of its file; --help says what a dump
    is on a CPU and exit status 130."""
    cli, one_shot, helped = (run_py_runs[0][name] for name in ("lines", "one_shot", "help"))
    assert cli.returncode == 0, cli.stderr[-2000:]
    # the JSON: for machines
    lines, r = cli.stdout.splitlines()[:-1], json.loads(cli.stdout.splitlines()[-1])
    assert not [line for line in lines if len(line) > 120], [line for line in lines
                                                             if len(line) > 120]
    flat = " ".join(cli.stdout.split())
    assert "greedy speculative vs plain output: not compared" in flat and \
        "tree - decode" in flat, cli.stdout
    # SIMULATED routing's distinct experts labelled so in the phase table's header, its rows
    # leaving room for timings of 3 digits and a noisy mark; the component table's row too
    counts = [line for line in lines if "/eager " in line and "distinct experts" in line]
    assert len(counts) == 5 and all(line.endswith(" distinct experts") and len(line) <= 100
                                    for line in counts), counts
    assert "repetitions; floors need a GPU; distinct experts: per MoE layer (SIMULATED " \
        "uniform))" in flat
    assert "distinct experts: per MoE layer (SIMULATED uniform)):" in flat
    # on a CPU the profiler's cost per op is said under the component table, not warned of
    assert "the profiler's own cost per op makes the summed op time exceed" in flat
    assert not any("profiled run's summed" in w for w in r["warnings"])
    _refused(one_shot,
             r"--allreduce one-shot: picks real TP's all-reduce .* a single process runs none")
    cfg = _settled("--speculative-eagle-topk 2 --speculative-num-draft-tokens 4")
    assert "end-to-end rows" in run.tree_note(cfg) and "isolated" in run.tree_note(cfg)
    cfg.dump = "x.npz"
    assert "the dump drafts a tree" in run.tree_note(cfg) and "isolated" not in run.tree_note(cfg)
    help_text = " ".join(helped.stdout.split())
    assert "the trained tiny pair's (the CPU default)" in help_text and \
        "130 interrupted (Ctrl-C)" in help_text


# ---------------------------------------------------------------------------------------------
# Source style

def test_source_lines_fit_100_columns():
    """Every line of the repository's tracked Python files within 100 columns, the project's one
    width."""
    names = subprocess.run(["git", "ls-files", "*.py"], cwd=HERE, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    over = []
    for name in names:
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            over += [f"{name}:{i}:{len(line)}" for i, line in enumerate(f.read().splitlines(), 1)
                     if len(line) > 100]
    assert names and not over, f"{len(over)} lines past 100 columns, first: {over[:10]}"


# ---------------------------------------------------------------------------------------------
# Routing for timing: distinct and trace (routing.py), refused in one line where they cannot run

@pytest.mark.slow
def test_run_py_refuses_routing_flags_before_building(monkeypatch, tmp_path, run_py_runs):
    """The trained pair routes top-4 of 16 experts; its verify reads 4 tokens (D in [4, 16]),
    a --batch-size 2 random tiny 8 (D in [4, 16] too), num_steps 1 a verify of 2 (D in [4, 8])."""
    monkeypatch.setattr(timing, "build", lambda *a: pytest.fail("a model was built"))
    big = tmp_path / "kimi.npz"
    routing.save_trace(big, torch.zeros(2, 5, 8, dtype=torch.long), 384, 8)
    cpu = torch.device("cpu")
    for flags, message in [
            ("--routing distinct --distinct-experts 3", r"--distinct-experts 3: .* \[4, 16\]"),
            ("--routing distinct --distinct-experts 17", r"--distinct-experts 17: .* \[4, 16\]"),
            ("--routing distinct --distinct-experts 9 --speculative-num-steps 1",
             r"--distinct-experts 9: must lie in \[4, 8\] \(top-4; a verify of 2 tokens"),
            (f"--routing trace --routing-trace {big}",
             f"--routing-trace {big}: 384 experts, top-8; the model routes top-4 of 16"),
            (f"--routing trace --routing-trace {HERE}/README.md",
             rf"^--routing-trace {HERE}/README.md is not an .npz file \(a zip of numpy arrays\): "
             "it starts with b'# EA'$")]:
        with pytest.raises(run.BadInput, match=message):
            run.check_sizes(_settled(flags), cpu, 1)
    run.check_sizes(_settled("--routing distinct --distinct-experts 16 --random-weights "
                             "--batch-size 2"), cpu, 1)
    for flags, message in [
            ("--routing distinct", "--routing distinct needs --distinct-experts D"),
            ("--distinct-experts 6", "--distinct-experts 6 is for --routing distinct"),
            ("--routing trace", "--routing trace needs --routing-trace FILE"),
            (f"--routing-trace {big}", "--routing-trace is for --routing trace"),
            ("--routing trace --routing-trace none.npz", "--routing-trace none.npz: no such file"),
            ("--dump-routing", "--dump-routing records the routing of a --dump run"),
            ("--dump x.npz --prompt-ids p --distinct-sweep", "--distinct-sweep shapes the timing"),
            ("--dump x.npz --prompt-ids p --routing distinct --distinct-experts 6",
             "--dump records the model's own routing: drop --routing distinct")]:
        with pytest.raises(run.BadInput, match=message):
            run.parse_args(flags.split())
    # from the command line (the trace of RUN_PY_RUNS: the same as `big`)
    distinct, trace = (run_py_runs[0][name] for name in ("distinct_17", "trace_of_another_model"))
    _refused(distinct, r"--distinct-experts 17: must lie in \[4, 16\]")
    _refused(trace, "384 experts, top-8; the model routes top-4 of 16")


@pytest.mark.slow
def test_run_py_distinct_routing_and_its_sweep_end_to_end(run_py_runs):
    """--routing distinct D: every timed verify reaches D experts a MoE layer, the decode step
    top-k, labelled SIMULATED; --distinct-sweep times the verify at D = 4, 6, 8, 12, 16 (top 4 of
    16, 4 tokens), each counted as it ran, its lines within 100 columns; a --dump-routing file
    replays in --routing trace, labelled TRACE. Its verify sweep (--sweep-tokens 6) times 6 tokens
    and the chains of num_steps 1 to 3, whose cycles the cost model prices."""
    cli, dumped = (run_py_runs[0][name] for name in ("distinct", "dump_routing"))
    trace = run_py_runs[1] / "d.npz"   # dump_routing's: prompts [10, 20, 30, 40, 50], [7, 8, 9]
    assert cli.returncode == 0, cli.stderr[-2000:]
    r = json.loads(cli.stdout.splitlines()[-1])
    assert r["env"]["routing"] == "distinct" and r["env"]["simulated_routing"] is True
    assert r["env"]["distinct_experts_asked"] == 6
    assert list(r["verify_sweep_ms"]) == ["1", "2", "3", "4", "6"] and \
        sorted(r["cost_model"]["steps"]) == ["1", "2", "3"]
    assert r["contexts"]["16"]["distinct_experts"] == {"decode_step": 4, "verify/prefill": 6,
                                                       "verify/decode": 6}
    s = r["routing_sweep"]
    assert [p["distinct"] for p in s["points"]] == [4, 6, 8, 12, 16] and s["tokens"] == 4
    assert all(p["distinct_ran"] == p["distinct"] for p in s["points"])
    for p in s["points"]:
        assert p["plain_steps"] == pytest.approx(p["verify_ms"] / s["plain_step_ms"])
        assert p["break_even_accept_len"] == pytest.approx(p["cycle_ms"] / s["plain_step_ms"])
    # each point's verify has its spread, so a noisy one is warned of like any other timing
    assert set(r["spread_ms"]["routing_sweep"]["points"]) == {"D=4", "D=6", "D=8", "D=12", "D=16"}
    out = cli.stdout
    table = out[out.index("verify of 4 tokens across distinct experts"):].split("\n\n")[0]
    assert not [line for line in table.splitlines() if len(line) > 100], table
    assert "routing SIMULATED distinct (D = 6" in out and "Across distinct experts" in out
    assert "6.0 distinct experts" in out and \
        "distinct experts: per MoE layer (SIMULATED distinct)" in " ".join(out.split())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    t = routing.read_trace(trace, 16, 4)
    # each row's prompt and output but its last token: P + N - 1 = 10, 8 for the shorter prompt
    assert t.sequence_lengths == [10, 8] and t.ids.shape[1] == 18
    cli = ran(run_py_runs, "trace_replay")   # run.py --routing trace --routing-trace that file
    r = json.loads(cli.stdout.splitlines()[-1])
    assert r["env"]["routing"] == "trace" and r["env"]["routing_trace"]["tokens"] == 18
    assert "routing TRACE (" in cli.stdout and \
        "distinct experts: per MoE layer (TRACE))" in " ".join(cli.stdout.split())
