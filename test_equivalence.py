"""Every fast or parallel path against its plain reference, on fresh random inputs.

CPU tests use the tiny preset (milliseconds a forward) and spawn gloo ranks for TP. GPU tests
(graphs, bf16) skip on a machine without CUDA, saying so; run them on the GPU before calling
graph work done: `python -m pytest -q test_equivalence.py` there runs both parts.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

if not torch.cuda.is_available():  # Triton's CPU interpreter runs the kernels' small cases; set before
    os.environ.setdefault("TRITON_INTERPRET", "1")  # anything imports Triton (its decorators read it)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import model  # noqa: E402
import tp  # noqa: E402
from model import ModelArgs, Transformer, init_random, load_target, save_target  # noqa: E402
from tp import TP  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
triton_runs = pytest.mark.skipif(not model.fused_moe_available(TRITON_DEVICE, torch.float32),
                                 reason="needs Triton (on CUDA, or its CPU interpreter with TRITON_INTERPRET=1)")


def tiny(**kw):
    return model.preset("tiny", **kw)


def assert_close(a, b, atol, what):
    diff = (a.double() - b.double()).abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3e} > {atol:.1e}"


# ---------------------------------------------------------------------------------------------
# Spawning gloo ranks on the CPU

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, fn, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tp.init_distributed("cpu")
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def run_ranks(world, fn, *args):
    """Run fn(*args) on `world` gloo ranks; return rank 0's result."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.pt")
        mp.spawn(_rank_main, args=(world, _free_port(), fn, args, out), nprocs=world, join=True)
        return torch.load(out)


# ---------------------------------------------------------------------------------------------
# The target: TP N against TP 1, extend against decode, incremental against whole

def step_inputs(vocab, seed=0):
    """A 12-token prefill for 3 rows, then a 3-token step with every row at its own position
    (rows 1 and 2 go back and overwrite slots, as a rejected draft would)."""
    g = torch.Generator().manual_seed(seed)
    prefill = torch.randint(0, vocab, (3, 12), generator=g)
    step = torch.randint(0, vocab, (3, 3), generator=g)
    step_pos = torch.tensor([[12, 13, 14], [10, 11, 12], [7, 8, 9]])
    return prefill, torch.arange(12).expand(3, 12), step, step_pos


def run_steps(m):
    """Logits of the prefill and of the step in both attention modes, concatenated along T."""
    prefill, prefill_pos, step, step_pos = step_inputs(m.args.vocab_size)
    outs = [m(prefill, prefill_pos, "extend")]
    for mode in ("extend", "decode"):
        outs.append(m(step, step_pos, mode))
    return torch.cat(outs, 1)


def _tp_worker(ckpt, seed, dtype):
    """On each rank: the seeded random model and the checkpoint-loaded model."""
    from_seed = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=dtype), seed)
    loaded = load_target(ckpt, max_batch_size=3, max_seq_len=32, dtype=dtype)
    return run_steps(from_seed), run_steps(loaded)


@pytest.fixture(scope="module")
def tiny_ckpt():
    """The tiny model (seed 1) saved as a sharded float64 checkpoint, and its TP 1 logits."""
    with tempfile.TemporaryDirectory() as d:
        m = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=torch.float64), 1)
        save_target(m, d, max_shard_bytes=200_000)
        yield d, m


@pytest.mark.parametrize("world", [2, 4])
def test_tp_equals_tp1(world, tiny_ckpt):
    ckpt, _ = tiny_ckpt
    seed = 7
    ref_seed = run_steps(init_random(Transformer(tiny(), 3, 32, dtype=torch.float64), seed))
    ref_loaded = run_steps(load_target(ckpt, 3, 32, dtype=torch.float64))
    got_seed, got_loaded = run_ranks(world, _tp_worker, ckpt, seed, torch.float64)
    assert_close(got_seed, ref_seed, 1e-10, f"TP {world} vs TP 1, seeded init")
    assert_close(got_loaded, ref_loaded, 1e-10, f"TP {world} vs TP 1, loaded checkpoint")


def test_extend_decode_and_incremental_agree():
    m = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=40, dtype=torch.float64), 3)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, m.args.vocab_size, (3, 20), generator=g)
    pos = torch.arange(20).expand(3, 20)
    whole = {mode: m(tokens, pos, mode) for mode in ("extend", "decode")}
    assert_close(whole["decode"], whole["extend"], 1e-10, "decode vs extend attention, whole prompt")
    for mode in ("extend", "decode"):
        # prefill 15, one token, then a (k+1) = 4 token step at the offset
        parts = [m(tokens[:, :15], pos[:, :15], "extend"), m(tokens[:, 15:16], pos[:, 15:16], mode),
                 m(tokens[:, 16:], pos[:, 16:], mode)]
        assert_close(torch.cat(parts, 1), whole["extend"], 1e-10, f"incremental {mode} vs one forward")


def test_kv_len_bounds_the_read_without_changing_results():
    m = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=64, dtype=torch.float64), 4)
    prefill, prefill_pos, step, step_pos = step_inputs(m.args.vocab_size, seed=4)
    m(prefill, prefill_pos)
    full = m(step, step_pos, "decode")
    assert_close(m(step, step_pos, "decode", kv_len=16), full, 1e-12, "kv_len=16 vs full cache")


@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_grouped_moe_equals_gather(quant):
    """With INT4 or FP8 experts, "grouped" dequantizes every expert once the token-expert pairs
    outnumber them (every call here: 36 and 9 tokens x 4 experts >= 16)."""
    args = tiny(quantization_config=quant)
    m = init_random(Transformer(args, max_batch_size=3, max_seq_len=32, dtype=torch.float32), 5)
    g = Transformer(args, max_batch_size=3, max_seq_len=32, dtype=torch.float32, moe_impl="grouped")
    g.load_state_dict(m.state_dict())
    assert m.moe_impl == "gather" and g.moe_impl == "grouped"
    assert_close(run_steps(g), run_steps(m), 1e-4, f"grouped_mm MoE vs gathered weights, {quant or 'plain'} experts")


# ---------------------------------------------------------------------------------------------
# The fused MoE kernel (kernels.py) against the gather path, on the same routing. Float32: the
# same math up to the order of fp32 sums (1e-5 of the largest output); bf16: the fused kernel
# rounds h and each pair's output once from fp32 where the plain path rounds gate, up, SiLU, the
# product and each expert's output to bf16, so they agree within 2% of the largest output.

class ExpertsHolder(torch.nn.Module):
    """Just enough of a Transformer (args, tp, parameters) for init_random to fill one Experts."""

    def __init__(self, args, tp, impl, device, dtype):
        super().__init__()
        self.args, self.tp = args, tp
        self.experts = model.Experts(args, tp, impl, device, dtype)


