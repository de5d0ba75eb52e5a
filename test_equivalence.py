"""The reference's equivalences: every parallel or incremental path against its plain reference,
on fresh random inputs. TP N against TP 1, extend against decode, incremental against whole, HF's
DeepseekV3; checkpoints and quantized loading; EAGLE-3 lossless against plain greedy (chains and
trees), training's unrolled head, the tiny trained pair; CUDA graphs against eager.

CPU tests use the tiny preset (milliseconds a forward) and spawn gloo ranks for TP. Tests marked
`gpu` skip on a machine without CUDA, saying so (conftest.py); run them on the GPU before calling
graph work done: `python -m pytest -q -m gpu` there.
"""
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import baseline
import checkpoint
import kernels
import model
import train
from checkpoint import (CheckpointError, init_random, init_random_draft, load_draft, load_target,
                        save_draft, save_target)
from draft import (draft_preset, draft_vocab, Eagle3Draft, set_target_aux_layers, train_step, Tree,
                   tree_capacity, ttt_loss)
from graphs import copy_out, CudaGraphs, function_id, function_name, GraphKey
from model import ModelArgs, Transformer
from testing import (assert_close, captured_calls, eager_without_pdl, edit_checkpoint, flat,
                     fp8_checkpoint, gpu_models, HERE, int4_checkpoint, PlantedProposer, PROMPTS,
                     random_tree, reference_sequences, run_ranks, run_steps, step_inputs, tiny,
                     TRITON_DEVICE)
from tp import TP
from verify import (Probe, accept, accept_tree, generate, sample, simulated_accept,
                    simulated_center, simulated_mean, tree_ancestors, tree_emitted,
                    tree_forward, tree_visible, walk_tree)


# ---------------------------------------------------------------------------------------------
# The target: TP N against TP 1, extend against decode, incremental against whole, the router
# on a hand case, HF's DeepseekV3ForCausalLM

def _tp_worker(ckpt, seed, dtype, draft_path=None, draft_seed=None):
    """On each rank: the seeded random model and the checkpoint-loaded model; with draft_path, also
    the saved draft head's logits and drafts (_draft_tp_worker)."""
    from_seed = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=dtype),
                            seed)
    loaded = load_target(ckpt, max_batch_size=3, max_seq_len=32, dtype=dtype)
    draft = () if draft_path is None else _draft_tp_worker(draft_path, draft_seed)
    return run_steps(from_seed), run_steps(loaded), *draft


@pytest.mark.parametrize("world", [2, 4])
def test_tp_equals_tp1(world, tiny_ckpt, tmp_path):
    """The target at TP `world` against TP 1 (seeded and loaded from a checkpoint), and in the same
    gloo ranks (one spawn a world: a CI core starts a rank in seconds) the saved draft head loaded
    at TP `world` against TP 1: its logits and the drafts it proposes."""
    ckpt, _ = tiny_ckpt
    seed = 7
    ref_seed = run_steps(init_random(Transformer(tiny(), 3, 32, dtype=torch.float64), seed))
    ref_loaded = run_steps(load_target(ckpt, 3, 32, dtype=torch.float64))
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float64),
                         9)
    save_draft(init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 10), tmp_path)
    ref_logits, ref_drafts = _draft_tp_worker(tmp_path, 9)
    got_seed, got_loaded, logits, drafts = run_ranks(world, _tp_worker, ckpt, seed, torch.float64,
                                                     tmp_path, 9)
    assert_close(got_seed, ref_seed, 1e-10, f"TP {world} vs TP 1, seeded init")
    assert_close(got_loaded, ref_loaded, 1e-10, f"TP {world} vs TP 1, loaded checkpoint")
    assert_close(logits, ref_logits, 1e-10, f"draft logits TP {world} vs TP 1")
    assert torch.equal(drafts, ref_drafts), f"draft proposals TP {world} vs TP 1"


def test_extend_decode_and_incremental_agree():
    """Decode attention against extend attention over a whole prompt, and a prompt in three parts
    (15 tokens, one, four) in each mode against one forward, from zeroed caches: each part reads
    only what the parts before it wrote."""
    m = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=40, dtype=torch.float64), 3)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, m.args.vocab_size, (3, 20), generator=g)
    pos = torch.arange(20).expand(3, 20)
    whole = {mode: m(tokens, pos, mode).logits for mode in ("extend", "decode")}
    assert_close(whole["decode"], whole["extend"], 1e-10,
                 "decode vs extend attention, whole prompt")
    for mode in ("extend", "decode"):
        m.kv_caches.zero_()
        m.pe_caches.zero_()
        # prefill 15, one token, then a (k+1) = 4 token step at the offset
        parts = [m(tokens[:, :15], pos[:, :15], "extend").logits,
                 m(tokens[:, 15:16], pos[:, 15:16], mode).logits,
                 m(tokens[:, 16:], pos[:, 16:], mode).logits]
        assert_close(torch.cat(parts, 1), whole["extend"], 1e-10,
                     f"incremental {mode} vs one forward")


def test_kv_len_bounds_the_read_without_changing_results():
    """kv_len=16 reads only the first 16 slots (NaN past them changes nothing) and gives what
    reading the whole cache gave before."""
    m = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=64, dtype=torch.float64), 4)
    prefill, prefill_pos, step, step_pos = step_inputs(m.args.vocab_size, seed=4)
    m(prefill, prefill_pos)
    full = m(step, step_pos, "decode").logits
    assert int(step_pos.max()) < 16
    for caches in (m.kv_caches, m.pe_caches):
        caches[:, :, 16:] = float("nan")
    assert_close(m(step, step_pos, "decode", kv_len=16).logits, full, 1e-12,
                 "kv_len=16 vs full cache")
    head = Eagle3Draft(draft_preset("tiny"), m)                 # the target's cache size, 64
    hidden = torch.zeros(*step.shape, head.args.hidden_size, dtype=torch.float64)
    for bad in (0, 65, 16.0, True):   # none of them "all slots" or a slot count the cache has
        with pytest.raises(ValueError, match="kv_len must be an int from 1 to the cache's 64"):
            m(step, step_pos, "decode", kv_len=bad)
        with pytest.raises(ValueError, match="kv_len must be an int from 1 to the cache's 64"):
            head(step, step_pos, hidden, kv_len=bad)


def test_aux_states_are_the_chosen_layer_outputs():
    m = init_random(Transformer(tiny(), max_batch_size=1, max_seq_len=16, dtype=torch.float64,
                                aux_layer_ids=[6, 2, 0]), 6)
    assert m.aux_layer_ids == [0, 2, 6]
    tokens, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    seen = []
    # a layer returns (its MLP output, the stream it read): their sum is its output
    hooks = [m.layers[i].register_forward_hook(lambda mod, i_, o: seen.append(o[0] + o[1]))
             for i in (0, 2, 6)]
    logits, aux = m(tokens, pos, capture_aux=True)
    for h in hooks:
        h.remove()
    assert aux.shape == (1, 3, 3 * m.args.hidden_size)
    assert torch.equal(aux, torch.cat(seen, -1))
    assert Transformer(tiny(), 1, 8).aux_layer_ids == [1, 3, 4]  # 1, L//2 - 1, L - 4 for L = 8
    # toy depths: the default's ids clamp into [0, L), two may name one layer, read twice
    for L, ids in ((4, [0, 1, 1]), (5, [1, 1, 1]), (6, [1, 2, 2])):
        m = init_random(Transformer(tiny(num_hidden_layers=L), 1, 8, dtype=torch.float64), 6)
        assert m.aux_layer_ids == ids
        logits, aux = m(tokens, pos, capture_aux=True)
        D = m.args.hidden_size
        assert aux.shape == (1, 3, 3 * D) and torch.equal(aux[..., D:2 * D], aux[..., 2 * D:])
    with pytest.raises(ValueError, match="EAGLE-3 reads 3 layers"):
        Transformer(tiny(), 1, 8, aux_layer_ids=[0, 2])


def test_router_follows_noaux_tc_on_a_hand_case():
    """model.Router as DeepSeek-V3's noaux_tc, on scores set by hand: 8 experts in 4 groups of 2,
    2 groups kept, 2 experts a token. Sigmoid scores [.9 .1 | .62 .30 | .56 .54 | .8 .05], expert
    3's correction bias +0.3 (biased: .60). A group scores the sum of its top-2 biased scores
    (1.0, 1.22, 1.10, .85): groups 1 and 2 kept (their maxima alone would keep 0 and 3); their
    experts by biased score: 2 and 3 (by unbiased ones: 2 and 4); weighed by their unbiased
    scores .62 and .30, normalized, times routed_scaling_factor 2.5."""
    args = tiny(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                routed_scaling_factor=2.5, norm_topk_prob=True)
    router = model.Router(args, "cpu", torch.float64)
    scores = torch.tensor([0.9, 0.1, 0.62, 0.30, 0.56, 0.54, 0.8, 0.05], dtype=torch.float64)
    x = torch.zeros(1, args.hidden_size, dtype=torch.float64)
    x[0, 0] = 1.0                                             # x . weight[e] = logit(scores[e])
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.logit(scores)
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[3] = 0.3
    ids, weights = router(x)
    assert ids.tolist() == [[2, 3]], f"experts {ids.tolist()}, not [[2, 3]]"
    want = torch.tensor([[0.62, 0.30]], dtype=torch.float64) / (0.62 + 0.30) * 2.5
    assert_close(weights, want, 1e-9, "router weights of experts 2 and 3")


@contextlib.contextmanager
def hugging_face_kernels():
    """transformers imports a package named kernels of its own (Hugging Face's), now and lazily
    later, which this repository's kernels/ shadows where the repository is on the path: inside
    this block that path and our kernels modules are set aside; after it, ours are back."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = {n: m for n, m in sys.modules.items() if n == "kernels" or n.startswith("kernels.")}
    path = list(sys.path)
    try:
        for n in ours:
            del sys.modules[n]
        sys.path[:] = [p for p in path if os.path.abspath(p or ".") != here]
        yield
    finally:
        sys.path[:] = path
        for n in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
            del sys.modules[n]
        sys.modules.update(ours)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("transformers"),
                    reason="transformers is not installed (pip install transformers to compare "
                           "with HF)")
def test_matches_hf_transformers(tiny_ckpt):
    """Same weights, same logits as transformers' DeepseekV3ForCausalLM (float32: its grouped
    experts take no float64)."""
    ckpt, _ = tiny_ckpt
    ours = load_target(ckpt, max_batch_size=2, max_seq_len=32, dtype=torch.float32)
    tokens = torch.randint(0, ours.args.vocab_size, (2, 24),
                           generator=torch.Generator().manual_seed(8))
    with hugging_face_kernels(), torch.no_grad():
        from transformers import DeepseekV3ForCausalLM
        hf = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        ref = hf(tokens).logits
    got = ours(tokens, torch.arange(24).expand(2, 24)).logits
    assert_close(got, ref, 2e-5, "ours vs HF DeepseekV3")


# ---------------------------------------------------------------------------------------------
# Checkpoints: round trip, per-rank memory, clear errors; YaRN's RoPE tables against the
# formula, RoPE's interleaved pairs

def test_save_load_round_trip_is_exact(tiny_ckpt):
    ckpt, m = tiny_ckpt
    loaded = load_target(ckpt, max_batch_size=3, max_seq_len=32, dtype=torch.float64)
    for (name, a), (_, b) in zip(m.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(run_steps(loaded), run_steps(m))


def assert_same_parameters(got, want, what):
    names = [n for n, _ in want.named_parameters()]
    assert [n for n, _ in got.named_parameters()] == names, what
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8),
                                                  b.view(torch.uint8)), (what, name)


@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_saved_pair_loads_as_each_ranks_slices(quant, tmp_path):
    """save_target / save_draft at TP 1, then load_target / load_draft at TP 1 and on each rank of
    TP 2: every rank holds exactly the parameters the seeded init gives that rank (the init is
    the same model at any TP), plain, with INT4 experts (kept packed) and FP8 experts (kept FP8,
    in 16 x 24 blocks, so a rank's slice starts inside a block)."""
    qc = {None: None, "int4": "int4", "fp8": checkpoint.fp8_quantization_config((16, 24))}[quant]
    args = tiny(moe_intermediate_size=64, quantization_config=qc)

    def pair(tp_):
        target = init_random(Transformer(args, 2, 16, dtype=torch.float32, tp=tp_), 11)
        return target, init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 12)
    target, head = pair(None)
    save_target(target, tmp_path / "target", max_shard_bytes=100_000)
    save_draft(head, tmp_path / "draft")
    for tp_ in (TP(0, 1), TP(0, 2), TP(1, 2)):
        where = f"{quant or 'plain'}, rank {tp_.rank} of TP {tp_.world_size}"
        want_target, want_head = pair(tp_)
        got_target = load_target(tmp_path / "target", 2, 16, dtype=torch.float32, tp=tp_)
        assert_same_parameters(got_target, want_target, f"target, {where}")
        assert_same_parameters(load_draft(tmp_path / "draft", got_target), want_head,
                               f"draft, {where}")


