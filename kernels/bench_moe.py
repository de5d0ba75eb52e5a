"""The fused MoE's micro-benchmark (python -m kernels.bench --moe; kernels/bench.py's CLI): one
layer's routed experts at a Kimi-K2 TP-8 rank's shapes, each weight format, token count, routing
and variant against its floor."""
import torch
import torch.nn.functional as F

import model

from . import GEMV_MAX_PAIRS, GEMV_MAX_TOKENS, ExpertWeights, fused_moe, silu_mul
from .moe_gemv import activation_planes
from .bench_timing import copy_bandwidth_GBps, graph_ms, kernel_ms
from .common import triton


# One layer's fused MoE at the shapes of one Kimi-K2 rank at TP 8 (D 7168, I 256, 384 experts, K 8),
# each format and variant, against its floor (the distinct experts' stored bytes over the copy
# bandwidth measured in the same run). Routing is uniform (each token K experts of all E at random)
# or, with `distinct`, drawn from a fixed random set of that many experts (SIMULATED routing that
# shares experts between tokens). Each time is the median over replays of a CUDA graph of LAYERS
# calls on different weights (as in a captured step, launch gaps included; the weights of LAYERS
# layers are larger than the 50 MB L2), divided by LAYERS.

def _random_experts(fmt, E, out, inp, device, g):
    if fmt == "plain":
        w = torch.randn(E, out, inp, device=device, generator=g, dtype=torch.bfloat16)
        return ExpertWeights("plain", w / inp ** 0.5)
    if fmt == "fp8":
        w = torch.randn(E, out, inp, device=device, generator=g).to(torch.float8_e4m3fn)
        s = torch.rand(E, triton.cdiv(out, 128), triton.cdiv(inp, 128), device=device,
                       generator=g) / inp ** 0.5
        return ExpertWeights("fp8", w, s, (128, 128))
    words = torch.randint(-2**31, 2**31 - 1, (E, out, inp // 8), device=device, generator=g,
                          dtype=torch.int32)
    s = (torch.rand(E, out, inp // 32, device=device,
                    generator=g) / (4.6 * inp ** 0.5)).to(torch.bfloat16)
    return ExpertWeights("int4", words, s, group=32)


def _expert_bytes(w):
    return sum(t[0].numel() * t.element_size() for t in (w.data, w.scale) if t is not None)


# Sweep points (at N = 1, 3 and 4, or the token counts asked for), each beside the default: the tile
# variant ("dot") and the GEMV variant.
# bf16 / FP8 tiles (moe._configs): gate_up (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT)
DOT_SWEEP = dict(gate_up=[(16, 128, 4, 4, 1), (32, 128, 4, 4, 1), (16, 128, 4, 5, 1),
                          (32, 128, 4, 5, 1), (64, 128, 4, 4, 1), (64, 128, 4, 3, 1),
                          (64, 128, 8, 4, 1), (128, 128, 8, 3, 1), (16, 256, 4, 3, 1),
                          (32, 256, 8, 3, 1), (16, 64, 4, 6, 1), (16, 128, 4, 4, 4),
                          (16, 128, 4, 4, 7), (32, 128, 4, 4, 2), (32, 128, 4, 4, 4),
                          (32, 128, 4, 4, 7), (64, 128, 4, 4, 4), (64, 128, 4, 4, 7)],
                 down=[(64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 4, 3), (64, 256, 8, 3)])
# INT4's tiles (moe._int4_configs): gate_up (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT),
# down the same with BLOCKS (row blocks a program makes in turn) for SPLIT. Their tile is laid out
# for the MMA's operand registers: 64 rows, steps of 128-column blocks (moe._check_int4_tiles).
# gate_up's sm_90 build at Kimi-K2's shapes and moe._int4_configs' (Triton 3.7.1, compiled on a CPU)
# takes 96 registers a thread at steps of 256 in 2 stages, down 79 at 128 in 3
INT4_DOT_SWEEP = dict(gate_up=[(64, 256, 4, 3, 7), (64, 256, 4, 3, 4), (64, 256, 4, 3, 2),
                               (64, 256, 4, 3, 1), (64, 256, 4, 4, 7), (64, 256, 4, 2, 7),
                               (64, 128, 4, 3, 7), (64, 128, 4, 4, 7), (64, 128, 4, 5, 7),
                               (64, 128, 4, 4, 4), (64, 512, 4, 2, 7), (64, 256, 4, 4, 4),
                               (64, 256, 4, 2, 4), (64, 128, 4, 2, 7)],
                      down=[(64, 128, 4, 2, 1), (64, 128, 4, 2, 2), (64, 128, 4, 2, 4),
                            (64, 128, 4, 3, 2), (64, 128, 4, 4, 2), (64, 256, 4, 2, 1),
                            (64, 256, 4, 2, 2), (64, 256, 4, 1, 2), (64, 128, 4, 3, 4),
                            (64, 128, 4, 3, 1)])
GEMV_SWEEP = {"plain": dict(gate_up=[], down=[(32, 256, 4, 1)]),
              "fp8": dict(gate_up=[(8, 128, 2, 4, 4), (2, 128, 2, 2, 4), (4, 128, 1, 4, 4),
                                   (4, 128, 2, 8, 8)],
                          down=[(16, 128, 4, 2), (4, 128, 2, 2)]),
              "int4": dict(gate_up=[(2, 128, 1), (1, 256, 1), (1, 64, 1), (2, 128, 2), (4, 128, 2),
                                    (2, 256, 1), (8, 128, 2), (8, 128, 4), (16, 128, 4),
                                    (1, 512, 1), (1, 1024, 1), (1, 1024, 2), (1, 128, 2),
                                    (1, 128, 4), (1, 256, 2), (1, 256, 4), (1, 64, 2)],
                           down=[(8, 256, 2), (4, 64, 1), (2, 128, 1), (4, 256, 1), (2, 256, 1),
                                 (8, 128, 2), (4, 128, 2), (16, 128, 2), (16, 128, 4),
                                 (32, 128, 4)])}


def _sweep_points(fmt, variant):
    """A variant's sweep points: the adaptive variant's configs are its GEMV launches' (the tiles
    keep moe._configs')."""
    if variant in ("gemv", "adaptive"):
        return [{part: c} for part, cs in GEMV_SWEEP[fmt].items() for c in cs]
    if fmt == "int4":
        return [{part: c} for part, cs in INT4_DOT_SWEEP.items() for c in cs]
    ok = lambda c: fmt != "fp8" or c[1] <= 128                                  # noqa: E731
    return [{part: c} for part, cs in DOT_SWEEP.items() for c in cs if ok(c)]


def benchmark_moe(sweep=(), variants=("dot", "gemv"), D=7168, I=256, E=384, K=8, LAYERS=6,
                  tokens=(1, 2, 3, 4, 8, 32),
                  formats=("plain", "fp8", "int4"), shared=False, distinct=None,
                  sweep_tokens=(1, 3, 4)):
    """One layer's routed experts per format, token count and variant of fused_moe ("dot": the tile
    variant's tiles through tl.dot, "gemv": the GEMV variant, "adaptive": the tiles or the GEMV,
    chosen on the device from the routing) against its floor (the distinct
    experts' stored bytes over the eager copy bandwidth measured here), timed as a graph of LAYERS
    calls. sweep: the variants whose sweep points are also timed, at the token counts of
    sweep_tokens.
    shared (INT4, FP8): also the GEMV launch with a bf16 shared expert in it ("gemv+shared",
    its bytes added to the floor; its gate_up in the default form, then in the loop form:
    moe_gemv.SHARED_DOT_MIN_TOKENS), and that shared expert alone the way the model runs it
    unfolded ("shared-torch": one GEMM over the stacked gate and up, SiLU times up, the down GEMM
    adding onto the routed output). distinct: pool sizes; each token's K experts drawn from a
    fixed random set of that many (SIMULATED routing; None: uniform over all E), a row's "pool".
    INT4's GEMV and adaptive also run as the model calls them, the activation planes made before the
    timing ("gemv+planes": the model's router kernel writes them, so no permute launch)."""
    dev, g = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    bandwidth = copy_bandwidth_GBps()
    LAYERS = max(2, LAYERS * 256 // I)   # wider ranks (TP 4, 2, 1): fewer layers, still past the L2
    print(f"fused MoE, one Kimi-K2 rank (D {D}, I {I}, {E} experts, K {K}, {LAYERS} layers); "
          f"copy bandwidth {bandwidth:.0f} GB/s")
    rows = []
    for fmt in formats:
        layers = [[_random_experts(fmt, E, o, i, dev, g) for o, i in ((I, D), (I, D), (D, I))]
                  for _ in range(LAYERS)]
        per_expert = sum(_expert_bytes(w) for w in layers[0])
        for N, pool in [(N, pool) for N in tokens for pool in distinct or (E,)]:
            x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
            ids, route_w = _simulated_routing(N, K, E, pool, g)
            floor_ms = ids.unique().numel() * per_expert / bandwidth / 1e6
            print(f"{fmt} N={N}: experts from {pool} of {E}, {ids.unique().numel()} distinct")
            first = len(rows)
            for variant in variants:
                if variant != "dot" and N * K > GEMV_MAX_PAIRS:
                    continue
                points = [None] + (_sweep_points(fmt, variant) if variant in sweep
                                   and N in sweep_tokens else [])
                for cfg in points:
                    rows += _time_moe(fmt, N, variant, cfg, layers, (x, ids, route_w), floor_ms,
                                      bandwidth, LAYERS)
                if variant != "dot" and fmt == "int4":   # as the model calls it (router's planes)
                    rows += _time_moe(fmt, N, variant, None, layers, (x, ids, route_w), floor_ms,
                                      bandwidth, LAYERS, planes=activation_planes(x))
            if shared and fmt in ("int4", "fp8") and N * K <= GEMV_MAX_PAIRS:
                # the shared expert's gate_up in its default form, then in the loop form
                points = [None, dict(shared_dot=False)] + (
                    _sweep_points(fmt, "gemv") if "gemv" in sweep and N in sweep_tokens else [])
                rows += _time_shared(fmt, N, layers, (x, ids, route_w), floor_ms, bandwidth,
                                     LAYERS, D, I, g, points)
            for r in rows[first:]:
                r.update(pool=pool, distinct=ids.unique().numel())
        del layers
    return dict(bandwidth_GBps=bandwidth, shapes=dict(D=D, I=I, E=E, K=K, layers=LAYERS), rows=rows,
                gemv_max_tokens=GEMV_MAX_TOKENS, device=torch.cuda.get_device_name(),
                torch=torch.__version__,
                triton=triton.__version__)


def _simulated_routing(N, K, E, pool, g):
    """SIMULATED routing of N tokens: each token's K experts drawn without repeats from one random
    pool of `pool` of the E experts (pool E: uniform over all), and random routing weights in
    [0, 1); ids [N, K], route_w [N, K] on g's device."""
    chosen = torch.randperm(E, device=g.device, generator=g)[:pool]
    ids = torch.stack([chosen[torch.randperm(pool, device=g.device, generator=g)[:K]]
                       for _ in range(N)])
    return ids, torch.rand(N, K, device=g.device, generator=g)


def _time_shared(fmt, N, layers, inputs, floor_ms, bandwidth, LAYERS, D, I, g, points):
    """The "gemv+shared" rows (at each config of points) and the "shared-torch" row of benchmark_moe
    (a bf16 shared expert a layer)."""
    dev = inputs[0].device
    shared = [[torch.randn(*s, device=dev, generator=g, dtype=torch.bfloat16) / s[1] ** 0.5
               for s in ((I, D), (I, D), (D, I))] for _ in layers]
    shared_ms = sum(t.numel() * t.element_size() for t in shared[0]) / bandwidth / 1e6
    rows = [r for cfg in points
            for r in _time_moe(fmt, N, "gemv", cfg, layers, inputs, floor_ms + shared_ms,
                               bandwidth, LAYERS, shared)]
    x, out = inputs[0], torch.zeros_like(inputs[0])
    stacked = [torch.cat([gate, up]) for gate, up, _ in shared]

    def torch_shared():
        return lambda: [out.addmm_(silu_mul(*F.linear(x, gu).chunk(2, -1)), d.t())
                        for gu, (_, _, d) in zip(stacked, shared)]
    ms = graph_ms([torch_shared()]) / LAYERS
    print(f"bf16 shared expert alone, torch (N={N}): {ms * 1e3:.1f} us  "
          f"floor {shared_ms * 1e3:.1f} us  {ms / shared_ms:.2f}x", flush=True)
    return rows + [dict(fmt="bf16", tokens=N, variant="shared-torch", config=None, ms=ms,
                        floor_ms=shared_ms,
                        x_floor=ms / shared_ms, GBps=shared_ms * bandwidth / ms)]


def _time_moe(fmt, N, variant, cfg, layers, inputs, floor_ms, bandwidth, LAYERS, shared=None,
              planes=None):
    """One benchmark row (a list of 0 or 1 dicts), printed. shared: a bf16 shared expert a layer, in
    the launch (fused_moe's shared). planes: INT4's activation planes made before the timing, as
    the model's router kernel writes them beside its logits (fused_moe's planes; row "gemv+planes":
    no permute launch)."""
    def run():
        return lambda: [fused_moe(*inputs, *w, configs=cfg, variant=variant, shared=s,
                                  planes=planes)
                        for w, s in zip(layers, shared or [None] * len(layers))]
    label = variant + ("+shared" if shared else "") + ("+planes" if planes is not None else "")
    try:
        ms = graph_ms([run()]) / LAYERS
    except Exception as e:  # a sweep point that does not compile: say so, go on
        print(f"{fmt} N={N} {label} {cfg}: {type(e).__name__}: {str(e)[:200]}")
        return []
    alone_ms, by_kernel = kernel_ms(run())        # each kernel's share, sweep points too
    alone_ms = alone_ms / LAYERS if alone_ms else None
    by_kernel = {name[:40]: v / LAYERS for name, v in by_kernel.items()}   # ms a layer, per kernel
    print(f"{fmt:5s} N={N:3d} {label:11s} {str(cfg or 'default'):34s} {ms * 1e3:8.1f} us"
          f"  floor {floor_ms * 1e3:7.1f} us"
          f"  {ms / floor_ms:5.2f}x  {floor_ms * bandwidth / ms:6.0f} GB/s"
          + (f"  kernels alone {alone_ms * 1e3:.1f} us ({alone_ms / floor_ms:.2f}x): "
             + ", ".join(f"{k.replace('_moe_', '').split('_kernel')[0]} {v * 1e3:.1f}"
                         for k, v in by_kernel.items())
             if alone_ms else ""), flush=True)
    return [dict(fmt=fmt, tokens=N, variant=label, config=cfg, ms=ms, kernel_ms=alone_ms,
                 by_kernel=by_kernel,
                 floor_ms=floor_ms, x_floor=ms / floor_ms, GBps=floor_ms * bandwidth / ms)]


def int4_precision(tokens=(1, 3, 8, 32), draws=3, D=7168, I=256, E=384, K=8):
    """The INT4 GEMV's packed form (a bf16 activation) against its fp32 form on the same weights and
    activation (x in fp32), beside the plain twin and the tile variant: a row per draw, each
    error's largest over the largest output and its mean over the mean output. The plain twin is
    model.Experts' products (weights dequantized to bf16, torch's bf16 einsums) with the K experts
    summed in fp32 and not rounded to bf16 at the end, as model.Experts and the kernels' outputs
    are: its errors here are that rounding lower."""
    dev, g = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    w = [_random_experts("int4", E, o, i, dev, g) for o, i in ((I, D), (I, D), (D, I))]
    rows = []
    for N, draw in [(N, d) for N in tokens for d in range(draws)]:
        x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(N)])
        route_w = torch.rand(N, K, device=dev, generator=g)
        fp32 = fused_moe(x.float(), ids, route_w, *w, variant="gemv").double()
        gate, up, down = (model.dequantize_int4(p.data[ids], p.scale[ids], p.group) for p in w)
        h = F.silu(torch.einsum("nd,nkid->nki", x, gate)) * torch.einsum("nd,nkid->nki", x, up)
        plain = (torch.einsum("nki,nkdi->nkd", h, down).float() * route_w[..., None]).sum(1)
        row = dict(tokens=N, draw=draw)
        for name, y in (("packed_gemv", fused_moe(x, ids, route_w, *w, variant="gemv")),
                        ("plain_bf16", plain),
                        ("tiles", fused_moe(x, ids, route_w, *w, variant="dot"))):
            err = (y.double() - fp32).abs()
            row[name] = dict(max=(err.max() / fp32.abs().max()).item(),
                             mean=(err.mean() / fp32.abs().mean()).item())
        rows.append(row)
        print(f"int4 N={N} draw {draw}: error against the fp32 form, max / mean: "
              + ", ".join(f"{k} {row[k]['max']:.2%} / {row[k]['mean']:.2%}"
                          for k in ("packed_gemv", "plain_bf16", "tiles")), flush=True)
    return dict(shapes=dict(D=D, I=I, E=E, K=K), rows=rows, device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__)
