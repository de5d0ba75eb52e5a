"""The fast path: Triton kernels for the hot paths of a decode or verify step, and the module swaps
that put them in place of model.py's plain code, which stays the readable specification.

  Routed experts         fused_moe              swap: FusedExperts (twin: model.Experts)
  MLA decode step        mla_decode_attention   swap: DecodeAttentionKernel (twins: model.MLA.write_cache,
                         mla_merge_absorb       model.absorbed_attention; with NormGemvMLA at one row,
                                                the merge inside W_uv's GEMV launch)
  RoPE + cache write     mla_rope_cache_write   swap: RopeCacheKernel (twin: model.MLA.write_cache; extend
                                                mode and draft trees)
  Router                 router_topk            swap: RouterKernel (twin: model.Router)
  Residual add + RMSNorm add_rmsnorm            swap: AddRMSNorm (twin: model.RMSNorm with a residual)
  SwiGLU activation      silu_mul               swap: SiluMulKernel (twin: model.MLP.act)
  RMSNorm + GEMV         norm_gemv              swap: NormGemvMLA (twin: model.MLA.query; with
                                                StackedQKVA, its q_kv_a), GemvRowParallel (twin:
                                                tp.RowParallelLinear, MLA's o_proj), with fused_proj
                                                and add_rmsnorm InputNormInQKVA (twin: model.Block's
                                                input add + norm and MLA.project, in one launch)
  GEMV per head          head_gemv              swap: NormGemvMLA (twin: model.MLA.absorb_query,
                                                absorb_output)
  EAGLE-3 head: input    draft_input_norms      swap: DraftNormsKernel (twin: draft.MidLayer's two norms
  norms, attention,      draft_attention        and concat), DraftAttentionKernel (twin:
  draft token            draft_top1             draft.DraftAttention), DraftTop1Kernel (twin:
                                                draft.Eagle3Draft.to_target_ids)

A swap is a subclass of a model.py (or tp.py) module that overrides only the methods that differ
and keeps the parameter names, so one state dict loads into both and each test compares a module
with its swap on the same weights. Torch-only swaps live here too: GroupedExperts
(torch._grouped_mm), StackedQKVA / StackedGateUp (one GEMM over stacked weights, "fused_proj"),
SharedExpertInLaunch (the shared expert inside the fused launch), StackedQKV (the
head's q/k/v). accelerate(model, names, moe=...) puts them in place, re-classing the modules of a
built model (run.py --kernels, --moe-impl); accelerate_draft(head, names) does the same for the
EAGLE-3 head; compile_layers(model) is run.py --compile's regional torch.compile.

Triton is imported only where it exists: without it this module still imports (HAVE_TRITON is
False) and the plain paths run. On a CPU the kernels run only under the Triton interpreter
(TRITON_INTERPRET=1, set before import; slow, for tests). This module imports model.py, draft.py
and tp.py, never the reverse; the kernels' micro-benchmarks are kernels_bench.py.

Shape legend: B batch rows, T query tokens per row, H local heads, M = T*H query rows of one
batch row, C kv_lora_rank (latent width), R qk_rope_head_dim, S cache slots, N tokens, D hidden,
E routed experts, G expert groups, K experts per token, I expert intermediate (this rank's
slice), P = N*K token-expert pairs. Every kernel keeps a fixed launch shape for given input
shapes and reads no device value on the host, so all of them can be captured in CUDA graphs.
Every kernel begins with _wait_for_prior() and every launch passes launch_pdl=PDL: on Hopper a
kernel starts while the one before it finishes (programmatic dependent launch, below _jit).
"""
import functools

import torch

import model

from .common import (HAVE_TRITON, PDL, AttachAgain, _counters, _pow2, check_available, interpreting,
                     launch, rows)
from .eagle import (DRAFT_ATTN_BLOCK_N, DraftAttentionKernel, DraftHeadNorm, DraftNormsKernel,
                    DraftTop1Kernel, StackedQKV, compile_head, draft_attention, draft_input_norms,
                    draft_split_len, draft_top1)
from .elementwise import AddRMSNorm, SiluMulKernel, add_rmsnorm, silu_mul
from .gemv import (HEAD_GEMV_MAX_ROWS, INPUT_NORM_QKVA_MAX_ROWS, NORM_GEMV_MAX_ROWS,
                   O_PROJ_GEMV_MAX_ROWS, QKVA_GEMV_MAX_ROWS, GemvRowParallel, InputNormInQKVA,
                   NormGemvMLA, head_gemv, norm_gemv)
from .mla import (MLA_MERGE_ABSORB_MAX_ROWS, DecodeAttentionKernel, MLAParts, RopeCacheKernel,
                  mla_combine, mla_decode_attention, mla_merge_absorb, mla_rope_cache_write,
                  mla_split_len)