MEMORY_PROBE = r"""
import sys, threading, time, torch
sys.path.insert(0, sys.argv[2])
from checkpoint import load_target
from tp import TP
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
peak, done = [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], status("RssAnon:"))
        time.sleep(0.0005)
base_anon, base_hwm = status("RssAnon:"), status("VmHWM:")
t = threading.Thread(target=sample); t.start()
m = load_target(sys.argv[1], dtype=torch.bfloat16, tp=TP(rank=1, world_size=4), max_seq_len=16)
done[0] = True; t.join()
peak[0] = max(peak[0], status("RssAnon:"))
print(peak[0] - base_anon, status("VmHWM:") - base_hwm)
"""


def test_rank_loads_only_its_quarter():
    """A rank of four loading a >= 512 MiB checkpoint: its peak anonymous memory (sampled) grows by
    less than half the checkpoint, and even counting the file pages safetensors maps in (page
    cache, shared by all ranks), its resident peak stays below the whole checkpoint."""
    args = ModelArgs(vocab_size=4096, hidden_size=1024, intermediate_size=4096,
                     moe_intermediate_size=4096,
                     num_hidden_layers=2, num_attention_heads=8, n_routed_experts=22,
                     num_experts_per_tok=2,
                     first_k_dense_replace=0, q_lora_rank=256, kv_lora_rank=128,
                     qk_nope_head_dim=64,
                     qk_rope_head_dim=32, v_head_dim=64, rope_scaling=None)
    with tempfile.TemporaryDirectory() as d:
        m = Transformer(args, max_seq_len=16, dtype=torch.bfloat16)
        for p in m.parameters():
            p.fill_(0.01)
        save_target(m, d, max_shard_bytes=256 << 20)
        del m
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        assert size >= 512 << 20
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, d, HERE], capture_output=True,
                             text=True, check=True).stdout.split()
        anon_growth, hwm_growth = int(out[-2]), int(out[-1])
        assert anon_growth < size / 2, \
            f"anonymous memory grew {anon_growth / 2**20:.0f} MiB of {size / 2**20:.0f}"
        assert hwm_growth < size, \
            f"resident peak grew {hwm_growth / 2**20:.0f} MiB of {size / 2**20:.0f}"


KEY = "model.layers.2.self_attn.kv_b_proj.weight"


@pytest.mark.parametrize("edit, error, words", [
    (lambda t: t.pop(KEY), CheckpointError, ["missing", KEY]),
    (lambda t: t.update({"model.extra.weight": torch.zeros(2)}), CheckpointError,
     ["unexpected", "model.extra.weight"]),
    (lambda t: t.update({KEY: torch.zeros(3, 4, dtype=torch.float64)}), ValueError,
     [KEY, "[128, 32]", "[3, 4]"]),
    (lambda t: t.update({KEY: t[KEY].to(torch.int32)}), CheckpointError,
     [KEY, "I32", "model.safetensors"]),
    # an MTP layer: skipped
    (lambda t: t.update({"model.layers.8.mlp.gate.weight": torch.zeros(2)}), None, []),
])
def test_bad_checkpoints_name_the_problem(tiny_ckpt, edit, error, words):
    """A missing, unexpected, misshapen or mistyped tensor is refused with an error naming it; an
    MTP layer's tensor (layers.8) is skipped: that checkpoint loads, with the saved model's
    logits."""
    ckpt, m = tiny_ckpt
    with tempfile.TemporaryDirectory() as d:
        bad = os.path.join(d, "bad")
        edit_checkpoint(ckpt, bad, edit)
        if error is None:
            loaded = load_target(bad, max_batch_size=3, max_seq_len=32, dtype=torch.float64)
            assert torch.equal(run_steps(loaded), run_steps(m))
            return
        with pytest.raises(error) as e:
            load_target(bad, max_batch_size=1, max_seq_len=8, dtype=torch.float64)
        for w in words:
            assert w in str(e.value), (w, str(e.value))


def _truncate(f):
    data = open(f, "rb").read()
    open(f, "wb").write(data[:len(data) // 2])


def _set_config(f, **kw):
    cfg = json.load(open(f))
    json.dump(dict(cfg, **kw), open(f, "w"))


BROKEN = [  # (what, file to edit or None: the folder is missing, edit, what the error must say)
    ("missing", None, None, "{dir}: no such file or folder"),
    ("no config", "config.json", os.remove, "{dir} has no config.json"),
    ("not JSON", "config.json",
     lambda f: open(f, "w").write('{\n  "hidden_size": 64,\n  "vocab_size": ,\n}'),
     "{dir}/config.json line 3 column 17: not JSON"),
    ("wrong type", "config.json", lambda f: _set_config(f, hidden_size="abc"),
     "{dir}/config.json: hidden_size = 'abc' is not int"),
    ("truncated", "{tensors}", _truncate, "{dir}/{tensors}: not a readable safetensors file"),
    ("corrupt", "{tensors}", lambda f: open(f, "w").write("not a tensor file"),
     "{dir}/{tensors}: not a readable safetensors file"),
]


def test_unreadable_checkpoints_are_one_error_naming_the_file(tiny_ckpt, tmp_path):
    """Target and draft alike: each problem is a CheckpointError (a ValueError) whose message
    names the file, as run.py prints it."""
    ckpt, m = tiny_ckpt
    shard = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))[1]
    save_draft(init_random_draft(Eagle3Draft(draft_preset("tiny"), m), 3), tmp_path / "draft")
    for kind, src, tensors in (("target", ckpt, shard),
                               ("draft", str(tmp_path / "draft"), "model.safetensors")):
        for what, name, edit, message in BROKEN:
            bad = str(tmp_path / f"{kind} {what}".replace(" ", "_"))
            if name is not None:
                shutil.copytree(src, bad)
                edit(os.path.join(bad, name.format(tensors=tensors)))
            with pytest.raises(CheckpointError) as e:
                if kind == "target":
                    load_target(bad, max_seq_len=8, dtype=torch.float64)
                else:
                    load_draft(bad, m)
            assert message.format(dir=bad, tensors=tensors) in str(e.value), (kind,
                                                                              what, str(e.value))


def test_world_size_that_does_not_divide_is_named():
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by .* 3"):
        Transformer(tiny(vocab_size=258), tp=TP(0, 3))
    with pytest.raises(ValueError, match="vocab_size = 256 is not divisible"):
        Transformer(tiny(), tp=TP(0, 3))
    with pytest.raises(ValueError, match="moe_intermediate_size = 32 is not divisible"):
        Transformer(tiny(num_attention_heads=6, vocab_size=258, intermediate_size=132), tp=TP(0, 6))


def test_config_spellings_and_refusals():
    old = checkpoint.target_config(tiny())
    new = dict(old)
    rs = dict(new.pop("rope_scaling"))
    rs["rope_type"] = rs.pop("type")
    new["rope_parameters"] = dict(rs, rope_theta=new.pop("rope_theta"))
    a, b = checkpoint.target_args(old), checkpoint.target_args(new)
    assert a == b and a.softmax_scale == b.softmax_scale and a.is_yarn
    nested = checkpoint.target_args({"architectures": ["KimiK25ForConditionalGeneration"],
                                     "text_config": old})
    assert nested == a
    for key, value in [("scoring_func", "softmax"), ("topk_method", "greedy"),
                       ("hidden_act", "gelu")]:
        with pytest.raises(NotImplementedError, match=f"{key} = '{value}'"):
            checkpoint.target_args(dict(old, **{key: value}))
    with pytest.raises(NotImplementedError, match="rope_scaling type 'linear'"):
        checkpoint.target_args(dict(old, rope_scaling={"type": "linear", "factor": 2.0}))
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(dict(old, quantization_config={"quant_method": "fp8"}), f)
        with pytest.raises(NotImplementedError, match="fp8"):
            load_target(d)


def test_yarn_attention_factor_as_hf():
    """The cos/sin tables carry YaRN's attention factor: rope_scaling's own attention_factor when
    given (as transformers reads it), else mscale(factor, mscale) / mscale(factor,
    mscale_all_dim)."""
    rs = dict(type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=0.8,
              mscale_all_dim=1.0)
    for scaling, want in ((rs, model.yarn_mscale(4.0, 0.8) / model.yarn_mscale(4.0, 1.0)),
                          (dict(rs, attention_factor=1.25),
                           1.25), (dict(rs, mscale=0, attention_factor=0.5), 0.5)):
        cos, sin = model.rope_tables(8, 10000.0, scaling, 16, "cpu")
        assert_close((cos ** 2 + sin ** 2).sqrt(), torch.full_like(cos, want), 1e-6,
                     f"attention factor {scaling}")


