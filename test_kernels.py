"""The fast path (the kernels/ package) against the plain reference: the routed experts' grouped_mm
and fused MoE kernel against the gather path, each Triton kernel against its plain twin in model.py
or draft.py, each swap against the module it replaces, on fresh random inputs.

Tests marked `triton` run the kernels under Triton's CPU interpreter on a machine without CUDA
(TRITON_INTERPRET=1, set in conftest.py): float32, and the bf16 cases whose rounding the
interpreter reproduces (it rounds to bf16 toward zero), small caches; without triton they skip,
saying so. On the GPU the same tests run natively (their bf16 cases too), and those marked `gpu`
add bf16 attention on caches up to 32768 slots, graph replay against eager and the absence of host
syncs.
"""
import importlib
import itertools
import json
import os
import pkgutil
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import checkpoint
import kernels
import model
import tp
from checkpoint import init_random, init_random_draft, load_target, save_target
from draft import draft_preset, DraftAttention, Eagle3Draft, rotate_half_rope
from graphs import CudaGraphs
from kernels.common import _jit, _pow2, tl, triton
from model import Transformer
from testing import (assert_close, captured_calls, count_reads, eager_without_pdl, flat,
                     fp8_checkpoint, gpu_models, HERE, int4_checkpoint, PROMPTS, random_tree,
                     run_steps, step_inputs, tiny, TRITON_DEVICE)
import testing
from tp import TP
from verify import generate, tree_visible


# ---------------------------------------------------------------------------------------------
# The routed experts: grouped_mm and the fused MoE kernel against the gather path, on the same
# routing. Float32: the same math up to the order of fp32 sums (1e-5 of the largest output); bf16:
# the fused kernel rounds h and each pair's output once from fp32 where the plain path rounds gate,
# up, SiLU, the product and each expert's output to bf16, so they agree within 2% of the largest
# output.

@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_grouped_moe_equals_gather(quant):
    """With INT4 or FP8 experts, "grouped" dequantizes every expert once the token-expert pairs
    outnumber them (every call here: 36 and 9 tokens x 4 experts >= 16)."""
    args = tiny(quantization_config=quant)
    m = init_random(Transformer(args, max_batch_size=3, max_seq_len=32, dtype=torch.float32), 5)
    g = Transformer(args, max_batch_size=3, max_seq_len=32, dtype=torch.float32)
    kernels.accelerate(g, moe="grouped")
    g.load_state_dict(m.state_dict())
    assert type(m.layers[1].mlp.experts) is model.Experts and g.moe_impl == "grouped"
    assert isinstance(g.layers[1].mlp.experts, kernels.GroupedExperts)
    assert_close(run_steps(g), run_steps(m), 1e-4,
                 f"grouped_mm MoE vs gathered weights, {quant or 'plain'} experts")


class ExpertsHolder(torch.nn.Module):
    """Just enough of a Transformer (args, tp, parameters) for init_random to fill one Experts,
    swapped for kernels.FusedExperts (model.Experts.forward on it is the plain reference)."""

    def __init__(self, args, tp, device, dtype):
        super().__init__()
        self.args, self.tp = args, tp
        self.experts = kernels.swap(model.Experts(args, tp, device, dtype), kernels.FusedExperts)


def moe_experts(shape, quant, E, device, dtype, seed=0):
    """One layer's routed experts, random. "tiny": the tiny preset's sizes at TP 2, rank 1 (FP8 in
    16x24 blocks, so a rank's slice of down_proj starts inside a block); "kimi": one rank of Kimi-K2
    at TP 8 (D 7168, I 256, FP8 in 128x128 blocks)."""
    fp8 = checkpoint.fp8_quantization_config((16, 24) if shape == "tiny" else (128, 128))
    qc = {None: None, "int4": "int4", "fp8": fp8}[quant]
    if shape == "tiny":
        args, tp_ = tiny(n_routed_experts=E, num_experts_per_tok=8, moe_intermediate_size=64,
                         quantization_config=qc), TP(1, 2)
    else:
        args, tp_ = checkpoint.preset("kimi-k2", n_routed_experts=E,
                                      quantization_config=qc), TP.simulate(8)
    holder = ExpertsHolder(args, tp_, device, dtype)
    return init_random(holder, seed, rank_local=shape != "tiny").experts, args.hidden_size


def shared_mlp(x, shared):
    """A shared expert (gate [I, D], up [I, D], down [D, I]) on x [N, D], as the plain MLP computes
    it: the reference for fused_moe's `shared`."""
    gate, up, down = shared
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def routing(kind, N, K, E, g, device):
    """ids [N, K]: "shared": every token picks the same K experts (in its own order); "disjoint": no
    two tokens share one (needs N*K <= E); "random": each token K distinct experts at random."""
    if kind == "disjoint" and N * K > E:
        raise ValueError(f"disjoint routing of {N} tokens x {K} experts needs {N * K} experts, "
                         f"not {E}")
    if kind == "shared":
        base = torch.randperm(E, generator=g)[:K]
        ids = torch.stack([base[torch.randperm(K, generator=g)] for _ in range(N)])
    elif kind == "disjoint":
        ids = torch.randperm(E, generator=g)[:N * K].view(N, K)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return ids.to(device), torch.rand(N, K, generator=g).to(device) * 2


def check_fused_moe(experts_and_dim, cases, dtype, seed=0, K=8):
    """cases: (N, routing kind, variant): the model's path (variant None: kernels.fused_moe's rule
    picks) or kernels.fused_moe forced to "gemv", "dot" or "adaptive"; K experts a token."""
    experts, D = experts_and_dim
    g = torch.Generator().manual_seed(seed)
    E = experts.n_experts
    for N, kind, variant in cases:
        ids, w = routing(kind, N, K, E, g, TRITON_DEVICE)
        x = torch.randn(N, D, generator=g).to(TRITON_DEVICE, dtype)
        fused = experts(x, ids, w) if variant is None else experts.fused(x, ids, w, variant=variant)
        ref = model.Experts.forward(experts, x, ids, w)  # the plain reference on the same weights
        tol = (1e-5 if dtype == torch.float32 else 2e-2) * ref.abs().max().item()
        assert fused.dtype == ref.dtype and fused.shape == ref.shape
        assert_close(fused, ref, tol,
                     f"fused ({variant or 'auto'}) vs gather MoE, E {E}, N {N}, "
                     f"{kind} routing, {dtype}")
        assert ref.abs().max() > 0.1


# (N, routing, variant) cases; the CPU interpreter runs a few of them (each ~1-5 s there) at 4
# experts a token (its time follows the token-expert pairs), the GPU all at 8. The rule
# (gemv_max_tokens, on tokens) picks the GEMV variant at small N and tiles (tl.dot) at 37.
def fused_cases_all(E, K=8):
    """Every (N, routing, variant) case the GPU runs at E experts, K a token: disjoint routing only
    where the N * K pairs fit in E experts (at 16 experts, 8 a token: N 1 and 2)."""
    return [(N, kind, v) for N in (1, 2, 4, 8, 37)
            for kind in ("shared", "disjoint", "random")
            for v in ((None, "dot", "adaptive") if N <= 8 else (None, "adaptive"))
            if kind != "disjoint" or N * K <= E]


FUSED_CASES_CPU = {16: [(1, "random", None), (2, "disjoint", None), (4, "shared", None),
                        (4, "shared", "dot"), (3, "shared", "gemv"), (6, "shared", "gemv"),
                        (37, "random", None), (3, "random", "adaptive"), (2, "shared", "adaptive")],
                   384: [(8, "disjoint", None), (2, "random", "dot")]}


@pytest.mark.triton
@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_fused_moe_equals_gather_tiny(quant):
    for E in (16, 384):
        cases = fused_cases_all(E) if TRITON_DEVICE.type == "cuda" else FUSED_CASES_CPU[E]
        on_gpu = TRITON_DEVICE.type == "cuda"
        dtypes = (torch.float32, torch.bfloat16) if on_gpu else (torch.float32,)
        # (Triton's interpreter computes bf16 dots wrongly: float32 on the CPU)
        for dtype in dtypes:
            check_fused_moe(moe_experts("tiny", quant, E, TRITON_DEVICE, dtype), cases, dtype,
                            K=8 if on_gpu else 4)


@pytest.mark.triton
def test_fused_moe_gemv_fp8_scale_blocks_as_rows():
    """FP8 in 128x128 blocks (Kimi-K2's layout): the GEMV variant reads each k-step as SUB scale
    blocks laid out as tile rows of their own (GEMV_CONFIGS' FP8 entries), one scale per tile
    row."""
    args = tiny(n_routed_experts=8, num_experts_per_tok=8, hidden_size=256,
                moe_intermediate_size=512,
                quantization_config=checkpoint.fp8_quantization_config((128, 128)))
    experts = init_random(ExpertsHolder(args, TP(1, 2), TRITON_DEVICE, torch.float32), 0).experts
    ids, w = routing("random", 2, 8, 8, torch.Generator().manual_seed(0), TRITON_DEVICE)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(TRITON_DEVICE)
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    got = kernels.fused_moe(x, ids, w, *weights, variant="gemv",
                            configs=dict(gate_up=(32, 128, 1, 4, 2), down=(64, 128, 4, 2)))
    ref = model.Experts.forward(experts, x, ids, w)
    assert_close(got, ref, 1e-5 * ref.abs().max().item(),
                 "GEMV FP8 with 2 scale blocks a k-step vs gather")


def check_adaptive_with_shared(x, ids, w, experts, weights, shared, what):
    """The adaptive variant with a shared expert in its GEMV launches on 3 tokens (ids [3, K], K
    at most a third of the experts) with every pair on an expert of its own (the GEMV) and with
    every token on token 2's experts (K distinct of 3 K pairs: the tiles), against the gather path
    plus the plain MLP."""
    K, g = ids.shape[1], torch.Generator().manual_seed(5)
    disjoint = torch.randperm(experts.n_experts, generator=g)[:3 * K].view(3, K).to(ids)
    for how, chosen in (("every pair its own expert", disjoint),
                        ("every token on one token's experts", ids[[2, 2, 2]])):
        want = model.Experts.forward(experts, x, chosen, w) + shared_mlp(x, shared)
        got = kernels.fused_moe(x, chosen, w, *weights, variant="adaptive", shared=shared)
        assert_close(got, want, 1e-5 * want.abs().max().item(),
                     f"adaptive {what} + shared, 3 tokens, {how}")


@pytest.mark.triton
def test_fused_moe_gemv_fp8_takes_a_shared_expert():
    """The FP8 GEMV launches with a shared expert in the compute dtype beside the routed experts
    (fused_moe's shared: Kimi-K2-Instruct's, dequantized at load) against the gather path plus the
    plain MLP, at 1 and 3 tokens, the shared programs in the loop form (running its tokens one
    after another) with blocks that divide the shapes and blocks that do not (masked shared rows
    and steps), and in the dot form (all at once; I 52 a rank: 4 rows of its last 16-row tile
    masked); and the adaptive variant, its tiles chosen and not. 4 routed experts a token on the
    GPU, 2 on the CPU (the interpreter's time follows the token-expert pairs)."""
    K = 4 if TRITON_DEVICE.type == "cuda" else 2
    args = tiny(n_routed_experts=16, num_experts_per_tok=4, hidden_size=256,
                moe_intermediate_size=104,
                quantization_config=checkpoint.fp8_quantization_config((128, 128)))
    experts = init_random(ExpertsHolder(args, TP(1, 2), TRITON_DEVICE, torch.float32), 0).experts
    D, I, g = 256, experts.gate_proj.weight.shape[1], torch.Generator().manual_seed(0)
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    shared = [torch.randn(*s, generator=g).to(TRITON_DEVICE) / 8 for s in ((I, D), (I, D), (D, I))]
    for N in (1, 3):
        ids, w = routing("random", N, K, 16, g, TRITON_DEVICE)
        x = torch.randn(N, D, generator=g).to(TRITON_DEVICE)
        want = model.Experts.forward(experts, x, ids, w) + shared_mlp(x, shared)
        # gate_up (BLOCK_N, BLOCK_K, UNROLL, warps, SUB), down (BLOCK_N, BLOCK_K, warps, SUB): 16
        # rows (shared steps of 64 columns divide D / 2); 32 rows (masked rows, 32-column steps)
        blocks = (((16, 128, 1, 4, 1), (64, 128, 4, 1)), ((32, 64, 2, 4, 2), (32, 64, 4, 2)))
        # the dot form (its own 16-row tiles, masked at I 52) with the first blocks
        for (gate_up, down), dot in [(b, False) for b in blocks] + [(blocks[0], True)]:
            got = kernels.fused_moe(x, ids, w, *weights, variant="gemv", shared=shared,
                                    configs=dict(gate_up=gate_up, down=down, shared_dot=dot))
            assert_close(got, want, 1e-5 * want.abs().max().item(),
                         f"GEMV FP8 + shared, {N} tokens, {gate_up} {down}, dot form {dot}")
    check_adaptive_with_shared(x, ids, w, experts, weights, shared, "FP8")


@pytest.mark.triton
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_fused_moe_tiles_split_over_d(quant):
    """The bf16 / fp32 and FP8 tiles' gate_up split over D (moe.TILE_SPLIT) against the gather
    path: D 64 in 3 parts of 32 columns (16 a step; the third part empty) and in 2 parts of one
    128-column step (the second empty), whole in one part; an expert shared by every token (its
    pairs in one tile) and random routing. FP8 in 16x24 blocks: steps that cross a scale block."""
    experts, D = moe_experts("tiny", quant, 16, TRITON_DEVICE, torch.float32)
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    g = torch.Generator().manual_seed(3)
    for kind, parts in (("shared", (16, 16, 4, 1, 3)), ("random", (64, 128, 4, 1, 2)),
                        ("random", (64, 16, 4, 1, 1))):
        ids, w = routing(kind, 3, 4, 16, g, TRITON_DEVICE)
        x = torch.randn(3, D, generator=g).to(TRITON_DEVICE)
        ref = model.Experts.forward(experts, x, ids, w)
        got = kernels.fused_moe(x, ids, w, *weights, variant="dot",
                                configs=dict(gate_up=parts, down=(64, 16, 4, 1)))
        assert_close(got, ref, 1e-5 * ref.abs().max().item(),
                     f"{quant or 'plain'} tiles, D {D}, {kind} routing, gate_up {parts}")


@pytest.mark.triton
def test_fused_moe_int4_tiles_even_and_masked_blocks():
    """The INT4 tile kernels (weights as the MMA's first operand, rows and columns in the MMA's
    order) against the gather path: steps that divide the matrix (EVEN) and steps that do not,
    weight rows past I and D in the last row block, steps of one and two 128-column blocks,
    gate_up whole and split over D, down's programs making 1 to 3 row blocks in turn, and an
    expert picked by more pairs than a tile holds (20 tokens on the same K experts: two tiles
    each), in fp32 (and bf16 on a GPU: the weights rounded to bf16 once, as the plain module
    rounds them). D 256 (32 words a row), then D 96 (12); I 96 a rank (masked rows and columns),
    then 128 (EVEN at D 256). K = 8 experts a token on the GPU; 2 on the CPU (the interpreter's
    time follows the programs, a program per tile: 3 tokens take up to 6 tiles, 20 shared tokens
    2 experts of 2 tiles each)."""
    on_gpu = TRITON_DEVICE.type == "cuda"
    K = 8 if on_gpu else 2
    # (BLOCK_N, BLOCK_K, warps, stages, gate_up's SPLIT or down's BLOCKS): gate_up in 2 parts of
    # D (at D 96 one part masked and one empty) before the silu launch; down making 3 row blocks
    # a program in turn (at D 256 the second program's last block lies past D; at D 96 one program
    # makes all three); steps of 256 columns: two blocks, the second past I = 96 and 128
    configs = [dict(gate_up=(64, 128, 4, 1, 1), down=(64, 128, 4, 1, 3)),
               dict(gate_up=(64, 128, 4, 1, 2), down=(64, 256, 4, 1, 1)),
               dict(gate_up=(64, 256, 4, 1, 1), down=(64, 128, 4, 1, 2))]
    cases = [(D, I, N, kind, cfg) for D in (256, 96) for I in (96, 128)
             for N, kind in ((3, "random"), (20, "shared")) for cfg in configs]
    if not on_gpu:  # the interpreter: each D, I, routing and config once
        cases = [(256, 96, 3, "random", configs[0]), (96, 96, 20, "shared", configs[1]),
                 (256, 128, 20, "shared", configs[1]), (256, 128, 3, "random", configs[2]),
                 (256, 128, 3, "random", configs[0])]
    for D, I, N, kind, cfg in cases:
        args = tiny(n_routed_experts=16, num_experts_per_tok=8, hidden_size=D,
                    moe_intermediate_size=2 * I, quantization_config="int4")
        for dtype in (torch.float32, torch.bfloat16) if on_gpu else (torch.float32,):
            experts = init_random(ExpertsHolder(args, TP(1, 2), TRITON_DEVICE, dtype), 0).experts
            weights = [kernels.expert_weights(getattr(experts, p))
                       for p in ("gate_proj", "up_proj", "down_proj")]
            g = torch.Generator().manual_seed(N)
            ids, w = routing(kind, N, K, 16, g, TRITON_DEVICE)
            x = torch.randn(N, D, generator=g).to(TRITON_DEVICE, dtype)
            ref = model.Experts.forward(experts, x, ids, w)
            got = kernels.fused_moe(x, ids, w, *weights, variant="dot", configs=cfg)
            tol = (1e-5 if dtype == torch.float32 else 2e-2) * ref.abs().max().item()
            assert_close(got, ref, tol, f"INT4 tiles D {D} I {I} {dtype} N {N} K {K} {kind} {cfg}")


def test_fused_moe_int4_tiles_refuse_blocks_off_the_mma_shape():
    """The INT4 tiles take 64 weight rows and whole 128-column blocks a step (their dequantized
    tile is laid out for the MMA's operand registers): other block sizes are refused by name."""
    args = tiny(n_routed_experts=16, num_experts_per_tok=8, hidden_size=256,
                moe_intermediate_size=256, quantization_config="int4")
    experts = init_random(ExpertsHolder(args, TP(1, 2), "cpu", torch.float32), 0).experts
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    ids, w = routing("random", 3, 2, 16, torch.Generator().manual_seed(0), "cpu")
    x = torch.randn(3, 256)
    for cfg in (dict(gate_up=(32, 128, 4, 1, 1), down=(64, 128, 4, 1, 1)),
                dict(gate_up=(64, 128, 4, 1, 1), down=(64, 64, 4, 1, 1))):
        with pytest.raises(ValueError, match="64 rows .* multiple of 128 columns"):
            kernels.fused_moe(x, ids, w, *weights, variant="dot", configs=cfg)