def moe_experts(shape, quant, E, device, dtype, seed=0):
    """One layer's routed experts, random. "tiny": the tiny preset's sizes at TP 2, rank 1 (FP8 in 16x24
    blocks, so a rank's slice of down_proj starts inside a block); "kimi": one rank of Kimi-K2 at TP 8
    (D 7168, I 256, FP8 in 128x128 blocks)."""
    fp8 = model.fp8_quantization_config((16, 24) if shape == "tiny" else (128, 128))
    qc = {None: None, "int4": "int4", "fp8": fp8}[quant]
    if shape == "tiny":
        args, tp_ = tiny(n_routed_experts=E, num_experts_per_tok=8, moe_intermediate_size=64, quantization_config=qc), TP(1, 2)
    else:
        args, tp_ = model.preset("kimi-k2", n_routed_experts=E, quantization_config=qc), TP.simulate(8)
    holder = ExpertsHolder(args, tp_, "fused", device, dtype)
    return init_random(holder, seed, rank_local=shape != "tiny").experts, args.hidden_size


def routing(kind, N, K, E, g, device):
    """ids [N, K]: "shared": every token picks the same K experts (in its own order); "disjoint": no
    two tokens share one (needs N*K <= E); "random": each token K distinct experts at random."""
    if kind == "shared":
        base = torch.randperm(E, generator=g)[:K]
        ids = torch.stack([base[torch.randperm(K, generator=g)] for _ in range(N)])
    elif kind == "disjoint":
        ids = torch.randperm(E, generator=g)[:N * K].view(N, K)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return ids.to(device), torch.rand(N, K, generator=g).to(device) * 2


def check_fused_moe(experts_and_dim, cases, dtype, seed=0):
    experts, D = experts_and_dim
    g = torch.Generator().manual_seed(seed)
    E, K = experts.n_experts, 8
    for N, kind in cases:
        if kind == "disjoint" and N * K > E:
            continue
        ids, w = routing(kind, N, K, E, g, TRITON_DEVICE)
        x = torch.randn(N, D, generator=g).to(TRITON_DEVICE, dtype)
        experts.impl = "fused"
        fused = experts(x, ids, w)
        experts.impl = "gather"
        ref = experts(x, ids, w)
        tol = (1e-5 if dtype == torch.float32 else 2e-2) * ref.abs().max().item()
        assert fused.dtype == ref.dtype and fused.shape == ref.shape
        assert_close(fused, ref, tol, f"fused vs gather MoE, E {E}, N {N}, {kind} routing, {dtype}")
        assert ref.abs().max() > 0.1


# (N, routing) cases; the CPU interpreter runs a few of them (each case ~1 s there), the GPU all
FUSED_CASES_ALL = [(N, kind) for N in (1, 2, 4, 8, 37) for kind in ("shared", "disjoint", "random")]
FUSED_CASES_CPU = {16: [(1, "random"), (2, "disjoint"), (4, "shared"), (37, "random")], 384: [(8, "disjoint")]}


@triton_runs
@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_fused_moe_equals_gather_tiny(quant):
    for E in (16, 384):
        cases = FUSED_CASES_ALL if TRITON_DEVICE.type == "cuda" else FUSED_CASES_CPU[E]
        dtypes = (torch.float32, torch.bfloat16) if TRITON_DEVICE.type == "cuda" else (torch.float32,)
        for dtype in dtypes:   # (Triton's interpreter computes bf16 dots wrongly: float32 on the CPU)
            check_fused_moe(moe_experts("tiny", quant, E, TRITON_DEVICE, dtype), cases, dtype)


@cuda
@triton_runs
@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_fused_moe_equals_gather_kimi_rank_shapes(quant):
    for E in (16, 384):
        for dtype in (torch.float32, torch.bfloat16):
            check_fused_moe(moe_experts("kimi", quant, E, "cuda", dtype), FUSED_CASES_ALL, dtype)
            torch.cuda.empty_cache()


@triton_runs
def test_fused_moe_refuses_bad_input_by_name():
    import kernels
    experts, _ = moe_experts("tiny", None, 16, TRITON_DEVICE, torch.float32)
    x, ids = torch.randn(2, 64, device=TRITON_DEVICE), torch.zeros(2, 8, dtype=torch.int64, device=TRITON_DEVICE)
    w = kernels.ExpertWeights("plain", experts.gate_proj)
    with pytest.raises(ValueError, match=r"expected \[E, I, D\], \[E, I, D\], \[E, D, I\]"):
        kernels.fused_moe(x, ids, ids.float(), w, w, w)
    with pytest.raises(ValueError, match="x must be bf16, fp16 or fp32"):
        kernels.fused_moe(x.double(), ids, ids.float(), w, w, kernels.ExpertWeights("plain", experts.down_proj))
    with pytest.raises(ValueError, match="moe_impl='fused' needs Triton and a bf16, fp16 or float32 model"):
        Transformer(tiny(), dtype=torch.float64, moe_impl="fused")


def test_aux_states_are_the_chosen_layer_outputs():
    m = init_random(Transformer(tiny(), max_batch_size=1, max_seq_len=16, dtype=torch.float64,
                                aux_layer_ids=[6, 2, 0]), 6)
    assert m.aux_layer_ids == [0, 2, 6]
    tokens, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    seen = []
    hooks = [m.layers[i].register_forward_hook(lambda mod, i_, o: seen.append(o)) for i in (0, 2, 6)]
    logits, aux = m(tokens, pos, capture_aux=True)
    for h in hooks:
        h.remove()
    assert aux.shape == (1, 3, 3 * m.args.hidden_size)
    assert torch.equal(aux, torch.cat(seen, -1))
    assert Transformer(tiny(), 1, 8).aux_layer_ids == [1, 3, 4]  # 1, L//2 - 1, L - 4 for L = 8


@pytest.mark.skipif(not __import__("importlib").util.find_spec("transformers"),
                    reason="transformers is not installed (pip install transformers to compare with HF)")
def test_matches_hf_transformers(tiny_ckpt):
    """Same weights, same logits as transformers' DeepseekV3ForCausalLM (float32: its grouped
    experts take no float64)."""
    from transformers import DeepseekV3ForCausalLM
    ckpt, _ = tiny_ckpt
    ours = load_target(ckpt, max_batch_size=2, max_seq_len=32, dtype=torch.float32)
    hf = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf(tokens).logits
    got = ours(tokens, torch.arange(24).expand(2, 24))
    assert_close(got, ref, 2e-5, "ours vs HF DeepseekV3")


# ---------------------------------------------------------------------------------------------
# Checkpoints: round trip, per-rank memory, clear errors