def yarn_inv_freq(dim, theta, factor, original, beta_fast, beta_slow):
    """YaRN's frequencies (arXiv:2309.00071, as DeepSeek-V3's precompute_freqs_cis computes them):
    the fast dimensions kept, the slow ones divided by factor, a linear ramp between the
    dimensions that turn beta_fast and beta_slow times over the original context."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def dim_of(turns):
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3))
    kept = 1 - ramp.clamp(0, 1)                          # 1: a fast dimension, left as it is
    return freqs / factor * (1 - kept) + freqs * kept


@pytest.mark.parametrize("factor,positions", [(32.0, 131072), (64.0, 262144)])
def test_rope_tables_at_kimi_k2s_yarn_follow_the_formula(factor, positions):
    """Kimi-K2's YaRN (rope_theta 50000, 64 rope dims, factor 32 (K2-Instruct) or 64
    (K2-Thinking), beta_fast = beta_slow = 1, mscale = mscale_all_dim = 1: attention factor 1) at
    every position of the context, against YaRN's formula written out here; and the softmax scale
    192^-0.5 x mscale(factor, 1)^2."""
    rs = dict(type="yarn", factor=factor, original_max_position_embeddings=4096, beta_fast=1.0,
              beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    cos, sin = model.rope_tables(64, 50000.0, rs, positions, "cpu")
    angle = torch.outer(torch.arange(positions, dtype=torch.float32),
                        yarn_inv_freq(64, 50000.0, factor, 4096, 1.0, 1.0))
    assert_close(cos, angle.cos(), 1e-5, f"cos, factor {factor}")
    assert_close(sin, angle.sin(), 1e-5, f"sin, factor {factor}")
    args = model.ModelArgs(rope_scaling=rs, max_position_embeddings=positions)
    want = 192 ** -0.5 * (0.1 * math.log(factor) + 1.0) ** 2
    assert abs(args.softmax_scale - want) < 1e-12, (args.softmax_scale, want)


def test_rope_rotates_interleaved_pairs():
    """model.apply_rope turns each pair (x[2i], x[2i+1]) by angle i (DeepSeek-V3's layout, not
    the two halves of rotate_half): the unit vector at dim 2i comes out as (cos, sin) at dims 2i,
    2i+1, the one at dim 2i+1 as (-sin, cos), and zero elsewhere."""
    R = 8
    angles = torch.tensor([0.3, 0.7, 1.1, 1.9])
    rope = torch.stack((angles.cos(), angles.sin()), -1).view(1, 1, R // 2, 2)  # [B, T, R/2, 2]
    for i, (c, s) in enumerate(zip(angles.cos(), angles.sin())):
        for d, pair in ((2 * i, (c, s)), (2 * i + 1, (-s, c))):
            x, want = torch.zeros(1, 1, R), torch.zeros(R)
            x[..., d] = 1.0
            want[2 * i], want[2 * i + 1] = pair
            assert_close(model.apply_rope(x, rope)[0, 0], want, 1e-6, f"unit vector at dim {d}")


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints: INT4 experts (kept packed) and FP8 blocks (dequantized at load) against
# the same weights dequantized and saved plain

def test_int4_bit_layout():
    # compressed-tensors pack-quantized (checkpoint.py): element c of a row sits in word c//8 at
    # bits 4*(c%8)..+3, stored as q + 8
    q = torch.tensor([[-8, -1, 0, 7, 3, -5, 1, 2]])
    nibbles = "A93BF870"   # q + 8 = 0 7 8 15 11 3 9 10, written from element 7 down to element 0
    word = int(nibbles, 16) - 2**32   # the top nibble is >= 8: a negative int32
    assert checkpoint.pack_int4(q).tolist() == [[word]]
    assert model.unpack_int4(torch.tensor([[word]], dtype=torch.int32)).tolist() == q.tolist()
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (5, 3, 64), generator=g)
    q[0, 0, :8] = -8   # the edge: nibble 0, and a word of all-zero bits
    packed = checkpoint.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 3, 8)
    assert torch.equal(model.unpack_int4(packed).long(), q)
    scale = torch.rand(5, 3, 2, generator=g)
    w = model.dequantize_int4(packed, scale, 32)
    assert torch.equal(w, q * scale.repeat_interleave(32, -1))


def _quant_worker(quant, plain):
    return run_steps(load_target(quant, 3, 32,
                                 dtype=torch.float32)), run_steps(load_target(plain, 3, 32,
                                                                              dtype=torch.float32))


@pytest.mark.parametrize("make", [int4_checkpoint, fp8_checkpoint])
def test_quantized_checkpoint_equals_dequantized(make, tmp_path):
    quant, plain = make(str(tmp_path))
    loaded = load_target(quant, 3, 32, dtype=torch.float32)
    if make is int4_checkpoint:
        # stays packed
        assert loaded.layers[1].mlp.experts.gate_proj.weight_packed.dtype == torch.int32
    else:
        # stays FP8
        assert loaded.layers[1].mlp.experts.down_proj.weight.dtype == torch.float8_e4m3fn
    for world in (1, 2):
        got, ref = _quant_worker(quant,
                                 plain) if world == 1 else run_ranks(2, _quant_worker, quant, plain)
        assert_close(got, ref, 1e-5, f"{make.__name__} at TP {world}: quantized vs dequantized")
        assert ref.abs().max() > 0.1


def small_steps(m):
    """Logits of a 2 x 3 prefill and a 2-token decode step: run_steps, smaller (Triton's CPU
    interpreter takes ~0.3-1 s per fused MoE call)."""
    tokens = torch.tensor([[5, 17, 3, 250, 9], [41, 2, 199, 64, 8]], device=m.device)
    pos = torch.arange(5, device=m.device).expand(2, 5)
    return torch.cat([m(tokens[:, :3], pos[:, :3], "extend").logits,
                      m(tokens[:, 3:], pos[:, 3:], "decode").logits],
                     1).cpu()


def _fused_quant_worker(quant, plain, device, tp=None):
    fused = load_target(quant, 2, 16, device=device, dtype=torch.float32, tp=tp)
    kernels.accelerate(fused, moe="fused")
    ref = load_target(plain, 2, 16, device=device, dtype=torch.float32, tp=tp)
    return small_steps(fused), small_steps(ref)


@pytest.mark.triton
@pytest.mark.parametrize("make", [int4_checkpoint, fp8_checkpoint])
def test_quantized_checkpoint_through_fused_moe_equals_dequantized(make, tmp_path):
    """The fused kernel reads the experts as stored (INT4 words, FP8 in 32 x 24 blocks, TP-2 slices
    starting inside a block along rows and columns): equal to the dequantized checkpoint through the
    gather path, at TP 1 and on each rank's slices of TP 2 (simulated ranks in this process: each
    rank's partial sums, the collectives skipped, compared rank by rank; the real TP-2 load of these
    checkpoints is test_quantized_checkpoint_equals_dequantized's). 3 layers (2 of them MoE), and on
    the CPU 2 routed experts a token (the tiny model's 4 on the GPU): Triton's CPU interpreter takes
    ~0.3-1 s a fused MoE call, its time following the token-expert pairs."""
    cpu = {} if TRITON_DEVICE.type == "cuda" else {"num_experts_per_tok": 2}
    quant, plain = make(str(tmp_path), num_hidden_layers=3, **cpu)
    for tp in (None, TP.simulate(2, 0), TP.simulate(2, 1)):
        got, ref = _fused_quant_worker(quant, plain, TRITON_DEVICE.type, tp)
        where = "TP 1" if tp is None else f"rank {tp.rank} of TP 2"
        assert_close(got, ref, 1e-5 * max(1.0, ref.abs().max().item()),
                     f"{make.__name__} at {where}: fused on quantized vs gather on dequantized")
        assert ref.abs().max() > 0.1


def _edit(src, dst, edit_tensors=lambda t: None, edit_config=lambda c: None):
    edit_checkpoint(src, dst, edit_tensors)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_bad_quantized_checkpoints_name_the_tensor(tmp_path):
    int4, _ = int4_checkpoint(str(tmp_path / "a"))
    fp8, _ = fp8_checkpoint(str(tmp_path / "b"))
    E = "language_model.model.layers.3.mlp.experts.5.down_proj"
    A = "model.layers.2.self_attn.q_b_proj.weight"

    def qcfg(c):
        return c["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
    cases = [
        (int4, dict(edit_tensors=lambda t: t.pop(E + ".weight_scale")), CheckpointError,
         [E + ".weight_scale", "missing"]),
        (int4,
         dict(edit_tensors=lambda t: t.update({E + ".weight_shape": torch.tensor([64, 128])})),
         ValueError, [E + ".weight_packed", "[64, 128]"]),
        (int4, dict(edit_config=lambda c: qcfg(c).update(group_size=48)), ValueError,
         ["hidden_size = 64", "48-element"]),
        (int4, dict(edit_config=lambda c: qcfg(c).update(group_size=12)), NotImplementedError,
         ["group_size 12"]),
        (int4,
         dict(edit_config=lambda c: c["text_config"]["quantization_config"].update(
             quant_method="awq")),
         NotImplementedError, ["'awq'"]),
        (int4,
         dict(edit_config=lambda c: c["text_config"]["quantization_config"].update(
             ignore=["lm_head"])),
         NotImplementedError, ["self_attn", "ignore"]),
        (int4,
         dict(edit_tensors=lambda t: t.update(
             {"language_model." + A.replace("weight", "weight_packed"):
              torch.zeros(2, dtype=torch.int32)})),
         NotImplementedError, ["INT4-packed", "self_attn.q_b_proj.weight_packed"]),
        (int4, dict(edit_config=lambda c: c["text_config"].pop("quantization_config")),
         NotImplementedError, ["INT4-packed", "no compressed-tensors quantization_config"]),
        (fp8, dict(edit_tensors=lambda t: t.pop(A + "_scale_inv")), CheckpointError,
         [A + "_scale_inv"]),
        (fp8, dict(edit_tensors=lambda t: t.update({A + "_scale_inv": torch.ones(2, 2)})),
         ValueError, [A + "_scale_inv", "[3, 2]"]),
        (fp8, dict(edit_config=lambda c: c.pop("quantization_config")), CheckpointError,
         ["F8_E4M3", "quantization_config"]),
    ]
    for i, (src, edits, error, words) in enumerate(cases):
        bad = _edit(src, str(tmp_path / f"bad{i}"), **edits)
        with pytest.raises(error) as e:
            load_target(bad, max_batch_size=1, max_seq_len=8, dtype=torch.float32)
        for w in words:
            assert w in str(e.value), (i, w, str(e.value))
    with pytest.raises(ValueError,
                       match="moe_intermediate_size per rank = 16 does not fall on whole "
                             "32-element"):
        Transformer(tiny(moe_intermediate_size=64, quantization_config="int4"), tp=TP(0, 4))


def test_int4_scope_names_every_linear_layer_left_quantized():
    """checkpoint.check_int4_scope: an INT4 ignore list must name every linear layer but the
    routed experts; kv_a_proj_with_mqa (no "_proj.weight" ending) is one of them."""
    layer = "model.layers.1."
    names = [layer + n for n in ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                                 "mlp.experts.0.down_proj.weight_packed", "input_layernorm.weight")]
    table = [(n, None, None) for n in names]
    checkpoint.check_int4_scope(table, ["re:.*self_attn.*"])   # the attention ignored: accepted
    with pytest.raises(NotImplementedError, match="kv_a_proj_with_mqa is not in the ignore"):
        checkpoint.check_int4_scope(table, ["re:.*q_a_proj.*"])


# ---------------------------------------------------------------------------------------------
# A SIMULATED rank: one rank's shard of a TP-8 model

def test_simulated_rank_is_labelled_and_shaped_like_tp8():
    sim = TP.simulate(4)
    m = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float32,
                                tp=sim), 0,
                    rank_local=True)
    assert "SIMULATED" in sim.describe() and m.layers[0].self_attn.n_local_heads == 1
    logits, _ = m(torch.tensor([[3, 4], [5, 6]]), torch.arange(2).expand(2, 2), "decode")
    assert logits.shape == (2, 2, m.args.vocab_size) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# EAGLE-3 head and speculative decoding: lossless greedy, sampling, EOS, the head's files and
# SGLang's configs, refusals

def lossless_matrix(seed, max_new=24, ks=(1, 2, 4), batches=tuple(PROMPTS)):
    """Every (batch in batches, attention mode, num_steps in ks, proposer) case; returns failures
    and, per case of the erring proposer, the accepted lengths seen."""
    dtype = torch.float64
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=40, dtype=dtype), seed)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    failures, seen = [], {}
    for B, prompts in ((B, PROMPTS[B]) for B in batches):
        plain = generate(target, None, prompts, max_new_tokens=max_new).tokens
        ref = reference_sequences(prompts, plain, 40)
        for mode in ("extend", "decode"):
            for k in ks:
                proposers = {"eagle3": head,
                             "errs": PlantedProposer(ref, target.args.vocab_size,
                                                     lambda c, b, k=k: (c + b) % (k + 1)),
                             "right": PlantedProposer(ref, target.args.vocab_size, lambda c, b: 99)}
                for name, prop in proposers.items():
                    res = generate(target, prop, prompts, max_new_tokens=max_new, num_steps=k,
                                   attention_mode=mode)
                    if res.tokens != plain:
                        failures.append((B, mode, k, name, plain, res.tokens))
                    body = []  # each row's live cycles but its last, which max_new_tokens may cut
                    for b in range(B):
                        live = res.accepted[:, b][res.accepted[:, b] >= 0].tolist()
                        body += live[:-1]
                    seen[(B, mode, k, name)] = sorted(set(body))
    return failures, seen


def check_lossless(failures, seen):
    assert not failures, \
        f"speculative != plain greedy in {len(failures)} cases, first: {failures[0]}"
    for (B, mode, k, name), lengths in seen.items():
        if name == "errs":
            assert lengths == list(range(k + 1)), \
                f"accepted lengths {lengths} for k={k} B={B} {mode}"
        if name == "right":
            assert lengths == [k], \
                f"always-right proposer accepted {lengths} (k={k}, B={B}, {mode})"


def test_speculative_equals_plain_greedy_tp1():
    check_lossless(*lossless_matrix(seed=21))


def _lossless_worker(seed):
    # TP 2 over chains of 4 (each accepted length 0-4 met) at batch 3, whose rows stand at different
    # positions (gloo's collectives make a TP-2 cycle ten times a TP-1 one); chains of 1 and 2, and
    # batch 1, run at TP 1
    return lossless_matrix(seed, ks=(4,), batches=(3,))


def test_speculative_equals_plain_greedy_tp2():
    check_lossless(*run_ranks(2, _lossless_worker, 21))


def test_accepted_lengths_follow_the_plan():
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=64, dtype=torch.float64),
                         2)
    prompts = PROMPTS[3]
    plain = generate(target, None, prompts, max_new_tokens=30, eos_id=-1).tokens
    ref = reference_sequences(prompts, plain, 64)
    k = 3
    res = generate(target, PlantedProposer(ref, 256, lambda c, b: (c + b) % (k + 1)), prompts,
                   max_new_tokens=30, num_steps=k, eos_id=-1)
    assert res.tokens == plain
    for c in range(res.cycles - 1):  # every cycle but the last, which max_new_tokens may cut
        for b in range(3):
            if res.accepted[c + 1, b] >= 0:
                assert res.accepted[c, b] == (c + b) % (k + 1), (c, b, res.accepted[:, b])


def test_accepted_counts_what_commit_keeps():
    """A cycle that max_new_tokens or an EOS cuts counts the tokens it kept, not the drafts it
    accepted: per row, the kept lengths (accepted + 1) plus the prefill's token sum to the tokens
    produced. An always-right proposer (k = 3, 4 tokens a cycle) makes the cut cycle known."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=64, dtype=torch.float64),
                         3)
    prompts, k = PROMPTS[3], 3
    plain = generate(target, None, prompts, max_new_tokens=30, eos_id=-1).tokens
    ref = reference_sequences(prompts, plain, 64)
    for max_new, eos in ((5, -1), (7, -1), (8, -1), (13, -1), (30, plain[1][6]), (30, plain[0][9])):
        res = generate(target, PlantedProposer(ref, 256, lambda c, b: 99), prompts,
                       max_new_tokens=max_new,
                       num_steps=k, eos_id=eos)
        for b, tokens in enumerate(res.tokens):
            live = res.accepted[:, b][res.accepted[:, b] >= 0]
            assert int((live + 1).sum()) + 1 == len(tokens), (max_new, eos, b, live, len(tokens))
            # every cycle but the cut one: all kept
            assert (live[:-1] == k).all(), (max_new, eos, b, live)
            if eos == -1:
                assert len(tokens) == max_new and live[-1] == (max_new - 2) % (k + 1), (max_new, b,
                live)
            else:
                assert eos not in tokens[:-1] and (tokens[-1] == eos
                                                   or len(tokens) == max_new), (b, tokens)


def test_simulated_acceptance_has_the_mean_asked():
    """--simulate-accept-len's draws (a normal rounded and clamped to 1..k+1, as SGLang's) average
    to the length asked, the clamp's pull on the tails offset by the normal's center: over 400k
    draws within 5 standard errors (~0.007); the center at the mean itself misses at 1.2 by ~0.3."""
    g = torch.Generator().manual_seed(0)
    m = torch.zeros(400_000, dtype=torch.int64)
    for k, mean in ((1, 1.5), (1, 1.9), (2, 2.5), (3, 1.2), (3, 2.5), (3, 3.7), (5, 2.0), (3, 1.0),
                    (3, 4.0)):
        lengths = simulated_accept(m, mean, k, g).double() + 1
        assert lengths.min() >= 1 and lengths.max() <= k + 1, (k, mean)
        err = 5 * lengths.std().item() / len(lengths) ** 0.5 + 1e-9
        assert abs(lengths.mean().item() - mean) <= err, (k, mean, lengths.mean().item())
        assert simulated_mean(simulated_center(mean, k), k) == pytest.approx(mean, abs=1e-9)
    assert simulated_mean(1.2, 3) - 1.2 > 0.25  # what drawing around the mean itself gave