@pytest.mark.triton
def test_moe_align_sorts_pairs_by_expert_stably():
    """The tile variant's align (two launches, a program per chunk of pairs) against the same order
    built in torch: each expert's pairs in pair order, in whole tiles of BLOCK_M rows, experts
    ascending, padding rows P; each tile's expert, -1 past the last used tile. Pair counts within
    one chunk and across several, routing spread and shared (experts with several tiles). With the
    adaptive variant's share: the choice in use_tiles, no tile where it is 0, and the tighter
    bound on the tiles (at most share / ADAPTIVE_SCALE of the pairs distinct)."""
    g = torch.Generator().manual_seed(7)
    BM, SCALE = kernels.moe.BLOCK_M, kernels.moe.ADAPTIVE_SCALE
    for N, K, E, kind in ((3, 2, 16, "random"), (20, 8, 16, "shared"), (40, 4, 384, "random")):
        ids = routing(kind, N, K, E, g, TRITON_DEVICE)[0].reshape(-1)
        P, distinct = ids.numel(), len(set(ids.tolist()))
        for share in (0, kernels.moe.ADAPTIVE_SHARE):
            what = f"{N} x {K} pairs, {E} experts, share {share}"
            sorted_pair, tile_expert, use_tiles = kernels.moe.align(ids, E, share=share)
            chosen = not share or distinct * SCALE <= P * share
            max_tiles = max(1, min(E, P * share // SCALE if share else P) + P // BM)
            rows, experts = [], []
            for e in range(E if chosen else 0):
                pairs = (ids.cpu() == e).nonzero().flatten().tolist()
                tiles = -(-len(pairs) // BM)
                rows += pairs + [P] * (tiles * BM - len(pairs))
                experts += [e] * tiles
            rows += [P] * (max_tiles * BM - len(rows))
            experts += [-1] * (max_tiles - len(experts))
            assert sorted_pair.cpu().tolist() == rows, f"{what}: rows"
            assert tile_expert.cpu().tolist() == experts, f"{what}: tiles"
            assert use_tiles is None if not share else use_tiles.item() == chosen, what
        assert kind != "shared" or distinct * SCALE <= P * kernels.moe.ADAPTIVE_SHARE, kind


@_jit
def _int4_mma_block_kernel(w_ptr, s_ptr, k_ptr, out_ptr, magic, R, K_IN: tl.constexpr,
                           EVEN: tl.constexpr, PACKED: tl.constexpr):
    """out[r, k] = W[r, k] (bf16) from kernels.moe._int4_mma_block for an INT4 matrix [R, K_IN]
    (group 32), each element stored where _int4_mma_row and k_ptr (the k of each column, as the
    activation's permutation orders them: _mma_k_order_kernel) say it belongs: a program per
    (64 rows, 128 columns)."""
    row0, k0 = tl.program_id(0) * 64, tl.program_id(1) * 128
    n = (row0 + tl.arange(0, 64))[:, None]
    w = kernels.moe._int4_mma_block(w_ptr + n * (K_IN // 8), s_ptr + n * (K_IN // 32), n < R, k0,
                                    magic, K_IN, 32, EVEN, tl.bfloat16, PACKED)
    n = (row0 + kernels.moe._int4_mma_row(64))[:, None]
    k = (k0 + tl.load(k_ptr + tl.arange(0, 128)))[None, :]
    tl.store(out_ptr + n * K_IN + k, w, mask=(n < R) & (k < K_IN))


@_jit
def _mma_k_order_kernel(out_ptr):
    """out[c] = the k that row c of kernels.moe._in_int4_mma_order's result holds."""
    k = tl.broadcast_to(tl.arange(0, 128)[:, None], (128, 16))
    c = kernels.moe._in_int4_mma_order(k, 16)
    tl.store(out_ptr + tl.arange(0, 128)[:, None] + 128 * tl.arange(0, 16)[None, :], c)


@pytest.mark.triton
def test_int4_tile_dequantization_equals_the_plain_module():
    """The INT4 tiles' dequantized weights (kernels.moe._int4_mma_block, in the MMA's row and
    column order, each put back by _int4_mma_row and by the k order the activation is permuted
    to, _in_int4_mma_order's) against model.dequantize_int4, bf16 scales, bit
    for bit: every element once (the output starts NaN), the packed form (nibble pairs through
    fma.rn.bf16x2, which the tiles take for bf16 activations and scales) and the fp32 form,
    blocks that divide the matrix and blocks that mask rows and words. The fp32 form on a GPU
    only: Triton's CPU interpreter rounds fp32 to bf16 by truncation (3.7), so there it is
    checked to one bf16 step."""
    g = torch.Generator().manual_seed(3)
    order = torch.empty(16, 128, dtype=torch.int64, device=TRITON_DEVICE)
    _mma_k_order_kernel[(1,)](order)              # the activation's order, the weights' to match
    k_order = order[0].to(torch.int32)
    for R, K_IN in ((128, 256), (48, 192)):
        words = torch.randint(-2**31, 2**31 - 1, (R, K_IN // 8), generator=g, dtype=torch.int32)
        scale = (torch.rand(R, K_IN // 32, generator=g) - 0.5).to(torch.bfloat16)
        want = model.dequantize_int4(words, scale, 32).to(TRITON_DEVICE)
        even = R % 64 == 0 and K_IN % 128 == 0
        for packed in (True, False):
            out = torch.full((R, K_IN), float("nan"), dtype=torch.bfloat16, device=TRITON_DEVICE)
            magic = kernels.moe_gemv.BF16_MAGIC if packed else kernels.moe_gemv.MAGIC
            _int4_mma_block_kernel[(triton.cdiv(R, 64), triton.cdiv(K_IN, 128))](
                words.to(TRITON_DEVICE), scale.to(TRITON_DEVICE), k_order, out, magic, R, K_IN=K_IN,
                EVEN=even, PACKED=packed)
            what = f"{'packed' if packed else 'fp32'} form, [{R}, {K_IN}], even {even}"
            if packed or TRITON_DEVICE.type == "cuda":
                assert torch.equal(out, want), what
            else:
                assert_close(out.float(), want.float(), 2 ** -7 * want.abs().max().item(), what)


@pytest.mark.gpu
@pytest.mark.triton
def test_gpu_fused_moe_int4_tiles_packed_form_equals_fp32_form():
    """The INT4 tile variant at a Kimi-K2 TP-8 rank's shapes, bf16, 16 tokens: bf16 scales (the
    packed dequantization) and the same scales held in fp32 (the fp32 form) give the same output
    bits, under random routing and 16 tokens on the same 8 experts; and match the plain module."""
    experts, D = moe_experts("kimi", "int4", 384, "cuda", torch.bfloat16)
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    as_fp32 = [kernels.ExpertWeights("int4", w.data, w.scale.float(), group=w.group)
               for w in weights]
    g = torch.Generator().manual_seed(5)
    for kind in ("random", "shared"):
        ids, w = routing(kind, 16, 8, 384, g, "cuda")
        x = torch.randn(16, D, generator=g).to("cuda", torch.bfloat16)
        packed = kernels.fused_moe(x, ids, w, *weights, variant="dot")
        assert torch.equal(packed, kernels.fused_moe(x, ids, w, *as_fp32, variant="dot")), kind
        ref = model.Experts.forward(experts, x, ids, w)
        assert_close(packed, ref, 2e-2 * ref.abs().max().item(), f"INT4 tiles, {kind}: vs plain")


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("quant, variant", [("int4", "dot"), (None, "adaptive"),
                                            ("fp8", "adaptive"), ("int4", "adaptive")])
def test_gpu_fused_moe_graph_equals_eager(quant, variant):
    """The INT4 tile variant and the adaptive variant at a Kimi-K2 TP-8 rank's shapes (384 experts,
    D 7168, I 256), bf16, captured once with no host sync: replays on new tokens and new routing (16
    tokens, from every expert distinct to all on the same 8: the adaptive variant's choice between
    tiles and GEMV moves with the routing inside one graph) equal the eager call (launched without
    programmatic dependent launch: eager_without_pdl), and the plain module."""
    experts, D = moe_experts("kimi", quant, 384, "cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    N = 16
    ids, w = routing("random", N, 8, 384, g, "cuda")
    x = torch.randn(N, D, generator=g).to("cuda", torch.bfloat16)
    experts.fused(x, ids, w, variant=variant)                            # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = experts.fused(x, ids, w, variant=variant)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    what = f"{quant or 'plain'} {variant}"
    for kind in ("disjoint", "random", "shared"):
        new_ids, new_w = routing(kind, N, 8, 384, g, "cuda")
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(N, D, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        eager = eager_without_pdl(lambda: experts.fused(x, ids, w, variant=variant))
        assert_close(out, eager, 0.0, f"{what}, {kind} routing: graph replay vs eager")
        ref = model.Experts.forward(experts, x, ids, w)
        assert_close(out, ref, 2e-2 * ref.abs().max().item(), f"{what}, {kind}: vs plain")


@pytest.mark.triton
def test_fused_moe_gemv_int4_even_and_masked_blocks():
    """The INT4 GEMV kernels with blocks that divide the shapes (EVEN: no load masked, as at
    Kimi-K2's) and blocks that do not (masked rows, words and expert columns), against the gather
    path, alone and with a shared expert in the launch (against the plain MLP added). D 96: 12 words
    a row. 2 tokens of 8 experts each on the GPU, of 4 on the CPU (the interpreter's time follows
    the token-expert pairs)."""
    args = tiny(n_routed_experts=16, num_experts_per_tok=8, hidden_size=96,
                moe_intermediate_size=64,
                quantization_config="int4")
    experts = init_random(ExpertsHolder(args, TP(1, 2), TRITON_DEVICE, torch.float32), 0).experts
    D, I, g = 96, experts.gate_proj.weight_packed.shape[1], torch.Generator().manual_seed(0)
    K = 8 if TRITON_DEVICE.type == "cuda" else 4
    ids, w = routing("random", 2, K, 16, g, TRITON_DEVICE)
    x = torch.randn(2, D, generator=g).to(TRITON_DEVICE)
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    ref = model.Experts.forward(experts, x, ids, w)
    shared = [torch.randn(*s, generator=g).to(TRITON_DEVICE) / 8 for s in ((I, D), (I, D), (D, I))]
    ref_shared = ref + shared_mlp(x, shared)
    # (gate_up, down): all unmasked (4-word steps); masked rows, words and expert columns; masked
    # words, rows
    for gate_up, down in (((32, 4, 4), (32, 32, 4)), ((64, 8, 4), (64, 64, 4)),
                          ((16, 16, 4), (128, 32, 4))):
        for sh, want in ((None, ref), (shared, ref_shared)):
            got = kernels.fused_moe(x, ids, w, *weights, variant="gemv", shared=sh,
                                    configs=dict(gate_up=gate_up, down=down))
            assert_close(got, want, 1e-5 * want.abs().max().item(),
                         f"GEMV INT4 {gate_up} {down}, shared {sh is not None}")


@pytest.mark.triton
def test_fused_moe_gemv_int4_packed_bf16_precision():
    """bf16 activations take the INT4 GEMV's packed form (products by bf16 pairs, a word's 4 pairs
    summed in bf16, then fp32): against the fp32 form on the same weights (x in fp32), within 1.5%
    of the largest output, and on average within 2x the plain bf16 module's own error (its
    dequantized weights rounded to bf16); with blocks that divide the shapes and blocks that do
    not, alone and with a shared expert in the launch. On the CPU the interpreter runs the same
    arithmetic in fp32 with the GPU's rounding (moe_gemv._fma2), at 4 experts a token (8 on the
    GPU: the interpreter's time follows the token-expert pairs)."""
    K = 8 if TRITON_DEVICE.type == "cuda" else 4
    args = tiny(n_routed_experts=16, num_experts_per_tok=8, hidden_size=96,
                moe_intermediate_size=64, quantization_config="int4")
    experts = init_random(ExpertsHolder(args, TP(1, 2), TRITON_DEVICE, torch.bfloat16), 0).experts
    D, I, g = 96, experts.gate_proj.weight_packed.shape[1], torch.Generator().manual_seed(3)
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    shared = [(torch.randn(*s, generator=g) / 8).to(TRITON_DEVICE, torch.bfloat16)
              for s in ((I, D), (I, D), (D, I))]
    for N, (gate_up, down), sh in ((1, ((32, 4, 4), (32, 32, 4)), None),
                                   (3, ((64, 8, 4), (64, 64, 4)), shared)):
        ids, w = routing("random", N, K, 16, g, TRITON_DEVICE)
        x = torch.randn(N, D, generator=g).to(TRITON_DEVICE, torch.bfloat16)
        cfg = dict(gate_up=gate_up, down=down)
        got = kernels.fused_moe(x, ids, w, *weights, variant="gemv", shared=sh, configs=cfg)
        fp32 = kernels.fused_moe(x.float(), ids, w, *weights, variant="gemv",
                                 shared=sh and [t.float() for t in sh], configs=cfg)
        plain = model.Experts.forward(experts, x, ids, w)
        if sh:
            plain = plain + shared_mlp(x, sh)
        what = f"packed INT4 GEMV, {N} tokens, {cfg}, shared {sh is not None}"
        assert got.dtype == torch.bfloat16 and fp32.abs().max() > 0.1
        assert_close(got.float(), fp32, 1.5e-2 * fp32.abs().max().item(), what + " vs fp32")
        err, plain_err = ((y.float() - fp32).abs().mean().item() for y in (got, plain))
        assert err <= 2 * plain_err, (f"{what}: mean error {err:.2e}, the plain "
                                      f"module's {plain_err:.2e}")


@pytest.mark.triton
@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_fused_moe_gemv_shared_h_made_once(quant, monkeypatch):
    """The shared expert's h = silu(g) * u is made once a row block, by the last of its split
    programs to finish (a shared atomic counter): calls in a row with other tokens (a counter left
    non-zero would make a later call's last program the wrong one) each equal the plain sum, with
    masked rows and without, repeat bitwise, leave the counters zero, in the loop form and (the
    first blocks) in the dot form (a counter a 16-row tile); more row blocks than counters are
    refused. Two routed experts a token and 2 slices of D a dot-form tile (the interpreter's time
    follows the programs; test_fused_moe_gemv_fp8_takes_a_shared_expert runs the default slices).
    Each form runs 3 tokens then 1 (a call after one with more row programs); the GPU adds a third
    call, of 4 tokens, in the loop form."""
    monkeypatch.setattr(kernels.moe_gemv, "SHARED_DOT_SLICES", 2)
    qc = "int4" if quant == "int4" else checkpoint.fp8_quantization_config((128, 128))
    D = 96 if quant == "int4" else 256
    args = tiny(n_routed_experts=16, num_experts_per_tok=2, hidden_size=D,
                moe_intermediate_size=192, quantization_config=qc)
    experts = init_random(ExpertsHolder(args, TP(1, 2), TRITON_DEVICE, torch.float32), 0).experts
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    I, g = weights[0].shape[1], torch.Generator().manual_seed(1)
    shared = [torch.randn(*s, generator=g).to(TRITON_DEVICE) / 8 for s in ((I, D), (I, D), (D, I))]
    # I 96 a rank: 32 rows a block divide it, 64 leave the second block's rows masked
    blocks = ([dict(gate_up=(32, 4, 4), down=(32, 32, 4)),
               dict(gate_up=(64, 4, 4), down=(32, 32, 4))]
              if quant == "int4" else [dict(gate_up=(32, 64, 1, 4, 1), down=(64, 64, 4, 1)),
                                       dict(gate_up=(64, 64, 2, 4, 2), down=(32, 64, 4, 2))])
    for cfg in [dict(b, shared_dot=False) for b in blocks] + [dict(blocks[0], shared_dot=True)]:
        for N in (3, 1, 4) if not cfg["shared_dot"] and TRITON_DEVICE.type == "cuda" else (3, 1):
            ids, w = routing("random", N, 2, 16, g, TRITON_DEVICE)
            x = torch.randn(N, D, generator=g).to(TRITON_DEVICE)
            want = model.Experts.forward(experts, x, ids, w) + shared_mlp(x, shared)
            got = kernels.fused_moe(x, ids, w, *weights, variant="gemv", shared=shared, configs=cfg)
            what = f"GEMV {quant} + shared, {N} tokens, {cfg}"
            assert_close(got, want, 1e-5 * want.abs().max().item(), what)
            assert not kernels._counters(x.device).any(), \
                f"{what}: the last programs leave the counters 0"
        again = kernels.fused_moe(x, ids, w, *weights, variant="gemv", shared=shared, configs=cfg)
        assert torch.equal(again, got), f"GEMV {quant} + shared, {cfg}: a second call differs"
    ids, w = routing("random", 3, 2, 16, g, TRITON_DEVICE)
    x = torch.randn(3, D, generator=g).to(TRITON_DEVICE)
    check_adaptive_with_shared(x, ids, w, experts, weights, shared, quant)
    monkeypatch.setattr(kernels.common, "COUNTERS", 2)
    with pytest.raises(ValueError, match="more than 2 row blocks"):
        kernels.fused_moe(x, ids, w, *weights, variant="gemv", shared=shared,
                          configs=dict(blocks[0], shared_dot=False))


@pytest.mark.triton
def test_int4_adaptive_gemv_programs_take_several_pairs_and_row_blocks(monkeypatch):
    """INT4's adaptive variant launches its GEMV with few programs (moe_gemv.ADAPTIVE_PROGRAMS, 5
    here), each taking several pairs (gate_up) or row blocks of D (down) in turn, the last of
    them partly past the pairs and past D: with the GEMV chosen and with the tiles chosen, with a
    shared expert and without, equal to the gather path (plus the plain MLP). I 96 a rank in 32-row
    blocks: gate_up 3 row blocks x 6 pairs, 4 pairs a program; down 3 row blocks of D 96 x 3
    tokens, 2 a program."""
    monkeypatch.setattr(kernels.moe_gemv, "ADAPTIVE_PROGRAMS", 5)
    D = 96
    args = tiny(n_routed_experts=16, num_experts_per_tok=2, hidden_size=D,
                moe_intermediate_size=192, quantization_config="int4")
    experts = init_random(ExpertsHolder(args, TP(1, 2), TRITON_DEVICE, torch.float32), 0).experts
    weights = [kernels.expert_weights(getattr(experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    I, g = weights[0].shape[1], torch.Generator().manual_seed(2)
    assert kernels.moe_gemv._adaptive_fold((), 6, 3) == 4
    assert kernels.moe_gemv._adaptive_fold((), 3, 3) == 2
    assert kernels.moe_gemv._adaptive_fold(None, 6, 3) == 1
    shared = [torch.randn(*s, generator=g).to(TRITON_DEVICE) / 8 for s in ((I, D), (I, D), (D, I))]
    cfg = dict(gate_up=(32, 4, 4), down=(32, 32, 4))
    ids, w = routing("random", 3, 2, 16, g, TRITON_DEVICE)
    x = torch.randn(3, D, generator=g).to(TRITON_DEVICE)
    disjoint = torch.randperm(16, generator=g)[:6].view(3, 2).to(ids)
    for how, chosen in (("the GEMV", disjoint), ("the tiles", ids[[2, 2, 2]])):
        for s in (None, shared):
            want = model.Experts.forward(experts, x, chosen, w)
            want = want if s is None else want + shared_mlp(x, s)
            got = kernels.fused_moe(x, chosen, w, *weights, variant="adaptive", shared=s,
                                    configs=cfg)
            assert_close(got, want, 1e-5 * want.abs().max().item(),
                         f"INT4 adaptive, {how} chosen, shared {s is not None}, folded programs")


@pytest.mark.triton
def test_fused_moe_rule_picks_gemv_for_few_pairs(monkeypatch):
    """The model's fused path runs the GEMV variant up to gemv_max_tokens tokens and tiles above: a
    rule on shapes (never on routed values), so one captured graph always replays one variant. The
    limit is the one measured at the expert width nearest the experts' (by ratio)."""
    experts, D = moe_experts("tiny", "fp8", 16, TRITON_DEVICE, torch.float32)
    calls = []
    gemv = kernels.moe_gemv._fused_moe_gemv
    monkeypatch.setattr(kernels.moe_gemv, "_fused_moe_gemv", lambda *a: calls.append(a[0].shape[0])
                        or gemv(*a))
    g = torch.Generator().manual_seed(0)
    monkeypatch.setitem(kernels.GEMV_MAX_TOKENS, "plain", {256: 1, 512: 2, 1024: 3})
    widths = (16, 256, 360, 400, 512, 800, 2048)     # nearest by ratio: 360 to 256, 400 to 512
    assert [kernels.gemv_max_tokens("plain", I) for I in widths] == [1, 1, 1, 2, 2, 3, 3]
    # the experts' width (32 a rank) nearer 16 than 256: fused_moe's rule reads the width's row
    monkeypatch.setitem(kernels.GEMV_MAX_TOKENS, "fp8", {16: 3, 256: 32})
    limit = kernels.gemv_max_tokens("fp8", kernels.expert_weights(experts.gate_proj).shape[1])
    assert limit == 3
    for N in (1, limit, limit + 1):
        ids, w = routing("random", N, 8, 16, g, TRITON_DEVICE)
        experts(torch.randn(N, D, generator=g).to(TRITON_DEVICE), ids, w)
    assert calls == [1, limit], f"GEMV variant ran for token counts {calls}, expected [1, {limit}]"
    many = kernels.GEMV_MAX_PAIRS // 8 + 1  # tokens: more pairs than it handles
    with pytest.raises(ValueError, match=f"'gemv' up to {kernels.GEMV_MAX_PAIRS} pairs"):
        experts.fused(torch.randn(many, D, device=TRITON_DEVICE), ids[:1].expand(many, 8),
                      w[:1].expand(many, 8),
                      variant="gemv")


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_fused_moe_equals_gather_kimi_rank_shapes(quant):
    for E in (16, 384):
        for dtype in (torch.float32, torch.bfloat16):
            check_fused_moe(moe_experts("kimi", quant, E, "cuda", dtype),
                            [c for c in fused_cases_all(E) if not c[2]], dtype)
            torch.cuda.empty_cache()


@pytest.mark.triton
def test_fused_moe_refuses_bad_input_by_name():
    experts, _ = moe_experts("tiny", None, 16, TRITON_DEVICE, torch.float32)
    x, ids = torch.randn(2, 64, device=TRITON_DEVICE), torch.zeros(2, 8, dtype=torch.int64,
                                                                   device=TRITON_DEVICE)
    w = kernels.ExpertWeights("plain", experts.gate_proj)
    with pytest.raises(ValueError, match=r"expected \[E, I, D\], \[E, I, D\], \[E, D, I\]"):
        kernels.fused_moe(x, ids, ids.float(), w, w, w)
    with pytest.raises(ValueError, match="x must be bf16, fp16 or fp32"):
        kernels.fused_moe(x.double(), ids, ids.float(), w, w,
                          kernels.ExpertWeights("plain", experts.down_proj))
    with pytest.raises(ValueError,
                       match="moe='fused' needs Triton and a bf16, fp16 or float32 model"):
        kernels.accelerate(Transformer(tiny(), dtype=torch.float64), moe="fused")
    # scales that do not fit their weights: the kernels would read past them
    words = torch.zeros(2, 8, 8, dtype=torch.int32, device=TRITON_DEVICE)       # [E, I, 64 / 8]
    int4 = [kernels.ExpertWeights("int4", words, torch.ones(2, 8, 4, device=TRITON_DEVICE),
                                  group=32)] * 2      # 64 / 32 = 2 groups a row, not 4
    down = kernels.ExpertWeights("int4", torch.zeros(2, 64, 1, dtype=torch.int32,
                                                     device=TRITON_DEVICE),
                                 torch.ones(2, 64, 1, device=TRITON_DEVICE), group=8)
    with pytest.raises(ValueError, match=r"gate scales \[2, 8, 4\], expected \[2, 8, 2\]"):
        kernels.fused_moe(x, ids[:, :2] % 2, ids[:, :2].float(), *int4, down)
    fp8 = [kernels.ExpertWeights("fp8", torch.zeros(2, *shape, device=TRITON_DEVICE).to(
        torch.float8_e4m3fn), torch.ones(2, 1, 1, device=TRITON_DEVICE), (16, 16))
        for shape in ((32, 64), (32, 64), (64, 32))]       # 16 x 16 blocks: [2, 2, 4], not 1 x 1
    with pytest.raises(ValueError, match=r"gate scales \[2, 1, 1\], expected \[2, 2, 4\]"):
        kernels.fused_moe(x, ids[:, :2] % 2, ids[:, :2].float(), *fp8)
    # no tokens: nothing to compute, in every variant
    gate, down = (kernels.ExpertWeights("plain", p) for p in (experts.gate_proj,
                                                               experts.down_proj))
    for variant in ("gemv", "dot", None):
        out = kernels.fused_moe(x[:0], ids[:0], ids[:0].float(), gate, gate, down,
                                variant=variant)
        assert out.shape == (0, 64), variant


# ---------------------------------------------------------------------------------------------
# The weight bytes a fused MoE launch reads, counted under Triton's CPU interpreter (count_reads:
# every mask-true element a tl.load fetches from each expert tensor). "issued": every load counted;
# "distinct": the bytes loaded at least once. A token's experts are K = 8 of E = 16, so tokens share
# them; the routing gives each expert's pairs (the tokens that pick it).

ON_THE_INTERPRETER = pytest.mark.skipif(
    TRITON_DEVICE.type == "cuda",
    reason="counts loads inside Triton's CPU interpreter (TRITON_INTERPRET=1, a machine without "
           "CUDA); on CUDA the kernels run compiled and their loads cannot be counted")


@_jit
def _load_twice_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = 2 * src[i], i < n, src loaded twice: a known count for count_reads."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(src_ptr + i, mask=i < n)
    b = tl.load(src_ptr + i, mask=i < n)
    tl.store(dst_ptr + i, a + b, mask=i < n)


@pytest.mark.triton
@ON_THE_INTERPRETER
def test_count_reads_counts_the_mask_true_loads_inside_each_tensor():
    """100 fp32 elements in the middle of a buffer, loaded twice by 2 programs of 64 lanes: the 28
    masked-off lanes point into the buffer's tail and must not count; stores do not count."""
    from triton.runtime.interpreter import InterpreterBuilder
    original = InterpreterBuilder.create_masked_load
    buf = torch.arange(300, dtype=torch.float32)
    head, src, tail = buf[:100], buf[100:200].view(10, 10), buf[200:]
    dst = torch.zeros(100)
    with count_reads({"head": head, "src": src, "tail": tail, "dst": dst}) as reads:
        _load_twice_kernel[(2,)](src, dst, 100, BLOCK=64)
    assert InterpreterBuilder.create_masked_load is original, "count_reads left its wrapper in"
    assert torch.equal(dst, 2 * src.flatten())
    assert (reads["src"].bytes, reads["src"].distinct) == (800, 400)
    assert reads["src"].by_row() == ([80] * 10, [40] * 10)
    assert [reads[k].bytes for k in ("head", "tail", "dst")] == [0, 0, 0]


def expert_tensors(experts):
    """The fused MoE's expert tensors by name: each projection's data and, quantized, its scales."""
    tensors = {}
    for p in ("gate", "up", "down"):
        w = kernels.expert_weights(getattr(experts, p + "_proj"))
        tensors[p] = w.data
        if w.scale is not None:
            tensors[p + " scales"] = w.scale
    return tensors


def moe_reads(experts, D, N, kind, variant, seed):
    """One fused_moe call of `variant` on N tokens routed as `kind` (checked against the plain
    reference): its pairs per expert [E] and, per expert tensor, (issued, distinct) bytes per
    expert."""
    g = torch.Generator().manual_seed(seed)
    ids, w = routing(kind, N, 8, experts.n_experts, g, TRITON_DEVICE)
    x = torch.randn(N, D, generator=g)
    with count_reads(expert_tensors(experts)) as reads:
        out = experts.fused(x, ids, w, variant=variant)
    ref = model.Experts.forward(experts, x, ids, w)
    assert_close(out, ref, 1e-5 * ref.abs().max().item(), f"fused ({variant}) vs gather MoE, N {N}")
    pairs = torch.bincount(ids.flatten(), minlength=experts.n_experts).tolist()
    return pairs, {name: r.by_row() for name, r in reads.items()}


def one_expert_bytes(experts):
    return {name: t[0].numel() * t.element_size() for name, t in expert_tensors(experts).items()}


def per_pass_bytes(experts, D, variant):
    """Bytes a launch issues for one expert serving one token, per expert tensor, from one token's
    call (its K experts one pair each); every one of them must read alike."""
    pairs, reads = moe_reads(experts, D, 1, "random", variant, seed=1)
    per_pass = {}
    for name, (issued, _) in reads.items():
        seen = {b for b, p in zip(issued, pairs) if p}
        assert len(seen) == 1 and 0 not in seen, f"{name}: one token's experts issued {issued}"
        per_pass[name] = seen.pop()
    return per_pass


@pytest.mark.triton
@ON_THE_INTERPRETER
@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_fused_moe_tile_variant_reads_each_distinct_expert_once(quant):
    """The tile variant reads each distinct expert's weights once, however many tokens pick it (up
    to 4 here): every expert a token picks, its gate, up and down data loaded once, element by
    element (issued = distinct = the expert's bytes), nothing of the others; its scales loaded
    completely and as often as for one token (FP8's once for each weight element they scale, so
    issued scale bytes exceed distinct by a fixed factor; INT4's once a row and group)."""
    experts, D = moe_experts("tiny", quant, 16, TRITON_DEVICE, torch.float32)
    one, per_pass = one_expert_bytes(experts), per_pass_bytes(experts, D, "dot")
    for name in ("gate", "up", "down"):
        assert per_pass[name] == one[name], (
            f"{name}: {per_pass[name]} bytes issued a pass, {one[name]} held")
    for N, kind in ((4, "shared"), (4, "random")):
        pairs, reads = moe_reads(experts, D, N, kind, "dot", seed=2)
        for name, (issued, distinct) in reads.items():
            what = f"{quant or 'plain'} {name}, {kind} routing, pairs per expert {pairs}"
            assert issued == [per_pass[name] if p else 0 for p in pairs], f"{what}: issued {issued}"
            once = [one[name] if p else 0 for p in pairs]
            assert distinct == once, f"{what}: distinct {distinct}"


# the GEMV variant's passes over one expert's data per pair: INT4's gate_up, where its blocks
# divide the shapes, loads its next step's words ahead and reloads the last step's own in place of
# a masked load; here (64 columns: 8 words, one step of 8 in the interpreter's block sizes) that
# reads gate and up twice a pass
GEMV_DATA_PASSES = {None: {}, "fp8": {}, "int4": {"gate": 2, "up": 2}}


@pytest.mark.triton
@ON_THE_INTERPRETER
@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_fused_moe_gemv_variant_reads_an_expert_once_per_token_that_picks_it(quant):
    """The GEMV variant does NOT pay once: it issues one read of an expert per token that picks
    it. gate_up runs a program per pair and row block, each a pass over its expert's rows (on a GPU
    side by side, the later ones mostly reading from L2, but they are issued loads), and down is
    token-major (each token reads its K experts). So an expert with c pairs is issued c passes of
    every tensor (data: GEMV_DATA_PASSES times its bytes a pass, scales: as often as for one
    token), and its distinct bytes are its bytes once."""
    experts, D = moe_experts("tiny", quant, 16, TRITON_DEVICE, torch.float32)
    one, per_pass = one_expert_bytes(experts), per_pass_bytes(experts, D, "gemv")
    for name in ("gate", "up", "down"):
        passes = GEMV_DATA_PASSES[quant].get(name, 1)
        assert per_pass[name] == passes * one[name], (
            f"{name}: {per_pass[name]} bytes issued a pass, {one[name]} held")
    for N, kind in ((4, "shared"), (4, "random")):
        pairs, reads = moe_reads(experts, D, N, kind, "gemv", seed=2)
        for name, (issued, distinct) in reads.items():
            what = f"{quant or 'plain'} {name}, {kind} routing, pairs per expert {pairs}"
            assert issued == [p * per_pass[name] for p in pairs], f"{what}: issued {issued}"
            once = [one[name] if p else 0 for p in pairs]
            assert distinct == once, f"{what}: distinct {distinct}"


@pytest.mark.triton
@ON_THE_INTERPRETER
@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_fused_moe_adaptive_variant_reads_each_distinct_expert_once_where_tokens_share(quant):
    """The adaptive variant reads each distinct expert once where the routing shares experts: with
    at most ADAPTIVE_SHARE / ADAPTIVE_SCALE of the pairs distinct, every expert is issued the
    tiles' one pass, and the GEMV's programs read no weights; above it (one token's 8 distinct
    experts) the GEMV's pass a pair (INT4: its pass reloads its last step's words,
    GEMV_DATA_PASSES) and the tiles read nothing."""
    experts, D = moe_experts("tiny", quant, 16, TRITON_DEVICE, torch.float32)
    one = one_expert_bytes(experts)
    gemv, tiles = per_pass_bytes(experts, D, "gemv"), per_pass_bytes(experts, D, "dot")
    share = kernels.moe.ADAPTIVE_SHARE / kernels.moe.ADAPTIVE_SCALE
    for N, kind, want_tiles in ((4, "shared", True), (4, "random", True), (1, "random", False)):
        pairs, reads = moe_reads(experts, D, N, kind, "adaptive", seed=2)
        assert (sum(p > 0 for p in pairs) <= share * N * 8) == want_tiles, f"routing {pairs}"
        for name, (issued, distinct) in reads.items():
            what = f"{quant or 'plain'} {name}, {kind} routing, pairs per expert {pairs}"
            want = [0 if p == 0 else tiles[name] if want_tiles else p * gemv[name] for p in pairs]
            assert issued == want, f"{what}: issued {issued}"
            once = [one[name] if p else 0 for p in pairs]
            assert distinct == once, f"{what}: distinct {distinct}"


# ---------------------------------------------------------------------------------------------
# The target's Triton kernels against their plain twins in model.py (the row kernels' tail masks
# too), and each swap against the module it replaces; on the GPU also long caches, one graph for
# any length, captured paths

KIMI_TP8 = dict(H=8, C=512, R=64)          # Kimi-K2's MLA at TP 8: 8 local heads


TINY_MLA = dict(H=4, C=32, R=8)            # the tiny preset at TP 1


def mla_inputs(B, T, H, C, R, S, dtype, device, seed):
    """A decode step's inputs to kernels.mla_decode_attention: queries (q_pe not rotated), T new
    latents a row (kv_a's halves, not normalized or rotated), kv_a_layernorm's weight, the rope
    table's rows at the positions, and caches with one spare row (the kernel gets [:B] views, as
    the model's); each row's T positions are consecutive and end at its own length, one row at
    the cache's end, one at slot 0."""
    g = torch.Generator().manual_seed(seed)
    q_lat, q_pe = torch.randn(B, T, H, C, generator=g), torch.randn(B, T, H, R, generator=g)
    kv, k_pe = torch.randn(B, T, C, generator=g), torch.randn(B, T, R, generator=g)
    weight = 1 + 0.1 * torch.randn(C, generator=g)
    kv_cache, pe_cache = torch.randn(B + 1, S, C, generator=g), torch.randn(B + 1,
                                                                            S, R, generator=g)
    last = torch.randint(T - 1, S, (B,), generator=g)
    last[0] = S - 1                              # one row uses the whole cache
    if B > 2:
        last[2] = T - 1                          # one row starts at slot 0
    positions = last.unsqueeze(1) - (T - 1) + torch.arange(T)
    # [B, T, R/2, 2]
    rope = torch.stack(model.rope_tables(R, 10000.0, None, S, "cpu"), -1)[positions]
    to = dict(device=device, dtype=dtype)
    return dict(q_lat=q_lat.to(**to), q_pe=q_pe.to(**to), kv=kv.to(**to), k_pe=k_pe.to(**to),
                norm_weight=weight.to(**to), eps=1e-6, rope=rope.to(device),
                positions=positions.to(device),
                kv_cache=kv_cache.to(**to)[:B], pe_cache=pe_cache.to(**to)[:B])


def mla_reference(inputs, scale, dtype=None):
    """The plain twins on copies of the caches, in `dtype` (default: the inputs'): model.MLA's
    write_cache lines (kv_a_layernorm, apply_rope, the index writes), then
    model.absorbed_attention of the rotated queries. Returns (o_lat, kv_cache, pe_cache)."""
    x = {k: v.to(dtype or v.dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "rope"
         else v
         for k, v in inputs.items()}
    kv_cache, pe_cache, pos = x["kv_cache"].clone(), x["pe_cache"].clone(), x["positions"]
    norm = model.RMSNorm(kv_cache.shape[-1], x["eps"], kv_cache.device, kv_cache.dtype)
    with torch.no_grad():
        norm.weight.copy_(x["norm_weight"])
    rows = torch.arange(pos.shape[0], device=pos.device).unsqueeze(1)
    kv_cache[rows, pos] = norm(x["kv"])
    pe_cache[rows, pos] = model.apply_rope(x["k_pe"], x["rope"])
    hidden = torch.arange(kv_cache.shape[1], device=pos.device) > pos.unsqueeze(-1)
    o = model.absorbed_attention(x["q_lat"], model.apply_rope(x["q_pe"], x["rope"]), kv_cache,
                                 pe_cache, hidden, scale)
    return o, kv_cache, pe_cache


def bf16_twin_tolerance(twin, truth):
    """How far a bf16 kernel's output may lie from the float64 truth: twice the bf16 twin's own
    largest error, and at least 2^-6 of the truth's largest value. Relative to the output's size:
    a long cache's outputs are small (0.28 at 32768 slots), and an absolute 2e-2 passed a kernel
    that skipped 1024 of its slots. Returns (the tolerance, the twin's error)."""
    twin_err = (twin.double() - truth).abs().max().item()
    return max(2 * twin_err, 2 ** -6 * truth.abs().max().item()), twin_err


def check_mla(B, T, shape, S, dtype, device, seed, split_len=None):
    """The kernel's output against the float64 twin, and the caches it wrote against the twin's in
    the kernel's dtype."""
    scale = 0.07
    inputs = mla_inputs(B, T, **shape, S=S, dtype=dtype, device=device, seed=seed)
    truth, _, _ = mla_reference(inputs, scale, dtype=torch.float64)
    twin, twin_kv, twin_pe = mla_reference(inputs, scale)
    got = kernels.mla_decode_attention(**inputs, softmax_scale=scale, split_len=split_len)
    assert got.shape == truth.shape and got.dtype == dtype and torch.isfinite(got).all()
    what = f"MLA kernel B={B} T={T} {shape} S={S} {dtype} split {split_len}"
    # bf16: one rounding of values below 4
    cache_tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * 4
    assert_close(inputs["kv_cache"], twin_kv, cache_tol, what + ": latent cache")
    assert_close(inputs["pe_cache"], twin_pe, cache_tol, what + ": rope cache")
    if dtype == torch.float32:
        assert_close(got, truth, 2e-5, what + " vs float64 twin")
    else:  # bf16: the twin rounds the scores and the output; the kernel keeps scores in fp32
        tol, twin_err = bf16_twin_tolerance(twin, truth)
        assert_close(got, truth, tol, what + f" vs float64 twin (bf16 twin: {twin_err:.2e})")


@pytest.mark.triton
@pytest.mark.parametrize("B, T", [(1, 1), (3, 1), (1, 4), (3, 4)])
def test_mla_decode_kernel_equals_twin_tiny(B, T):
    """Tiny shapes: the cached slots in one split (S=40), in 64-slot splits and in 16-slot splits
    (S=300: 5 and 19 splits, merged with the new tokens' part)."""
    device = TRITON_DEVICE.type
    check_mla(B, T, TINY_MLA, 40, torch.float32, device, seed=B * 10 + T)
    check_mla(B, T, TINY_MLA, 300, torch.float32, device, seed=B * 10 + T + 1, split_len=64)
    check_mla(B, T, TINY_MLA, 300, torch.float32, device, seed=B * 10 + T + 2, split_len=16)


def first_args_launched(monkeypatch, module, kernel):
    """module.kernel replaced by a stand-in whose launches (kernel[grid](...)) run nothing and
    record their first tensor: the list they fill, to check what reaches a kernel uncopied."""
    launched = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append(args[0])
    monkeypatch.setattr(module, kernel, Launch())
    return launched


@pytest.mark.triton
def test_mla_decode_kernel_reads_permuted_queries_in_place(monkeypatch):
    """q_lat as the absorbed einsum leaves it (stored head-major, [B, T, H, C] a permuted view:
    model.MLA.absorb_query past head_gemv's rows) reaches the kernel uncopied, and gives its output
    and caches equal to a contiguous q_lat's, bit for bit, and against the float64 twin."""
    device = TRITON_DEVICE.type
    inputs = mla_inputs(3, 4, **TINY_MLA, S=40, dtype=torch.float32, device=device, seed=7)
    permuted = inputs["q_lat"].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    assert not permuted.is_contiguous() and torch.equal(permuted, inputs["q_lat"])
    truth, _, _ = mla_reference(inputs, 0.07, dtype=torch.float64)
    outs = []
    for q_lat in (inputs["q_lat"], permuted):
        x = dict(inputs, q_lat=q_lat, kv_cache=inputs["kv_cache"].clone(),
                 pe_cache=inputs["pe_cache"].clone())
        outs.append((kernels.mla_decode_attention(**x, softmax_scale=0.07), x["kv_cache"],
                     x["pe_cache"]))
    for a, b, what in zip(outs[0], outs[1], ("o_lat", "latent cache", "rope cache")):
        assert torch.equal(a, b), f"MLA kernel, permuted q_lat: {what} differs"
    assert_close(outs[1][0], truth, 2e-5, "MLA kernel, permuted q_lat vs float64 twin")
    launched = first_args_launched(monkeypatch, kernels.mla, "_mla_decode_kernel")
    kernels.mla_decode_attention(**dict(inputs, q_lat=permuted), softmax_scale=0.07, merge=False)
    assert launched[0].data_ptr() == permuted.data_ptr(), "permuted q_lat copied before the launch"


@pytest.mark.triton
def test_mla_decode_kernel_equals_twin_kimi_shapes():
    """Kimi-K2 at TP 8 (H=8, C=512, R=64), verify-sized (T=4), rows of different lengths."""
    device = TRITON_DEVICE.type
    check_mla(3, 4, KIMI_TP8, 100, torch.float32, device, seed=5, split_len=64)


@pytest.mark.triton
@pytest.mark.parametrize("block_m", [8, 16, 32])
def test_mla_decode_kernel_query_rows_in_blocks(block_m, monkeypatch):
    """A verify's query rows (T x H = 24 at Kimi-K2's TP 8) in blocks of block_m rows, each block
    a program of its own that recomputes the new tokens' latents (block 0 writes them), or all in
    one block of 32: equal to the twin either way."""
    monkeypatch.setattr(kernels.mla, "mla_block_m", lambda rows, batch, kv_len: block_m)
    device = TRITON_DEVICE.type
    check_mla(2, 3, KIMI_TP8, 100, torch.float32, device, seed=6, split_len=64)


def parts_in_use(x, unmerged):
    """For each batch row, the parts mla_decode_attention's merge reads: part 0 and the splits of
    the cached slots before the row's first position (computed on the host, for the test)."""
    first = x["positions"][:, 0].cpu().clamp(max=unmerged.kv_len)
    return (1 + (first + unmerged.split_len - 1) // unmerged.split_len).tolist()


def _merge_absorb_cases(device, dtype):
    """The merge_absorb test's cases (shape, rows of W_uv a head N, B, T, cached slots S, split
    length): see its docstring for which run where."""
    tiny_cases = ((1, 1, 40, None), (3, 1, 300, 16), (1, 4, 300, 16), (2, 2, 40, None),
                  (4, 4, 40, None), (4, 4, 300, 16))
    kimi, kimi_shape = ((1, 1, 300, 16), (3, 1, 100, 64), (1, 4, 300, 16)), KIMI_TP8
    if device == "cpu":
        tiny_cases = (((1, 1, 40, None), (3, 1, 100, 16), (4, 4, 40, None), (1, 4, 300, 16))
                      if dtype == torch.float32 else ((3, 1, 100, 16), (1, 4, 300, 16)))
        kimi, kimi_shape = ((3, 1, 100, 64),), dict(KIMI_TP8, H=2)   # the case that merges
    cases = [(TINY_MLA, 16, B, T, S, split) for B, T, S, split in tiny_cases]
    cases += [(kimi_shape, 128, B, T, S, split) for B, T, S, split in kimi]
    if device == "cuda":
        cases += [(KIMI_TP8, 128, B, T, S, None) for B, T in ((1, 1), (3, 1), (1, 4), (4, 4))
                  for S in (256, 4096)]
    return cases


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_merge_absorb_equals_combine_then_head_gemv(dtype, monkeypatch):
    """kernels.mla_merge_absorb (the merge inside W_uv's GEMV launch) against the two launches it
    replaces, head_gemv(mla_decode_attention(..., merge=True), w_uv): equal bit for bit, on fresh
    random inputs, tiny and Kimi-K2 TP-8 shapes (N = 128 rows of W_uv a head, a strided view as the
    model's), 1 to 16 rows, batch rows at different positions (mla_inputs: one at the cache's end,
    with B > 2 one starting at slot 0, whose only part is the new tokens'), one part up to 20; the
    parts no row uses are filled with NaN first, to show they are never read. Where the parts do not
    fit (MLA_MERGE_ABSORB_REGS) it must take the two launches itself; both cases occur. float32:
    also against the float64 twin. Triton's CPU interpreter takes seconds a case: there float32
    runs 1, 3 and 16 rows that merge (2 to 8 parts) and 4 rows of 20 parts that fall back, and
    the one Kimi-K2 case that merges with 2 of its 8 heads (each head is its own programs); bf16
    (whose K steps are twice as wide) a tiny case of each kind and that Kimi-K2 case. The GPU runs
    every case, Kimi-K2's with all 8 heads."""
    device = TRITON_DEVICE.type
    combines, combine = [], kernels.mla_combine
    monkeypatch.setattr(kernels.mla, "mla_combine", lambda *a: combines.append(a[0].partial.shape)
                        or combine(*a))
    scale, merged, fell_back = 0.07, 0, 0
    for i, (shape, N, B, T, S, split) in enumerate(_merge_absorb_cases(device, dtype)):
        what = f"merge_absorb H={shape['H']} C={shape['C']} B={B} T={T} S={S} split {split} {dtype}"
        x = mla_inputs(B, T, **shape, S=S, dtype=dtype, device=device, seed=40 + i)
        g = torch.Generator().manual_seed(i)
        kv_b = (torch.randn(shape["H"], 2 * N, shape["C"],
                            generator=g) / shape["C"] ** 0.5).to(device, dtype)
        w_uv = kv_b[:, N:]  # [H, N, C], row-strided
        ref_x = {k: v.clone() if torch.is_tensor(v) else v for k, v in x.items()}
        want = kernels.head_gemv(kernels.mla_decode_attention(**ref_x, softmax_scale=scale,
                                                              split_len=split), w_uv)
        combines.clear()
        unmerged = kernels.mla_decode_attention(**x, softmax_scale=scale,
                                                split_len=split, merge=False)
        assert not combines, f"{what}: merge=False ran the combine"
        for b, used in enumerate(parts_in_use(x, unmerged)):
            unmerged.partial[b, :, used:] = float("nan")
            unmerged.lse[b, :, used:] = float("nan")
        got = kernels.mla_merge_absorb(unmerged, x["positions"], w_uv)
        assert got.shape == want.shape == (B, T, shape["H"], N)
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert torch.equal(got, want), \
            f"{what}: max abs diff {(got.double() - want.double()).abs().max().item():.3e}"
        merged, fell_back = merged + (not combines), fell_back + bool(combines)
        # poisoned parts too
        o_lat = combine(unmerged, x["positions"], dtype).view(B, T, shape["H"], shape["C"])
        assert torch.equal(kernels.head_gemv(o_lat, w_uv),
                           want), f"{what}: the combine read a part not in use"
        if dtype == torch.float32:
            truth = torch.einsum("bthc,hnc->bthn", mla_reference(x, scale, dtype=torch.float64)[0],
                                 w_uv.double())
            assert_close(got, truth, 2e-5 * truth.abs().max().item(), what + " vs float64 twin")
    assert merged and fell_back, \
        f"{merged} cases merged in W_uv's launch and {fell_back} fell back: want both"


@pytest.mark.triton
def test_mla_decode_kernel_refuses_bad_input():
    x = mla_inputs(2, 1, **TINY_MLA, S=16, dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match="positions must be int64"):
        kernels.mla_decode_attention(**{**x, "positions": x["positions"].int()}, softmax_scale=0.1)
    with pytest.raises(ValueError, match="float64: use the plain path"):
        kernels.mla_decode_attention(**{k: v.double() if k in ("q_lat", "q_pe", "kv", "k_pe",
                                                               "kv_cache", "pe_cache")
                                        else v for k, v in x.items()}, softmax_scale=0.1)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.mla_decode_attention(**{**x, "kv_cache": x["kv_cache"][:1]}, softmax_scale=0.1)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        kernels.mla_decode_attention(**{**x, "kv": x["kv"].repeat_interleave(2, -1)[..., ::2]},
                                     softmax_scale=0.1)
    with pytest.raises(ValueError, match="norm_weight"):
        kernels.mla_decode_attention(**{**x, "norm_weight": x["norm_weight"][:1]},
                                     softmax_scale=0.1)


@pytest.mark.triton
@pytest.mark.parametrize("shape", ["tiny", "kimi-k2-tp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cache_kernel_equals_twin(shape, dtype):
    """RoPE + latent norm + cache writes against MLA's plain lines (model.apply_rope, RMSNorm,
    index writes): q_pe, kv and k_pe strided views as MLA splits them, the caches whole as MLA
    passes its own, a row more than the batch (a max batch above it); every slot not written,
    that spare row's too, stays as it was."""
    device = TRITON_DEVICE.type
    H, C, R = (TINY_MLA if shape == "tiny" else KIMI_TP8).values()
    B, S, nope = 3, 40, 16
    norm = model.RMSNorm(C, 1e-6, device, dtype)
    table = torch.stack(model.rope_tables(R, 10000.0, None, S, device), -1)          # [S, R/2, 2]
    g = torch.Generator().manual_seed(H + C)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(C, generator=g))
    for T in (1, 4):
        q = torch.randn(B, T, H, nope + R, generator=g).to(device, dtype)
        kv_a = torch.randn(B, T, C + R, generator=g).to(device, dtype)
        caches = [torch.randn(B + 1, S, n, generator=g).to(device, dtype) for n in (C, R)]
        positions = torch.tensor([[S - T], [5], [0]]) + torch.arange(T)
        positions = positions.to(device)
        rope = table[positions]  # [B, T, R/2, 2]
        q_pe = q.split([nope, R], -1)[1]
        kv, k_pe = kv_a.split([C, R], -1)
        kv_cache, pe_cache = (c.clone() for c in caches)
        got = kernels.mla_rope_cache_write(q_pe, kv, k_pe, norm.weight, norm.eps, rope, positions,
                                           kv_cache, pe_cache)
        want_kv, want_pe = (c.clone() for c in caches)
        rows = torch.arange(B, device=device).unsqueeze(1)
        want_kv[rows, positions] = norm(kv)
        want_pe[rows, positions] = model.apply_rope(k_pe, rope)
        # bf16: one rounding of values below 4
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * 4
        what = f"rope_cache kernel {shape} T={T} {dtype}"
        assert_close(got, model.apply_rope(q_pe, rope), tol, what + ": rotated q_pe")
        assert_close(kv_cache, want_kv, tol, what + ": latent cache")
        assert_close(pe_cache, want_pe, tol, what + ": rope cache")


def random_routers(args, device, dtype, seed, routing="model"):
    """model.Router and its swap kernels.RouterKernel, with the same random weights."""
    router = model.Router(args, device, dtype, routing)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) / 8)
        router.e_score_correction_bias.copy_(0.1 * torch.randn(args.n_routed_experts, generator=g))
    fast = kernels.swap(model.Router(args, device, dtype, routing), kernels.RouterKernel)
    fast.load_state_dict(router.state_dict())
    assert_same_state(fast, router)
    return router, fast


def assert_same_state(swapped, plain):
    """A swap keeps the state dict: the same keys, equal values."""
    a, b = swapped.state_dict(), plain.state_dict()
    assert list(a) == list(b), f"state dict keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after the swap"


ROUTER_SHAPES = {"tiny": {},  # 16 experts in 4 groups, 2 kept, top 4
                 # D 2048: the logits in 2 slices of D, the selection adds their partial sums
                 "kimi-k2": dict(n_routed_experts=384, num_experts_per_tok=8, n_group=1,
                                 topk_group=1, hidden_size=2048),
                 "deepseek-v3": dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                                     topk_group=4)}


def test_router_kernel_refuses_groups_it_cannot_score():
    """A group scores by its two best experts: groups of one expert are refused by name (the
    kernel chose expert 0 for every slot; the plain Router fails in topk), as are groups that
    cannot give top_k."""
    x, w, bias = torch.randn(2, 16), torch.randn(8, 16), torch.zeros(8)
    for n_group, topk_group, top_k in ((8, 4, 2), (2, 1, 5)):
        with pytest.raises(ValueError, match=f"8 experts in {n_group} groups"):
            kernels.router.router_topk(x, w, bias, top_k, n_group, topk_group, True, 1.0)


def strided(n):
    """A 1-D float32 view of n elements at stride 2."""
    return torch.randn(2 * n)[::2]


def strided_calls():
    """Each entry point's call with one strided 1-D argument (the rest fitting), by the entry's
    name: (the argument's name, the call)."""
    D, x = 8, torch.randn(2, 8)
    mla = mla_inputs(1, 1, **TINY_MLA, S=16, dtype=torch.float32, device="cpu", seed=0)
    w = strided(mla["norm_weight"].shape[0])
    cache_write = {k: mla[k] for k in ("q_pe", "kv", "k_pe", "eps", "rope", "positions",
                                       "kv_cache", "pe_cache")}
    return {
        "add_rmsnorm": ("weight", lambda: kernels.add_rmsnorm(x, x, strided(D), 1e-6)),
        "rmsnorm": ("weight", lambda: kernels.rmsnorm(x, strided(D), 1e-6)),
        "norm_gemv": ("norm_weight",
                      lambda: kernels.norm_gemv(x, torch.randn(4, D), strided(D), 1e-6)),
        "draft_input_norms": ("hidden_weight", lambda: kernels.eagle.draft_input_norms(
            x, x, torch.ones(D), 1e-6, strided(D), 1e-6)),
        "mla_decode_attention": ("norm_weight", lambda: kernels.mla_decode_attention(
            **{**mla, "norm_weight": w}, softmax_scale=0.1)),
        "mla_rope_cache_write": ("norm_weight", lambda: kernels.mla_rope_cache_write(
            **cache_write, norm_weight=w)),
        "router_topk": ("bias", lambda: kernels.router.router_topk(
            x, torch.randn(8, D), strided(8), 2, 1, 1, True, 1.0)),
        "router_topk's weight": ("weight's rows", lambda: kernels.router.router_topk(
            x, torch.randn(D, 8).t(), torch.zeros(8), 2, 1, 1, True, 1.0)),
        "draft_top1": ("d2t", lambda: kernels.draft_top1(x, torch.arange(2 * D)[::2]))}


@pytest.mark.parametrize("entry", list(strided_calls()))
def test_a_strided_weight_is_refused(entry):
    """A 1-D argument that a kernel reads as contiguous (a norm's weight, the router's bias, the
    draft's d2t; the router's weight rows), given as a strided view: a ValueError naming it,
    where the kernel would read the wrong elements."""
    (name, call), launcher = strided_calls()[entry], entry.split("'")[0]
    with pytest.raises(ValueError, match=f"^{launcher}: {name} must be contiguous"):
        call()


@pytest.mark.triton
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.slow) if s == "kimi-k2" else s
                                   for s in ROUTER_SHAPES])   # Kimi-K2's: 20-170 s on 2 cores
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_router_kernel_equals_twin(shape, dtype, monkeypatch):
    device = TRITON_DEVICE.type
    args = tiny(**ROUTER_SHAPES[shape])
    router, fast = random_routers(args, device, dtype, seed=len(shape))
    # the weight as the checkpoints store it (bf16), fp16 models widening it to fp32 (bf16's range):
    # the tensor cores' logits then take W in two tf32 parts
    want = torch.float32 if dtype == torch.float16 else dtype
    assert router.weight.dtype == want, f"router weight {router.weight.dtype} in a {dtype} model"
    g = torch.Generator().manual_seed(100 + len(shape))
    select_in_kernel = kernels.router._select_in_kernel
    # each case: tokens, where the selection runs, and whether the INT4 planes are written. The
    # selection: the rule (None; on the GPU a selection kernel reading the logits kernel's partial
    # sums, past ROUTER_GEMV_MAX_TOKENS cuBLAS's logits; under the CPU interpreter the chunks'
    # logits kernel's last program), forced into the last program (True) or
    # apart (False). The chunks' logits kernel takes its tokens 4 at a time (ROUTER_CHUNK): 1, 2
    # and 5 tokens (5: a chunk and a masked one), 20 here (five chunks of a 32-row block), with the
    # planes and without; from 24 here the tensor cores' kernel, the planes then by a copy.
    r = kernels.router
    monkeypatch.setattr(r, "ROUTER_CHUNK", 4)
    monkeypatch.setattr(r, "ROUTER_DOT_MIN_TOKENS", 24)
    assert 24 <= r.ROUTER_GEMV_MAX_TOKENS < 37
    cases = ((1, None, False), (2, True, True), (5, None, True), (5, False, True),
             (20, False, True), (20, None, False), (24, None, False), (24, None, True),
             (37, None, True))
    if device == "cpu":   # the interpreter takes seconds a case at 384 experts and in bf16: there
        # Kimi-K2's float32 up to the forced selection kernel (20 and 37 select as at 5, in
        # DeepSeek-V3's and tiny's float32), bf16 the pair planes written by each path
        cases = (cases[:4] if dtype == torch.float32 and shape == "kimi-k2"
                 else cases if dtype == torch.float32 else (cases[1], cases[3], *cases[6:]))
    for n, in_kernel, with_planes in cases:
        monkeypatch.setattr(r, "_select_in_kernel", select_in_kernel
                            if in_kernel is None else lambda N, device, v=in_kernel: v)
        x = torch.randn(n, args.hidden_size, generator=g).to(device, dtype)
        shared_slot = n == 5  # expert E with weight 1 in a column more (the shared expert's launch)
        ids, w = router(x)
        if shared_slot:
            ids, w = kernels.with_shared_slot(ids, w, args.n_routed_experts)
        planes = kernels.moe_gemv.empty_planes(x).fill_(-1)   # -1: fp32 -1.0, a bf16 NaN pair
        got_ids, got_w = fast(x, shared_slot, planes=planes if with_planes else None)
        assert got_ids.dtype == ids.dtype and got_w.dtype == w.dtype
        what = (f"router kernel {shape} N={n} shared slot {shared_slot}, planes {with_planes}, "
                f"selecting in the last program: {'the rule' if in_kernel is None else in_kernel}")
        assert torch.equal(got_ids, ids), f"{what}: ids differ\n{got_ids}\n{ids}"
        assert_close(got_w, w, 1e-6, f"{what}: weights")
        if with_planes and dtype == torch.bfloat16:  # x as the INT4 GEMV's pair planes: word w
            # of plane j holds elements 8w + j (low half) and 8w + j + 4 (high), written beside
            got = planes.view(torch.bfloat16).view(n, 4, -1, 2)
            for j, half in ((j, half) for j in range(4) for half in range(2)):
                assert torch.equal(got[:, j, :, half],
                                   x[:, j + 4 * half::8]), f"{what}: pair plane {j}, {half}"
        elif with_planes:  # x as the INT4 GEMV's fp32 planes (plane j = elements 8w + j)
            want = x.float().view(n, -1, 8).transpose(1, 2)
            assert torch.equal(planes, want), f"{what}: the activation planes differ"
    with pytest.raises(ValueError, match="planes must be a contiguous"):
        fast(x, planes=torch.empty(n, 8, args.hidden_size // 8 + 1, device=device))


@pytest.mark.triton
def test_router_planes_feed_the_int4_gemv_as_its_own():
    """bf16 INT4 experts (Kimi-K2.5's path with --kernels all): the pair planes the router kernel
    writes beside its selection, read by the fused MoE's INT4 GEMV, give exactly what the GEMV
    gives from planes it makes itself (the two sides agree on the layout, not only each with the
    layout written in test_router_kernel_equals_twin)."""
    device = TRITON_DEVICE
    args = tiny(n_routed_experts=16, num_experts_per_tok=4, hidden_size=96,
                moe_intermediate_size=64, quantization_config="int4")
    experts = init_random(ExpertsHolder(args, TP(1, 2), device, torch.bfloat16), 0).experts
    _, router = random_routers(args, device, torch.bfloat16, seed=3)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    planes = kernels.moe_gemv.empty_planes(x)
    ids, w = router(x, planes=planes)
    W = [kernels.expert_weights(getattr(experts, p)) for p in ("gate_proj", "up_proj", "down_proj")]
    got = kernels.fused_moe(x, ids, w, *W, variant="gemv", planes=planes)
    assert_close(got, kernels.fused_moe(x, ids, w, *W, variant="gemv"), 0.0,
                 "INT4 GEMV on the router's planes vs on its own")


@pytest.mark.triton
@pytest.mark.parametrize("D", [64, 7168])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_kernel_equals_twin(D, dtype):
    """kernels.add_rmsnorm (the sum exactly, the norm of it) and kernels.rmsnorm (its kernel
    without the add) against model.RMSNorm on fresh random rows."""
    device = TRITON_DEVICE.type
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the Triton interpreter rounds float32 -> bf16 toward zero (GPUs round to "
                    "nearest): bf16 kernels are checked on the GPU")
    norm = model.RMSNorm(D, 1e-6, device, dtype)
    g = torch.Generator().manual_seed(D)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
    x, y = (torch.randn(3, 5, D, generator=g).to(device, dtype) for _ in range(2))
    h, out = kernels.add_rmsnorm(x, y, norm.weight, norm.eps)
    assert_close(h, x + y, 0.0, f"add_rmsnorm D={D} {dtype}: the sum")
    for got, ref, what in ((out, norm(x + y), "add_rmsnorm"),
                           (kernels.rmsnorm(x, norm.weight, norm.eps), norm(x), "rmsnorm")):
        # bf16: one rounding apart
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * ref.abs().max().item()
        assert got.shape == ref.shape and got.dtype == dtype
        assert_close(got, ref, tol, f"{what} D={D} {dtype}: the norm")


@pytest.mark.triton
def test_rmsnorm_reads_a_column_slice_in_place(monkeypatch):
    """kernels.rmsnorm on q_a's columns of a stacked [B, T, q_a + kv_a] output, as MLA's q_a norm
    gets them: equal, bit for bit, to the norm of a contiguous copy and close to model.RMSNorm's,
    and the launch reads the slice's own storage (no copy before it)."""
    device = TRITON_DEVICE.type
    g = torch.Generator().manual_seed(5)
    stacked = torch.randn(2, 10, 96 + 72, generator=g).to(device)
    x = stacked[..., :96]
    assert not x.is_contiguous()
    norm = model.RMSNorm(96, 1e-6, device, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
    got = kernels.rmsnorm(x, norm.weight, norm.eps)
    assert got.is_contiguous() and got.shape == x.shape
    assert torch.equal(got, kernels.rmsnorm(x.contiguous(), norm.weight, norm.eps)), \
        "rmsnorm: a column slice and its contiguous copy differ"
    assert_close(got, norm(x), 1e-5, "rmsnorm of a column slice vs model.RMSNorm")
    launched = first_args_launched(monkeypatch, kernels.elementwise, "_add_rmsnorm_kernel")
    kernels.rmsnorm(x, norm.weight, norm.eps)
    assert launched[0].data_ptr() == x.data_ptr(), "the column slice copied before the launch"


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_equals_twin(dtype):
    """SwiGLU's silu(gate) * up against model.MLP's plain line, on the two halves of one [N, 2I]
    output (as fused_proj gives them) and on separate tensors, at tiny and Kimi-K2 TP-8 widths."""
    device = TRITON_DEVICE.type
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the Triton interpreter rounds float32 -> bf16 toward zero (GPUs round to "
                    "nearest): bf16 kernels are checked on the GPU")
    g = torch.Generator().manual_seed(11)
    for I in (32, 256, 2304):   # tiny's shared expert, Kimi-K2's at TP 8, its dense MLP at TP 8
        gate_up = (2 * torch.randn(2, 3, 2 * I, generator=g)).to(device, dtype)
        for gate, up in (gate_up.chunk(2, -1),
                         (gate_up[..., :I].contiguous(), gate_up[..., I:].contiguous())):
            got, want = kernels.silu_mul(gate, up), F.silu(gate) * up
            # bf16: one rounding less
            tol = (1e-6 if dtype == torch.float32 else 2 ** -7) * want.abs().max().item()
            assert got.shape == want.shape and got.dtype == dtype
            assert_close(got, want, tol,
                         f"silu_mul I={I} {dtype} contiguous={gate.is_contiguous()}")


SENTINEL = 12345.0


def rows_before_sentinels(N, I):
    """A buffer of N * I elements and 64 sentinels after them, and its head as rows [N, I]."""
    buf = torch.full((N * I + 64,), SENTINEL, device=TRITON_DEVICE)
    return buf, buf[:N * I].view(N, I)


@pytest.mark.triton
@pytest.mark.parametrize("name", ["silu_mul", "add_rmsnorm"])
def test_row_kernels_write_nothing_past_their_rows(name):
    """The row kernels' tail masks: launched on outputs [N, I] that are the head of a buffer of
    sentinels, at I = 32 (one block, nothing masked) and 48 (a block of 64, 16 masked),
    silu_mul and add_rmsnorm (its sum and its norm) leave every sentinel as it was, and their rows
    equal the plain lines. Under the CPU interpreter the programs run in order, so a row's
    overrun is overwritten by the next row's results: the last row's shows, in the sentinels."""
    g = torch.Generator().manual_seed(3)
    for N, I in ((3, 32), (2, 48)):
        a, b = (torch.randn(N, I, generator=g).to(TRITON_DEVICE) for _ in range(2))
        bufs, outs = zip(*(rows_before_sentinels(N, I) for _ in range(2)))
        if name == "silu_mul":
            kernels.elementwise._silu_mul_kernel[(N, 1)](a, b, outs[0], I, I, I, I,
                                                         BLOCK=_pow2(I))
            wants = [F.silu(a) * b]
        else:
            norm = model.RMSNorm(I, 1e-6, TRITON_DEVICE, torch.float32)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.1 * torch.randn(I, generator=g))
            kernels.elementwise._launch_norm(a, b, norm.weight, outs[0], outs[1], norm.eps,
                                             add=True)
            wants = [a + b, norm(a + b)]
        for buf, out, want in zip(bufs, outs, wants):
            tail = buf[N * I:]
            assert torch.equal(tail, torch.full_like(tail, SENTINEL)), \
                f"{name} I={I}: wrote past its rows, at {(tail != SENTINEL).nonzero().tolist()}"
            assert_close(out, want, 1e-5, f"{name} I={I}")


NORM_GEMV_SHAPES = [(40, 64), (33, 100)]                       # (N, K): tiny, odd sizes


NORM_GEMV_KIMI = [(2112, 7168), (1536, 1536), (7168, 1024)]  # Kimi-K2 TP 8: q_a + kv_a, q_b, o_proj


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_gemv_kernel_equals_twin(dtype):
    """kernels.norm_gemv against its twin (model.RMSNorm and F.linear) on fresh random inputs: with
    the norm and without (a plain GEMV); 1, 2, 3, 4, 5 and 16 rows (the CPU interpreter: 1, 3, 4
    and 16, a power of 2 and not, below and at the row limit); x a strided view (a split of a
    wider output, as q_a is) and W a row-strided view (as the stacked q_a + kv_a weight is); K
    whole in a program (at 16 rows the default step is cut to 64 columns: two steps, the last
    one partial at K 100) and (steps of 16 columns) cut into slices whose partial sums the last
    program of a row block adds: one step a slice, and (8 rows of W a block, twice as many
    programs as blocks) two slices of several steps, the last one partial where K is no multiple
    of 16 (the CPU interpreter runs the plain GEMV in the last, two slices, alone: the norm's
    absence changes no block's path); and x's rows in groups of 2, a program a group (each
    group's sums of squares across two slices: the CPU interpreter runs that with the norm).
    Each block shape in the default form (bf16 from NORM_GEMV_DOT_MIN_ROWS rows: the tensor
    cores'), and each form forced, K whole, and the tensor cores' also in two slices (16 rows of
    W a block; the CPU interpreter: also in steps of 16 without the norm; float32 only, whose
    products there are ieee: its bf16 tl.dot is wrong); Kimi-K2's shapes (GPU) K whole only.
    float32 to 1e-5 relative; bf16 (GPU) to 1% of the largest output, since only the order of
    the float32 sums and a rounding of the normed row differ (the tensor cores' form rounds x *
    g to bf16 as the plain path rounds the normed row)."""
    device = TRITON_DEVICE.type
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the Triton interpreter rounds float32 -> bf16 toward zero (GPUs round to "
                    "nearest): bf16 kernels are checked on the GPU")
    g = torch.Generator().manual_seed(15)
    shapes = NORM_GEMV_SHAPES + (NORM_GEMV_KIMI if device == "cuda" else [])
    for N, K in shapes:
        norm = model.RMSNorm(K, 1e-6, device, dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(K, generator=g))
        # rows strided
        w = (torch.randn(N + 3, K + 8, generator=g) / K ** 0.5).to(device, dtype)[:N, :K]
        # (block_n, block_k, programs, group_rows, dot)
        whole, steps16 = (None, None, None, None, None), (None, 16, None, None, None)
        two_slices = (8, 16, 2 * ((N + 7) // 8), None, None)
        grouped, grouped_slices = (None, None, None, 2, None), two_slices[:3] + (2, None)
        cores, dot, dot_steps16 = whole[:4] + (False,), whole[:4] + (True,), steps16[:4] + (True,)
        dot_slices = (16, 16, 2 * ((N + 15) // 16), None, True)
        cases = list(itertools.product((norm, None), (whole, steps16, two_slices, grouped,
                                                      grouped_slices, cores, dot, dot_slices)))
        if K > 1000:  # Kimi-K2's shapes: the defaults and each form forced, K whole
            cases = list(itertools.product((norm, None), (whole, cores, dot)))
        cpu_cases = [(norm, whole), (norm, steps16), (norm, two_slices), (norm, grouped_slices),
                     (None, two_slices), (norm, dot), (norm, dot_slices), (None, dot_steps16)]
        for rows in (1, 2, 3, 4, 5, 16) if device == "cuda" else (1, 3, 4, 16):
            x = (2 * torch.randn(rows, K + 5, generator=g)).to(device, dtype)[:, :K]  # rows strided
            for nrm, blocks in cases if device == "cuda" else cpu_cases:
                block_n, block_k, programs, group_rows, dot = blocks
                out = kernels.norm_gemv(x, w, None if nrm is None else nrm.weight, 1e-6,
                                        block_n=block_n, block_k=block_k, programs=programs,
                                        group_rows=group_rows, dot=dot)
                ref = F.linear(x if nrm is None else nrm(x), w)
                what = (f"norm_gemv N={N} K={K} rows={rows} {dtype} norm={nrm is not None} "
                        f"blocks={blocks}")
                tol = (1e-5 if dtype == torch.float32 else 1e-2) * ref.abs().max().item()
                assert out.shape == ref.shape and out.dtype == dtype
                assert_close(out, ref, tol, what)
                assert not kernels._counters(x.device).any(), \
                    f"{what}: the last programs leave the counters 0"


@pytest.mark.triton
def test_norm_gemv_refuses_what_it_cannot_run():
    """kernels.norm_gemv refuses, naming the problem: more than 16 rows, groups of rows that are no
    power of 2, and the tensor cores' form forced on fp16."""
    device = TRITON_DEVICE.type
    with pytest.raises(ValueError, match="at most 16 rows"):
        kernels.norm_gemv(torch.zeros(17, 64, device=device), torch.zeros(8, 64, device=device))
    with pytest.raises(ValueError, match="group_rows 3: a power of 2"):
        kernels.norm_gemv(torch.zeros(5, 64, device=device), torch.zeros(8, 64, device=device),
                          group_rows=3)
    with pytest.raises(ValueError, match="tensor cores' form runs bf16 or float32"):
        kernels.norm_gemv(torch.zeros(5, 64, device=device, dtype=torch.float16),
                          torch.zeros(8, 64, device=device, dtype=torch.float16), dot=True)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_gemv_with_residual_equals_add_rmsnorm_and_linear(dtype):
    """kernels.norm_gemv with a residual (kernels.InputNormInQKVA's: a layer's input add and norm
    inside the stacked q_a + kv_a GEMV) against its twin, model.RMSNorm with the residual (the
    sum rounded to the dtype, then the norm) and F.linear, on fresh random inputs: 1 to 4 rows,
    x and the residual strided views [rows, 1, K]; K whole in a program, in steps of 16, and cut
    into two slices (each program of row block 0 stores its own part of the sum), and in two
    slices with x's rows in groups of 2 (each group's programs of row block 0 store its rows of
    the sum); the CUDA cores' form and the tensor cores' forced, K whole and (16 rows of W a
    block) in two slices; also without a norm (two slices). The sum equals x + residual bit for
    bit; the output float32 to 1e-5 relative, bf16 (GPU) to 1% of the largest output (the CUDA
    cores' form does not round the normed row, the tensor cores' rounds x * g to bf16). Refused: a
    residual of another shape or dtype."""
    device = TRITON_DEVICE.type
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the Triton interpreter rounds float32 -> bf16 toward zero (GPUs round to "
                    "nearest): bf16 kernels are checked on the GPU")
    g = torch.Generator().manual_seed(25)
    for N, K in NORM_GEMV_SHAPES + (NORM_GEMV_KIMI[:1] if device == "cuda" else []):
        norm = model.RMSNorm(K, 1e-6, device, dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(K, generator=g))
        # rows strided
        w = (torch.randn(N + 3, K + 8, generator=g) / K ** 0.5).to(device, dtype)[:N, :K]
        two_slices = {"block_n": 8, "block_k": 16, "programs": 2 * ((N + 7) // 8)}
        dot_slices = {"block_n": 16, "block_k": 16, "programs": 2 * ((N + 15) // 16), "dot": True}
        blocks = ({}, {"block_k": 16}, {**two_slices, "group_rows": 2}, {"dot": False},
                  {"dot": True}, dot_slices, two_slices)
        for rows in (1, 2, 3, 4):
            x, r = ((2 * torch.randn(rows, 1, K + 5, generator=g)).to(device, dtype)[..., :K]
                    for _ in range(2))
            h, want_sum = norm(x, r)
            for nrm, block in [(norm, block) for block in blocks] + [(None, blocks[-1])]:
                out, summed = kernels.norm_gemv(x, w, None if nrm is None else nrm.weight, 1e-6,
                                                residual=r, **block)
                ref = F.linear(want_sum if nrm is None else h, w)
                what = (f"norm_gemv + residual N={N} K={K} rows={rows} {dtype} "
                        f"norm={nrm is not None} {block}")
                assert summed.shape == x.shape and torch.equal(summed, want_sum), f"{what}: the sum"
                assert out.shape == ref.shape and out.dtype == dtype
                assert_close(out, ref, (1e-5 if dtype == torch.float32
                                        else 1e-2) * ref.abs().max().item(), what)
                assert not kernels._counters(x.device).any(), \
                    f"{what}: the last programs leave the counters 0"
    x = torch.zeros(2, 64, device=device, dtype=dtype)
    for bad in (torch.zeros(1, 64, device=device, dtype=dtype),
                torch.zeros(2, 64, device=device, dtype=torch.float16)):
        with pytest.raises(ValueError, match="residual .* is not of x's shape and dtype"):
            kernels.norm_gemv(x, torch.zeros(8, 64, device=device, dtype=dtype), residual=bad)


def test_prefetch_bytes(monkeypatch):
    """common.prefetch_bytes: PREFETCH_ROW_BYTES at most the row's bytes, a power of 2 (the
    sectors' tl.arange) from one 32-byte sector; none where PDL cannot run (PREFETCH), for a
    strided row, or at 0; pdl_off (a profile) keeps them."""
    monkeypatch.setattr(kernels.common, "PREFETCH", True)
    monkeypatch.setattr(kernels.common, "PREFETCH_ROW_BYTES", 1024)
    got = [kernels.common.prefetch_bytes(b) for b in (14336, 1024, 1000, 512, 100, 31)]
    assert got == [1024, 1024, 512, 512, 64, 0]
    assert kernels.common.prefetch_bytes(14336, contiguous=False) == 0
    monkeypatch.setattr(kernels.common, "PREFETCH_ROW_BYTES", 0)
    assert kernels.common.prefetch_bytes(14336) == 0
    monkeypatch.setattr(kernels.common, "PREFETCH_ROW_BYTES", 1024)
    with kernels.common.pdl_off():
        assert kernels.common.prefetch_bytes(14336) == 1024 and not kernels.common.PDL
    monkeypatch.setattr(kernels.common, "PREFETCH", False)
    assert kernels.common.prefetch_bytes(14336) == 0


@pytest.mark.gpu
@pytest.mark.triton
def test_gpu_prefetch_changes_no_result(monkeypatch):
    """The L2 prefetch before the wait (common._prefetch_rows) is a hint: norm_gemv in each form,
    head_gemv (W's rows contiguous, and its columns: W_uk^T), the router's logits kernels, MLA's
    decode kernel (the cache's slots; its caches written alike each time) and the merge in W_uv's
    launch at Kimi-K2 TP-8 shapes give the same bits with it off, at the default and at 8192
    bytes a row (each launch caps it at its slice of a row)."""
    if not (torch.cuda.is_available() and kernels.common.PDL):
        pytest.skip("the prefetch runs only under programmatic dependent launch (CUDA, sm_90+)")
    g = torch.Generator().manual_seed(31)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16, 7168, generator=g).to(**bf16)
    w, nw = (torch.randn(2112, 7168, generator=g) / 85).to(**bf16), torch.ones(7168, **bf16)
    q, w_uv = (torch.randn(s, generator=g).to(**bf16) for s in ((3, 8, 512), (8, 128, 512)))
    q_nope, w_uk = torch.randn(3, 8, 128, generator=g).to(**bf16), w_uv.transpose(1, 2)
    rw, bias = (torch.randn(384, 7168, generator=g) / 85).to(**bf16), torch.zeros(384).cuda()
    mla = {T: mla_inputs(1, T, 8, 512, 64, 320, torch.bfloat16, "cuda", seed=T) for T in (1, 3)}

    def outputs():
        outs = [kernels.norm_gemv(x[:rows], w, nw, 1e-6, dot=dot)
                for rows, dot in ((1, False), (3, False), (5, True), (16, True))]
        outs += [kernels.head_gemv(q, w_uv), kernels.head_gemv(q_nope, w_uk)]
        for rows in (3, 16):  # the chunks' logits kernel and the tensor cores'
            outs += kernels.router.router_topk(x[:rows], rw, bias, 8, 1, 1, True, 2.827)
        for T in (1, 3):
            inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in mla[T].items()}
            outs.append(kernels.mla_decode_attention(**inputs, softmax_scale=0.07))
            outs += [inputs["kv_cache"], inputs["pe_cache"]]
            unmerged = kernels.mla_decode_attention(**mla[T], softmax_scale=0.07, merge=False)
            outs.append(kernels.mla_merge_absorb(unmerged, mla[T]["positions"], w_uv))
        return outs

    monkeypatch.setattr(kernels.common, "PREFETCH_ROW_BYTES", 0)
    plain = outputs()
    for row_bytes in (1024, 8192):
        monkeypatch.setattr(kernels.common, "PREFETCH_ROW_BYTES", row_bytes)
        for a, b in zip(outputs(), plain):
            assert torch.equal(a, b), f"prefetch of {row_bytes} bytes a row changed a result"


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_gemv_kernel_equals_twin(dtype):
    """kernels.head_gemv against model.MLA's absorbed products (absorb_query, absorb_output), on
    views of one kv_b_proj weight as the model takes them (W_uk transposed: its K strided; W_uv:
    row-strided), the query a strided split of q: 1 to 4 and 16 rows, tiny (at 16 rows W_uv's K of
    100 takes two steps, the last partial) and (GPU) Kimi-K2 TP-8 heads; at 3 and 16 rows also in
    groups of 2 rows, a program a group."""
    device = TRITON_DEVICE.type
    g = torch.Generator().manual_seed(16)
    for H, d, R, C in [(4, 16, 8, 100)] + ([(8, 128, 64, 512)] if device == "cuda" else []):
        kv_b = (torch.randn(H, 2 * d, C, generator=g) / C ** 0.5).to(device, dtype)
        w_uk, w_uv = kv_b.split([d, d], 1)                                     # [H, d, C]
        for B, T in ((1, 1), (1, 2), (1, 3), (1, 4), (4, 4)):
            q_nope = torch.randn(B, T, H, d + R, generator=g).to(device, dtype)[..., :d]
            ref = model.MLA.absorb_query(None, q_nope, w_uk)
            want = model.MLA.absorb_output(None, ref, w_uv)
            for group_rows in (None, 2) if B * T in (3, 16) else (None,):
                what = f"H={H} B={B} T={T} {dtype} group_rows={group_rows}"
                q_lat = kernels.head_gemv(q_nope, w_uk.transpose(1, 2), group_rows=group_rows)
                tol = (1e-5 if dtype == torch.float32 else 1e-2) * ref.abs().max().item()
                assert_close(q_lat, ref, tol, f"head_gemv W_uk {what}")
                o = kernels.head_gemv(ref, w_uv, group_rows=group_rows)
                assert o.is_contiguous() and o.shape == want.shape
                assert_close(o, want,
                             (1e-5 if dtype == torch.float32 else 1e-2) * want.abs().max().item(),
                             f"head_gemv W_uv {what}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_bmm_equals_absorb_output_row_major(dtype, device):
    """kernels.gemv.head_bmm (NormGemvMLA's W_uv past HEAD_GEMV_MAX_ROWS) against
    model.MLA.absorb_output's einsum on fresh inputs, W_uv the row-strided view of kv_b_proj's
    weight the model takes: equal (on the GPU to cuBLAS's rounding), and its output row-major, so
    o_proj's flatten is a view. On the GPU the product is one GEMM launch, no copy after it.
    Plain torch, no Triton: the CPU case runs anywhere, the CUDA one is marked gpu."""
    g = torch.Generator().manual_seed(17)
    H, d, C = (8, 128, 512) if device == "cuda" else (4, 16, 100)
    kv_b = (torch.randn(H, 2 * d, C, generator=g) / C ** 0.5).to(device, dtype)
    w_uv = kv_b.split([d, d], 1)[1]                                            # [H, d, C]
    for B, T in ((1, 17), (4, 8), (3, 32)):
        o_lat = torch.randn(B, T, H, C, generator=g).to(device, dtype)
        want = model.MLA.absorb_output(None, o_lat, w_uv)
        got = kernels.gemv.head_bmm(o_lat, w_uv)
        what = f"head_bmm B={B} T={T} {dtype}"
        assert got.is_contiguous() and got.shape == want.shape, f"{what}: {got.stride()}"
        if device == "cpu":
            assert torch.equal(got, want), f"{what}: differs from the einsum"
        else:
            tol = (1e-5 if dtype == torch.float32 else 1e-2) * want.abs().max().item()
            assert_close(got, want, tol, what)
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            kernels.gemv.head_bmm(o_lat, w_uv).flatten(2)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        assert names and not any("copy" in n.lower() or "elementwise" in n.lower()
                                 for n in names), f"head_bmm launched {names}"


def _norm_gemv_launches(rows, mode, others):
    """test_norm_gemv_in_model_equals_plain's (norm_gemv, head_gemv, mla_merge_absorb, combine)
    launches a layer at `rows` rows in attention mode `mode`, with the swaps `others` beside
    norm_gemv."""
    n = ((rows <= kernels.Q_B_GEMV_MAX_ROWS) + (rows <= kernels.O_PROJ_GEMV_MAX_ROWS)
         + ("fused_proj" in others and rows <= kernels.QKVA_GEMV_MAX_ROWS))
    few, attention = rows <= kernels.HEAD_GEMV_MAX_ROWS, mode == "decode" and "attention" in others
    merged = attention and rows <= kernels.MLA_MERGE_ABSORB_MAX_ROWS
    return n, (mode == "decode") * (2 - merged) * few, merged, attention * (not merged)


def _add_norm_launches(rows, others, L):
    """add_rmsnorm launches a forward of L layers: after each attention, in front of each attention
    but the first layer's (no residual yet) unless q_a + kv_a's GEMV does the add
    (InputNormInQKVA), and the final norm."""
    in_qkva = ({"add_rmsnorm", "fused_proj"} <= set(others)
               and rows <= kernels.INPUT_NORM_QKVA_MAX_ROWS)
    return ("add_rmsnorm" in others) * (L + (0 if in_qkva else L - 1) + 1)


@pytest.mark.triton
@pytest.mark.parametrize("others", [(), ("add_rmsnorm", "fused_proj"), ("attention",)])
def test_norm_gemv_in_model_equals_plain(monkeypatch, others):
    """kernels "norm_gemv" (alone, with the fused residual adds and stacked q_a + kv_a, and with
    the attention kernel) against the plain tiny model, float32, 2 layers: the 36-row prefill
    runs the plain path; steps of 9 and 6 rows run the absorbed products as head_gemv kernels
    (decode mode, up to HEAD_GEMV_MAX_ROWS, in groups of rows), q_b_proj's GEMV kernel
    (q_a_layernorm inside, up to Q_B_GEMV_MAX_ROWS) once a layer and, with fused_proj, the
    stacked q_a + kv_a (QKVA_GEMV_MAX_ROWS), o_proj plain; steps of 1 and 2 rows also o_proj (up
    to O_PROJ_GEMV_MAX_ROWS) as a GEMV kernel, and a step of 3 rows not. With the attention
    kernel, decode mode at one row (MLA_MERGE_ABSORB_MAX_ROWS) merges the attention's parts in
    W_uv's launch (mla_merge_absorb, no combine launch: W_uk's head_gemv alone), and at more
    rows in the combine launch; both modes. (On the CPU, with the attention kernel, the prefill
    runs extend mode in both, as generate prefills: the decode kernel over 12 tokens a row is
    the interpreter's slowest part and no norm_gemv launch.)"""
    device = TRITON_DEVICE.type
    args = tiny(num_hidden_layers=2)
    plain = init_random(Transformer(args, 3, 64, device=device, dtype=torch.float32), 0)
    fast = init_random(Transformer(args, 3, 64, device=device, dtype=torch.float32), 0)
    kernels.accelerate(fast, ("norm_gemv",) + others)
    calls, heads = [], []
    monkeypatch.setattr(kernels.launch, "norm_gemv",
                        lambda *a, **k: calls.append(a[0].shape) or kernels.norm_gemv(*a, **k))
    monkeypatch.setattr(kernels.launch, "head_gemv",
                        lambda *a, **k: heads.append(a[0].shape) or kernels.head_gemv(*a, **k))
    merges, combines, combine = [], [], kernels.mla_combine
    monkeypatch.setattr(kernels.launch, "mla_merge_absorb",
                        lambda *a, **k: merges.append(a[0].partial.shape)
                        or kernels.mla_merge_absorb(*a, **k))
    monkeypatch.setattr(kernels.mla, "mla_combine", lambda *a: combines.append(a[0].partial.shape)
                        or combine(*a))
    adds = []
    monkeypatch.setattr(kernels.launch, "add_rmsnorm", lambda *a: adds.append(1)
                        or kernels.add_rmsnorm(*a))
    prefill, prefill_pos, step, step_pos = (t.to(device) for t in step_inputs(256, seed=4))
    one, one_pos = step[:1, :1], torch.tensor([[15]], device=device)    # row 0's next token alone
    L = args.num_hidden_layers
    for mode in ("extend", "decode"):
        pre = mode if device == "cuda" or "attention" not in others else "extend"
        assert_close(fast(prefill, prefill_pos, pre).logits,
                     plain(prefill, prefill_pos, pre).logits, 1e-4,
                     f"norm_gemv {others} prefill, {pre}")
        assert not calls and not heads and not merges, \
            "the prefill's 36 rows must take the plain path"
        assert len(adds) == _add_norm_launches(36, others, L), \
            "the prefill's 36 rows: add_rmsnorm in front of each attention"
        combines.clear(), adds.clear()             # (decode mode's prefill merges in the combine)
        for tokens, pos in ((step, step_pos), (step[:2], step_pos[:2]), (one, one_pos),
                            (step[:2, :1], step_pos[:2, :1]), (step[:1], step_pos[:1])):
            what = f"norm_gemv {others} {tokens.numel()}-row step, {mode}"
            counts = _norm_gemv_launches(tokens.numel(), mode, others)
            assert_close(fast(tokens, pos, mode).logits, plain(tokens, pos, mode).logits, 1e-4,
                         what)
            got = len(calls), len(heads), len(merges), len(combines)
            assert got == tuple(c * L for c in counts), (
                f"{what}: (norm_gemv, head_gemv, mla_merge_absorb, combine) launches {got}, "
                f"not {counts} a layer")
            assert len(adds) == _add_norm_launches(tokens.numel(), others, L), \
                f"{what}: {len(adds)} add_rmsnorm launches"
            calls.clear(), heads.clear(), merges.clear(), combines.clear(), adds.clear()


def kernel_models(device, dtype, B=3, max_seq_len=64, layers=8):
    """The tiny model twice (same seed): all kernels off (the gather MoE), all on (the fused
    MoE)."""
    args = tiny(num_hidden_layers=layers)
    plain = init_random(Transformer(args, B, max_seq_len, device=device, dtype=dtype), 0)
    fast = init_random(Transformer(args, B, max_seq_len, device=device, dtype=dtype), 0)
    kernels.accelerate(fast, "all", moe="fused")
    return plain, fast


@pytest.mark.triton
def test_model_with_kernels_equals_plain():
    """The swapped tiny model (every kernel, the fused MoE) against the plain one, end to end
    (2 layers on a CPU, one dense and one MoE: the interpreter runs each program in turn), float32,
    on the same weights (accelerate keeps the state dict's keys and values): in each attention mode
    a 12-token prefill, a 3-token step at each row's own position, then a token of two rows and of
    one row (the GEMV kernels' row limits: 1, 2, 4, 8); logits and the EAGLE-3 aux states. On the
    CPU the prefill runs once, in extend mode (as generate prefills; the decode kernel over a
    9-token extend is test_each_swap_equals_the_module_it_replaces[attention (MLA)]'s), before both
    modes' steps (each step rewrites the slots it reads past the prefill's)."""
    device = TRITON_DEVICE.type
    plain, fast = kernel_models(device, torch.float32, layers=8 if device == "cuda" else 2)
    assert fast.kernels == kernels.KERNELS and not hasattr(plain, "kernels")
    assert_same_state(fast, plain)
    prefill, prefill_pos, step, step_pos = (t.to(device) for t in step_inputs(256, seed=9))
    one, one_pos = step[:1, :1], torch.tensor([[15]], device=device)    # row 0's next token alone
    calls = []
    for mode in ("decode", "extend"):
        if device == "cuda" or not calls:
            calls.append((mode if device == "cuda" else "extend", prefill, prefill_pos, "prefill"))
        calls += [(mode, step, step_pos, "step"),
                  (mode, step[:2, :1], step_pos[:2, :1], "2-row step"),
                  (mode, one, one_pos, "1-row step")]
    for mode, tokens, pos, what in calls:
        want, got = plain(tokens, pos, mode, capture_aux=True), fast(tokens, pos, mode,
                                                                     capture_aux=True)
        assert_close(got.logits, want.logits, 1e-4,
                     f"kernels on vs off, {what}, {mode} attention: logits")
        assert_close(got.aux, want.aux, 1e-4,
                     f"kernels on vs off, {what}, {mode} attention: aux states")
    with pytest.raises(ValueError, match="unknown kernels"):
        kernels.accelerate(plain, ["attention", "flash"])
    with pytest.raises(ValueError, match="accelerated already"):
        kernels.accelerate(fast, "all")


def randomized(module, seed):
    """module with every floating parameter drawn at random (norm weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            w = torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 10)
            p.copy_(w + (1 if name.endswith("norm.weight") or p.dim() == 1 else 0))
    return module


def mla_calls(args, device):
    """MLA inputs: a 9-token extend over an empty cache, then 3 tokens at each row's own position
    (row 1 two behind row 0: it rewrites two of its slots, as after a rejected draft), then one
    token of both rows (2 rows) and one of row 0 alone (1 row: a decode step's GEMV paths)."""
    g = torch.Generator().manual_seed(31)
    rope = torch.stack(model.rope_tables(args.qk_rope_head_dim, 10000.0, None, 32, device), -1)
    calls = []
    for B, start, T, behind in ((2, 0, 9, 0), (2, 9, 3, 2), (2, 12, 1, 2), (1, 13, 1, 0)):
        x = torch.randn(B, T, args.hidden_size, generator=g).to(device)
        pos = (start + torch.arange(T) - torch.tensor([0, behind])[:B, None]).to(device)
        future = torch.arange(16, device=device) > pos.unsqueeze(-1)
        calls.append((x, pos, rope[pos], future))
    return calls


def swap_class(swaps):
    """The class kernels.swap makes of a plain module given `swaps`: the one swap, or the class
    COMBINED declares for several."""
    return swaps[0] if len(swaps) == 1 else kernels.swaps.COMBINED[frozenset(swaps)]


# The MLA module's swaps (kernels.SWAPS' rows on the "attention" slot): class -> name
MLA_SWAPS = {row.cls: row.name for row in kernels.SWAPS if row.slot == "attention"}


def mla_cases():
    """A case of each MLA swap alone and of each set of them that COMBINED declares a class for:
    name: (None, the swap classes); the names as KERNELS orders them, then " (MLA)"."""
    sets = [frozenset([cls]) for cls in MLA_SWAPS]
    sets += [parts for parts in kernels.swaps.COMBINED if parts <= set(MLA_SWAPS)]
    cases = {}
    for parts in sets:
        swaps = tuple(sorted(parts, key=lambda cls: kernels.KERNELS.index(MLA_SWAPS[cls])))
        cases[" + ".join(MLA_SWAPS[cls] for cls in swaps) + " (MLA)"] = (None, swaps)
    return cases


def plain_mlp(a, d):
    return model.MLP(a.hidden_size, 96, TP(), "x", device=d)


# name: (the plain module's maker(args, device), or None for model.MLA; the swap classes). The
# norms, the MLP (with COMBINED's class for its two swaps), o_proj, and mla_cases()
SWAP_CASES = {
    "add_rmsnorm": (lambda a, d: model.RMSNorm(a.hidden_size, 1e-6, d), (kernels.AddRMSNorm,)),
    "silu_mul": (plain_mlp, (kernels.SiluMulKernel,)),
    "fused_proj (MLP)": (plain_mlp, (kernels.StackedGateUp,)),
    "fused_proj + silu_mul (MLP)": (plain_mlp, (kernels.StackedGateUp, kernels.SiluMulKernel)),
    "norm_gemv (o_proj)": (lambda a, d: tp.RowParallelLinear(64, a.hidden_size,
                                                             TP(), "x", device=d),
                           (kernels.GemvRowParallel,)),
    **mla_cases(),
}


def check_mla_swap(name, plain, fast, args, device):
    """An MLA swap against model.MLA in both attention modes (each also against extend mode) at
    mla_calls' row counts: its outputs and the caches it writes."""
    for mode in ("extend", "decode"):
        for call in mla_calls(args, device):
            want, got = plain(*call, mode), fast(*call, mode)
            assert_close(got, want, 1e-5 * want.abs().max().item(),
                         f"{name} swap vs MLA, {mode}")
            extend = plain(*call, "extend")  # the same cache writes again, then the other path
            assert_close(got, extend, 1e-5 * extend.abs().max().item(),
                         f"{name} swap, {mode}, vs MLA, extend")
        # the projections' kernels (norm_gemv, fused_proj) sum the latents in another order:
        # relative, as the outputs; the others write what plain code computes: 1e-6
        reordered = "norm_gemv" in name or "fused_proj" in name
        for cache, what in (("kv_cache", "latent cache"), ("pe_cache", "rope cache")):
            want = getattr(plain, cache)
            tol = 1e-5 * want.abs().max().item() if reordered else 1e-6
            assert_close(getattr(fast, cache), want, tol, f"{name} swap vs MLA, {mode}: {what}")


@pytest.mark.triton
@pytest.mark.parametrize("name", list(SWAP_CASES))
def test_each_swap_equals_the_module_it_replaces(name):
    """Each case of SWAP_CASES (a swap of kernels.SWAPS, or several in the class COMBINED declares
    for them) on the RMSNorm, the MLP, o_proj or MLA: the module kernels.swap makes is of that
    class and equals the module it replaces, on the same weights (the swap keeps the state dict)
    and fresh random inputs, float32: 1, 4 and 20 rows (o_proj's GEMV up to O_PROJ_GEMV_MAX_ROWS,
    the plain GEMM past it); MLA in both attention modes (each also against extend mode) at
    mla_calls' 18, 6, 2 and 1 rows, on both sides of its GEMVs' limits (Q_B_GEMV_MAX_ROWS,
    HEAD_GEMV_MAX_ROWS, QKVA_GEMV_MAX_ROWS with fused_proj, and W_uv's merge in the attention
    launch, MLA_MERGE_ABSORB_MAX_ROWS), its outputs and the caches it writes. The swap classes
    that no case builds: SWAPS_TESTED_ELSEWHERE (test_every_swap_class_is_tested)."""
    device = TRITON_DEVICE.type
    args = tiny()
    make, swaps = SWAP_CASES[name]
    if make is None:
        make = lambda a, d: model.MLA(a, TP(), 2, 16, d, torch.float32)   # noqa: E731
    plain = randomized(make(args, device), seed=len(name))
    fast = kernels.swap(make(args, device), *swaps)       # swapped, then loaded by the plain names
    assert type(fast) is swap_class(swaps), f"{name}: kernels.swap made a {type(fast).__name__}"
    fast.load_state_dict(plain.state_dict())
    assert_same_state(fast, plain)
    g = torch.Generator().manual_seed(7 + len(name))
    if isinstance(plain, model.MLA):
        check_mla_swap(name, plain, fast, args, device)
        return
    width = (plain.gate_proj if isinstance(plain, model.MLP) else plain).weight.shape[-1]
    for n in (1, 4, 20):
        x = torch.randn(n, width, generator=g).to(device)
        if isinstance(plain, model.RMSNorm):
            r = torch.randn(n, x.shape[-1], generator=g).to(device)
            (want, want_sum), (got, got_sum) = plain(x, r), fast(x, r)
            assert_close(got_sum, want_sum, 0.0, f"{name}: the residual sum")
            # without a residual the swap runs the norm alone in the same kernel (kernels.rmsnorm)
            assert_close(fast(x), plain(x), 1e-5 * plain(x).abs().max().item(),
                         f"{name} without a residual")
        else:
            want, got = plain(x), fast(x)
        assert_close(got, want, 1e-5 * want.abs().max().item(),
                     f"{name} swap vs its module, {n} rows")
    # the shared expert's down GEMM onto the routed output
    if isinstance(fast, kernels.StackedGateUp):
        shared = kernels.swap(make(args, device), *swaps)
        shared.load_state_dict(plain.state_dict())
        shared.down_proj.reduce = False
        for n in (1, 4):
            routed = torch.randn(n, args.hidden_size, generator=g).to(device)
            want = routed + plain(x[:n])
            assert_close(shared(x[:n], add_to=routed.clone()), want, 1e-5 * want.abs().max().item(),
                         f"{name}: add_to, {n} rows")


@pytest.mark.triton
def test_input_norm_in_qkva_block_equals_the_plain_block(monkeypatch):
    """kernels.InputNormInQKVA (accelerate_layer's with "norm_gemv", "fused_proj" and "add_rmsnorm":
    the input add and norm inside q_a + kv_a's GEMV) against the plain model.Block on the same
    weights and fresh random inputs, float32, in both attention modes: a 9-token extend of 2 rows
    (18 rows: model.Block, an add_rmsnorm launch in front of the attention), then 4, 2 (no residual,
    as after an EAGLE-3 state: the norm alone inside the GEMV), 3 and 1 rows (one add_rmsnorm
    launch, after the attention); both outputs (the MLP's, the stream after the attention) and the
    caches written. The swap's limit, INPUT_NORM_QKVA_MAX_ROWS (one row), is raised here to the
    stacked GEMV's, QKVA_GEMV_MAX_ROWS, so that its kernel runs at several rows too. This swap is no
    module's own (the test of each swap takes one module's inputs): a layer's, so tested here."""
    monkeypatch.setattr(kernels.gemv, "INPUT_NORM_QKVA_MAX_ROWS", kernels.QKVA_GEMV_MAX_ROWS)
    device = TRITON_DEVICE
    args = tiny()
    plain = randomized(model.Block(0, args, TP(), 2, 16, device, torch.float32), seed=25)
    fast = model.Block(0, args, TP(), 2, 16, device, torch.float32)
    kernels.accelerate_layer(fast, {"norm_gemv", "fused_proj", "add_rmsnorm"}, "gather")
    assert isinstance(fast, kernels.InputNormInQKVA)
    fast.load_state_dict(plain.state_dict())
    assert_same_state(fast, plain)
    adds = []
    monkeypatch.setattr(kernels.launch, "add_rmsnorm", lambda *a: adds.append(1)
                        or kernels.add_rmsnorm(*a))
    g = torch.Generator().manual_seed(26)
    rope = torch.stack(model.rope_tables(args.qk_rope_head_dim, 10000.0, None, 16, device), -1)
    for mode in ("extend", "decode"):
        for B, start, T, with_residual in ((2, 0, 9, True), (2, 9, 2, True), (2, 11, 1, False),
                                           (1, 12, 3, True),
                                           (1, 15, 1, True)):
            x, r = (torch.randn(B, T, args.hidden_size, generator=g).to(device) for _ in range(2))
            r = r if with_residual else None
            pos = (start + torch.arange(T)).expand(B, T).contiguous().to(device)
            call = (pos, rope[pos], torch.arange(16, device=device) > pos.unsqueeze(-1), mode)
            (want, want_res), (got, got_res) = plain(x, r, *call), fast(x, r, *call)
            what = f"InputNormInQKVA, {B * T} rows, {mode}, residual {with_residual}"
            assert_close(got, want, 1e-5 * want.abs().max().item(), what + ": the MLP's output")
            assert_close(got_res, want_res, 1e-5 * want_res.abs().max().item(),
                         what + ": the stream")
            in_qkva = B * T <= kernels.gemv.INPUT_NORM_QKVA_MAX_ROWS
            assert len(adds) == 1 + (with_residual
                                     and not in_qkva), f"{what}: {len(adds)} add_rmsnorm launches"
            adds.clear()
        for cache in ("kv_cache", "pe_cache"):
            want = getattr(plain.self_attn, cache)
            assert_close(getattr(fast.self_attn, cache), want, 1e-5 * want.abs().max().item(),
                         f"InputNormInQKVA, {mode}: {cache}")


def test_model_py_knows_nothing_of_the_fast_path():
    """model.py imports neither kernels/ nor Triton (a fresh interpreter: what importing model
    loads), and holds no switch of the fast path; kernels/ imports model.py."""
    code = ("import sys, model; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('kernels', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", f"importing model.py loaded {out.stdout.strip()}"
    with open(os.path.join(HERE, "model.py")) as f:
        source = f.read()
    for word in ("import kernels", "triton", "use_kernels", "_impl", "forward_fused", "fused_proj",
                 r"\bscope\(",
                 "def _apply", "MAX_TOKENS", "MAX_ROWS"):
        assert not re.search(word, source), f"model.py mentions {word!r}"
    assert "import model" in open(os.path.join(HERE, "kernels", "swaps.py")).read()


@pytest.mark.triton
@pytest.mark.parametrize("shape", list(ROUTER_SHAPES))
def test_router_kernel_uniform_routing_equals_twin(shape):
    """SIMULATED uniform routing inside the select kernel (no kernel of its own): the experts of
    model.Router's torch path (pair j of the N*K to expert j mod E, wrapping past E pairs) and their
    scores, normalized and scaled, as its weights."""
    device = TRITON_DEVICE.type
    args = tiny(**ROUTER_SHAPES[shape])
    router, fast = random_routers(args, device, torch.float32, seed=len(shape) + 1,
                                  routing="uniform")
    g = torch.Generator().manual_seed(200 + len(shape))
    # 5 x 4 = 20 pairs wrap past tiny's 16 experts
    for n in (1, 5, 37, 60) if device == "cuda" else (1, 5, 37):
        x = torch.randn(n, args.hidden_size, generator=g).to(device)
        # True: expert E, weight 1, in a column more (shared expert launch)
        for shared_slot in (False, True):
            ids, w = router(x)
            if shared_slot:
                ids, w = kernels.with_shared_slot(ids, w, args.n_routed_experts)
            got_ids, got_w = fast(x, shared_slot)
            what = f"uniform router kernel {shape} N={n} shared slot {shared_slot}"
            assert torch.equal(got_ids, ids), f"{what}: ids differ\n{got_ids}\n{ids}"
            assert_close(got_w, w, 1e-6, f"{what}: weights")


@pytest.mark.triton
@pytest.mark.parametrize("shape", list(ROUTER_SHAPES))
def test_router_kernel_with_a_choice_equals_twin(shape):
    """A choice made outside the router (routing "distinct" or "trace": model.Router's `choice`,
    ids [N, K] -> ids [N, K]): the chosen ids, each column weighed as the router's own pick in
    that column, as model.Router keeps them. Each call draws K distinct random experts a token,
    the same for both routers; the identity choice (a trace without ids for the call returns the
    router's own) keeps the router's ids and weights."""
    device = TRITON_DEVICE.type
    args = tiny(**ROUTER_SHAPES[shape])
    E, K = args.n_routed_experts, args.num_experts_per_tok
    router, fast = random_routers(args, device, torch.float32, seed=len(shape) + 2)
    g = torch.Generator().manual_seed(300 + len(shape))
    for n in (1, 5, 20, 37) if device == "cuda" else (1, 5, 37):
        x = torch.randn(n, args.hidden_size, generator=g).to(device)
        picked = torch.rand(n, E, generator=g).argsort(1)[:, :K].to(device)
        for name, choice in (("random", lambda ids, p=picked: p), ("identity", lambda ids: ids)):
            for m in (router, fast):
                m.routing, m.choice = "distinct", choice
            ids, w = router(x)
            if name == "random":
                assert torch.equal(ids, picked), "model.Router does not take the choice"
            for shared_slot in (False, True):
                want_ids, want_w = ((ids, w) if not shared_slot
                                    else kernels.with_shared_slot(ids, w, E))
                got_ids, got_w = fast(x, shared_slot)
                what = f"router kernel, {name} choice, {shape} N={n} shared slot {shared_slot}"
                assert torch.equal(got_ids, want_ids), f"{what}: ids differ\n{got_ids}\n{ids}"
                assert_close(got_w, want_w, 1e-6, f"{what}: weights")


@pytest.mark.triton
def test_add_rmsnorm_across_layers_equals_plain_with_exact_aux_states(monkeypatch):
    """kernels="add_rmsnorm": every residual add fused into the norm that reads it (the MLP output
    carried into the next layer's input norm, the last one into the final norm). Logits and the
    EAGLE-3 aux states (whole layer outputs, x + mlp, among them the second-to-last layer's) equal
    the plain model's, in both attention modes. The kernel runs 2 a layer with or without the
    capture (none in the first layer's input norm, one in the final norm; a captured layer's output
    is added for EAGLE-3 beside the pair the next norm adds), and the norm alone (kernels.rmsnorm)
    where there is no residual: the first layer's input norm, and every layer's MLA norms of q_a
    and of the new latents (2 a layer)."""
    calls, alone = [], []
    monkeypatch.setattr(kernels.launch, "add_rmsnorm", lambda *a: calls.append(1)
                        or kernels.add_rmsnorm(*a))
    monkeypatch.setattr(kernels.launch, "rmsnorm", lambda *a: alone.append(1)
                        or kernels.rmsnorm(*a))
    device = TRITON_DEVICE.type
    args = tiny(num_hidden_layers=4 if device == "cpu" else 8)
    aux_ids = [0, 1, args.num_hidden_layers - 2]
    plain = init_random(Transformer(args, 3, 32, device=device, dtype=torch.float32,
                                    aux_layer_ids=aux_ids), 3)
    fused = init_random(Transformer(args, 3, 32, device=device, dtype=torch.float32,
                                    aux_layer_ids=aux_ids), 3)
    assert kernels.accelerate(fused, "add_rmsnorm") == ("add_rmsnorm",)
    prefill, prefill_pos, step, step_pos = (t.to(device) for t in step_inputs(256, seed=4))
    for tokens, pos, mode in ((prefill, prefill_pos, "extend"), (step, step_pos, "decode"),
                              (step, step_pos, "extend")):
        for capture_aux in (True, False):
            want, got = plain(tokens, pos, mode, capture_aux), fused(tokens, pos, mode, capture_aux)
            what = f"add_rmsnorm across layers, {mode}, T={tokens.shape[1]}, aux {capture_aux}"
            L = args.num_hidden_layers
            assert (len(calls), len(alone)) == (2 * L, 1 + 2 * L), what
            calls.clear(), alone.clear()
            assert_close(got.logits, want.logits, 1e-4, what + ": logits")
            if capture_aux:
                assert_close(got.aux, want.aux, 1e-5 * want.aux.abs().max().item(),
                             what + ": aux states")


def fused_proj_target(path, **kw):
    target = load_target(path, 3, 32, **kw)
    assert kernels.accelerate(target, "fused_proj") == ("fused_proj",)
    return target


def test_fused_proj_equals_plain_on_one_copy_of_the_weights(tiny_ckpt, tmp_path):
    """kernels "fused_proj" (plain torch, any dtype): q_a_proj + kv_a_proj_with_mqa and gate_proj +
    up_proj as one GEMM each over the stacked weights, the shared expert's down GEMM adding onto
    the routed output. Swapped in after loading by the checkpoint's own names (float64, FP8 and
    INT4 checkpoints, a simulated TP-2 rank's slices) it equals the plain model and keeps its
    state dict; each weight is a view of its stacked buffer (no second copy), also after .to()."""
    ckpt, m = tiny_ckpt
    assert not hasattr(m.layers[1].self_attn, "q_kv_a_weight")          # plain: no stacked buffers
    fused = fused_proj_target(ckpt, dtype=torch.float64)
    assert_same_state(fused, m)
    assert_close(run_steps(fused), run_steps(m), 1e-12, "fused_proj vs plain, float64 checkpoint")
    attn, dense, shared = (fused.layers[1].self_attn, fused.layers[0].mlp,
                           fused.layers[1].mlp.shared_experts)
    for buf, parts in ((attn.q_kv_a_weight, (attn.q_a_proj, attn.kv_a_proj_with_mqa)),
                       (dense.gate_up_weight, (dense.gate_proj, dense.up_proj)),
                       (shared.gate_up_weight, (shared.gate_proj, shared.up_proj))):
        first, second = (p.weight for p in parts)
        assert (first.data_ptr() == buf.data_ptr()
                and second.data_ptr() == buf[len(first):].data_ptr())
        assert torch.equal(torch.cat([first, second]), buf)
    storages = {p.untyped_storage().data_ptr() for p in fused.parameters()}
    pairs = 2 * fused.args.num_hidden_layers          # each layer: the attention pair and an MLP's
    assert len(storages) == len(list(fused.parameters())) - pairs, \
        "a stacked pair is not one storage"
    # .to() moves each tensor alone: stacked again
    moved = fused.to(torch.float32).to(torch.float64)
    assert (moved.layers[1].self_attn.q_a_proj.weight.data_ptr()
            == moved.layers[1].self_attn.q_kv_a_weight.data_ptr())
    assert_close(run_steps(moved), run_steps(m), 1e-6, "fused_proj after .to() and back")
    for r in (0, 1):
        tp = TP.simulate(2, r)
        rank, rank_plain = (fused_proj_target(ckpt, dtype=torch.float64, tp=tp),
                            load_target(ckpt, 3, 32, dtype=torch.float64, tp=tp))
        assert_same_state(rank, rank_plain)
        assert_close(run_steps(rank), run_steps(rank_plain), 1e-12,
                     f"fused_proj vs plain, simulated rank {r} of TP 2")
    for make in (fp8_checkpoint, int4_checkpoint):
        quant, plain = make(str(tmp_path / make.__name__))
        got = fused_proj_target(quant, dtype=torch.float32)
        assert_same_state(got, load_target(quant, 3, 32, dtype=torch.float32))
        assert_close(run_steps(got), run_steps(load_target(plain, 3, 32, dtype=torch.float32)),
                     1e-5, f"fused_proj on {make.__name__} vs the dequantized checkpoint, plain")


@pytest.mark.triton
def test_shared_expert_in_the_fused_launch_equals_plain(tmp_path):
    """kernels "shared_expert": the shared expert as expert E of the fused MoE launch equals the
    plain MoE, whether swapped in before the weights are loaded by name (they land in the [E + 1]
    tensors) or after load_target; the parameters are views, nothing is held twice, the state dict
    is the plain one. Left off (and not listed) on the other MoE paths (gather, below); quantized
    routed experts take it too, in their GEMV launches (the next test)."""
    args = tiny(num_hidden_layers=3)
    kw = dict(max_batch_size=2, max_seq_len=32, device=TRITON_DEVICE, dtype=torch.float32)
    plain = init_random(Transformer(args, **kw), 4)
    save_target(plain.cpu(), tmp_path / "t")
    plain = plain.to(TRITON_DEVICE)
    before = Transformer(args, **kw)
    kernels.accelerate(before, ["shared_expert"], moe="fused")
    before.load_state_dict(plain.state_dict())
    after = load_target(tmp_path / "t", **kw)
    kernels.accelerate(after, ["shared_expert"], moe="fused")
    tokens = torch.randint(0, args.vocab_size, (2, 6),
                           generator=torch.Generator().manual_seed(5)).to(TRITON_DEVICE)
    positions = torch.arange(6, device=TRITON_DEVICE).expand(2, 6)
    step, step_pos = (tokens[:, :1] + 1) % args.vocab_size, torch.full((2, 1), 6,
                                                                       device=TRITON_DEVICE)
    want = [plain(tokens, positions).logits, plain(step, step_pos).logits,
            plain(step[:1], step_pos[:1]).logits]
    for folded in (before, after):
        assert folded.kernels == ("shared_expert",)
        assert_same_state(folded, plain)
        moe = folded.layers[-1].mlp
        assert (isinstance(moe, kernels.SharedExpertInLaunch)
                and moe.stacked[0].shape[0] == args.n_routed_experts + 1)
        assert moe.shared_experts.down_proj.weight.data_ptr() == moe.stacked[2][-1].data_ptr()
        # a prefill (the tile variant), then decode steps of 2 and 1 tokens (the GEMV variant, K + 1
        # pairs a token)
        got = [folded(tokens, positions).logits, folded(step, step_pos).logits,
               folded(step[:1], step_pos[:1]).logits]
        for g, w, what in zip(got, want, ("prefill", "step of 2 tokens", "step of 1 token")):
            assert_close(g, w, 1e-5, f"shared expert in the fused launch, {what}")
    # .to() moves each parameter alone
    moved = after.to(torch.float64).to(torch.float32).layers[-1].mlp
    assert moved.shared_experts.up_proj.weight.data_ptr() == moved.stacked[1][-1].data_ptr()
    assert moved.experts.up_proj.data_ptr() == moved.stacked[1].data_ptr()
    assert_close(after(tokens, positions).logits, want[0], 1e-5,
                 "shared expert in the fused launch, after .to()")
    assert kernels.accelerate(Transformer(args, **kw), ["shared_expert"], moe="gather") == ()


@pytest.mark.triton
@pytest.mark.parametrize("quant, names",
                         [("int4", ("shared_expert",)), ("int4", ("router", "shared_expert")),
                                          ("fp8", ("shared_expert",))])
def test_quantized_experts_take_the_shared_expert_in_their_launch(quant, names, monkeypatch):
    """kernels "shared_expert" with INT4 or FP8 routed experts (Kimi-K2.5; Kimi-K2-Instruct's FP8
    checkpoint: the shared expert in the compute dtype): their GEMV launches take its weights beside
    theirs (fused_moe's shared) and equal the plain MoE at 1 and 2 tokens; a prefill past the GEMV
    rule runs the plain sum, and past SHARED_MAX_TOKENS (set to 1 here) the shared expert runs
    alone beside the routed experts' GEMV launches (gate and up one GEMM, down adding onto them).
    With "router" too, INT4 experts read the activation planes that the router kernel writes (the
    MoE's own permute never runs). The state dict is the plain one; fused_moe refuses a shared
    expert it cannot take."""
    permutes, permute = [], kernels.nibble_planes
    monkeypatch.setattr(kernels.moe_gemv, "nibble_planes", lambda *a: permutes.append(1)
                        or permute(*a))
    args = tiny(num_hidden_layers=2, moe_intermediate_size=64, quantization_config=quant)
    kw = dict(max_batch_size=2, max_seq_len=48, device=TRITON_DEVICE, dtype=torch.float32)
    plain = init_random(Transformer(args, **kw), 6)
    folded = Transformer(args, **kw)
    assert kernels.accelerate(folded, names, moe="fused") == names
    folded.load_state_dict(plain.state_dict())
    assert_same_state(folded, plain)
    moe = folded.layers[-1].mlp
    assert isinstance(moe, kernels.SharedExpertInLaunch) and moe.stacked is None
    # alone, its gate and up are one GEMM: their weights views of one stacked buffer
    sh = moe.shared_experts
    assert [sh.gate_proj.weight.data_ptr(), sh.up_proj.weight.data_ptr()] == [
        half.data_ptr() for half in moe.shared_gate_up.chunk(2)]
    g = torch.Generator().manual_seed(7)
    width = kernels.expert_weights(moe.experts.gate_proj).shape[1]
    n = kernels.gemv_max_tokens(quant, width) + 1  # past the GEMV rule: the plain sum
    # two rows of their own: a prefill past the GEMV rule, then a step of a fresh token each
    tokens = torch.randint(0, args.vocab_size, (2, n), generator=g).to(TRITON_DEVICE)
    positions = torch.arange(n, device=TRITON_DEVICE).expand(2, n)
    step = torch.randint(0, args.vocab_size, (2, 1), generator=g).to(TRITON_DEVICE)
    step_pos = torch.full((2, 1), n, device=TRITON_DEVICE)
    for what, t, p in (("prefill", tokens, positions), ("step of 2 tokens", step[:, :1], step_pos),
                       ("step of 1 token", step[:1, :1], step_pos[:1])):
        assert_close(folded(t, p).logits, plain(t, p).logits, 1e-5,
                     f"{quant} {names}, the shared expert in the launch, {what}")
    # the steps' GEMV launches read planes: the router kernel's, else the MoE's permute
    if quant == "int4":
        assert bool(permutes) == ("router" not in names), \
            f"{names}: {len(permutes)} permutes in the MoE"
    # above SHARED_MAX_TOKENS tokens the shared expert runs alone beside the GEMV launches
    calls, fused = [], kernels.moe.fused_moe
    monkeypatch.setattr(kernels.moe, "fused_moe", lambda x, *a, shared=None, **kw: calls.append(
        (x.shape[0], shared is not None)) or fused(x, *a, shared=shared, **kw))
    monkeypatch.setitem(kernels.moe_gemv.SHARED_MAX_TOKENS, quant, 1)
    for what, t, p in (("step of 2 tokens, the shared expert alone", step[:, :1], step_pos),
                       ("step of 1 token, the shared expert in the launch", step[:1, :1],
                        step_pos[:1])):
        assert_close(folded(t, p).logits, plain(t, p).logits, 1e-5, f"{quant} {names}, {what}")
    assert set(calls) == {(2, False), (1, True)}, f"(tokens, shared in the launch): {calls}"
    assert_fused_moe_refuses_shared_it_cannot_take(moe, args, g)


def assert_fused_moe_refuses_shared_it_cannot_take(moe, args, g):
    """fused_moe with a shared expert beside moe's quantized experts: refused in the tile variant,
    with a wrongly shaped weight, and beside plain experts (there it is stacked as expert E)."""
    sh = moe.shared_experts
    x = torch.randn(2, args.hidden_size, generator=g).to(TRITON_DEVICE)
    ids, w = moe.gate(x)
    weights = [kernels.expert_weights(getattr(moe.experts, p))
               for p in ("gate_proj", "up_proj", "down_proj")]
    both = [sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight]
    with pytest.raises(ValueError, match="rides in the INT4 and FP8 GEMV launches only"):
        kernels.fused_moe(x, ids, w, *weights, variant="dot", shared=both)
    with pytest.raises(ValueError, match="shared expert"):
        kernels.fused_moe(x, ids, w, *weights, shared=[both[0][:-1], *both[1:]])
    # plain routed experts stack the shared one as expert E
    (I, D), E = both[0].shape, args.n_routed_experts
    plain_w = [kernels.ExpertWeights("plain", torch.zeros(E, *s, device=TRITON_DEVICE))
               for s in ((I, D), (I, D), (D, I))]
    with pytest.raises(ValueError, match="make it expert E"):
        kernels.fused_moe(x, ids, w, *plain_w, variant="gemv", shared=both)


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_quantized_shared_expert_in_the_launch_replays_without_host_sync(quant):
    """INT4 or FP8 routed experts with the shared expert in their launch, bf16, and the router
    kernel (beside INT4 experts it writes the packed form's pair planes): each captured shape
    (decode, verify of 3 rows of 4 tokens, the head's) replays equal to eager (launched without
    programmatic dependent launch: eager_without_pdl), on its capture's inputs and on others, and
    nothing syncs with the host."""
    target, head = gpu_models(quant=quant, moe_impl="fused", kernels_on=["router", "shared_expert"])
    assert target.kernels == ("router", "shared_expert")
    runner = CudaGraphs("cuda")
    # captured on one set of inputs, then replayed on other tokens at other positions
    for calls in (captured_calls(target, head), captured_calls(target, head, P=15, seed=1)):
        for key, fn, inputs in calls:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                eager = flat(eager_without_pdl(fn, *inputs))
                runner.run(key, fn, *inputs)                  # capture (the first set), replay
                graphed = flat(runner.run(key, fn, *inputs))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert_close(graphed, eager, 0.0,
                         f"{quant}, the shared expert in the launch: graph vs eager {key}")


@pytest.mark.triton
def test_fused_proj_with_the_shared_expert_in_the_launch():
    """"shared_expert" and "fused_proj" together: the folded shared expert is not stacked (its gate
    and up rows live in the [E + 1] tensors) and runs unstacked where it still runs on its own
    (past the fused kernel's token limit, here lowered to 4, where torch._grouped_mm runs: the
    CPU; CUDA has none for float32, so there the fused launch serves every count and the second
    check repeats the first); the attention pair and the dense MLP are stacked. Logits equal the
    plain model's with the fused launch and without."""
    args = tiny(num_hidden_layers=3)
    kw = dict(max_batch_size=2, max_seq_len=32, device=TRITON_DEVICE, dtype=torch.float32)
    plain = init_random(Transformer(args, **kw), 4)
    both = init_random(Transformer(args, **kw), 4)
    assert kernels.accelerate(both, ["shared_expert", "fused_proj"],
                              moe="fused") == ("shared_expert", "fused_proj")
    for layer in both.layers[1:]:
        assert not isinstance(layer.mlp.shared_experts, kernels.StackedGateUp)
        assert not isinstance(layer.mlp, kernels.SharedDownAddsRouted)
        assert isinstance(layer.self_attn, kernels.StackedQKVA)
    assert isinstance(both.layers[0].mlp, kernels.StackedGateUp)
    tokens = torch.randint(0, args.vocab_size, (2, 6),
                           generator=torch.Generator().manual_seed(5)).to(TRITON_DEVICE)
    positions = torch.arange(6, device=TRITON_DEVICE).expand(2, 6)
    want = plain(tokens, positions).logits
    assert_close(both(tokens, positions).logits, want, 1e-5,
                 "shared expert in the launch + fused_proj")
    alone = kernels.grouped_mm_available(TRITON_DEVICE, torch.float32)
    for layer in both.layers[1:]:
        # 12 tokens: where torch._grouped_mm runs, the grouped path and the shared MLP alone
        layer.mlp.experts.FUSED_MAX_TOKENS = 4
        x = torch.zeros(12, args.hidden_size, device=TRITON_DEVICE)
        assert layer.mlp.paths(x) == ((False, False) if alone else (True, True))
    assert_close(both(tokens, positions).logits, want, 1e-5,
                 "folded shared expert run alone + fused_proj")


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T", [(1, 1), (3, 1), (1, 4), (3, 4)])
def test_gpu_mla_decode_kernel_long_cache(dtype, B, T):
    """Kimi-K2 TP 8 shapes on caches of 256, 4096 and 32768 slots (automatic splits), and the tiny
    ones."""
    for S in (256, 4096, 32768):
        check_mla(B, T, KIMI_TP8, S, dtype, "cuda", seed=S + B + T)
    check_mla(B, T, TINY_MLA, 1000, dtype, "cuda", seed=B + T)


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("S", [512, 32768])
def test_gpu_mla_decode_kernel_one_graph_any_length(S):
    """One graph captured on an S-slot cache serves every length: replays with new positions
    (lengths from 1 to the whole cache) equal the eager call (launched without programmatic
    dependent launch: eager_without_pdl) and lie within check_mla's bound of the float64 twin
    (bf16_twin_tolerance), without a host sync: a short cache (8 splits of 64 slots) and a long
    one (splits of 768 slots)."""
    B, T, scale = 3, 4, 0.07
    x = mla_inputs(B, T, **KIMI_TP8, S=S, dtype=torch.bfloat16, device="cuda", seed=1)
    table = torch.stack(model.rope_tables(KIMI_TP8["R"], 10000.0, None, S, "cuda"), -1)
    kernels.mla_decode_attention(**x, softmax_scale=scale)      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    for i, last in enumerate(([S - 1, 3, 100], [T - 1, S - 1, 400], [200, S - 300, 17])):
        new_pos = torch.tensor(last,
                               device="cuda").unsqueeze(1) - (T - 1) + torch.arange(T,
                               device="cuda")
        new_rope = table[new_pos]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if i == 0:
                with torch.cuda.graph(graph):
                    out = kernels.mla_decode_attention(**x, softmax_scale=scale)
            x["positions"].copy_(new_pos)
            x["rope"].copy_(new_rope)
            graph.replay()
            eager = eager_without_pdl(lambda: kernels.mla_decode_attention(**x,
                                                                           softmax_scale=scale))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_close(out, eager, 0.0, f"S {S}: graph replay vs eager, last positions {last}")
        truth = mla_reference(x, scale, dtype=torch.float64)[0]
        tol, twin_err = bf16_twin_tolerance(mla_reference(x, scale)[0], truth)
        assert_close(out, truth, tol, f"S {S}: graph replay vs float64 twin (bf16 twin: "
                                      f"{twin_err:.2e}), last positions {last}")


def bf16_errors(fast, plain, truth, what):
    """The largest errors of bf16 logits with the kernels (fast) and without (plain) against the
    float32 logits of the plain module on the same weights (truth); fast's must be at most 4 times
    plain's. The kernels round at other points than the plain path, not more often (the fused
    ones keep more in fp32), so a correct kernel's error is of plain's size, and a wrong one moves
    the logits by their own size (on the tiny model, plain bf16 lies 0.36-0.62% of the largest
    logit from float32 in the head and 3.7-4.6% in the target under uniform routing: 4 seeds, on
    the CPU)."""
    fast_err, plain_err = ((x.float() - truth).abs().max().item() for x in (fast, plain))
    assert fast_err <= 4 * plain_err, (f"{what}: largest logit error {fast_err:.3e} with the "
                                       f"kernels, {plain_err:.3e} without")
    return fast_err, plain_err


def clear_top1(truth, err):
    """Where the truth's top-1 leads its second by more than 2 * err: logits within err of the
    truth's pick its top-1 there."""
    top2 = truth.topk(2, -1).values
    return top2[..., 0] - top2[..., 1] > 2 * err


def _graph_replays_eager(runner, key, fn, inputs, capture, what):
    """One captured call replayed (captured first where `capture`) equal to its eager run, which
    launches without programmatic dependent launch, with no host sync in either."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = flat(eager_without_pdl(fn, *inputs))
        if capture:
            runner.run(key, fn, *inputs)
        graphed = flat(runner.run(key, fn, *inputs))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(graphed, eager, 0.0, what)


@pytest.mark.gpu
@pytest.mark.triton
def test_gpu_kernels_in_captured_paths(monkeypatch):
    """The tiny model with every kernel on: each captured shape replays equal to eager (launched
    without programmatic dependent launch: eager_without_pdl), with no host sync anywhere, then
    again on other tokens at other positions. The decode step (batch 3: 3 rows, with the merge in
    W_uv's launch allowed up to those 3 rows for the test; run.py's step has 1) merges the
    attention's parts in W_uv's launch (mla_merge_absorb), the verify in decode mode (12 rows) in
    the combine launch."""
    monkeypatch.setattr(kernels.mla, "MLA_MERGE_ABSORB_MAX_ROWS", 3)   # captured_calls' batch
    target, head = gpu_models(kernels_on="all")
    runner = CudaGraphs("cuda")
    merged_in = {}
    merge_absorb, combine = kernels.launch.mla_merge_absorb, kernels.mla_combine
    monkeypatch.setattr(kernels.launch, "mla_merge_absorb",
                        lambda *a: merged_in.__setitem__(key, "w_uv") or merge_absorb(*a))
    monkeypatch.setattr(kernels.mla, "mla_combine",
                        lambda *a: merged_in.__setitem__(key, "combine") or combine(*a))
    for routing in ("model", "uniform"):   # uniform: SIMULATED, inside the router kernel
        target.set_routing(routing)
        for key, fn, inputs in captured_calls(target, head):
            _graph_replays_eager(runner, key + (routing,), fn, inputs, True,
                                 f"kernels on, {routing} routing: graph vs eager {key}")
        # replayed on other tokens at other positions (a graph that kept its capture's inputs or
        # positions would fail here, not above)
        for key, fn, inputs in captured_calls(target, head, P=15, seed=1):
            _graph_replays_eager(runner, key + (routing,), fn, inputs, False,
                                 f"kernels on, {routing} routing: replay on new inputs vs "
                                 f"eager {key}")
    assert {key.phase: where for key, where in merged_in.items() if key.mode == "decode"} == \
        {"decode_step": "w_uv", "verify": "combine"}, merged_in


@pytest.mark.gpu
@pytest.mark.triton
def test_gpu_kernels_in_bf16_against_float32():
    """In bf16 under uniform routing, a prefill and a decode step of the tiny model with every
    kernel and without, against the plain model in float32 on the same weights: the kernels'
    largest logit error within bf16_errors' bound, and their top-1 the float32 one at no fewer
    positions than the plain bf16 model's, less a tenth of the positions (float32 logits against
    the plain model's: test_model_with_kernels_equals_plain, which runs on the GPU too)."""
    # uniform routing: under the model's, near-tied routing choices flip with bf16 rounding and
    # move the logits as much as a layer does, kernels or not (docs/engine-check.md)
    plain, fast = kernel_models("cuda", torch.bfloat16)
    ref = Transformer(plain.args, 3, 64, device="cuda", dtype=torch.float32)
    ref.load_state_dict(plain.state_dict())
    prefill, prefill_pos, step, step_pos = (t.cuda() for t in step_inputs(256, seed=9))
    logits = []
    for m in (fast, plain, ref):
        m.set_routing("uniform")
        logits.append(torch.cat([m(prefill, prefill_pos).logits,
                                 m(step, step_pos, "decode").logits], 1))
    what = "bf16 tiny model, kernels on vs off, against float32"
    bf16_errors(*logits, what)
    # 45 positions, of which plain bf16 leaves the float32 top-1 at 1 to 3 (4 seeds, on the CPU)
    fast_agree, plain_agree = ((x.argmax(-1) == logits[2].argmax(-1)).float().mean().item()
                               for x in logits[:2])
    assert fast_agree >= plain_agree - 0.1, (f"{what}: top-1 agreement {fast_agree:.3f} with the "
                                             f"kernels, {plain_agree:.3f} without")


# ---------------------------------------------------------------------------------------------
# The EAGLE-3 head's swaps (kernels.accelerate_draft) against the plain head, float32 on fresh
# random inputs: its attention kernel against draft.py's attention (GQA and MHA, one split and
# several), the swapped head's extend, chain steps and caches, a speculative run, a tree's verify;
# on the GPU, Kimi-K2's shapes and graph replay

def draft_attention_inputs(B, T, H, G, HD, S, device, seed):
    """q, k, v of T new tokens a row at consecutive positions (one row ending at the cache's end,
    one starting at slot 0), their cos / sin rows, and caches of random values with a spare row."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(B, T, H, HD, generator=g), torch.randn(B, T, G, HD, generator=g), \
        torch.randn(B, T, G, HD, generator=g)
    caches = [torch.randn(B + 1, S, G, HD, generator=g) for _ in range(2)]
    last = torch.randint(T - 1, S, (B,), generator=g)
    last[0] = S - 1
    if B > 2:
        last[2] = T - 1
    positions = last.unsqueeze(1) - (T - 1) + torch.arange(T)
    cos, sin = model.rope_tables(HD, 10000.0, None, S, "cpu")
    return [x.to(device) for x in (q, k, v, cos[positions], sin[positions], positions, *caches)]


@pytest.mark.triton
@pytest.mark.parametrize("B, T, H, G", [(1, 1, 4, 4), (3, 4, 4, 2), (2, 3, 8, 1)])
def test_draft_attention_kernel_equals_twin(B, T, H, G):
    """kernels.draft_attention against DraftAttention's RoPE and attend_cache on copies of the same
    caches: the output and both caches, with the cached slots in one split and in splits of 16
    and 24 slots (merged with the new tokens' part)."""
    HD, S, scale = 16, 56, 16 ** -0.5
    twin = DraftAttention(draft_preset("tiny", num_attention_heads=H, num_key_value_heads=G,
                                       head_dim=HD), TP(),
                          B + 1, S, TRITON_DEVICE, torch.float32)
    for split_len in (None, 16, 24):
        q, k, v, cos, sin, pos, k_cache, v_cache = draft_attention_inputs(B, T, H, G, HD, S,
                                                                          TRITON_DEVICE, B + T)
        twin.k_cache.copy_(k_cache)
        twin.v_cache.copy_(v_cache)
        want = twin.attend_cache(rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin), v,
                                 pos, S)
        got = kernels.draft_attention(q, k, v, cos, sin, pos, k_cache[:B], v_cache[:B], scale,
                                      split_len)
        what = f"draft attention B={B} T={T} H={H} G={G} split {split_len}"
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, 2e-5 * want.abs().max().item(), what)
        assert_close(k_cache, twin.k_cache, 1e-5, what + ": key cache")
        assert_close(v_cache, twin.v_cache, 0.0, what + ": value cache")
    # 40 tokens: prefill
    *long, k_cache, v_cache = draft_attention_inputs(1, 40, H, G, HD, S, TRITON_DEVICE, 0)
    with pytest.raises(ValueError, match="query rows"):
        kernels.draft_attention(*long, k_cache[:1], v_cache[:1], scale)


@pytest.mark.triton
def test_draft_top1_kernel_equals_twin():
    """kernels.draft_top1 against Eagle3Draft.to_target_ids's argmax and d2t map, over two blocks of
    logits: random ones, ones of three values (ties: the first maximum wins, as torch.argmax's), a
    row of -inf."""
    g = torch.Generator().manual_seed(5)
    V = 5000
    d2t = torch.randint(0, 1000, (V,), generator=g)
    ties = torch.randint(0, 3, (4, V), generator=g).float()
    ties[0, 4100] = ties[0, 200] = 9.0   # the first maximum in block 0, a later lane than block 1's
    ties[1, -1] = 9.0                    # the only maximum in the last, partial block
    ties[2] = float("-inf")
    for logits in (torch.randn(3, 2, V, generator=g), ties):
        ids = logits.argmax(-1)
        got = kernels.draft_top1(logits.to(TRITON_DEVICE), d2t.to(TRITON_DEVICE))
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), ids + d2t[ids]), \
            f"top-1 of {list(logits.shape)}"


def draft_heads(device, dtype, seed=0, names="all", **draft_kw):
    """A tiny target and the tiny head twice: plain, and with the head swaps `names` (default
    every one; then loaded with the plain head's state dict by the plain names)."""
    target = init_random(Transformer(tiny(), max_batch_size=3, max_seq_len=64, device=device,
                                     dtype=dtype), seed)
    plain = init_random_draft(Eagle3Draft(draft_preset("tiny", **draft_kw), target), seed + 1)
    fast = Eagle3Draft(draft_preset("tiny", **draft_kw), target)
    want = tuple(k for k in kernels.DRAFT_KERNELS if names == "all" or k in names)
    assert kernels.accelerate_draft(fast, names) == want
    fast.load_state_dict(plain.state_dict())
    assert_same_state(fast, plain)
    return target, plain, fast


@pytest.mark.triton
def test_head_swaps_train_as_the_plain_head():
    """A swapped head trained (draft.Eagle3Draft.unroll with trainable parameters, as train.py
    trains): the swaps without a backward (silu_mul's kernel; fused_proj's stacked GEMMs, whose
    buffer is no Parameter) take the plain products there, so every gradient is the plain head's."""
    target, plain, fast = draft_heads(TRITON_DEVICE, torch.float32,
                                      names=["silu_mul", "fused_proj"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 5), generator=g).to(TRITON_DEVICE)
    states = torch.randn(2, 5, 3 * target.args.hidden_size, generator=g).to(TRITON_DEVICE)
    grads = []
    for head in (plain, fast):
        params = {n: p for n, p in head.named_parameters() if p.is_floating_point()}
        for p in params.values():
            p.requires_grad_(True)
        head.unroll(tokens, states, 2).pow(2).mean().backward()
        grads.append({n: p.grad for n, p in params.items()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name, want in grads[0].items():
        assert grads[1][name] is not None, f"{name}: no gradient through the swapped head"
        assert_close(grads[1][name], want, 1e-5, f"{name}: swapped head's gradient vs plain")


@pytest.mark.triton
@pytest.mark.parametrize("kv_heads,names", [(4, "all"), (2, "all"),
                                            *((2, [k]) for k in kernels.DRAFT_KERNELS)])
def test_draft_head_with_kernels_equals_plain(kv_heads, names):
    """The swapped head (every head swap, and each alone, as run.py --kernels may ask) against the
    plain one on the same weights: an extend of 4 rows at each batch row's own position, then 2
    chain steps, over the first 48 slots and over all of them: logits, g and the caches they write;
    a tree (slots and masks: the plain attention) alike; then extend's first draft and chain's
    drafts in target ids (to_target_ids: the "router" swap's top-1 kernel)."""
    target, plain, fast = draft_heads(TRITON_DEVICE, torch.float32, names=names,
                                      num_key_value_heads=kv_heads)
    g = torch.Generator().manual_seed(kv_heads)
    B, T = 3, 4
    tokens = torch.randint(0, 256, (B, T), generator=g).to(TRITON_DEVICE)
    start = torch.tensor([0, 9, 40])
    positions = (start.unsqueeze(1) + torch.arange(T)).to(TRITON_DEVICE)
    states = torch.randn(B, T, 3 * target.args.hidden_size, generator=g).to(TRITON_DEVICE)
    for kv_len in (48, None):
        outs = []
        for head in (plain, fast):
            logits, h = head(tokens, positions, head.fc(states), kv_len)
            steps = [(logits, h)]
            for i in range(2):   # chain steps: the last row's g fed back, one position on
                steps.append(head(tokens[:, i:i + 1], positions[:, -1:] + 1 + i,
                                  steps[-1][1][:, -1:], kv_len))
            outs.append(steps)
        for i, ((want_l, want_g), (got_l, got_g)) in enumerate(zip(*outs)):
            what = f"kv heads {kv_heads}, kv_len {kv_len}, " + ("extend" if i == 0
                                                                else f"chain step {i}")
            assert_close(got_l, want_l, 1e-5 * want_l.abs().max().item(), what + ": logits")
            assert_close(got_g, want_g, 1e-5 * want_g.abs().max().item(), what + ": g")
        attn_p, attn_f = plain.midlayer.self_attn, fast.midlayer.self_attn
        assert_close(attn_f.k_cache, attn_p.k_cache, 1e-5, f"kv_len {kv_len}: key cache")
        assert_close(attn_f.v_cache, attn_p.v_cache, 1e-5, f"kv_len {kv_len}: value cache")
    last = torch.full((B,), T - 1, device=TRITON_DEVICE)
    trees = [head.tree(tokens[:, -1], *head.extend_logits(tokens, positions, states, last, 64),
                       positions[:, -1],
                       2, 3, 6, 64) for head in (plain, fast)]
    for name, want, got in zip(trees[0]._fields, *trees):
        assert_close(got, want, 1e-5 * max(want.abs().max().item(), 1), f"tree {name}")
    firsts = [head.extend(tokens, positions, states, last, 64) for head in (plain, fast)]
    assert torch.equal(firsts[1][0], firsts[0][0]), "extend's first draft"
    chains = [head.chain(*first, positions[:, -1], 3, 64) for head, first in zip((plain, fast),
                                                                                 firsts)]
    assert torch.equal(chains[1], chains[0]), "chain's drafts"


@pytest.mark.triton
def test_speculative_with_the_draft_kernels_equals_plain_greedy():
    """Greedy speculative decoding with the swapped head (float32) emits the plain greedy output and
    accepts exactly what the plain head accepts (the same drafts)."""
    target, plain, fast = draft_heads(TRITON_DEVICE, torch.float32, seed=3)
    prompts = PROMPTS[3][1:2]   # 1 row, 3 cycles: the interpreter takes ~0.2 s a head forward
    want = generate(target, None, prompts, max_new_tokens=6).tokens
    runs = [generate(target, head, prompts, max_new_tokens=6, num_steps=2)
            for head in (plain, fast)]
    assert runs[1].tokens == want == runs[0].tokens
    assert torch.equal(runs[1].accepted, runs[0].accepted)
    assert torch.equal(runs[1].drafts, runs[0].drafts)


@pytest.mark.triton
def test_compile_head_compiles_what_the_head_calls():
    """run.py --compile's kernels.compile_head: with "add_rmsnorm" the head calls its midlayer's
    residual_parts, not its forward, and that is what gets compiled; the plain head its forward.
    Each head's output stays the uncompiled twin's, and dynamo's frame counter shows the compiled
    code ran (backend "eager": the wiring, not Inductor, which the GPU test of the layers
    covers)."""
    target, plain, fast = draft_heads(TRITON_DEVICE, torch.float32, seed=7)
    twin = Eagle3Draft(draft_preset("tiny"), target)
    twin.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (3, 4), generator=g).to(TRITON_DEVICE)
    positions = torch.arange(4).repeat(3, 1).to(TRITON_DEVICE)
    hidden = torch.randn(3, 4, target.args.hidden_size, generator=g).to(TRITON_DEVICE)
    for name, head, ref in (("plain", twin, plain), ("kernels", fast, plain)):
        want = ref(tokens, positions, hidden)[0]
        torch._dynamo.reset()
        counters.clear()
        kernels.compile_head(head, backend="eager")
        got = head(tokens, positions, hidden)[0]
        assert counters["frames"]["ok"] > 0, f"{name} head: no compiled frame ran"
        assert_close(got, want, 1e-5 * want.abs().max().item(), f"{name} head compiled")
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_draft_attention_kimi_shapes(T):
    """Kimi-K2's head at TP 8 (8 heads of 128, MHA), bf16, on caches of 320 and 32768 slots
    (automatic splits): the kernel against the float64 twin, within twice the bf16 twin's error (at
    least 2^-6 of the largest output: outputs are small on a long cache), and the caches it writes
    against the bf16 twin's."""
    for S in (320, 32768):
        x = draft_attention_inputs(1, T, 8, 8, 128, S, "cuda", S + T)
        got_caches = [c.bfloat16() for c in x[6:]]
        got = kernels.draft_attention(*[t.bfloat16() for t in x[:3]], *x[3:6], got_caches[0][:1],
                                      got_caches[1][:1],
                                      128 ** -0.5)
        outs = {}
        for dtype in (torch.float64, torch.bfloat16):
            twin = DraftAttention(draft_preset("kimi-k2", num_attention_heads=8,
                                               num_key_value_heads=8), TP(), 2, S,
                                  "cuda", dtype)
            twin.k_cache.copy_(x[6])
            twin.v_cache.copy_(x[7])
            q, k, v = (t.to(dtype) for t in x[:3])
            outs[dtype] = twin.attend_cache(rotate_half_rope(q, *x[3:5]),
                                            rotate_half_rope(k, *x[3:5]), v, x[5], S)
        truth = outs[torch.float64]
        tol, twin_err = bf16_twin_tolerance(outs[torch.bfloat16], truth)
        assert_close(got, truth, tol, f"S {S} T {T} vs float64 (bf16 twin {twin_err:.2e})")
        assert_close(got_caches[0], twin.k_cache, 2 ** -7 * 4,
                     f"S {S} T {T}: key cache vs the bf16 twin's")
        assert_close(got_caches[1], twin.v_cache, 0.0,
                     f"S {S} T {T}: value cache vs the bf16 twin's")


@pytest.mark.gpu
@pytest.mark.triton
def test_gpu_draft_kernels_in_captured_paths():
    """The tiny head with every swap, bf16: its extend and chain replay from CUDA graphs equal to
    the eager calls (launched without programmatic dependent launch: eager_without_pdl), with no
    host sync, then on other inputs. The logits behind the extend's draft and behind the chain's
    first step (on the same inputs for each head), with the kernels and without, against the plain
    head in float32 on the same weights: the kernels' largest error within bf16_errors' bound; and
    that draft is the plain bf16 head's wherever float32's top-1 leads by more than twice the
    larger error (clear_top1), at one row at least."""
    target, plain = gpu_models()
    _, fast = gpu_models()
    kernels.accelerate_draft(fast, "all")
    # the plain head in float32 on the same weights, beside a float32 copy of the target
    twin_target = Transformer(target.args, 3, 64, device="cuda", dtype=torch.float32)
    twin_target.load_state_dict(target.state_dict())
    twin = Eagle3Draft(draft_preset("tiny"), twin_target)
    twin.load_state_dict(plain.state_dict())
    runner = CudaGraphs("cuda")
    # extend, chain
    calls = zip(captured_calls(target, fast)[3:], captured_calls(target, plain)[3:])
    for (key, fn, inputs), (_, plain_fn, _) in calls:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = eager_without_pdl(fn, *inputs)
            runner.run(key, fn, *inputs)                          # capture
            graphed = runner.run(key, fn, *inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_close(flat(graphed), flat(eager), 0.0, f"head kernels: graph vs eager {key}")
        want = plain_fn(*inputs)
        # each head's logits behind the phase's first draft it makes (the twin's extend also
        # writes its cache, which the chain's step reads)
        if key.phase == "draft_extend":
            tokens, positions, states, last = inputs
            logits = [h.extend_logits(tokens, positions, s, last)[0]
                      for h, s in ((fast, states), (plain, states), (twin, states.float()))]
            got, ref = eager[0], want[0]
        else:
            first, g, last_pos = inputs
            step = (first.unsqueeze(1), (last_pos + 1).unsqueeze(1))
            logits = [h(*step, x.unsqueeze(1))[0][:, 0]
                      for h, x in ((fast, g), (plain, g), (twin, g.float()))]
            got, ref = eager[:, 1], want[:, 1]
        what = f"bf16 tiny head, kernels on vs off, {key.phase}"
        clear = clear_top1(logits[2], max(bf16_errors(*logits, what)))
        assert clear.any() and torch.equal(got[clear], ref[clear]), (
            f"{what}: drafts {got.tolist()} with the kernels, {ref.tolist()} without; rows where "
            f"float32's top-1 leads clearly: {clear.tolist()}")
    for key, fn, inputs in captured_calls(target, fast, P=15, seed=1)[3:]:   # other inputs
        eager = flat(eager_without_pdl(fn, *inputs))
        assert_close(flat(runner.run(key, fn, *inputs)), eager, 0.0,
                     f"head kernels: replay on new inputs vs eager {key}")


# ---------------------------------------------------------------------------------------------
# The target's attention swaps in a tree's verify

@pytest.mark.triton
def test_tree_verify_with_kernels_equals_plain():
    """The Triton decode attention cannot mask a tree, so a tree's forward takes the plain
    attention there; the rope/cache kernel writes at the tree's slots (9 to 15; its positions are
    9 + depth). The logits and every layer's latent and rope caches equal the plain model's, the
    tree's slots written (not zero)."""
    dev, build = TRITON_DEVICE, dict(max_batch_size=2, max_seq_len=32, dtype=torch.float32)
    plain = init_random(Transformer(tiny(), device=dev, **build), 4)
    fast = init_random(Transformer(tiny(), device=dev, **build), 4)
    assert kernels.accelerate(fast, ["attention", "rope_cache"]) == ("attention", "rope_cache")
    tree = random_tree(2, 7, 256, torch.Generator().manual_seed(5))
    tokens, parents, depths = (t.to(dev) for t in (tree.tokens, tree.parents, tree.depths))
    prefix = torch.arange(9, device=dev).expand(2, 9)
    ids = torch.randint(0, plain.args.vocab_size, (2, 9),
                        generator=torch.Generator().manual_seed(6)).to(dev)
    for m in (plain, fast):
        m(ids, prefix)                                             # a prefix of its own a row
    kw = dict(kv_len=16, slots=9 + torch.arange(7, device=dev).expand(2, 7),
              visible=tree_visible(parents, torch.full((2,), 9, device=dev), 16))
    a = plain(tokens, 9 + depths, "decode", **kw).logits
    b = fast(tokens, 9 + depths, "decode", **kw).logits
    assert_close(a, b, 1e-4, "tree verify, kernels on vs plain")
    for i, (p, f) in enumerate(zip(plain.layers, fast.layers)):
        for cache in ("kv_cache", "pe_cache"):
            want, got = getattr(p.self_attn, cache), getattr(f.self_attn, cache)
            what = f"tree verify, kernels on vs plain, layer {i}: {cache}"
            assert (want[:2, 9:16].abs().amax(-1) > 0).all(), what + ": a tree slot left empty"
            assert_close(got, want, 1e-5 * want.abs().max().item(), what)


def _package_kernels():
    """Every Triton kernel of the kernels package (module, name): its @_jit functions whose name
    ends in _kernel."""
    found = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        found |= {(module.__name__, name) for name, f in vars(module).items()
                  if name.endswith("_kernel") and hasattr(f, "fn")
                  and getattr(f.fn, "__module__", None) == module.__name__}
    return found


# ---------------------------------------------------------------------------------------------
# Every kernel: compiled for sm_90, no global access before programmatic dependent
# launch's wait

def test_the_pdl_check_sees_every_global_access_before_the_wait():
    """testing._before_wait on PTX written here: loads, stores and atomics to global memory with
    qualifiers before `.global` (volatile, release, predicated) and async copies are accesses; a
    prefetch, a parameter's declaration or load, shared memory are not."""
    wait = "\tgriddepcontrol.wait;\n"
    for access in ("ld.global.b32 %r1, [%rd1];", "@%p1 ld.volatile.global.b32 %r1, [%rd1];",
                   "atom.global.gpu.acq_rel.add.u32 %r1, [%rd1], 1;",
                   "st.release.gpu.global.b32 [%rd1], %r1;",
                   "@!%p2 st.global.v4.b32 [%rd2], {%r1, %r2, %r3, %r4};",
                   "cp.async.cg.shared.global [%r1], [%rd1], 16;"):
        assert "before the wait" in testing._before_wait(f"\t{access}\n{wait}", False), access
    for other in ("prefetch.global.L2 [%rd1];", ".param .u64 .ptr .global .align 1 k_param_0,",
                  "ld.param.u64 %rd1, [k_param_0];", "ld.shared.b32 %r1, [%r2];"):
        assert testing._before_wait(f"\t{other}\n{wait}", False) is None, other


@pytest.mark.triton
@pytest.mark.slow   # 20-100 s on 2 cores: it reruns six tests, then compiles every launch
def test_every_kernel_compiles_for_sm90(tmp_path):
    """Every Triton kernel of the kernels package, compiled for sm_90 by Triton's own compiler on
    a machine without a GPU. The CPU interpreter runs code that the compiler refuses (a helper
    returning a different type from each branch of a constexpr if), so the CPU tests alone do not
    show that a kernel builds. The launches of some of those tests, recorded under the interpreter
    (fp32 and bf16, the INT4 packed form, tiles, GEMVs and the adaptive variant, MLA decode and
    its merges, router, head), each compiled in a subprocess without TRITON_INTERPRET
    (testing.compile_launches), as a Hopper GPU runs them: recorded with common.PDL and
    common.PREFETCH on (the prefetch's bytes as a GPU launch asks; the interpreter runs neither),
    compiled with the wait (common.GDC), no global memory access before it, the weights' prefetch
    there where asked for."""
    if TRITON_DEVICE.type == "cuda":
        pytest.skip("records its launches under Triton's CPU interpreter, which is off on a GPU; "
                    "the GPU tests compile and run the kernels natively, but the PTX rule that no "
                    "global memory access precedes the PDL wait (testing._before_wait) is checked "
                    "only here, on a machine without a GPU")
    with testing.recorded_launches() as specs, pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels.common, "PDL", True)  # the launches' arguments as on a Hopper GPU
        mp.setattr(kernels.common, "PREFETCH", True)
        test_model_with_kernels_equals_plain()
        test_draft_head_with_kernels_equals_plain(4, "all")
        test_fused_moe_int4_tiles_even_and_masked_blocks()
        test_fused_moe_gemv_int4_packed_bf16_precision()
        test_router_kernel_equals_twin("tiny", torch.float32, mp)
        test_mla_merge_absorb_equals_combine_then_head_gemv(torch.bfloat16, mp)
        for quant in (None, "int4", "fp8"):                  # the adaptive variant's launches
            check_fused_moe(moe_experts("tiny", quant, 16, TRITON_DEVICE, torch.float32),
                            [(4, "shared", "adaptive")], torch.float32, K=4)
        test_draft_top1_kernel_equals_twin()
        for dtype in (torch.float32, torch.bfloat16):   # norm_gemv's tensor cores' form, as the
            x = torch.randn(5, 64, dtype=dtype)         # GPU runs it (bf16; recorded, not checked:
            kernels.norm_gemv(x, torch.randn(32, 64, dtype=dtype), torch.ones(64, dtype=dtype),
                              1e-6, residual=x, dot=True)  # the interpreter's bf16 dot is wrong)
    missing = _package_kernels() - {(s["module"], s["name"]) for s in specs}
    assert not missing, f"kernels that no recorded launch reached: {sorted(missing)}"
    prefetching = {s["name"] for s in specs if s["args"].get("PREFETCH", {}).get("value")}
    assert prefetching == {s["name"] for s in specs if "PREFETCH" in s["args"]}, \
        f"kernels with a prefetch that no recorded launch asked for: {sorted(prefetching)}"
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(specs))
    env = {k: v for k, v in testing.CPU_ENV.items() if k != "TRITON_INTERPRET"}
    code = f"import testing; testing.compile_launches({str(path)!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled ") == len(specs), out.stdout[-2000:]


def _int4_tile_specs():
    """The INT4 tile kernels' launch specs (testing.recorded_launches' form) at a Kimi-K2 TP-8
    rank's shapes (D 7168, I 256, group 32), bf16, with the GPU's configs up to 128 pairs."""
    D, I, P, K = 7168, 256, 64, 8
    cfg = kernels.moe._int4_configs(P, on_gpu=True)
    ptr = lambda t: {"type": f"*{t}", "div16": True}                          # noqa: E731
    # an int argument as the launcher specializes it: on its divisibility by 16
    i32 = lambda v: {"type": "i32", "div16": v % 16 == 0}                     # noqa: E731
    common = dict(D=D, I=I, GROUP=32, BLOCK_M=kernels.moe.BLOCK_M, EVEN=True, PACKED=True,
                  PRECISION="tf32", magic=i32(kernels.moe_gemv.BF16_MAGIC), P=i32(P),
                  stride_we=i32(I * D // 8), stride_wn=i32(D // 8), stride_se=i32(I * D // 32),
                  stride_sr=i32(D // 32), sorted_pair_ptr=ptr("i32"), tile_expert_ptr=ptr("i32"))
    value = lambda v: v if isinstance(v, dict) else {"value": v}              # noqa: E731
    (bn, bk, warps, stages, split), (dn, dk, dwarps, dstages, blocks) = cfg["gate_up"], cfg["down"]
    gate_up = dict(common, x_ptr=ptr("bf16"), h_ptr=ptr("bf16"), part_ptr=ptr("fp32"),
                   g_ptr=ptr("i32"), gs_ptr=ptr("bf16"), u_ptr=ptr("i32"), us_ptr=ptr("bf16"),
                   TOPK=i32(K), BLOCK_N=bn, BLOCK_K=bk, SPLIT=split)
    down = dict(common, h_ptr=ptr("bf16"), y_ptr=ptr("fp32"), route_w_ptr=ptr("fp32"),
                w_ptr=ptr("i32"), s_ptr=ptr("bf16"), stride_wn=i32(I // 8),
                stride_sr=i32(I // 32), BLOCK_N=dn, BLOCK_K=dk, BLOCKS=blocks)
    return [{"module": "kernels.moe", "name": name,
             "args": {k: value(v) for k, v in args.items()},
             "options": {"num_warps": w, "num_stages": st}}
            for name, args, w, st in (("_moe_int4_gate_up_kernel", gate_up, warps, stages),
                                      ("_moe_int4_down_kernel", down, dwarps, dstages))]


@pytest.mark.triton
def test_int4_tiles_take_the_weights_from_registers(tmp_path):
    """The INT4 tile kernels, compiled for sm_90 at Kimi-K2's shapes and the GPU's configs on a
    machine without a GPU: the dequantized weight tile reaches the MMA from registers (its order,
    kernels.moe's section above _int4_mma_row, equals the operand's layout), so the PTX holds no
    ldmatrix or stmatrix (a tile laid out otherwise passes through shared memory by them)."""
    if TRITON_DEVICE.type == "cuda":
        pytest.skip("compiles on a machine without a GPU (without TRITON_INTERPRET, in a "
                    "subprocess, as test_every_kernel_compiles_for_sm90 does); on a GPU the "
                    "kernels run natively and their time is measured instead")
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(_int4_tile_specs()))
    env = {k: v for k, v in testing.CPU_ENV.items() if k != "TRITON_INTERPRET"}
    code = f"import testing; testing.matrix_moves({str(path)!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    moves = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}
    assert moves == {"_moe_int4_gate_up_kernel": ["0", "0"],
                     "_moe_int4_down_kernel": ["0", "0"]}, out.stdout


# ---------------------------------------------------------------------------------------------
# Every swap class: built and checked against its plain module by some test

# The classes of kernels.SWAPS and COMBINED that no case of SWAP_CASES builds: their modules are
# none of the RMSNorm, MLP, o_proj or MLA that test_each_swap_equals_the_module_it_replaces makes
# inputs for (the routed experts, the router, a layer, the MoE, the head). Each with the test of
# this module that builds it and checks it against the plain module, and how that test builds it.
SWAPS_TESTED_ELSEWHERE = {
    kernels.GroupedExperts: (test_grouped_moe_equals_gather, "accelerate, moe='grouped'"),
    kernels.FusedExperts: (test_fused_moe_equals_gather_tiny, "kernels.swap in ExpertsHolder"),
    kernels.InputNormInQKVA: (test_input_norm_in_qkva_block_equals_the_plain_block,
                              "accelerate_layer: norm_gemv, fused_proj, add_rmsnorm"),
    kernels.RouterKernel: (test_router_kernel_equals_twin, "kernels.swap in random_routers"),
    kernels.SharedExpertInLaunch: (test_shared_expert_in_the_fused_launch_equals_plain,
                                   "accelerate: shared_expert, moe='fused'"),
    kernels.swaps.SharedExpertRouterInLaunch: (
        test_quantized_experts_take_the_shared_expert_in_their_launch,
        "accelerate: router and shared_expert, moe='fused', INT4 experts"),
    kernels.SharedDownAddsRouted: (test_fused_proj_equals_plain_on_one_copy_of_the_weights,
                                   "accelerate: fused_proj"),
    kernels.DraftAttentionKernel: (test_draft_head_with_kernels_equals_plain,
                                   "accelerate_draft: attention"),
    kernels.StackedQKV: (test_draft_head_with_kernels_equals_plain,
                         "accelerate_draft: fused_proj"),
    kernels.DraftNormsKernel: (test_draft_head_with_kernels_equals_plain,
                               "accelerate_draft: add_rmsnorm"),
    kernels.DraftHeadNorm: (test_draft_head_with_kernels_equals_plain,
                            "accelerate_draft: add_rmsnorm"),
    kernels.DraftTop1Kernel: (test_draft_head_with_kernels_equals_plain,
                              "accelerate_draft: router"),
    kernels.swaps.StackedQKVAttention: (test_draft_head_with_kernels_equals_plain,
                                        "accelerate_draft: all"),
    kernels.swaps.DraftHeadNormTop1: (test_draft_head_with_kernels_equals_plain,
                                      "accelerate_draft: all"),
}


def test_every_swap_class_is_tested():
    """Every class of kernels.SWAPS and every class COMBINED declares is built by a case of
    test_each_swap_equals_the_module_it_replaces (SWAP_CASES) or listed in SWAPS_TESTED_ELSEWHERE,
    not both, with a test function of this module; SWAPS_TESTED_ELSEWHERE lists no class outside
    the two tables. A swap added to the tables fails here until a test builds it."""
    table = {row.cls for row in kernels.SWAPS} | set(kernels.swaps.COMBINED.values())
    cases = {swap_class(swaps) for _, swaps in SWAP_CASES.values()}
    elsewhere = set(SWAPS_TESTED_ELSEWHERE)
    untested = sorted(cls.__name__ for cls in table - cases - elsewhere)
    assert not untested, f"swap classes no test builds: {untested}"
    assert not cases & elsewhere, \
        f"in SWAP_CASES and SWAPS_TESTED_ELSEWHERE: {sorted(c.__name__ for c in cases & elsewhere)}"
    assert elsewhere <= table, \
        f"not in the tables: {sorted(c.__name__ for c in elsewhere - table)}"
    for cls, (test, how) in SWAPS_TESTED_ELSEWHERE.items():
        assert test.__name__.startswith("test_") and globals()[test.__name__] is test and how, \
            f"{cls.__name__}: {test.__name__} is no test of this module"