def test_save_load_round_trip_is_exact(tiny_ckpt):
    ckpt, m = tiny_ckpt
    loaded = load_target(ckpt, max_batch_size=3, max_seq_len=32, dtype=torch.float64)
    for (name, a), (_, b) in zip(m.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(run_steps(loaded), run_steps(m))


MEMORY_PROBE = r"""
import sys, threading, time, torch
sys.path.insert(0, sys.argv[2])
from model import load_target
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
    args = ModelArgs(vocab_size=4096, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=4096,
                     num_hidden_layers=2, num_attention_heads=8, n_routed_experts=22, num_experts_per_tok=2,
                     first_k_dense_replace=0, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
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
        assert anon_growth < size / 2, f"anonymous memory grew {anon_growth / 2**20:.0f} MiB of {size / 2**20:.0f}"
        assert hwm_growth < size, f"resident peak grew {hwm_growth / 2**20:.0f} MiB of {size / 2**20:.0f}"


def _edit_checkpoint(src, dst, edit):
    os.makedirs(dst)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


KEY = "model.layers.2.self_attn.kv_b_proj.weight"


@pytest.mark.parametrize("edit, error, words", [
    (lambda t: t.pop(KEY), KeyError, ["missing", KEY]),
    (lambda t: t.update({"model.extra.weight": torch.zeros(2)}), KeyError, ["unexpected", "model.extra.weight"]),
    (lambda t: t.update({KEY: torch.zeros(3, 4, dtype=torch.float64)}), ValueError, [KEY, "[128, 32]", "[3, 4]"]),
    (lambda t: t.update({KEY: t[KEY].to(torch.int32)}), TypeError, [KEY, "I32"]),
    (lambda t: t.update({"model.layers.8.mlp.gate.weight": torch.zeros(2)}), None, []),  # an MTP layer: skipped
])
def test_bad_checkpoints_name_the_problem(tiny_ckpt, edit, error, words):
    ckpt, _ = tiny_ckpt
    with tempfile.TemporaryDirectory() as d:
        bad = os.path.join(d, "bad")
        _edit_checkpoint(ckpt, bad, edit)
        if error is None:
            load_target(bad, max_batch_size=1, max_seq_len=8, dtype=torch.float64)
            return
        with pytest.raises(error) as e:
            load_target(bad, max_batch_size=1, max_seq_len=8, dtype=torch.float64)
        for w in words:
            assert w in str(e.value), (w, str(e.value))


def test_world_size_that_does_not_divide_is_named():
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by .* 3"):
        Transformer(tiny(vocab_size=258), tp=TP(0, 3))
    with pytest.raises(ValueError, match="vocab_size = 256 is not divisible"):
        Transformer(tiny(), tp=TP(0, 3))
    with pytest.raises(ValueError, match="moe_intermediate_size = 32 is not divisible"):
        Transformer(tiny(num_attention_heads=6, vocab_size=258, intermediate_size=132), tp=TP(0, 6))


def test_config_spellings_and_refusals():
    old = tiny().to_hf_config()
    new = dict(old)
    rs = dict(new.pop("rope_scaling"))
    rs["rope_type"] = rs.pop("type")
    new["rope_parameters"] = dict(rs, rope_theta=new.pop("rope_theta"))
    a, b = ModelArgs.from_hf_config(old), ModelArgs.from_hf_config(new)
    assert a == b and a.softmax_scale == b.softmax_scale and a.is_yarn
    nested = ModelArgs.from_hf_config({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": old})
    assert nested == a
    for key, value in [("scoring_func", "softmax"), ("topk_method", "greedy"), ("hidden_act", "gelu")]:
        with pytest.raises(NotImplementedError, match=f"{key} = '{value}'"):
            ModelArgs.from_hf_config(dict(old, **{key: value}))
    with pytest.raises(NotImplementedError, match="rope_scaling type 'linear'"):
        ModelArgs.from_hf_config(dict(old, rope_scaling={"type": "linear", "factor": 2.0}))
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(dict(old, quantization_config={"quant_method": "fp8"}), f)
        with pytest.raises(NotImplementedError, match="fp8"):
            load_target(d)


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints: INT4 experts (kept packed) and FP8 blocks (dequantized at load) against
# the same weights dequantized and saved plain

def test_int4_bit_layout():
    # DESIGN.md: element c of a row sits in word c//8 at bits 4*(c%8)..+3, stored as q + 8
    q = torch.tensor([[-8, -1, 0, 7, 3, -5, 1, 2]])
    nibbles = "A93BF870"   # q + 8 = 0 7 8 15 11 3 9 10, written from element 7 down to element 0
    word = int(nibbles, 16) - 2**32   # the top nibble is >= 8: a negative int32
    assert model.pack_int4(q).tolist() == [[word]]
    assert model.unpack_int4(torch.tensor([[word]], dtype=torch.int32)).tolist() == q.tolist()
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (5, 3, 64), generator=g)
    q[0, 0, :8] = -8   # the edge: nibble 0, and a word of all-zero bits
    packed = model.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 3, 8)
    assert torch.equal(model.unpack_int4(packed).long(), q)
    scale = torch.rand(5, 3, 2, generator=g)
    w = model.dequantize_int4(packed, scale, 32)
    assert torch.equal(w, q * scale.repeat_interleave(32, -1))


def int4_checkpoint(d):
    """The tiny model with INT4 experts in the Kimi-K2.5 layout (text_config, `language_model.`
    prefix, a vision tower to skip), sharded; and the same weights dequantized, saved plain."""
    args = tiny(moe_intermediate_size=64, quantization_config="int4")
    m = init_random(Transformer(args, max_batch_size=3, max_seq_len=32, dtype=torch.float32), 5)
    tensors = model.checkpoint_tensors(m, "language_model.")
    tensors.update({"vision_tower.patch_embed.proj.weight": torch.zeros(4, 3), "mm_projector.proj.0.weight": torch.zeros(2)})
    quant, plain = os.path.join(d, "int4"), os.path.join(d, "plain")
    os.makedirs(quant)
    model.write_safetensors(tensors, quant, max_shard_bytes=300_000)
    with open(os.path.join(quant, "config.json"), "w") as f:
        json.dump({"architectures": ["KimiK25ForConditionalGeneration"], "vision_config": {},
                   "text_config": args.to_hf_config()}, f)
    ref = Transformer(tiny(moe_intermediate_size=64), max_batch_size=3, max_seq_len=32, dtype=torch.float32)
    for (name, p), (_, q) in zip(ref.named_parameters(), [(n, q) for n, q in m.named_parameters()
                                                           if not n.endswith("weight_scale")]):
        p.copy_(m.get_submodule(name.rsplit(".", 1)[0]).weights(name.rsplit(".", 1)[1])
                if ".mlp.experts." in name else q)
    save_target(ref, plain)
    return quant, plain


def fp8_checkpoint(d, block=(16, 24)):
    """The tiny model with every projection FP8 in 16 x 24 blocks (not square, so rows and columns
    cannot be mixed up; edges partial: 40 rows of kv_a_proj, 64 columns; TP 2 slices that start
    inside a block along rows, e.g. q_b_proj's 48, and columns, o_proj's 32), and the same weights
    dequantized here, independently of the loader, saved plain."""
    m = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=torch.float32), 6)
    quant, plain = os.path.join(d, "fp8"), os.path.join(d, "plain")
    save_target(m, plain)
    tensors, deq = load_file(os.path.join(plain, "model.safetensors")), {}
    br, bc = block
    for k in [k for k in tensors if k.endswith("_proj.weight")]:
        w = tensors[k]
        rows, cols = -(-w.shape[0] // br), -(-w.shape[1] // bc)
        padded = torch.zeros(rows * br, cols * bc)
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.unflatten(0, (rows, br)).unflatten(2, (cols, bc)).abs().amax((1, 3))
        scale = amax.clamp(min=1e-12) / 448
        full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:w.shape[0], :w.shape[1]]
        tensors[k] = (w / full).to(torch.float8_e4m3fn)
        tensors[k + "_scale_inv"] = scale
        deq[k] = tensors[k].float() * full
    os.makedirs(quant)
    model.write_safetensors(tensors, quant, max_shard_bytes=200_000)
    save_file({**load_file(os.path.join(plain, "model.safetensors")), **deq}, os.path.join(plain, "model.safetensors"))
    cfg = dict(m.args.to_hf_config(), quantization_config={"quant_method": "fp8", "fmt": "e4m3",
               "activation_scheme": "dynamic", "weight_block_size": list(block)})
    with open(os.path.join(quant, "config.json"), "w") as f:
        json.dump(cfg, f)
    return quant, plain


def _quant_worker(quant, plain):
    return run_steps(load_target(quant, 3, 32, dtype=torch.float32)), run_steps(load_target(plain, 3, 32, dtype=torch.float32))


@pytest.mark.parametrize("make", [int4_checkpoint, fp8_checkpoint])
def test_quantized_checkpoint_equals_dequantized(make, tmp_path):
    quant, plain = make(str(tmp_path))
    loaded = load_target(quant, 3, 32, dtype=torch.float32)
    if make is int4_checkpoint:
        assert loaded.layers[1].mlp.experts.gate_proj.weight_packed.dtype == torch.int32  # stays packed
    else:
        assert loaded.layers[1].mlp.experts.down_proj.weight.dtype == torch.float8_e4m3fn  # stays FP8
    for world in (1, 2):
        got, ref = _quant_worker(quant, plain) if world == 1 else run_ranks(2, _quant_worker, quant, plain)
        assert_close(got, ref, 1e-5, f"{make.__name__} at TP {world}: quantized vs dequantized")
        assert ref.abs().max() > 0.1


def small_steps(m):
    """Logits of a 2 x 3 prefill and a 2-token decode step: run_steps, smaller (Triton's CPU
    interpreter takes ~0.3-1 s per fused MoE call)."""
    tokens = torch.tensor([[5, 17, 3, 250, 9], [41, 2, 199, 64, 8]], device=m.device)
    pos = torch.arange(5, device=m.device).expand(2, 5)
    return torch.cat([m(tokens[:, :3], pos[:, :3], "extend"), m(tokens[:, 3:], pos[:, 3:], "decode")], 1).cpu()


def _fused_quant_worker(quant, plain, device):
    fused = load_target(quant, 2, 16, device=device, dtype=torch.float32, moe_impl="fused")
    ref = load_target(plain, 2, 16, device=device, dtype=torch.float32, moe_impl="gather")
    return small_steps(fused), small_steps(ref)


def run_ranks_interpreted(world, fn, *args):
    """run_ranks with Triton's CPU interpreter in the ranks: the variable must be in their
    environment before anything there imports Triton (on a GPU machine this process has)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return run_ranks(world, fn, *args)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


@triton_runs
@pytest.mark.parametrize("make", [int4_checkpoint, fp8_checkpoint])
def test_quantized_checkpoint_through_fused_moe_equals_dequantized(make, tmp_path):
    """The fused kernel reads the experts as stored (INT4 words, FP8 in 16 x 24 blocks, a TP-2 slice
    of down_proj starting inside a block): equal to the dequantized checkpoint through the gather
    path, at TP 1 (on the GPU where there is one) and TP 2 (gloo ranks, the interpreter)."""
    quant, plain = make(str(tmp_path))
    for world in (1, 2):
        got, ref = (_fused_quant_worker(quant, plain, TRITON_DEVICE.type) if world == 1
                    else run_ranks_interpreted(2, _fused_quant_worker, quant, plain, "cpu"))
        assert_close(got, ref, 1e-5 * max(1.0, ref.abs().max().item()),
                     f"{make.__name__} at TP {world}: fused on quantized vs gather on dequantized")
        assert ref.abs().max() > 0.1


def _edit(src, dst, edit_tensors=lambda t: None, edit_config=lambda c: None):
    _edit_checkpoint(src, dst, edit_tensors)
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
        (int4, dict(edit_tensors=lambda t: t.pop(E + ".weight_scale")), KeyError, [E + ".weight_scale", "missing"]),
        (int4, dict(edit_tensors=lambda t: t.update({E + ".weight_shape": torch.tensor([64, 128])})),
         ValueError, [E + ".weight_packed", "[64, 128]"]),
        (int4, dict(edit_config=lambda c: qcfg(c).update(group_size=48)), ValueError, ["hidden_size = 64", "48-element"]),
        (int4, dict(edit_config=lambda c: qcfg(c).update(group_size=12)), NotImplementedError, ["group_size 12"]),
        (int4, dict(edit_config=lambda c: c["text_config"]["quantization_config"].update(quant_method="awq")),
         NotImplementedError, ["'awq'"]),
        (int4, dict(edit_config=lambda c: c["text_config"]["quantization_config"].update(ignore=["lm_head"])),
         NotImplementedError, ["self_attn", "ignore"]),
        (int4, dict(edit_tensors=lambda t: t.update({"language_model." + A.replace("weight", "weight_packed"): torch.zeros(2, dtype=torch.int32)})),
         NotImplementedError, ["INT4-packed", "self_attn.q_b_proj.weight_packed"]),
        (int4, dict(edit_config=lambda c: c["text_config"].pop("quantization_config")),
         NotImplementedError, ["INT4-packed", "no compressed-tensors quantization_config"]),
        (fp8, dict(edit_tensors=lambda t: t.pop(A + "_scale_inv")), KeyError, [A + "_scale_inv"]),
        (fp8, dict(edit_tensors=lambda t: t.update({A + "_scale_inv": torch.ones(2, 2)})), ValueError, [A + "_scale_inv", "[6, 2]"]),
        (fp8, dict(edit_config=lambda c: c.pop("quantization_config")), TypeError, ["F8_E4M3", "quantization_config"]),
    ]
    for i, (src, edits, error, words) in enumerate(cases):
        bad = _edit(src, str(tmp_path / f"bad{i}"), **edits)
        with pytest.raises(error) as e:
            load_target(bad, max_batch_size=1, max_seq_len=8, dtype=torch.float32)
        for w in words:
            assert w in str(e.value), (i, w, str(e.value))
    with pytest.raises(ValueError, match="moe_intermediate_size per rank = 16 does not fall on whole 32-element"):
        Transformer(tiny(moe_intermediate_size=64, quantization_config="int4"), tp=TP(0, 4))