def total_variation(samples, p):
    """Half the L1 distance between the frequencies of the tokens in `samples` and p [V]."""
    freq = torch.bincount(samples, minlength=len(p)).double() / len(samples)
    return 0.5 * (freq - p.double()).abs().sum().item()


def test_speculative_sampling_follows_the_target():
    """200k rows, vocab 6, k = 2: the first emitted token ~ p_0; where it is d_1, the second ~ p_1;
    where both drafts are accepted, the bonus after them ~ p_2 (not p_1); for a good (most
    likely), bad (least likely) and random draft. Bound: total variation < 1.5 sqrt(V / n) over n
    samples (0.008 at n = 200k; a wrong rule is off by 0.1 or more)."""
    V, k, N = 6, 2, 200_000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, V, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    for kind in ("good", "bad", "random"):
        if kind == "random":
            drafts = torch.randint(0, V, (N, k), generator=g)
        else:
            pick = p[:k].argmax(-1) if kind == "good" else p[:k].argmin(-1)
            drafts = pick.expand(N, k).clone()
        m, bonus = accept(logits.expand(N, k + 1, V), drafts, 1.0, g)
        emitted = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, m.unsqueeze(1),
                                                                bonus.unsqueeze(1))
        took_d1 = emitted[:, 0] == drafts[:, 0]
        if kind == "random":  # condition per d_1 value: pool rows whose first token was their draft
            took_d1 = took_d1 & (drafts[:, 0] == 0)
        checks = [(torch.ones(N, dtype=torch.bool), 0, p[0]), (took_d1, 1, p[1]), (m == k, k, p[k])]
        for rows, col, want in checks:
            n = rows.sum().item()
            tv = total_variation(emitted[rows, col], want)
            assert tv < 1.5 * (V / n) ** 0.5, f"{kind} draft: column {col}, TV {tv:.4f} over n={n}"


def test_sampling_divides_the_logits_by_the_temperature():
    """At temperature 0.5, sample's token and accept's first emitted token (the draft where
    accepted, else the token drawn in its place) ~ softmax(logits / 0.5), not softmax(logits):
    200k rows, vocab 6, the bound of the test above."""
    V, N, T = 6, 200_000, 0.5
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(V, generator=g)
    want = torch.softmax(logits / T, -1)
    drafts = torch.randint(0, V, (N, 1), generator=g)
    m, bonus = accept(logits.expand(N, 2, V), drafts, T, g)
    for what, tokens in (("sample", sample(logits.expand(N, V), T, g)),
                         ("accept", torch.where(m > 0, drafts[:, 0], bonus))):
        tv = total_variation(tokens, want)
        assert tv < 1.5 * (V / N) ** 0.5, f"{what}: TV {tv:.4f} from softmax(logits / {T})"


def test_generation_stops_at_every_eos_id(tmp_path):
    """config.json and generation_config.json each name EOS ids (one or a list); generation stops
    at the first of any of them, as engines do, plain and speculative, wherever it falls in a
    cycle."""
    (tmp_path / "config.json").write_text(json.dumps(dict(checkpoint.target_config(tiny()),
                                                          eos_token_id=[2, 5])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert checkpoint.read_target_args(tmp_path).eos_token_ids == [2, 5, 9]
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=40, dtype=torch.float64),
                         21)
    free = generate(target, None, PROMPTS[3], max_new_tokens=20, eos_id=-1).tokens
    stops = [free[0][4], free[1][7], free[2][9]]
    ref = reference_sequences(PROMPTS[3], free, 40)
    for proposer in (None, PlantedProposer(ref, 256, lambda c, b: (c + b) % 3)):
        got = generate(target, proposer, PROMPTS[3], max_new_tokens=20, num_steps=2,
                       eos_id=stops).tokens
        for row, out in zip(free, got):
            assert out == row[:next(i + 1 for i, t in enumerate(row)
                                    if t in stops)], (proposer, stops)


def test_sampling_generate_runs_and_is_seeded():
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=40, dtype=torch.float32),
                         3)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 4)
    a = generate(target, head, PROMPTS[3], max_new_tokens=10, num_steps=2, temperature=0.8, seed=5)
    b = generate(target, head, PROMPTS[3], max_new_tokens=10, num_steps=2, temperature=0.8, seed=5)
    assert a.tokens == b.tokens and all(len(t) == 10 or 2 in t for t in a.tokens)


def test_draft_round_trip_and_errors(tmp_path):
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float64),
                         5)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 6)
    save_draft(head, tmp_path / "d")
    loaded = load_draft(tmp_path / "d", target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    tokens, pos = torch.tensor([[3, 4, 5]] * 2), torch.arange(3).expand(2, 3)
    hidden = torch.randn(2, 3, 3 * 64, dtype=torch.float64)
    assert torch.equal(head(tokens, pos, head.fc(hidden))[0],
                       loaded(tokens, pos, loaded.fc(hidden))[0])
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    # a head that carries an embedding of the target's width reads the target's, as SGLang does
    os.makedirs(tmp_path / "own")
    save_file(dict(tensors, **{"embed_tokens.weight": torch.randn(256, 64, dtype=torch.float64)}),
              tmp_path / "own" / "model.safetensors")
    (tmp_path / "own" / "config.json").write_text((tmp_path / "d" / "config.json").read_text())
    assert load_draft(tmp_path / "own", target).embed_tokens is target.embed_tokens
    tensors.pop("midlayer.self_attn.k_proj.weight")
    os.makedirs(tmp_path / "bad")
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="midlayer.self_attn.k_proj.weight"):
        load_draft(tmp_path / "bad", target)
    (tmp_path / "bad" / "config.json").write_text(
        json.dumps(dict(cfg, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        load_draft(tmp_path / "bad", target)


def test_draft_configs_read_and_write_as_sglang_does(tmp_path):
    """A head's config.json: written without null fields (SGLang takes a present
    target_hidden_size or eagle_config as set), read with what a missing field means to SGLang and
    Llama (rope_theta 10000, the target's default aux layers), rope_parameters read as rope_theta
    and rope_scaling, and a head that reads no aux states refused by name."""
    cfg = checkpoint.draft_config(draft_preset("tiny"))
    assert None not in cfg.values() and "eagle_config" not in cfg
    back = checkpoint.draft_args(cfg)
    assert back == draft_preset("tiny") and back.aux_layer_ids is None
    kimi = checkpoint.draft_config(draft_preset("kimi-k2"))
    assert checkpoint.draft_args(kimi).aux_layer_ids == [2, 30, 58]
    bare = {k: v for k, v in kimi.items() if k not in ("rope_theta", "eagle_config")}
    assert checkpoint.draft_args(bare).rope_theta == 10000.0
    assert checkpoint.draft_args(bare).aux_layer_ids is None
    newer = dict(bare, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert checkpoint.draft_args(newer).rope_theta == 5e5
    assert checkpoint.draft_args(newer).rope_scaling is None
    no_aux = dict(kimi, eagle_config={"use_aux_hidden_state": False})
    with pytest.raises(NotImplementedError, match="use_aux_hidden_state is false"):
        checkpoint.draft_args(no_aux)


def _draft_tp_worker(path, seed):
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float64),
                         seed)
    head = load_draft(path, target)
    tokens, pos = torch.tensor([[3, 4, 5], [7, 8, 9]]), torch.tensor([[0, 1, 2], [4, 5, 6]])
    hidden = torch.randn(2, 3, 3 * 64, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))
    return head(tokens, pos, head.fc(hidden))[0], head.propose(tokens, pos, hidden,
                                                               torch.tensor([2, 1]), 3)


# the draft head at TP 2 and 4 against TP 1: test_tp_equals_tp1 (in the target's gloo ranks)


def last_slot_written(attention):
    """Wrap a draft attention's cache writes: returns a list that keeps each call's last slot."""
    written, attend = [], attention.attend_cache

    def recorded(q, k, v, positions, kv_len, slots=None, visible=None):
        written.append(int((positions if slots is None else slots).max()))
        return attend(q, k, v, positions, kv_len, slots, visible)
    attention.attend_cache = recorded
    return written


def test_the_draft_chain_stays_inside_the_cache():
    """Full acceptance near the end of the output: the chain drafts k-1 positions past the verified
    ones, so the cache needs P + max_new_tokens + 2k - 2 slots; some seed's chain writes the last
    slot."""
    P, max_new, k = 6, 8, 4
    size = P + max_new + 2 * k - 2
    target = init_random(Transformer(tiny(), 1, size, dtype=torch.float32), 0)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 1)
    written = last_slot_written(head.midlayer.self_attn)
    for seed in range(8):
        generate(target, head, [list(range(1, P + 1))], max_new_tokens=max_new, num_steps=k,
                 probe=Probe(accept_len=4.0), seed=seed)
    assert max(written) == size - 1, f"no seed reached the cache's end: {max(written)}"
    with pytest.raises(ValueError, match="lookahead"):
        generate(target, head, [list(range(1, P + 2))], max_new_tokens=max_new, num_steps=k)