from .moe import (FusedExperts, GroupedExperts, SharedExpertInLaunch, expert_weights, fused_moe,
                  fused_moe_available, gemv_rule, grouped_mm_available, with_shared_slot)
from .moe_gemv import GEMV_MAX_PAIRS, GEMV_MAX_TOKENS, ExpertWeights, nibble_planes
from .router import RouterKernel, router_topk
from .stacked import SharedDownAddsRouted, StackedGateUp, StackedQKVA, stack_rows

# The names of run.py --kernels; all but "fused_proj" (GEMMs over stacked weights) are Triton
KERNELS = ("attention", "rope_cache", "router", "add_rmsnorm", "silu_mul", "shared_expert", "fused_proj",
           "norm_gemv")
MOE_IMPLS = ("gather", "grouped", "fused")   # run.py --moe-impl, with "auto"


def swap(module, *swaps):
    """Re-class `module` in place as a subclass of its class with `swaps` (subclasses of its
    model.py class) in front, then let each new swap attach() what it keeps beside the weights.
    Parameters, buffers and their names stay as they are. Returns the module."""
    plain = next(c for c in type(module).__mro__ if not c.__module__.startswith(__name__))
    new = tuple(s for s in swaps if not isinstance(module, s))
    for s in new:
        if not issubclass(s, plain):
            raise TypeError(f"{s.__name__} is no swap for a {plain.__name__}")
    if new:
        module.__class__ = _combined(new + (type(module),))
        for s in new:
            if "attach" in vars(s):
                s.attach(module)
    return module


@functools.cache
def _combined(bases):
    return type("+".join(b.__name__ for b in bases), bases, {})


def kernel_names(names):
    """names: an iterable of KERNELS, one name, "all", "none" or None -> a set; unknown refused."""
    names = set(KERNELS if names == "all" else () if names in (None, "none") else
                [names] if isinstance(names, str) else names)
    if names - set(KERNELS):
        raise ValueError(f"unknown kernels {sorted(names - set(KERNELS))}; choose from {list(KERNELS)} or 'all'")
    return names


def pick_moe(moe, device, dtype):
    """moe "auto" (on a GPU: fused where Triton is installed, else grouped where torch._grouped_mm
    runs; on the CPU: gather), or a named one, refused where it cannot run."""
    device = torch.device(device)
    if moe == "auto":
        moe = ("gather" if device.type != "cuda" else "fused" if fused_moe_available(device, dtype)
               else "grouped" if grouped_mm_available(device, dtype) else "gather")
    if moe not in MOE_IMPLS:
        raise ValueError(f"moe must be 'auto', 'gather', 'grouped' or 'fused', not {moe!r}")
    if moe == "grouped" and not grouped_mm_available(device, dtype):
        raise ValueError(f"moe='grouped' needs torch._grouped_mm for {dtype} on {device}")
    if moe == "fused" and not fused_moe_available(device, dtype):
        raise ValueError(f"moe='fused' needs Triton and a bf16, fp16 or float32 model on CUDA (or Triton's "
                         f"CPU interpreter, TRITON_INTERPRET=1); here: {dtype} on {device}, Triton "
                         f"{'installed' if HAVE_TRITON else 'not installed'}")
    return moe


def accelerate(target, names=(), moe="auto"):
    """Swap the fast paths into a plain model.Transformer, in place, and return the names of
    KERNELS swapped in. names: "attention" (decode-mode MLA attention), "rope_cache" (RoPE +
    latent norm + cache writes), "router" (SIMULATED uniform routing included), "add_rmsnorm"
    (every residual add with the norm that reads the sum), "silu_mul" (the MLPs' SwiGLU),
    "norm_gemv" (GEMV kernels: for <= 16 rows q_b_proj with q_a_layernorm inside; for <= 4 rows
    decode mode's absorbed products over the heads and, with fused_proj, the stacked q_a + kv_a,
    with add_rmsnorm too, at one row, the layer's input add and norm inside it: InputNormInQKVA;
    for <= 2 rows o_proj), "shared_expert" (the shared expert inside the fused MoE launch, where
    SharedExpertInLaunch.applies; else left off and not listed), "fused_proj" (plain torch: q_a +
    kv_a and each unfolded MLP's gate + up as one GEMM, the shared expert's down GEMM adding onto
    the routed output); an iterable, "all" or "none". moe: the routed experts' path
    (pick_moe). The state dict keeps its keys and values. What was done is recorded as
    target.kernels and target.moe_impl (run.py prints them)."""
    names = kernel_names(names)
    if hasattr(target, "kernels"):
        raise ValueError(f"accelerate: this model is accelerated already (kernels {target.kernels}); "
                         "build a plain one")
    device, dtype = target.device, target.dtype
    moe = pick_moe(moe, device, dtype)
    if names - {"fused_proj"}:
        check_available(device)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"the Triton kernels run bf16, fp16 or fp32 models, not {dtype}")
    for layer in target.layers:
        accelerate_layer(layer, names, moe)
    if "add_rmsnorm" in names:
        swap(target.norm, AddRMSNorm)
    folded = any(isinstance(m, SharedExpertInLaunch) for m in target.modules())
    target.kernels = tuple(k for k in KERNELS if k in names and (k != "shared_expert" or folded))
    target.moe_impl = moe
    return target.kernels