def test_simulated_rank_is_labelled_and_shaped_like_tp8():
    sim = TP.simulate(4)
    m = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float32, tp=sim), 0,
                    rank_local=True)
    assert "SIMULATED" in sim.describe() and m.layers[0].self_attn.n_local_heads == 1
    logits = m(torch.tensor([[3, 4], [5, 6]]), torch.arange(2).expand(2, 2), "decode")
    assert logits.shape == (2, 2, m.args.vocab_size) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# EAGLE-3 head and speculative decoding: lossless against plain greedy

from draft import Eagle3Draft, draft_preset, init_random_draft, load_draft, save_draft  # noqa: E402
from verify import accept, generate  # noqa: E402

PROMPTS = {1: [[11, 12, 13, 14, 15, 16]], 3: [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28, 29], [31, 32, 33, 34, 35, 36, 37]]}


class PlantedProposer:
    """Knows the target's greedy sequence `ref` [B, L] (by position) and errs where told: on its
    c-th call, row b's first wrong draft is number wrong_at(c, b) (0-based; >= k: all right)."""

    def __init__(self, ref, vocab, wrong_at):
        self.ref, self.vocab, self.wrong_at, self.calls = ref, vocab, wrong_at, 0

    def propose(self, tokens, positions, hidden, last, num_steps):
        q = positions.gather(1, last.unsqueeze(1))                          # [B, 1]
        idx = (q + 1 + torch.arange(1, num_steps + 1)).clamp(max=self.ref.shape[1] - 1)  # d_j: position q+1+j
        drafts = self.ref.gather(1, idx)
        first_wrong = torch.tensor([self.wrong_at(self.calls, b) for b in range(len(drafts))])
        self.calls += 1
        wrong = torch.arange(num_steps) == first_wrong.unsqueeze(1)
        return torch.where(wrong, (drafts + 1) % self.vocab, drafts)