def test_requests_that_cannot_run_are_refused():
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float32),
                         0)
    with pytest.raises(ValueError, match="max_seq_len 16"):
        generate(target, None, [[1] * 10], max_new_tokens=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(target, None, [[1, 999]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_batch_size 2"):
        generate(target, None, [[1]] * 3, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):   # a CPU model
        generate(target, None, [[1, 2]], max_new_tokens=2, use_graphs=True)
    for prompts in (torch.zeros(2, 0, dtype=torch.int64), torch.tensor([[1.7, 2.2]])):
        with pytest.raises(ValueError, match=r"integer ids \[B, P\] with B, P >= 1"):
            generate(target, None, prompts, max_new_tokens=2)
    for prompts in ([1, 2, 3], ["hello"], "hello", [[1, 2], []], [[1, 2.5]], [[True]], []):
        with pytest.raises(ValueError, match="a list of token-id lists"):
            generate(target, None, prompts, max_new_tokens=2)
    with pytest.raises(ValueError, match="topk sizes a draft tree"):
        generate(target, None, [[1, 2]], max_new_tokens=2, topk=2)
    for temperature in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            generate(target, None, [[1, 2]], max_new_tokens=2, temperature=temperature)
    with pytest.raises(ValueError, match="plain decoding"):
        generate(target, None, [[1, 2]], max_new_tokens=2, probe=Probe(accept_len=2.0))
    head = Eagle3Draft(draft_preset("tiny"), target)
    with pytest.raises(ValueError, match="give topk too"):
        generate(target, head, [[1, 2]], max_new_tokens=2, num_steps=2, num_draft_tokens=3)
    Vd = head.args.draft_vocab_size
    with pytest.raises(ValueError, match=f"topk {Vd + 1} > the head's draft vocabulary of {Vd}"):
        generate(target, head, [[1, 2]], max_new_tokens=2, num_steps=2, topk=Vd + 1)
    for size in (dict(max_seq_len=8), dict(max_batch_size=1)):
        small = Eagle3Draft(draft_preset("tiny"), target, **size)
        with pytest.raises(ValueError, match="the draft head's cache holds"):
            generate(target, small, [[1, 2]] * 2, max_new_tokens=2, num_steps=2)


def test_configs_that_cannot_route_or_draft_are_refused():
    """Router groups that cannot give K experts, a head that cannot read its target, a rank
    outside its world, and head calls that cannot run are refused, naming the fields."""
    for groups in (dict(n_group=2, topk_group=1, num_experts_per_tok=5),   # 4 kept experts
                   dict(n_group=3, topk_group=1, num_experts_per_tok=2),   # 8 in 3 groups
                   dict(n_group=4, topk_group=5, num_experts_per_tok=2),   # 5 of 4 groups
                   dict(num_experts_per_tok=9)):                           # 9 of 8 experts
        with pytest.raises(ValueError, match="num_experts_per_tok"):
            Transformer(tiny(n_routed_experts=8, **groups), 1, 8)
    target = Transformer(tiny(), 1, 8)
    with pytest.raises(ValueError, match="draft hidden_size 32 != target hidden_size 64"):
        Eagle3Draft(draft_preset("tiny", hidden_size=32), target)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads 4"):
        Eagle3Draft(draft_preset("tiny", num_attention_heads=6, num_key_value_heads=4), target)
    with pytest.raises(ValueError, match="draft_vocab_size 512 must lie in \\[1, vocab_size 256"):
        Eagle3Draft(draft_preset("tiny", draft_vocab_size=512), target)
    for bad in (dict(rank=2, world_size=2), dict(rank=-1, world_size=2), dict(world_size=0)):
        with pytest.raises(ValueError, match="the rank in \\[0, world size\\)"):
            TP(**bad)
    head = Eagle3Draft(draft_preset("tiny"), target)
    tokens, positions = torch.zeros(1, 2, dtype=torch.int64), torch.arange(2).expand(1, 2)
    hidden = torch.zeros(1, 2, head.args.hidden_size)
    with pytest.raises(ValueError, match="slots and visible go together"):
        head(tokens, positions, hidden, visible=torch.ones(1, 2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="sequences of at least 2 tokens"):
        ttt_loss(head, tokens[:, :1], torch.zeros(1, 1, 3 * target.args.hidden_size),
                 torch.zeros(1, 1, target.args.vocab_size), 3)


# ---------------------------------------------------------------------------------------------
# EAGLE-3 training: the unrolled head (training-time test) is the inference head

def test_unrolled_head_equals_inference():
    """Step i, row t of Eagle3Draft.unroll equals extend over rows 0..t, then i chain steps, when
    the unrolled sequence holds the drafts the chain read: same logits, same draft ids (float64)."""
    dtype, B, T, k = torch.float64, 3, 14, 4
    target = init_random(Transformer(tiny(), max_batch_size=B, max_seq_len=T + k, dtype=dtype), 41)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 42)
    g = torch.Generator().manual_seed(43)
    x = torch.randint(0, 256, (B, T), generator=g)
    positions = torch.arange(T).expand(B, T)
    _, states = target(x, positions, capture_aux=True)
    shifted = torch.cat([x[:, 1:], x[:, :1]], 1)  # row t reads x_{t+1} (the last row: junk)
    last = torch.tensor([3, 6, 9])                                # each row's extend ends at row t
    drafts = head.chain(*head.extend(shifted, positions, states, last), last, k)  # [B, k]: d_1..d_k
    for i in range(1, k):  # the unrolled sequence reads d_i at t+1+i
        x[torch.arange(B), last + 1 + i] = drafts[:, i - 1]
    shifted = torch.cat([x[:, 1:], x[:, :1]], 1)
    unrolled = head.unroll(x, states, k)                          # [k, B, T, Vd]
    logits, gh = head(shifted, positions, head.fc(states))  # inference, step by step: the extend...
    want = [logits[torch.arange(B), last]]
    gh = gh[torch.arange(B), last].unsqueeze(1)
    for i in range(k - 1):  # ...then the chain, as chain() runs it
        step_logits, gh = head(drafts[:, i:i + 1], (last + 1 + i).unsqueeze(1), gh)
        want.append(step_logits[:, 0])
    for i in range(k):
        assert_close(unrolled[i, torch.arange(B), last], want[i], 1e-10,
                     f"unrolled step {i} vs inference")
    assert torch.equal(head.to_target_ids(unrolled[:, torch.arange(B), last]).T, drafts)


def test_training_step_lowers_the_loss():
    """A few steps of draft.train_step on one fixed batch lower ttt_loss; gradients reach fc, the
    midlayer and lm_head; the draft vocabulary is the most predicted ids."""
    target = init_random(Transformer(tiny(), max_batch_size=4, max_seq_len=24, dtype=torch.float32),
                         44)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 45)
    x = torch.randint(0, 256, (4, 20), generator=torch.Generator().manual_seed(46))
    with torch.no_grad():
        logits, states = target(x, torch.arange(20).expand(4, 20), capture_aux=True)
    logits = 8 * logits  # a peaked target distribution: the loss can fall far below its start
    head.d2t.copy_(draft_vocab(logits.argmax(-1), 256, head.args.draft_vocab_size))
    counts = torch.bincount(logits.argmax(-1).flatten(), minlength=256)
    assert (counts[head.hot_ids()].min()
            >= counts.sort(descending=True).values[head.args.draft_vocab_size - 1])
    params = [p for p in head.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-2)
    losses = [train_step(head, opt, x, states, logits, num_steps=3)[0] for _ in range(30)]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    with torch.no_grad():
        final = ttt_loss(head, x, states, logits, 3)[0].item()
    assert final < 0.5 * losses[0], f"loss {losses[0]:.3f} -> {final:.3f}"


def test_draft_layer_ids_are_set_explicitly():
    target = init_random(Transformer(tiny(), max_batch_size=1, max_seq_len=8), 0)
    args = draft_preset("tiny", eagle_config={"eagle_aux_hidden_state_layer_ids": [5, 0, 2]})
    with pytest.raises(ValueError, match=r"reads target layers \[0, 2, 5\].*captures \[1, 3, 4\]"):
        Eagle3Draft(args, target)
    set_target_aux_layers(target, args)
    assert target.aux_layer_ids == [0, 2, 5] and Eagle3Draft(args, target).args is args


# ---------------------------------------------------------------------------------------------
# The tiny trained pair (checkpoints/tiny-stdlib, made by train.py): lossless, and its drafts are
# accepted

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_trained_pair_speculative_equals_plain_greedy(dtype):
    target, head = train.load_pair(max_batch_size=3, max_seq_len=96, dtype=dtype)
    prompts = [p[:n] for p, n in zip(train.heldout_prompts(3, 32), (32, 17, 25))]
    plain = generate(target, None, prompts, max_new_tokens=40, eos_id=-1).tokens
    for mode in ("extend", "decode"):
        for k in ((1, 3, 4) if dtype == torch.float64 else (3,)):
            res = generate(target, head, prompts, max_new_tokens=40, num_steps=k,
                           attention_mode=mode, eos_id=-1)
            assert res.tokens == plain, (mode, k, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels_on", [False, pytest.param(True, marks=pytest.mark.triton)])
def test_gpu_trained_pair_graph_speculative_equals_plain_greedy(kernels_on):
    """The trained pair on the GPU in float32, verify and draft replayed from CUDA graphs in both
    attention modes: the drafts are really accepted (so the graphs' accept, commit and draft-extend
    paths run with m > 0) and the tokens equal plain greedy decoding's (eager, without programmatic
    dependent launch), with and without the Triton kernels (where Triton is installed)."""
    target, head = train.load_pair(max_batch_size=3, max_seq_len=128, device="cuda")
    if kernels_on:
        kernels.accelerate(target, "all")                 # on CUDA with Triton: the fused MoE
    else:
        kernels.accelerate(target, "none", moe="gather")  # the plain model: no Triton launch
    prompts = [p[:n] for p, n in zip(train.heldout_prompts(3, 32), (32, 17, 25))]
    plain = eager_without_pdl(partial(generate, target, None, prompts, max_new_tokens=40,
                                      eos_id=-1)).tokens
    for mode in ("extend", "decode"):
        res = generate(target, head, prompts, max_new_tokens=40, num_steps=3, attention_mode=mode,
                       use_graphs=True, eos_id=-1)
        assert res.tokens == plain, mode
        accepted = res.accepted[res.accepted >= 0].float().mean().item()
        assert accepted > 0.5, \
            f"{mode}: {accepted:.2f} drafts accepted a cycle; the graphs' accept paths barely ran"


def test_trained_pair_accepts_more_than_a_random_head():
    target, head = train.load_pair(max_batch_size=6, max_seq_len=128)
    rand = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 1)
    prompts = train.heldout_prompts(6, 48)

    def accept_len(draft):
        acc = generate(target, draft, prompts, max_new_tokens=48, num_steps=3, eos_id=-1).accepted
        return acc[acc >= 0].float().mean().item() + 1
    trained, random = accept_len(head), accept_len(rand)
    assert trained >= 1.8 and trained > random + 0.5, f"trained {trained:.2f}, random {random:.2f}"


# ---------------------------------------------------------------------------------------------
# Draft trees (topk > 1): expansion, masks, acceptance

def hand_tree(B):
    """Root (token 10) -> nodes 1 (3), 2 (5); 1 -> 3 (7), 4 (8); 2 -> 5 (9); 3 -> 6 (4); 4 -> 7
    (2)."""
    t = lambda v: torch.tensor(v).expand(B, -1)  # noqa: E731
    return Tree(tokens=t([10, 3, 5, 7, 8, 9, 4, 2]), parents=t([-1, 0, 0, 1, 1, 2, 3, 4]),
                depths=t([0, 1, 1, 2, 2, 2, 3, 3]), scores=torch.zeros(B, 8))


def test_move_cache_moves_every_layers_slots_and_no_other():
    """Transformer.move_cache (one copy a cache over the stacked [L, B, S, width] caches) against
    its plain twin, each layer's own latent and rope-key cache copied slot by slot on the host, on
    fresh random caches: paths that overlap their targets (a node moved onto a slot another node
    leaves) and one already in place; each layer's caches are views of the stacked ones, so a
    write through a layer lands there."""
    t = Transformer(tiny(), 2, 40)
    g = torch.Generator().manual_seed(3)
    for caches in (t.kv_caches, t.pe_caches):
        caches.copy_(torch.randn(caches.shape, generator=g))
    src = torch.tensor([[20, 23, 21, 24], [30, 31, 32, 33]])
    dst = torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33]])
    want = [(layer.self_attn.kv_cache.clone(), layer.self_attn.pe_cache.clone())
            for layer in t.layers]
    for kv, pe in want:
        for b in range(2):
            for cache in (kv, pe):
                cache[b, dst[b]] = cache[b, src[b]].clone()     # all reads before any write
    t.move_cache(src, dst)
    for i, (layer, (kv, pe)) in enumerate(zip(t.layers, want)):
        assert torch.equal(layer.self_attn.kv_cache, kv) and torch.equal(layer.self_attn.pe_cache,
                                                                           pe), f"layer {i}"
    t.layers[1].self_attn.kv_cache[0, 5] = 7.0
    assert (t.kv_caches[1, 0, 5] == 7.0).all(), "a layer's cache is not a view of the stack"


def test_tree_greedy_walks_the_targets_argmax():
    """Hand-built tree, a target that knows where to go: row 0 takes 5, 9 (a leaf), then its
    bonus; row 1 runs to full depth; row 2 rejects every child of the root; row 3 stops at
    node 3, whose only child is not the target's choice."""
    tree = hand_tree(4)
    plan = {0: {0: 5, 2: 9, 5: 1}, 1: {0: 3, 1: 8, 4: 2, 7: 6}, 2: {0: 11}, 3: {0: 3, 1: 7, 3: 0}}
    logits = torch.randn(4, 8, 12, generator=torch.Generator().manual_seed(0))
    for b, choice in plan.items():
        for node, tok in choice.items():
            logits[b, node, tok] += 20
    m, path, bonus = walk_tree(logits, tree, 3, 0.0, None)
    assert m.tolist() == [2, 3, 0, 2] and bonus.tolist() == [1, 6, 11, 0]
    assert path.tolist() == [[0, 2, 5, 5], [0, 1, 4, 7], [0, 0, 0, 0], [0, 1, 3, 3]]
    emitted = tree_emitted(tree, path, m, bonus)
    assert [e[:k + 1] for e, k in zip(emitted.tolist(), m.tolist())] == [[5, 9, 1], [3, 8, 2, 6],
                                                                         [11], [3, 7, 0]]


def test_tree_greedy_equals_a_walk_on_the_host_and_masks_see_only_ancestors():
    g = torch.Generator().manual_seed(1)
    B, N, V = 64, 9, 16
    tree = random_tree(B, N, V, g)
    logits = torch.randn(B, N, V, generator=g)
    # most nodes point the target at one of their children (a proposer that knows)
    for b in range(B):
        for i in range(N):
            kids = [j for j in range(N) if tree.parents[b, j] == i]
            if kids and torch.rand(1, generator=g) < 0.8:
                logits[b, i, tree.tokens[b, kids[int(torch.randint(len(kids), (1,),
                                                                   generator=g))]]] += 20
    depth = int(tree.depths.max())
    m, path, bonus = walk_tree(logits, tree, depth, 0.0, None)
    start = torch.randint(0, 5, (B,), generator=g)
    visible = tree_visible(tree.parents, start, 20)
    for b in range(B):
        cur, walked = 0, [0]
        while True:
            nxt = [j for j in range(N) if tree.parents[b, j] == cur
                   and tree.tokens[b, j] == logits[b, cur].argmax()]
            if not nxt:
                break
            cur = nxt[0]
            walked.append(cur)
        assert (m[b], bonus[b], path[b, :len(walked)].tolist()) == (len(walked) - 1,
                                                                    logits[b, cur].argmax(), walked)
        for i in range(N):
            anc, a = {i}, i
            while a > 0:
                a = int(tree.parents[b, a])
                anc.add(a)
            s0 = int(start[b])
            want = [s < s0 or s - s0 in anc for s in range(20)]
            assert visible[b, i].tolist() == want, (b, i)
    assert tree_ancestors(tree.parents).sum(-1).equal(tree.depths + 1)
    chain = torch.arange(-1, 16).unsqueeze(0)                                 # 17 nodes deep
    assert tree_ancestors(chain)[0].equal(torch.ones(17, 17, dtype=torch.bool).tril())
    assert m.min() == 0 and m.max() >= 4, \
        f"accepted lengths {sorted(set(m.tolist()))}: too narrow a test"