def accelerate_layer(layer, names, moe):
    """accelerate's swaps for one model.Block."""
    attn = layer.self_attn
    if "fused_proj" in names and attn.args.q_lora_rank:
        swap(attn, StackedQKVA)                 # first: NormGemvMLA, in front of it, takes over its q_kv_a
    swap(attn, *[cls for name, cls in (("attention", DecodeAttentionKernel), ("rope_cache", RopeCacheKernel),
                                       ("norm_gemv", NormGemvMLA)) if name in names])
    if "norm_gemv" in names:
        swap(attn.o_proj, GemvRowParallel)
    if "add_rmsnorm" in names:
        swap(layer.input_layernorm, AddRMSNorm)
        swap(layer.post_attention_layernorm, AddRMSNorm)
    if {"norm_gemv", "fused_proj", "add_rmsnorm"} <= names and attn.args.q_lora_rank:
        swap(layer, InputNormInQKVA)
    mlp = layer.mlp
    if isinstance(mlp, model.MoE):
        swap(mlp.experts, *{"gather": (), "grouped": (GroupedExperts,), "fused": (FusedExperts,)}[moe])
        if "router" in names:
            swap(mlp.gate, RouterKernel)
        if "shared_expert" in names and SharedExpertInLaunch.applies(mlp):
            swap(mlp, SharedExpertInLaunch)   # its gate and up rows live in the [E + 1] tensors now
        elif "fused_proj" in names:
            swap(mlp, SharedDownAddsRouted)
            swap(mlp.shared_experts, StackedGateUp)
        mlp = mlp.shared_experts
    elif "fused_proj" in names:
        swap(mlp, StackedGateUp)
    if "silu_mul" in names:
        swap(mlp, SiluMulKernel)


def compile_layers(target):
    """run.py --compile: let torch.compile fuse each decoder layer's small kernels (regional
    compilation: the layers of a kind share one compiled code, one per shape and mode), the
    Triton launches left between the compiled parts. Tested equal to the plain layers; CUDA
    graphs stay explicit (graphs.py captures these)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in target.layers:
        layer.compile(dynamic=False)   # Block.forward, through the module's call
    return target




DRAFT_KERNELS = ("attention", "router", "add_rmsnorm", "silu_mul", "fused_proj")   # KERNELS names the head takes


def accelerate_draft(head, names=()):
    """Swap the fast paths into a plain draft.Eagle3Draft, in place, and return the names swapped in
    (of KERNELS; those of DRAFT_KERNELS): "attention" (RoPE, cache write and attention of a chain step
    or an extend), "router" (the draft token's argmax and d2t map), "add_rmsnorm" (the input norms in
    one launch, each residual add in the norm that reads the sum), "silu_mul" (the MLP's SwiGLU),
    "fused_proj" (plain torch: q/k/v and gate/up as one GEMM each); an iterable, "all" or "none", as
    accelerate. The state dict keeps its keys and values; head.kernels records what was done (run.py
    prints it)."""
    names = kernel_names(names) & set(DRAFT_KERNELS)
    if hasattr(head, "kernels"):
        raise ValueError(f"accelerate_draft: this head is accelerated already (kernels {head.kernels}); build a "
                         "plain one")
    device, dtype = head.norm.weight.device, head.norm.weight.dtype
    if names - {"fused_proj"}:
        check_available(device)
        if dtype not in DRAFT_ATTN_BLOCK_N:
            raise ValueError(f"the Triton kernels run bf16, fp16 or fp32 heads, not {dtype}")
    mid = head.midlayer
    if "attention" in names:
        swap(mid.self_attn, DraftAttentionKernel)
    if "fused_proj" in names:
        swap(mid.self_attn, StackedQKV)
        swap(mid.mlp, StackedGateUp)
    if "add_rmsnorm" in names:
        swap(mid, DraftNormsKernel)
        swap(head, DraftHeadNorm)
    if "silu_mul" in names:
        swap(mid.mlp, SiluMulKernel)
    if "router" in names:
        swap(head, DraftTop1Kernel)
    head.kernels = tuple(k for k in DRAFT_KERNELS if k in names)
    return head.kernels