def reference_sequences(prompts, outputs, length):
    ref = torch.zeros(len(prompts), length, dtype=torch.int64)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        seq = torch.tensor(p + o)
        ref[b, :len(seq)] = seq
    return ref


def lossless_matrix(seed, max_new=24):
    """Every (batch, attention mode, num_steps, proposer) case; returns failures and, per case of
    the erring proposer, the accepted lengths seen."""
    dtype = torch.float64
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=40, dtype=dtype), seed)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    failures, seen = [], {}
    for B, prompts in PROMPTS.items():
        plain = generate(target, None, prompts, max_new_tokens=max_new).tokens
        ref = reference_sequences(prompts, plain, 40)
        for mode in ("prefill", "decode"):
            for k in (1, 2, 4):
                proposers = {"eagle3": head,
                             "errs": PlantedProposer(ref, target.args.vocab_size, lambda c, b, k=k: (c + b) % (k + 1)),
                             "right": PlantedProposer(ref, target.args.vocab_size, lambda c, b: 99)}
                for name, prop in proposers.items():
                    res = generate(target, prop, prompts, max_new_tokens=max_new, num_steps=k, attention_mode=mode)
                    if res.tokens != plain:
                        failures.append((B, mode, k, name, plain, res.tokens))
                    body = []  # each row's live cycles but its last, which max_new_tokens may cut
                    for b in range(B):
                        live = res.accepted[:, b][res.accepted[:, b] >= 0].tolist()
                        body += live[:-1]
                    seen[(B, mode, k, name)] = sorted(set(body))
    return failures, seen


def check_lossless(failures, seen):
    assert not failures, f"speculative != plain greedy in {len(failures)} cases, first: {failures[0]}"
    for (B, mode, k, name), lengths in seen.items():
        if name == "errs":
            assert lengths == list(range(k + 1)), f"accepted lengths {lengths} for k={k} B={B} {mode}"
        if name == "right":
            assert lengths == [k], f"always-right proposer accepted {lengths} (k={k}, B={B}, {mode})"


def test_speculative_equals_plain_greedy_tp1():
    check_lossless(*lossless_matrix(seed=21))


def _lossless_worker(seed):
    return lossless_matrix(seed)


def test_speculative_equals_plain_greedy_tp2():
    check_lossless(*run_ranks(2, _lossless_worker, 21))


def test_accepted_lengths_follow_the_plan():
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=64, dtype=torch.float64), 2)
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


def test_speculative_sampling_follows_the_target():
    """200k rows, vocab 6, k = 2: the first emitted token ~ p_0 and, where it is d_1, the second
    ~ p_1, for a good (most likely), bad (least likely) and random draft. Bound: total variation
    < 1.5 sqrt(V / n) over n samples (0.008 at n = 200k; a wrong rule is off by 0.1 or more)."""
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
        emitted = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, m.unsqueeze(1), bonus.unsqueeze(1))
        first = torch.bincount(emitted[:, 0], minlength=V) / N
        tv0 = 0.5 * (first - p[0]).abs().sum().item()
        took_d1 = emitted[:, 0] == drafts[:, 0]
        if kind == "random":  # condition per d_1 value: pool rows whose first token was their draft
            took_d1 = took_d1 & (drafts[:, 0] == 0)
        second = torch.bincount(emitted[took_d1, 1], minlength=V) / took_d1.sum()
        tv1 = 0.5 * (second - p[1]).abs().sum().item()
        n1 = took_d1.sum().item()
        assert tv0 < 1.5 * (V / N) ** 0.5 and tv1 < 1.5 * (V / n1) ** 0.5, \
            f"{kind} draft: TV {tv0:.4f} (first, n={N}), {tv1:.4f} (second, n={n1})"


def test_sampling_generate_runs_and_is_seeded():
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=40, dtype=torch.float32), 3)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 4)
    a = generate(target, head, PROMPTS[3], max_new_tokens=10, num_steps=2, temperature=0.8, seed=5)
    b = generate(target, head, PROMPTS[3], max_new_tokens=10, num_steps=2, temperature=0.8, seed=5)
    assert a.tokens == b.tokens and all(len(t) == 10 or 2 in t for t in a.tokens)