def test_tree_sampling_follows_the_target():
    """The chain's distribution test, for a tree: 200k rows, vocab 6; the root has children with
    tokens 0, 2, 5, and the first of them two children (1, 2). The first emitted token ~ p_root;
    after child 0 (accepted) the next ~ p at that node, after child 2 (a leaf) the bonus ~ p
    there; for kids the target likes most and least. Bound: TV < 1.5 sqrt(V / n)."""
    V, R = 6, 200_000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    for kind in ("as drawn", "least likely first"):
        root_kids = [0, 2, 5] if kind == "as drawn" else p[0].argsort()[:3].tolist()
        t = torch.tensor([3] + root_kids + [1, 2]).expand(R, -1)
        tree = Tree(t, torch.tensor([-1, 0, 0, 0, 1, 1]).expand(R, -1),
                    torch.tensor([0, 1, 1, 1, 2, 2]).expand(R, -1),
                    torch.zeros(R, 6))
        m, path, bonus = walk_tree(logits.expand(R, 6, V), tree, 2, 1.0, g)
        emitted = tree_emitted(tree, path, m, bonus)
        checks = [(torch.ones(R, dtype=torch.bool), 0, p[0])]
        checks += [(emitted[:, 0] == root_kids[c], 1, p[1 + c]) for c in (0, 1)]
        for rows, col, want in checks:
            n = rows.sum().item()
            got = torch.bincount(emitted[rows, col], minlength=V) / n
            tv = 0.5 * (got - want).abs().sum().item()
            assert tv < 1.5 * (V / n) ** 0.5, f"{kind}: column {col}, TV {tv:.4f} over n={n}"
        others = ~torch.isin(emitted[:, 0], torch.tensor(root_kids))
        assert (m[others] == 0).all() and (m[~others] >= 1).all()


def test_tree_sampling_never_emits_a_token_the_target_rules_out(monkeypatch):
    """Two children hold all of p's mass (every other token underflows to 0) while their float32
    sum rounds below 1; a uniform in that gap (1 - 2^-24, which torch.rand can draw) rejects both.
    The bonus token must still be one of them: p has nothing else."""
    V = 8
    for a in torch.linspace(0.1, 3.0, 300):   # a gap between the two children's sum and 1
        logits = torch.full((V,), -200.0)
        logits[3], logits[5] = 0.0, a.item()
        p = torch.softmax(logits, -1)
        if p[3] + p[5] < 1.0:
            break
    assert p[3] + p[5] < 1.0 and p.count_nonzero() == 2
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, 1.0 - 2 ** -24))
    tree = Tree(torch.tensor([[1, 3, 5]]), torch.tensor([[-1, 0, 0]]), torch.tensor([[0, 1, 1]]),
                None)
    m, _, bonus = walk_tree(logits.expand(1, 3, V), tree, 1, 1.0, torch.Generator())
    assert m.item() == 0 and bonus.item() in (3, 5), f"emitted {bonus.item()}, p 0 there"


def tree_setup(seed=0):
    """A float64 tiny target and random head, the head extended over two ragged prompt rows."""
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=32, dtype=torch.float64),
                         seed)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    tokens, pos = torch.randint(0, 256, (2, 6), generator=g), torch.arange(6).expand(2, 6)
    last = torch.tensor([5, 3])
    logits, g0 = head.extend_logits(tokens, pos, torch.randn(2, 6, 3 * 64, dtype=torch.float64,
                                                             generator=g), last)
    return head, torch.tensor([7, 9]), logits, g0, last


def test_tree_with_topk_1_is_the_chain():
    head, root, logits, g0, q = tree_setup()
    for S in (1, 2, 4):
        tree = head.tree(root, logits, g0, q, 1, S, S + 1)
        chain = head.chain(head.to_target_ids(logits), g0, q, S)
        assert torch.equal(tree.tokens[:, 1:], chain) and torch.equal(tree.tokens[:, 0], root)
        assert (tree.parents.tolist() == [list(range(-1, S))] * 2
                and tree.depths.tolist() == [list(range(S + 1))] * 2)


def reference_tree(head, b, logits, g0, q, K, S, N):
    """Row b's tree, scored by running the head along each node's own path with slot = position
    (the chain's cache use, no mask but the causal one), then chosen as the issue states it.
    q [B]: every row runs (the others on junk tokens, above their prefixes)."""
    to_draft = {int(t): i for i, t in enumerate(head.hot_ids())}
    B = logits.shape[0]

    def children(path, hidden):   # path: the tokens below the root; hidden: g of the row before it
        lp, h = logits[b].log_softmax(-1), hidden
        for depth, tok in enumerate(path):
            x = torch.zeros(B, 1, dtype=torch.long)
            x[b] = tok
            out, h = head(x, (q + 1 + depth).unsqueeze(1), h.unsqueeze(1))
            lp, h = out[b, 0].log_softmax(-1), h[:, 0]
        top = lp.topk(K)
        return [(int(head.hot_ids()[i]), float(v)) for v, i in zip(top.values, top.indices)]

    nodes = []   # (flat index, parent flat index, token, score, path)
    frontier = [(-1, 0.0, ())]
    for level in range(S):
        grown = []
        for parent, score, path in frontier:
            for tok, lp in children(list(path), g0):
                grown.append((len(nodes) + len(grown), parent, tok, score + lp, path + (tok,)))
        nodes += grown
        frontier = [(n[0], n[3], n[4]) for n in sorted(grown, key=lambda n: -n[3])[:K]]
    chosen = sorted(sorted(nodes, key=lambda n: (-n[3], n[0]))[:N - 1])
    index = {n[0]: i + 1 for i, n in enumerate(chosen)}
    assert all(n[2] in to_draft for n in chosen), "a chosen token outside the draft vocabulary"
    return [n[2] for n in chosen], [index.get(n[1], 0) for n in chosen], [n[3] for n in chosen]


@pytest.mark.parametrize("K, S, N", [(2, 3, 8), (3, 2, 9), (4, 3, 16)])
def test_tree_expansion_is_the_head_along_each_path(K, S, N):
    """Every node of the tree, its parent and its score are what the head gives when run along
    that node's own path alone (so no row saw a sibling's or a cousin's keys), and the nodes
    are the N - 1 best scored, in SGLang's order."""
    head, root, logits, g0, q = tree_setup()
    tree = head.tree(root, logits, g0, q, K, S, N)
    for b in range(2):
        tokens, parents, scores = reference_tree(head, b, logits, g0, q, K, S, N)
        assert tree.tokens[b, 1:].tolist() == tokens and tree.parents[b, 1:].tolist() == parents, b
        assert_close(tree.scores[b, 1:], torch.tensor(scores, dtype=torch.float64), 1e-9,
                     f"row {b} scores")
    anc_depth = tree_ancestors(tree.parents).sum(-1) - 1
    assert torch.equal(anc_depth, tree.depths) and (tree.parents[:, 1:] < torch.arange(1, N)).all()


def test_tree_refuses_sizes_it_cannot_hold():
    head, root, logits, g0, q = tree_setup()
    with pytest.raises(ValueError, match=r"num_draft_tokens 12 outside \[2, 11\]"):
        head.tree(root, logits, g0, q, 2, 3, 12)


class PlantedTreeHead:
    """Stands in for an Eagle3Draft in a tree: its extend_logits, and the head pass that the real
    Eagle3Draft.tree (borrowed) makes over planted logits. Knows the target's greedy sequence
    ref [B, L]. A node is on the right path when its parent is and its token is ref's at its
    position (g[..., 0] carries that down the tree); such a node ranks the right next token at
    rank_at(cycle, row, depth) among its children (>= K: not proposed), any other node ranks
    junk. Runs eager (verify.tree_cycle never captures what is not an Eagle3Draft)."""
    tree = Eagle3Draft.tree

    def __init__(self, ref, vocab, rank_at):
        self.ref, self.vocab, self.rank_at, self.calls = ref, vocab, rank_at, -1
        self.d2t = torch.zeros(vocab, dtype=torch.long)

    def planted(self, guess_at, on, depth):      # guess_at [B, T]: the position whose token to rank
        B, T = guess_at.shape
        right = self.ref.gather(1, guess_at.clamp(max=self.ref.shape[1] - 1))
        rank = torch.tensor([[self.rank_at(self.calls, b, depth)] * T for b in range(B)])
        c, r = torch.where(on, right, (right + 7) % self.vocab), torch.where(on, rank, 0)
        # token c - r ranks first, c - r + 1 second, ...: c ranks r-th
        return -((torch.arange(self.vocab) - c.unsqueeze(-1) + r.unsqueeze(-1))
                 % self.vocab).double()

    def extend_logits(self, tokens, positions, target_states, last, kv_len=None):
        self.calls += 1
        self.q = positions.gather(1, last.unsqueeze(1))                     # [B, 1]
        on = torch.ones_like(self.q, dtype=torch.bool)
        return self.planted(self.q + 2, on, 0)[:, 0], torch.ones(len(last), 1, dtype=torch.float64)

    def __call__(self, tokens, positions, hidden, kv_len=None, slots=None, visible=None):
        """Pass j: positions q + j, reading the tokens at q + j + 1, guessing those at q + j + 2."""
        on = (hidden[..., 0] > 0) & (tokens == self.ref.gather(
            1, (positions + 1).clamp(max=self.ref.shape[1] - 1)))
        depth = int((positions - self.q)[0, 0])
        return self.planted(positions + 2, on, depth), on.unsqueeze(-1).double()


TREE_SIZES = [(K, S, N) for K in (2, 4) for S in (2, 3, 5) for N in (4, 8, 16)]   # those that fit


def tree_lossless(seed, max_new=16, sizes=TREE_SIZES):
    """Greedy tree decoding against plain greedy for every (K, S, N) of TREE_SIZES that fits,
    batch 2, both attention modes, a planted head that errs by plan (and, for one size, the
    random head: Eagle3Draft's own passes inside the loop)."""
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=48, dtype=torch.float64),
                         seed)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28]]
    plain = generate(target, None, prompts, max_new_tokens=max_new, eos_id=-1).tokens
    ref = reference_sequences(prompts, plain, 48)
    failures, seen = [], {}
    for K, S, N in sizes:
        if N > tree_capacity(K, S):
            continue
        for mode in ("extend", "decode"):
            # every third cycle of a row all right (rank 0 at every depth), else wrong somewhere
            planted = PlantedTreeHead(ref, 256, lambda c, b, d, K=K: (c + b) % 3
                                      and (c + b + d) % (K + 1))
            proposers = [("planted", planted)] + [("eagle3", head)] * ((K, S, N) == (4, 3, 8))
            for name, prop in proposers:
                res = generate(target, prop, prompts, max_new_tokens=max_new, num_steps=S,
                               attention_mode=mode,
                               eos_id=-1, topk=K, num_draft_tokens=N)
                if res.tokens != plain:
                    failures.append((K, S, N, mode, name, plain, res.tokens))
                seen[(K, S, N, mode, name)] = res.accepted[res.accepted >= 0].tolist()
    return failures, seen


def check_tree_lossless(failures, seen):
    assert not failures, f"tree != plain greedy in {len(failures)} cases, first: {failures[0]}"
    for (K, S, N, mode, name), accepted in seen.items():
        if name != "planted":
            continue
        # a whole right path fits among the N - 1 best-scored nodes when S <= 3 here; deeper
        # trees of few nodes keep shallower siblings instead (their cumulative scores are higher)
        deepest = min(S, N - 1) if S <= 3 else 1
        assert max(accepted) >= deepest and 0 in accepted, (K, S, N, mode, accepted)


def test_tree_speculative_equals_plain_greedy_tp1():
    check_tree_lossless(*tree_lossless(seed=21))


def test_tree_with_topk_1_equals_the_chain_cycle_by_cycle():
    """The trained pair (so drafts are accepted), K = 1 through the tree path against the chain:
    the same drafts, accepted counts and tokens, each cycle."""
    target, head = train.load_pair(max_batch_size=2, max_seq_len=96, dtype=torch.float64)
    prompts = [p[:n] for p, n in zip(train.heldout_prompts(2, 32), (32, 17))]
    for S in (1, 3):
        chain = generate(target, head, prompts, max_new_tokens=24, num_steps=S, eos_id=-1)
        tree = generate(target, head, prompts, max_new_tokens=24, num_steps=S, eos_id=-1, topk=1)
        assert tree.tokens == chain.tokens and torch.equal(tree.accepted, chain.accepted)
        assert torch.equal(tree.drafts, chain.drafts) and chain.accepted.max() > 0
        live = (chain.accepted >= 0).unsqueeze(-1)
        assert torch.equal(tree.parents, torch.arange(S).expand_as(tree.parents).where(live, -1))


def tree_logits_and_paths(target, tree, P, mode):
    """The target's logits over a tree verified after a P-token prefix (slots P.. in node order),
    and, per row and node, its logits when only its own path is run (slot = position)."""
    B, N = tree.tokens.shape
    g = torch.Generator().manual_seed(3)
    target(torch.randint(0, 256, (B, P), generator=g), torch.arange(P).expand(B, P))
    start = torch.full((B,), P)
    slots = start.unsqueeze(1) + torch.arange(N)
    out = target(tree.tokens, P + tree.depths, mode, kv_len=P + N, slots=slots,
                 visible=tree_visible(tree.parents, start, P + N)).logits
    anc = tree_ancestors(tree.parents)
    alone = torch.empty_like(out)
    for i in range(N):
        for b in range(B):
            path = anc[b, i].nonzero().squeeze(1)                 # ancestors and i, in node order
            rows = tree.tokens[b, path].expand(B, -1)
            alone[b, i] = target(rows, (P + torch.arange(len(path))).expand(B, -1),
                                 mode).logits[b, -1]
    return out, alone


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_tree_verify_sees_only_prefix_and_ancestors(mode):
    """Each node's logits from one forward over the whole tree equal its logits when its own path
    runs alone: nothing of a sibling's or a cousin's latent (written at the slots beside it) leaks
    in; and changing every node that is not node i's ancestor leaves node i's logits as they
    were."""
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=32, dtype=torch.float64),
                         4)
    tree = random_tree(2, 7, 256, torch.Generator().manual_seed(5))
    out, alone = tree_logits_and_paths(target, tree, 9, mode)
    assert_close(out, alone, 1e-10, f"{mode}: tree forward vs each path alone")
    anc = tree_ancestors(tree.parents)
    for i in (3, 6):
        planted = tree._replace(tokens=torch.where(anc[:, i], tree.tokens,
                                                   (tree.tokens + 100) % 256))
        again = target(planted.tokens, 9 + tree.depths, mode, kv_len=16,
                       slots=9 + torch.arange(7).expand(2, 7),
                       visible=tree_visible(tree.parents, torch.full((2,), 9), 16)).logits
        assert_close(again[:, i], out[:, i], 1e-10,
                     f"{mode}: node {i} after its non-ancestors changed")


def _tree_lossless_worker(seed):
    return tree_lossless(seed, max_new=12, sizes=[(2, 3, 4)])


def test_tree_speculative_equals_plain_greedy_tp2():
    check_tree_lossless(*run_ranks(2, _tree_lossless_worker, 21))


def test_tree_sampling_and_simulated_generate_run_and_are_seeded():
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=48, dtype=torch.float32),
                         3)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 4)
    kw = dict(max_new_tokens=10, num_steps=3, topk=2, num_draft_tokens=6, eos_id=-1)
    a = generate(target, head, PROMPTS[3], temperature=0.8, seed=5, **kw)
    b = generate(target, head, PROMPTS[3], temperature=0.8, seed=5, **kw)
    assert a.tokens == b.tokens and all(len(t) == 10 for t in a.tokens)
    assert a.drafts.shape[1:] == (3, 5) and a.parents.shape == a.drafts.shape
    sim = generate(target, head, PROMPTS[3], probe=Probe(accept_len=3.0), **kw)
    assert sim.simulated and sim.accepted[sim.accepted >= 0].float().mean() > 1
    with pytest.raises(ValueError, match=r"accept_len must lie in \[1, 4\]"):
        generate(target, head, PROMPTS[3], probe=Probe(accept_len=4.5), **kw)


def test_trained_pair_tree_accepts_more_than_the_chain():
    """Held-out prompts: the tree (K 4, S 3, N 8) accepts more tokens a cycle than the chain of
    3 (both lossless); the README quotes these numbers."""
    target, head = train.load_pair(max_batch_size=6, max_seq_len=128)
    prompts = train.heldout_prompts(6, 48)
    plain = generate(target, None, prompts, max_new_tokens=48, eos_id=-1).tokens
    lengths = {}
    for K, N in ((None, None), (2, 4), (4, 8)):
        res = generate(target, head, prompts, max_new_tokens=48, num_steps=3, eos_id=-1, topk=K,
                       num_draft_tokens=N)
        assert res.tokens == plain, (K, N)
        lengths[K] = res.accepted[res.accepted >= 0].float().mean().item() + 1
    print(f"\ntrained pair, accepted tokens per cycle (bonus included): chain of 3 "
          f"{lengths[None]:.2f}, tree K 2 N 4 {lengths[2]:.2f}, tree K 4 N 8 {lengths[4]:.2f}")
    assert lengths[4] > lengths[None] + 0.1, lengths


class CaptureLikeRunner:
    """CudaGraphs.run as a CPU sees it: a key's first call runs the function as CudaGraphs.capture
    does (3 warm-up calls on copies of the inputs, then the replay), later calls once."""

    def __init__(self):
        self.seen = set()

    def run(self, key, fn, *inputs):
        if key not in self.seen:
            self.seen.add(key)
            static = [x.clone() for x in inputs]
            for _ in range(3):
                fn(*static)
        return fn(*[x.clone() for x in inputs])


def test_whatever_generate_captures_can_run_again():
    """A capture runs its function several times (CudaGraphs' warm-up), so whatever generate hands
    to its runner must give the same result when run again: a tree's cache move, which along a
    path that skips a node reads a slot its first run overwrote, stays outside the graphs. The
    trained pair's trees (K 4, N 8; its first cycles accept paths through later siblings) with a
    runner that repeats each key's first call as a capture does: the same tokens, accepted paths
    and target cache as eager."""
    prompts = train.heldout_prompts(6, 24)
    runs = []
    for graphs in (None, CaptureLikeRunner()):
        target, head = train.load_pair(max_batch_size=6, max_seq_len=96)
        res = generate(target, head, prompts, max_new_tokens=16, num_steps=3, eos_id=-1, topk=4,
                       num_draft_tokens=8, graphs=graphs)
        runs.append((res, target.kv_caches.clone(), target.pe_caches.clone()))
    (eager, kv, pe), (repeated, kv2, pe2) = runs
    assert repeated.tokens == eager.tokens and torch.equal(repeated.accepted, eager.accepted)
    assert (eager.paths[0] > 1).any(), "no first-cycle path through a later sibling: no check"
    assert torch.equal(kv2, kv) and torch.equal(pe2, pe)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_gpu_tree_graph_generate_equals_eager(mode):
    """A tree's verify (its mask built inside), greedy acceptance (accept_tree: the walk, the
    tokens emitted), draft extend and expansion replayed from CUDA graphs: the same tokens, drafts,
    parents and accepted counts as eager, cycle by cycle, and the same target cache after (both
    runs write the same slots of one model's cache; a capture's warm-up runs must not move it)."""
    target, head = gpu_models()
    kw = dict(max_new_tokens=24, num_steps=3, attention_mode=mode, topk=2, num_draft_tokens=6)
    eager = generate(target, head, PROMPTS[3], **kw)
    caches = target.kv_caches.clone(), target.pe_caches.clone()
    graphed = generate(target, head, PROMPTS[3], use_graphs=True, **kw)
    assert graphed.tokens == eager.tokens and torch.equal(graphed.accepted, eager.accepted)
    assert torch.equal(graphed.drafts, eager.drafts) and torch.equal(graphed.parents, eager.parents)
    assert torch.equal(target.kv_caches, caches[0]) and torch.equal(target.pe_caches, caches[1])


@pytest.mark.gpu
def test_gpu_tree_cycle_makes_no_host_sync():
    """Every call of a tree's cycle, captured (verify with its mask, the greedy accept_tree,
    expansion) or eager (the sampling accept_tree, the cache move), with the device's sync check
    set to fail on any host sync."""
    target, head = gpu_models()
    B, P, K, S, N, kv = 3, 12, 2, 3, 6, 32
    tokens = torch.randint(0, 256, (B, P), generator=torch.Generator().manual_seed(0)).cuda()
    pos, last = torch.arange(P, device="cuda").expand(B, P), torch.full((B,), P - 1, device="cuda")
    _, aux = target(tokens, pos, "extend", capture_aux=True)
    logits, g = head.extend_logits(tokens, pos, aux, last)
    tree = head.tree(tokens[:, -1], logits, g, last, K, S, N, kv_len=kv)
    start, runner = last + 1, CudaGraphs("cuda")
    done = torch.zeros(B, dtype=torch.bool, device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mode, temperature in (("extend", 0.0), ("decode", 0.0), ("decode", 1.0)):
            verify = partial(tree_forward, target, mode=mode, kv_len=kv)
            for _ in range(2):  # capture, then replay
                out = runner.run(GraphKey("verify_tree", mode, B, N, kv), verify, tree.tokens,
                                 tree.parents, tree.depths, start)
            walk = partial(accept_tree, max_depth=S, temperature=temperature, generator=gen)
            for _ in range(2):
                args = (out.logits, tree.tokens, tree.parents, tree.depths, done)
                _, path, bonus, _ = (runner.run(GraphKey("accept_tree", None, B, N), walk, *args)
                                     if temperature == 0 else walk(*args))
            target.move_cache(start.unsqueeze(1) + path,
                              start.unsqueeze(1) + torch.arange(S + 1, device="cuda"))
            expand = partial(head.tree, topk=K, num_steps=S, num_nodes=N, kv_len=kv)
            for _ in range(2):
                runner.run(GraphKey("draft_tree", None, B, (S - 1) * K, kv), expand, bonus, logits,
                           g, last)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_tree_stays_inside_the_cache():
    """Deep acceptance near the end of the output, rows finishing at different cycles: a tree's
    verify writes N slots from the newest token and the head's passes (S - 1) K scratch slots
    past the accepted path, so generate asks for P + max_new_tokens + max(N, D + (S - 1) K - 1)
    slots (a bound: these runs write up to 4 slots short of it). The writes, the verify's (the
    target) and the head's, reach past the output's last position into that lookahead."""
    P, max_new, S = 6, 8, 3
    for K, N in ((2, 8), (4, 4)):   # the verify's N slots bound it, or the head's scratch does
        lookahead = max(N, min(S, N - 1) + (S - 1) * K - 1)
        size = P + max_new + lookahead
        target = init_random(Transformer(tiny(), 2, size, dtype=torch.float32), 0)
        head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 1)
        written = last_slot_written(head.midlayer.self_attn)
        mla, write = target.layers[0].self_attn, target.layers[0].self_attn.write_cache
        mla.write_cache = lambda q_pe, kv_a, slots, rope: written.append(int(slots.max())) or \
            write(q_pe, kv_a, slots, rope)
        prompts = [list(range(1, P + 1)), list(range(1, P - 1))]
        for seed in range(4):
            generate(target, head, prompts, max_new_tokens=max_new, num_steps=S, topk=K,
                     num_draft_tokens=N,
                     probe=Probe(accept_len=4.0), seed=seed, eos_id=-1)
        assert max(written) > P + max_new, f"K {K}, N {N}: no write past the output: {written}"
        with pytest.raises(ValueError, match="lookahead"):
            generate(target, head, [list(range(1, P + 2))], max_new_tokens=max_new, num_steps=S,
                     topk=K,
                     num_draft_tokens=N)


def test_a_finished_row_stays_inside_the_cache():
    """The trained pair, two ragged rows, the cache exactly P + max_new_tokens + 2k - 2: the row
    that finishes first (at max_new_tokens) keeps running in place while the other decodes, and
    its acceptance must not move it (found: it accepted k drafts and chained one slot past)."""
    k, max_new, P = 3, 12, 20
    prompts = train.heldout_prompts(8, 40)
    target, head = train.load_pair(max_batch_size=2, max_seq_len=P + max_new + 2 * k - 2)
    rows = [prompts[4][:P], prompts[0][:15]]   # the case found (row 0 finishes first)
    plain = generate(target, None, rows, max_new_tokens=max_new, eos_id=-1).tokens
    assert generate(target, head, rows, max_new_tokens=max_new, num_steps=k,
                    eos_id=-1).tokens == plain