def test_draft_round_trip_and_errors(tmp_path):
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float64), 5)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 6)
    save_draft(head, tmp_path / "d")
    loaded = load_draft(tmp_path / "d", target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    tokens, pos = torch.tensor([[3, 4, 5]] * 2), torch.arange(3).expand(2, 3)
    hidden = torch.randn(2, 3, 3 * 64, dtype=torch.float64)
    assert torch.equal(head(tokens, pos, hidden)[0], loaded(tokens, pos, hidden)[0])
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    tensors.pop("midlayer.self_attn.k_proj.weight")
    os.makedirs(tmp_path / "bad")
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError, match="midlayer.self_attn.k_proj.weight"):
        load_draft(tmp_path / "bad", target)
    (tmp_path / "bad" / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        load_draft(tmp_path / "bad", target)


def _draft_tp_worker(path, seed):
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float64), seed)
    head = load_draft(path, target)
    tokens, pos = torch.tensor([[3, 4, 5], [7, 8, 9]]), torch.tensor([[0, 1, 2], [4, 5, 6]])
    hidden = torch.randn(2, 3, 3 * 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return head(tokens, pos, hidden)[0], head.propose(tokens, pos, hidden, torch.tensor([2, 1]), 3)


@pytest.mark.parametrize("world", [2, 4])
def test_draft_tp_equals_tp1(world, tmp_path):
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float64), 9)
    save_draft(init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 10), tmp_path)
    ref_logits, ref_drafts = _draft_tp_worker(tmp_path, 9)
    logits, drafts = run_ranks(world, _draft_tp_worker, tmp_path, 9)
    assert_close(logits, ref_logits, 1e-10, f"draft logits TP {world} vs TP 1")
    assert torch.equal(drafts, ref_drafts)


def test_requests_that_cannot_run_are_refused():
    target = init_random(Transformer(tiny(), max_batch_size=2, max_seq_len=16, dtype=torch.float32), 0)
    with pytest.raises(ValueError, match="max_seq_len 16"):
        generate(target, None, [[1] * 10], max_new_tokens=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(target, None, [[1, 999]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_batch_size 2"):
        generate(target, None, [[1]] * 3, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        if torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device (this machine has one: nothing to refuse)")
        generate(target, None, [[1, 2]], max_new_tokens=2, use_graphs=True)


# ---------------------------------------------------------------------------------------------
# run.py on CPU

def test_run_py_cli_tiny(tmp_path):
    """run.py's CPU defaults (the GPU is hidden, so this is the CPU run on any machine)."""
    out = tmp_path / "r.json"
    cpu = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--json", str(out), "--max-new-tokens", "20",
                    "--speculative-num-steps", "2", "--batch-size", "2"], check=True, capture_output=True, cwd=HERE,
                   env=cpu)
    r = json.loads(out.read_text())
    assert r["env"]["simulated_acceptance"] is False and r["floors"] is None
    for mode in ("prefill", "decode"):
        assert f"verify/{mode}/eager" in r["phases_ms"]
        v = r["e2e"][f"eagle3/{mode}/eager"]
        parts = sum(t for p, t in v["phases_ms"].items() if p != "cycle")
        # medians of the parts need not add up to the median cycle exactly; a missing phase (verify
        # is over half the cycle) would
        assert abs(parts - v["phases_ms"]["cycle"]) <= 0.1 * v["phases_ms"]["cycle"], v["phases_ms"]
        assert 1 <= v["accept_len_mean"] <= 3 and sum(v["accept_len_hist"]) > 0
    assert r["greedy_agreement_with_plain"] == {"eagle3/prefill/eager": 1.0, "eagle3/decode/eager": 1.0}
    assert set(r["cost_model"]) == {"1", "2", "3", "4", "5"}
    sim = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--simulate-accept-len", "2.5",
                          "--max-new-tokens", "40"], check=True, capture_output=True, text=True, cwd=HERE,
                         env=cpu).stdout
    r = json.loads(sim.strip().splitlines()[-1])
    assert "SIMULATED" in sim and r["env"]["simulated_acceptance"] is True
    assert 1.8 <= r["e2e"]["eagle3/decode/eager"]["accept_len_mean"] <= 3.2


# ---------------------------------------------------------------------------------------------
# The correctness baseline: run.py --dump and --compare

import numpy as np  # noqa: E402

import run  # noqa: E402


def check_dump_layout(d, prompts, k):
    """The arrays mean what the README says: padding where it says, the teacher-forced top-1 along
    a greedy output is the token generated, and each cycle's accepted drafts are the output tokens
    they became, its first rejected draft is not."""
    for b, p in enumerate(prompts):
        out = d["output_ids"][b][d["output_ids"][b] >= 0]
        end = len(p) + len(out) - 1                     # positions < end predict a token of the row
        assert d["prompt_ids"][b, :len(p)].tolist() == p and (d["prompt_ids"][b, len(p):] == -1).all()
        assert (d["output_ids"][b, len(out):] == -1).all()
        assert d["topk_ids"][b, len(p) - 1:end, 0].tolist() == out.tolist(), b
        assert (np.diff(d["topk_logprobs"][b, :end], axis=-1) <= 0).all()
        assert (d["topk_ids"][b, end:] == -1).all() and np.isnan(d["topk_logprobs"][b, end:]).all()
        at = 1  # out[0] comes from the prefill; then each cycle emits its m accepted drafts and a bonus
        for m, drafts in zip(d["accepted"][b], d["draft_ids"][b]):
            if m < 0:
                assert (drafts == -1).all()
                continue
            want = out[at:at + m]
            assert drafts[:len(want)].tolist() == want.tolist(), (b, at, m)
            if m < k and at + m < len(out):
                assert drafts[m] != out[at + m], (b, at, m)
            at += m + 1


def _dump_worker(seed):
    """The random tiny target and EAGLE-3 head (seeded whole: the same model at any TP), dumped."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=torch.float32), seed)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    d = run.dump(target, head, PROMPTS[3], max_new_tokens=16, num_steps=2)
    return {key: torch.from_numpy(v) for key, v in d.items()}  # run_ranks' torch.load takes tensors


def test_dump_at_tp2_equals_tp1():
    ref = {key: v.numpy() for key, v in _dump_worker(31).items()}
    got = {key: v.numpy() for key, v in run_ranks(2, _dump_worker, 31).items()}
    check_dump_layout(ref, PROMPTS[3], 2)
    for key in ("prompt_ids", "output_ids", "topk_ids", "draft_ids", "accepted"):
        assert np.array_equal(got[key], ref[key]), key
    report = run.compare(ref, got, max_logprob_diff=1e-5, min_top1_agreement=1.0, max_accept_diff=0.0)
    assert not report["failures"] and [r["diverge"] for r in report["rows"]] == [None] * 3, report


@pytest.fixture(scope="module")
def planted_dump():
    """A float32 dump whose drafts come from a proposer that knows the answer and errs by plan, so
    every accepted length 0..k occurs; k = 2."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=32, dtype=torch.float32), 32)
    plain = generate(target, None, PROMPTS[3], max_new_tokens=16).tokens
    proposer = PlantedProposer(reference_sequences(PROMPTS[3], plain, 32), 256, lambda c, b: (c + b) % 3)
    d = run.dump(target, proposer, PROMPTS[3], max_new_tokens=16, num_steps=2)
    assert d["output_ids"].tolist() == [o + [-1] * (16 - len(o)) for o in plain]  # lossless
    return target, d


def test_compare_reports_a_planted_divergence(planted_dump, tmp_path, capsys):
    target, a = planted_dump
    check_dump_layout(a, PROMPTS[3], 2)
    b = {key: v.copy() for key, v in a.items()}
    row, j = 1, 5                   # the runner-up wins at output index 5 of row 1, as a near-tie flip would
    t = len(PROMPTS[3][row]) - 1 + j                                    # the position that chose it
    b["output_ids"][row, j] = a["topk_ids"][row, t, 1]
    b["topk_ids"][row, t, :2] = a["topk_ids"][row, t, [1, 0]]           # the two ids swap log-probabilities
    report = run.compare(a, b)
    assert [r["diverge"] for r in report["rows"]] == [None, j, None]
    r = report["rows"][row]
    assert (r["positions"], r["top1_agree"], r["at"]) == (t + 1, t, t)
    assert r["max_logprob_diff"] == pytest.approx(a["topk_logprobs"][row, t, 0] - a["topk_logprobs"][row, t, 1])
    # the CLI: the same table, exit 0 within the thresholds, 1 past one, 2 for files that do not fit
    for name, d in (("a", a), ("b", b), ("short", dict(a, topk_logprobs=a["topk_logprobs"][:, 1:])),
                    ("missing", {key: v for key, v in a.items() if key != "topk_ids"})):
        np.savez(tmp_path / f"{name}.npz", **d)

    def cli(*argv):
        with pytest.raises(SystemExit) as e:
            run.main(["--compare", *(str(tmp_path / f"{x}.npz") for x in argv[:2]), *argv[2:]])
        return e.value.code, capsys.readouterr()
    code, out = cli("a", "b", "--max-logprob-diff", "1")
    line = next(x for x in out.out.splitlines() if x.split()[:1] == [str(row)])
    assert code == 0 and line.split()[3] == str(j) and "PASS" in out.out, out.out
    code, out = cli("a", "b", "--min-top1-agreement", "1")
    assert code == 1 and "FAIL: top-1 agreement" in out.out
    code, out = cli("a", "short")
    assert code == 2 and "topk_logprobs has shape [3, 23, 20], expected [3, 24, 20]" in out.err, out.err
    code, out = cli("missing", "a")
    assert code == 2 and "missing.npz has no array 'topk_ids'" in out.err, out.err


def test_compare_refuses_a_logprob_that_is_not_finite(planted_dump):
    _, a = planted_dump
    b = {key: v.copy() for key, v in a.items()}
    b["topk_logprobs"][0, 2, 3] = np.nan   # NaN compares as "no difference": it must not pass
    with pytest.raises(ValueError, match=r"B: topk_logprobs\[0, 2, 3\] is not finite"):
        run.compare(a, b)


def test_compare_catches_a_draft_that_accepts_less(planted_dump):
    """The same target outputs (lossless), drafts from a random head instead of the planted ones."""
    target, a = planted_dump
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 33)
    b = run.dump(target, head, PROMPTS[3], max_new_tokens=16, num_steps=2)
    report = run.compare(a, b)
    assert np.array_equal(a["output_ids"], b["output_ids"]) and report["max_logprob_diff"] == 0
    assert report["accept_diff"] > run.MAX_ACCEPT_DIFF and "drafts accepted per cycle" in report["failures"][0]


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
    dumps = [run.dump(*conditioned_tiny(dtype, 0), PROMPTS[3], max_new_tokens=16, num_steps=2)
             for dtype in (torch.float32, torch.bfloat16)]
    report = run.compare(*dumps)
    print(f"\nbf16 against float32: top-1 agreement {report['top1_agreement']:.3f}, max |logprob diff| "
          f"{report['max_logprob_diff']:.3f}, diverge@ {[r['diverge'] for r in report['rows']]}")
    assert not report["failures"], report["failures"]
    tight = run.compare(*dumps, max_logprob_diff=1e-3, min_top1_agreement=1.0)
    assert any("--max-logprob-diff" in f for f in tight["failures"]), tight["failures"]