def test_tree_dump_holds_the_tree_and_its_accepted_path():
    """--dump of a tree (a planted head, so paths of every depth are accepted): each live cycle's
    accepted nodes are a path down the tree whose tokens are the output tokens they became;
    compare passes the dump against itself, refuses a chain against it and names a broken path."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=40, dtype=torch.float32),
                         32)
    plain = generate(target, None, PROMPTS[3], max_new_tokens=16).tokens
    ref = reference_sequences(PROMPTS[3], plain, 40)
    head = PlantedTreeHead(ref, 256, lambda c, b, d: (c + b) % 3 and (c + b + d) % 3)
    d = baseline.dump(target, head, PROMPTS[3], max_new_tokens=16, num_steps=3, tree=(2, 6))
    assert d["output_ids"].tolist() == [o + [-1] * (16 - len(o)) for o in plain]   # lossless
    assert d["draft_parents"].shape == d["draft_ids"].shape == (3, d["accepted"].shape[1], 5)
    for b, out in enumerate(plain):
        at = 1
        for m, drafts, nodes in zip(d["accepted"][b], d["draft_ids"][b], d["accepted_nodes"][b]):
            if m >= 0:
                assert [drafts[n - 1] for n in nodes[:m]] == out[at:at + m], (b, at, m)
                at += m + 1
    assert {0, 3} <= set(d["accepted"][d["accepted"] >= 0].tolist())
    assert not baseline.compare(d, d)["failures"]
    chain = baseline.dump(target, None, PROMPTS[3], max_new_tokens=16)
    chain.update(draft_ids=d["draft_ids"], accepted=d["accepted"])
    with pytest.raises(ValueError, match="A drafts a chain, B a tree"):
        baseline.compare(chain, d)
    broken = dict(d, accepted_nodes=np.where(d["accepted_nodes"] > 0, 5, -1))
    with pytest.raises(ValueError, match=r"accepted_nodes\[.*is not a path"):
        baseline.compare(d, broken)


# ---------------------------------------------------------------------------------------------
# CUDA graphs against eager on the GPU (no host sync, bf16 agreement) and graphs.py's keys,
# copies and replays (torch.cuda faked) on any machine; on the GPU also decode vs extend, grouped
# vs gather, compiled layers

# the fused MoE (with every Triton kernel on) needs Triton: marked so, it skips with the reason
GPU_MOE = [pytest.param(q, impl, marks=[pytest.mark.triton] if impl == "fused" else [])
           for q in (None, "int4", "fp8") for impl in ("fused", "grouped")]


@pytest.mark.gpu
@pytest.mark.parametrize("quant, impl", GPU_MOE)
def test_graph_replay_equals_eager(quant, impl):
    """With the fused MoE every Triton kernel is on, launched with programmatic dependent launch
    where the GPU has it (sm_90 on), and the eager reference runs without it: a kernel that read
    what its predecessor writes before waiting for it would differ."""
    target, head = gpu_models(quant=quant, moe_impl=impl, kernels_on="all" if impl == "fused"
                              else "none")
    assert target.moe_impl == impl
    assert kernels.PDL == (torch.cuda.get_device_capability() >= (9, 0))
    runner = CudaGraphs("cuda")
    for key, fn, inputs in captured_calls(target, head):
        eager = flat(eager_without_pdl(fn, *inputs))
        graphed = flat(runner.run(key, fn, *inputs))
        assert_close(graphed, eager, 0.0, f"graph vs eager {key}")
        again = [x.clone() for x in inputs]  # replay on other values: still equal to eager
        again[0] = (again[0] + 1) % 256 if again[0].dtype == torch.int64 else again[0]
        assert_close(flat(runner.run(key, fn, *again)), flat(eager_without_pdl(fn, *again)), 0.0,
                     f"graph vs eager {key}, new inputs")


def test_graph_keys_remember_their_function():
    """A CUDA graph replays what it captured, so a key names one function: the same partial or
    bound method again is the same, another mode or method is not (compared without a device
    read)."""
    target = Transformer(tiny(), max_batch_size=1, max_seq_len=8)
    head = Eagle3Draft(draft_preset("tiny"), target)
    assert function_id(partial(target,
                               mode="decode")) == function_id(partial(target, mode="decode"))
    assert function_id(partial(target,
                               mode="decode")) != function_id(partial(target, mode="extend"))
    assert function_id(head.extend) == function_id(head.extend) != function_id(head.chain)
    assert function_name(partial(head.chain,
                                 num_steps=3)) == "partial(Eagle3Draft.chain, num_steps=3)"


def test_graph_outputs_are_copied_whole():
    """A replay hands back copies (the pool may be reused): a named tuple stays one, None stays
    None."""
    out = model.TargetOutput(torch.ones(2, 3), None)
    copy = copy_out(out)
    assert type(copy) is model.TargetOutput and copy.aux is None and torch.equal(copy.logits,
    out.logits)
    assert copy.logits.data_ptr() != out.logits.data_ptr()
    first, g = copy_out((torch.zeros(2), torch.ones(2, 4)))
    assert torch.equal(g, torch.ones(2, 4)) and first.shape == (2,)


class FakeGraph:
    """torch.cuda.CUDAGraph's stand-in: the function run inside `with torch.cuda.graph(g)` (faked
    by fake_capture) records its work on FakeGraph.capturing, and replay reruns that work on the
    same tensors, as a CUDA graph replays its kernels on the same addresses."""
    capturing = None

    def replay(self):
        self.work()


@contextlib.contextmanager
def fake_capture(graph, pool=None):
    FakeGraph.capturing = graph
    try:
        yield
    finally:
        FakeGraph.capturing = None


def test_graph_replay_reads_each_calls_inputs(monkeypatch):
    """CudaGraphs.run copies each call's inputs into the static inputs its graph captured: run
    again on new inputs, it returns their result, not the first call's; inputs of another shape,
    dtype or count are refused before anything replays. On any machine, with torch.cuda's graph,
    streams and pool faked; the function writes its output in place."""
    stream = SimpleNamespace(wait_stream=lambda other: None)
    fakes = dict(CUDAGraph=FakeGraph, graph=fake_capture, graph_pool_handle=lambda: None,
                 Stream=lambda device=None: stream, current_stream=lambda device=None: stream,
                 stream=lambda s: contextlib.nullcontext())
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    out = torch.zeros(2)

    def double(x):
        if FakeGraph.capturing:
            FakeGraph.capturing.work = lambda: torch.mul(x, 2, out=out)
        return torch.mul(x, 2, out=out)
    runner = CudaGraphs("cuda", warmup=1)
    first = runner.run("key", double, torch.tensor([1.0, 2.0]))
    second = runner.run("key", double, torch.tensor([5.0, 7.0]))
    assert len(runner.graphs) == 1, "the second call captured again instead of replaying"
    assert first.tolist() == [2.0, 4.0] and second.tolist() == [10.0, 14.0], (first, second)
    for bad in ((torch.tensor([3.0]),), (torch.tensor([3, 4]),), ()):  # broadcast, cast, stale
        with pytest.raises(ValueError, match=r"captured inputs \[\(\(2,\), torch.float32\)\]"):
            runner.run("key", double, *bad)
    assert second.tolist() == [10.0, 14.0] and out.tolist() == [10.0, 14.0]   # nothing replayed


@pytest.mark.gpu
def test_graph_key_collision_is_refused():
    target, head = gpu_models()
    key, fn, inputs = captured_calls(target, head)[1]                  # verify, extend attention
    runner = CudaGraphs("cuda")
    runner.run(key, fn, *inputs)
    with pytest.raises(ValueError, match=r"replays partial\(Transformer, mode='extend'"):
        runner.run(key, partial(target, mode="decode", capture_aux=True), *inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("quant, impl", GPU_MOE)
def test_no_host_sync_in_captured_paths(quant, impl):
    target, head = gpu_models(quant=quant, moe_impl=impl, kernels_on="all" if impl == "fused"
                              else "none")
    calls = captured_calls(target, head)
    runner = CudaGraphs("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for key, fn, inputs in calls:
            fn(*inputs)                        # eager: no host sync either
            runner.run(key, fn, *inputs)       # capture + replay
            runner.run(key, fn, *inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_graph_generate_equals_eager_generate_and_reports_bf16_agreement(mode):
    """A chain's cycles replayed from CUDA graphs: the same tokens as eager and the same target
    cache after (both runs write the same slots of one model's cache)."""
    target, head = gpu_models()
    prompts = PROMPTS[3]
    eager = generate(target, head, prompts, max_new_tokens=24, num_steps=3, attention_mode=mode)
    caches = target.kv_caches.clone(), target.pe_caches.clone()
    graphed = generate(target, head, prompts, max_new_tokens=24, num_steps=3, attention_mode=mode,
                       use_graphs=True)
    assert graphed.tokens == eager.tokens
    assert torch.equal(target.kv_caches, caches[0]) and torch.equal(target.pe_caches, caches[1])
    plain = generate(target, None, prompts, max_new_tokens=24, use_graphs=True).tokens
    same = sum(a == b for x, y in zip(graphed.tokens, plain) for a, b in zip(x, y))
    total = sum(len(x) for x in plain)
    print(f"\nbf16 {mode}: speculative (graph) vs plain greedy agree on {same}/{total} tokens")
    # bf16 reorders reductions with shapes, so the sequences may part: reported, not asserted (the
    # assertion above, graph == eager, is exact; speculative == plain is proven in float64 on CPU)


@pytest.mark.gpu
def test_gpu_decode_attention_equals_extend_and_grouped_equals_gather():
    """Attention paths in float32 on the GPU (bf16 can flip a near-tied expert choice, which moves
    logits by O(1) in a random model); the grouped MoE against gathered weights on the same routing
    in bf16."""
    target = init_random(Transformer(tiny(), 3, 64, device="cuda", dtype=torch.float32), 0)
    prefill, prefill_pos, step, step_pos = (t.cuda() for t in step_inputs(256))
    target(prefill, prefill_pos)
    extend = target(step, step_pos, "extend").logits
    # float32 rounding only: the modes sum in other orders (decode: the absorbed latent products;
    # extend: the expanded keys and values); on a CPU they differ by 1e-6 of the largest logit
    # (test_extend_decode_and_incremental_agree: 1e-10 in float64). 1e-4 of it leaves room for the
    # GPU's reduction orders; a wrong slot, mask or position moves logits by O(1)
    assert_close(target(step, step_pos, "decode").logits, extend,
                 1e-4 * extend.abs().max().item(), "float32 GPU decode vs extend attention")
    if not kernels.grouped_mm_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm is not available for bf16 on this GPU")
    grouped = init_random(Transformer(tiny(), 1, 8, device="cuda", dtype=torch.bfloat16), 1)
    kernels.accelerate(grouped, moe="grouped")
    moe = grouped.layers[1].mlp
    x = torch.randn(37, 64, device="cuda", dtype=torch.bfloat16)
    ids, weights = moe.gate(x)
    grouped = moe.experts(x, ids, weights)
    assert_close(grouped, model.Experts.forward(moe.experts, x, ids, weights),
                 2e-2 * grouped.abs().max().item(), "bf16 grouped vs gather")


@pytest.mark.gpu
def test_uniform_routing_same_in_a_graph_as_eager_without_host_sync():
    """Uniform routing in float32: the router's choice and each captured call's output replayed
    from a CUDA graph equal eager ones (run without programmatic dependent launch), with no host
    sync in the capture and replay; replayed on other inputs, still equal to eager."""
    target, head = gpu_models(dtype=torch.float32)
    target.set_routing("uniform")
    router = target.layers[1].mlp.gate
    x = torch.randn(12, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    calls = captured_calls(target, head)[:3]  # decode, verify extend, verify decode
    eager = [router(x)] + [flat(eager_without_pdl(fn, *inputs)) for _, fn, inputs in calls]
    runner = CudaGraphs("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphed = [runner.run(("router", 12), router, x)]
        graphed += [flat(runner.run(key + ("uniform",), fn, *inputs)) for key, fn, inputs in calls]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    (ids, w), (eager_ids, eager_w) = graphed[0], eager[0]
    assert torch.equal(ids, eager_ids) and torch.equal(w, eager_w), \
        "uniform routing chose differently in a graph"
    for (key, _, _), a, b in zip(calls, graphed[1:], eager[1:]):
        assert_close(a, b, 0.0, f"uniform routing, graph vs eager {key}")
    # replayed on other tokens at other positions: uniform routing places a token's experts by its
    # place in the forward, so the same experts, other values
    x2 = torch.randn(12, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(runner.run(("router", 12), router, x2),
                                                 router(x2))), "router replay on a new x"
    for key, fn, inputs in captured_calls(target, head, P=15, seed=1)[:3]:
        assert_close(flat(runner.run(key + ("uniform",), fn, *inputs)),
                     flat(eager_without_pdl(fn, *inputs)), 0.0,
                     f"uniform routing, replay on new inputs vs eager {key}")


@pytest.mark.gpu
@pytest.mark.parametrize("kernels_on", [False, pytest.param(True, marks=pytest.mark.triton)])
def test_compiled_layers_equal_plain_inside_graphs_without_host_sync(kernels_on):
    """run.py --compile: torch.compile fuses each layer, our CUDA graphs capture the result; with
    every kernel on (run.py --compile --kernels all, SIMULATED uniform routing as run.py times it)
    the Triton launches run between the compiled parts. Logits and aux states against the same
    model uncompiled (run without programmatic dependent launch), for a 9-row step and a 3-row one
    (the GEMV paths: InputNormInQKVA's among them)."""
    target = init_random(Transformer(tiny(), 3, 64, device="cuda", dtype=torch.float32,
                                     routing="uniform" if kernels_on else "model"), 0)
    if kernels_on:
        kernels.accelerate(target, "all")                 # on CUDA with Triton: the fused MoE
    else:
        kernels.accelerate(target, "none", moe="gather")  # the plain model: no Triton launch
    prefill, prefill_pos, step, step_pos = (t.cuda() for t in step_inputs(256))
    target(prefill, prefill_pos)
    # contiguous, as CudaGraphs' static copies (clones) of them are: a strided view's other strides
    # would fail the compiled layers' guards and recompile inside the no-sync check (GPU run of
    # 2026-12-01)
    steps = {9: (step, step_pos), 3: (step[:, :1].contiguous(), step_pos[:, :1].contiguous())}
    # the same shapes on other tokens, a slot further on, replayed after the first set's capture
    # (each steps' call rewrites every slot it reads that these write)
    other = {9: (torch.roll(step, 1, 0), step_pos + 1),
             3: (step[:, 2:].contiguous(), (step_pos[:, 2:] + 1).contiguous())}
    plain = {(mode, n): flat(eager_without_pdl(partial(target, mode=mode, capture_aux=True),
                                               *steps[n]))
             for mode in ("extend", "decode") for n in steps}
    kernels.compile_layers(target)
    runner = CudaGraphs("cuda")
    for (mode, n), ref in plain.items():
        fn, what = partial(target, mode=mode,
                           capture_aux=True), f"{mode}, {n} rows, kernels {kernels_on}"
        assert_close(flat(fn(*steps[n])), ref, 1e-4, f"compiled vs plain layers, {what}")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphed = flat(runner.run(("compiled", mode, n), fn, *steps[n]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_close(graphed, ref, 1e-4, f"compiled layers in a CUDA graph vs plain, {what}")
        again = flat(runner.run(("compiled", mode, n), fn, *other[n]))
        assert_close(again, flat(eager_without_pdl(fn, *other[n])), 1e-4,
                     f"compiled layers' graph replayed on other inputs vs eager, {what}")