def test_dump_from_the_command_line_and_bad_input(tiny_ckpt, tmp_path):
    """run.py --dump with a checkpoint, a draft and a prompt file writes what dump() returns."""
    ckpt, _ = tiny_ckpt
    target = load_target(ckpt, max_batch_size=3, max_seq_len=32, dtype=torch.float32)
    save_draft(init_random_draft(Eagle3Draft(draft_preset("tiny"), target), 2), tmp_path / "draft")
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS[3]) + "\n")
    cmd = [sys.executable, os.path.join(HERE, "run.py"), "--model-path", ckpt, "--draft-path",
           str(tmp_path / "draft"), "--prompt-ids", str(tmp_path / "p.jsonl"), "--max-new-tokens", "12", "--speculative-num-steps", "2",
           "--dtype", "float32"]
    cpu = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess.run(cmd + ["--dump", str(tmp_path / "cli.npz")], check=True, capture_output=True, env=cpu)
    cli = run.load_dump(tmp_path / "cli.npz")
    assert json.loads(str(cli["meta"]))["target"] == f"loaded {ckpt}"
    ref = run.dump(target, load_draft(tmp_path / "draft", target), PROMPTS[3], max_new_tokens=12, num_steps=2,
                   chunk=5)  # the teacher-forced forward in chunks over the cache: the same answers
    report = run.compare(ref, cli, max_logprob_diff=1e-5, min_top1_agreement=1.0, max_accept_diff=0.0)
    assert not report["failures"] and np.array_equal(ref["draft_ids"], cli["draft_ids"]), report
    # bad input names the problem
    with pytest.raises(ValueError, match="prompt row 1 has id 999 at position 2"):
        run.dump(target, None, [[5, 6], [7, 8, 999]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_seq_len 32"):
        run.dump(target, None, [[5] * 30], max_new_tokens=4)
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n{\"ids\": [3]}\n")
    with pytest.raises(ValueError, match="bad.jsonl line 2: expected a non-empty JSON list"):
        run.read_prompt_ids(tmp_path / "bad.jsonl")
    bad = subprocess.run(cmd + ["--dump", str(tmp_path / "x.npz"), "--temperature", "0.7"], capture_output=True,
                         text=True, env=cpu)
    assert bad.returncode != 0 and "drop --temperature" in bad.stderr


# ---------------------------------------------------------------------------------------------
# GPU: graphs against eager, no host sync, bf16 agreement (skipped without CUDA; run on the H200)

def gpu_models(dtype=torch.bfloat16, B=3, seed=0, quant=None, moe_impl="auto"):
    target = init_random(Transformer(tiny(quantization_config=quant), max_batch_size=B, max_seq_len=64,
                                     device="cuda", dtype=dtype, moe_impl=moe_impl), seed)
    head = init_random_draft(Eagle3Draft(draft_preset("tiny"), target), seed + 1)
    return target, head


def captured_calls(target, head, k=3, B=3, P=12):
    """(key, fn, inputs) for every captured shape, on a prefilled cache."""
    from functools import partial
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (B, P), generator=g).cuda()
    _, aux = target(tokens, torch.arange(P, device="cuda").expand(B, P), "extend", capture_aux=True)
    pos = P + torch.arange(k + 1, device="cuda").expand(B, k + 1)
    vt = tokens[:, :k + 1]
    last = torch.tensor([k, 1, 0], device="cuda")[:B]
    first, gh = head.extend(vt, pos, aux[:, :k + 1], last)
    return [(("decode", B, 1), partial(target, mode="decode"), (vt[:, :1], pos[:, :1])),
            (("verify", "extend", B, k + 1), partial(target, mode="extend", capture_aux=True), (vt, pos)),
            (("verify", "decode", B, k + 1), partial(target, mode="decode", capture_aux=True), (vt, pos)),
            (("draft_extend", B, k + 1), head.extend, (vt, pos, aux[:, :k + 1], last)),
            (("draft_chain", B, k), partial(head.chain, num_steps=k), (first, gh, pos[:, 0] + last))]


def flat(out):
    return torch.cat([t.double().flatten() for t in (out if isinstance(out, tuple) else (out,))])


GPU_MOE = [(q, impl) for q in (None, "int4", "fp8") for impl in ("fused", "grouped")]


@cuda
@pytest.mark.parametrize("quant, impl", GPU_MOE)
def test_graph_replay_equals_eager(quant, impl):
    from graphs import CudaGraphs
    target, head = gpu_models(quant=quant, moe_impl=impl)
    assert target.moe_impl == impl
    runner = CudaGraphs("cuda")
    for key, fn, inputs in captured_calls(target, head):
        eager = flat(fn(*inputs))
        graphed = flat(runner.run(key, fn, *inputs))
        assert_close(graphed, eager, 0.0, f"graph vs eager {key}")
        again = [x.clone() for x in inputs]  # replay on other values: still equal to eager
        again[0] = (again[0] + 1) % 256 if again[0].dtype == torch.int64 else again[0]
        assert_close(flat(runner.run(key, fn, *again)), flat(fn(*again)), 0.0, f"graph vs eager {key}, new inputs")


@cuda
@pytest.mark.parametrize("quant, impl", GPU_MOE)
def test_no_host_sync_in_captured_paths(quant, impl):
    from graphs import CudaGraphs
    target, head = gpu_models(quant=quant, moe_impl=impl)
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


@cuda
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_graph_generate_equals_eager_generate_and_reports_bf16_agreement(mode):
    target, head = gpu_models()
    prompts = PROMPTS[3]
    eager = generate(target, head, prompts, max_new_tokens=24, num_steps=3, attention_mode=mode)
    graphed = generate(target, head, prompts, max_new_tokens=24, num_steps=3, attention_mode=mode, use_graphs=True)
    assert graphed.tokens == eager.tokens
    plain = generate(target, None, prompts, max_new_tokens=24, use_graphs=True).tokens
    same = sum(a == b for x, y in zip(graphed.tokens, plain) for a, b in zip(x, y))
    total = sum(len(x) for x in plain)
    print(f"\nbf16 {mode}: speculative (graph) vs plain greedy agree on {same}/{total} tokens")
    # bf16 reorders reductions with shapes, so the sequences may part: reported, not asserted (the
    # assertion above, graph == eager, is exact; speculative == plain is proven in float64 on CPU)


@cuda
def test_gpu_decode_attention_equals_extend_and_grouped_equals_gather():
    """Attention paths in float32 on the GPU (bf16 can flip a near-tied expert choice, which moves
    logits by O(1) in a random model); the grouped MoE against gathered weights on the same routing
    in bf16."""
    target = init_random(Transformer(tiny(), 3, 64, device="cuda", dtype=torch.float32, moe_impl="gather"), 0)
    prefill, prefill_pos, step, step_pos = (t.cuda() for t in step_inputs(256))
    target(prefill, prefill_pos)
    assert_close(target(step, step_pos, "decode"), target(step, step_pos, "extend"), 1e-3,
                 "float32 GPU decode vs extend attention")
    if not model.grouped_mm_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm is not available for bf16 on this GPU")
    moe = init_random(Transformer(tiny(), 1, 8, device="cuda", dtype=torch.bfloat16, moe_impl="grouped"), 1).layers[1].mlp
    x = torch.randn(37, 64, device="cuda", dtype=torch.bfloat16)
    ids, weights = moe.gate(x)
    grouped = moe.experts(x, ids, weights)
    moe.experts.impl = "gather"
    assert_close(grouped, moe.experts(x, ids, weights), 2e-2 * grouped.abs().max().item(), "bf16 grouped vs gather")


@cuda
def test_compiled_layers_equal_plain_inside_graphs_without_host_sync():
    """run.py --compile: torch.compile fuses each layer, our CUDA graphs capture the result."""
    from functools import partial
    from graphs import CudaGraphs
    target = init_random(Transformer(tiny(), 3, 64, device="cuda", dtype=torch.float32), 0)
    prefill, prefill_pos, step, step_pos = (t.cuda() for t in step_inputs(256))
    target(prefill, prefill_pos)
    plain = {mode: target(step, step_pos, mode) for mode in ("extend", "decode")}
    target.compile_layers()
    runner = CudaGraphs("cuda")
    for mode, ref in plain.items():
        fn = partial(target, mode=mode)
        assert_close(fn(step, step_pos), ref, 1e-4, f"compiled vs plain layers, {mode}")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphed = runner.run(("compiled", mode), fn, step, step_pos)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_close(graphed, ref, 1e-4, f"compiled layers in a CUDA graph vs plain, {mode}")
