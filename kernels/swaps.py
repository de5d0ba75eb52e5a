"""Putting the swaps in place: the one table of every swap (SWAPS: a kernel name, the module(s) it
swaps, its class, its prerequisites), the classes declared for the modules that take several swaps
at once (COMBINED), and accelerate / accelerate_draft, which read the table."""
from dataclasses import dataclass

import torch

import model

from .common import HAVE_TRITON, check_available, keep_out_of_compile
from .eagle import (DraftAttentionKernel, DraftHeadNorm, DraftNormsKernel, DraftTop1Kernel,
                    StackedQKV)
from .elementwise import AddRMSNorm, SiluMulKernel
from .gemv import GemvRowParallel, InputNormInQKVA, NormGemvMLA, NormGemvQKVA
from .mla import DecodeAttentionKernel, RopeCacheKernel
from .moe import (FusedExperts, GroupedExperts, SharedExpertInLaunch, fused_moe_available,
                  grouped_mm_available)
from .router import RouterKernel
from .stacked import SharedDownAddsRouted, StackedGateUp, StackedQKVA

# The names of run.py --kernels; all but "fused_proj" (GEMMs over stacked weights) are Triton
KERNELS = ("attention", "rope_cache", "router", "add_rmsnorm", "silu_mul", "shared_expert",
           "fused_proj", "norm_gemv")
MOE_IMPLS = ("gather", "grouped", "fused")   # run.py --moe-impl, with "auto"
DRAFT_KERNELS = ("attention", "router", "add_rmsnorm", "silu_mul", "fused_proj")   # the head's


# ---------------------------------------------------------------------------------------------
# Modules that take several swaps: one class each, declared here. Each swap overrides its own
# methods (DecodeAttentionKernel attend, RopeCacheKernel write_cache, NormGemvMLA the products,
# StackedQKVA the stacked q_a + kv_a), so the order of the bases only keeps Python's MRO; where
# two swaps meet in one method the class says so (merges_in_w_uv; NormGemvQKVA, gemv.py).

class AttentionRope(DecodeAttentionKernel, RopeCacheKernel):
    """"attention" with "rope_cache"."""


class AttentionQKVA(DecodeAttentionKernel, StackedQKVA):
    """"attention" with "fused_proj"."""


class RopeQKVA(RopeCacheKernel, StackedQKVA):
    """"rope_cache" with "fused_proj"."""


class AttentionRopeQKVA(DecodeAttentionKernel, RopeCacheKernel, StackedQKVA):
    """"attention", "rope_cache" and "fused_proj"."""


class RopeNormGemv(RopeCacheKernel, NormGemvMLA):
    """"rope_cache" with "norm_gemv"."""


class RopeNormGemvQKVA(RopeCacheKernel, NormGemvQKVA):
    """"rope_cache", "norm_gemv" and "fused_proj"."""


class AttentionNormGemv(DecodeAttentionKernel, NormGemvMLA):
    """"attention" with "norm_gemv": at one row (MLA_MERGE_ABSORB_MAX_ROWS) W_uv's GEMV launch
    merges the attention's parts."""
    merges_in_w_uv = True


class AttentionNormGemvQKVA(DecodeAttentionKernel, NormGemvQKVA):
    """"attention", "norm_gemv" and "fused_proj"; the merge as AttentionNormGemv's."""
    merges_in_w_uv = True


class AttentionRopeNormGemv(DecodeAttentionKernel, RopeCacheKernel, NormGemvMLA):
    """"attention", "rope_cache" and "norm_gemv"; the merge as AttentionNormGemv's."""
    merges_in_w_uv = True


class AttentionRopeNormGemvQKVA(DecodeAttentionKernel, RopeCacheKernel, NormGemvQKVA):
    """Every MLA swap; the merge in W_uv's launch as AttentionNormGemv."""
    merges_in_w_uv = True


class StackedGateUpSiluMul(SiluMulKernel, StackedGateUp):
    """"fused_proj" with "silu_mul" on an MLP (the target's and the head's)."""


class StackedQKVAttention(StackedQKV, DraftAttentionKernel):
    """"fused_proj" with "attention" on the head's attention."""


class DraftHeadNormTop1(DraftTop1Kernel, DraftHeadNorm):
    """"add_rmsnorm" with "router" on the head."""


class SharedExpertRouterInLaunch(SharedExpertInLaunch):
    """"shared_expert" with "router": the router kernel writes the shared expert's slot (and INT4
    experts' activation planes) in its own launch."""
    gate_kernel = True


def _parts(cls):
    """The swaps a declared class is made of."""
    if cls not in _DECLARED:
        return frozenset([cls])
    return frozenset().union(*(_parts(b) for b in cls.__bases__))


_DECLARED = (NormGemvQKVA, AttentionRope, AttentionQKVA, RopeQKVA, AttentionRopeQKVA,
             RopeNormGemv, RopeNormGemvQKVA, AttentionNormGemv, AttentionNormGemvQKVA,
             AttentionRopeNormGemv, AttentionRopeNormGemvQKVA, StackedGateUpSiluMul,
             StackedQKVAttention, DraftHeadNormTop1)
COMBINED = {_parts(cls): cls for cls in _DECLARED}   # {the swaps: the class that holds them}


def swap(module, *swaps):
    """Re-class a plain `module` (of a model.py, tp.py or draft.py class) in place as the swap that
    `swaps` name: one swap, or the class COMBINED declares for several; then let it attach() what it
    keeps beside the weights. Parameters, buffers and their names stay as they are. Returns the
    module."""
    plain = type(module)
    if plain.__module__.split(".")[0] == __name__.split(".")[0]:
        raise TypeError(f"swap: the module is a {plain.__name__} already; swap a plain one")
    for s in swaps:
        if not issubclass(s, plain):
            raise TypeError(f"{s.__name__} is no swap for a {plain.__name__}")
    if not swaps:
        return module
    parts = frozenset().union(*map(_parts, swaps))
    cls = next(iter(parts)) if len(parts) == 1 else COMBINED.get(parts)
    if cls is None:
        raise TypeError(f"no class declared for {sorted(s.__name__ for s in parts)} together "
                        "(COMBINED)")
    module.__class__ = cls
    if hasattr(cls, "attach"):
        module.attach()
    return module


# ---------------------------------------------------------------------------------------------
# The table

@dataclass(frozen=True)
class Swap:
    """One swap: where `name` is asked for (with every name of `also`), each module of `slot` that
    `where` accepts becomes `cls`, unless a swap of a name in `unless` went into the same layer
    before it (rows run in table order). Names: KERNELS, and "moe=" the routed experts' path."""
    name: str
    slot: str
    cls: type
    also: tuple = ()
    unless: tuple = ()
    where: object = None


def _q_lora(m):
    """MLA with q_lora_rank (q_a_proj and its norm): an attention module or its layer."""
    return bool(getattr(m, "self_attn", m).args.q_lora_rank)


def _moe(layer):
    return layer.mlp if isinstance(layer.mlp, model.MoE) else None


SLOTS = {   # slot -> the modules it names, of a layer of the target, the target, or the head
    "attention": lambda layer: [layer.self_attn],
    "o_proj": lambda layer: [layer.self_attn.o_proj],
    "norms": lambda layer: [layer.input_layernorm, layer.post_attention_layernorm],
    "attention norms": lambda layer: [getattr(layer.self_attn, "q_a_layernorm", None),
                                      layer.self_attn.kv_a_layernorm],     # MLA's, no residual
    "layer": lambda layer: [layer],
    "moe": lambda layer: [_moe(layer)],
    "experts": lambda layer: [_moe(layer) and layer.mlp.experts],
    "gate": lambda layer: [_moe(layer) and layer.mlp.gate],
    "mlp": lambda layer: [layer.mlp.shared_experts if _moe(layer) else layer.mlp],   # SwiGLU MLPs
    "final_norm": lambda target: [target.norm],
    "head": lambda head: [head],
    "head.midlayer": lambda head: [head.midlayer],
    "head.attention": lambda head: [head.midlayer.self_attn],
    "head.mlp": lambda head: [head.midlayer.mlp],
}
LAYER_SLOTS = ("attention", "o_proj", "norms", "attention norms", "layer", "moe", "experts", "gate",
               "mlp")
HEAD_SLOTS = ("head", "head.midlayer", "head.attention", "head.mlp")

SWAPS = (
    Swap("moe=grouped", "experts", GroupedExperts),
    Swap("moe=fused", "experts", FusedExperts),
    Swap("attention", "attention", DecodeAttentionKernel),
    Swap("rope_cache", "attention", RopeCacheKernel),
    Swap("norm_gemv", "attention", NormGemvMLA),
    Swap("fused_proj", "attention", StackedQKVA, where=_q_lora),
    Swap("norm_gemv", "o_proj", GemvRowParallel),
    Swap("add_rmsnorm", "norms", AddRMSNorm),
    Swap("add_rmsnorm", "attention norms", AddRMSNorm),
    Swap("norm_gemv", "layer", InputNormInQKVA, also=("fused_proj", "add_rmsnorm"), where=_q_lora),
    Swap("router", "gate", RouterKernel),
    Swap("shared_expert", "moe", SharedExpertRouterInLaunch, also=("moe=fused", "router"),
         where=SharedExpertInLaunch.applies),
    Swap("shared_expert", "moe", SharedExpertInLaunch, also=("moe=fused",), unless=("router",),
         where=SharedExpertInLaunch.applies),
    Swap("fused_proj", "moe", SharedDownAddsRouted, unless=("shared_expert",)),
    Swap("fused_proj", "mlp", StackedGateUp, unless=("shared_expert",)),
    Swap("silu_mul", "mlp", SiluMulKernel),
    Swap("add_rmsnorm", "final_norm", AddRMSNorm),
    Swap("attention", "head.attention", DraftAttentionKernel),
    Swap("fused_proj", "head.attention", StackedQKV),
    Swap("fused_proj", "head.mlp", StackedGateUp),
    Swap("silu_mul", "head.mlp", SiluMulKernel),
    Swap("add_rmsnorm", "head.midlayer", DraftNormsKernel),
    Swap("add_rmsnorm", "head", DraftHeadNorm),
    Swap("router", "head", DraftTop1Kernel),
)


def apply_swaps(root, slots, names):
    """The rows of SWAPS on `slots` of `root` (a layer, the target or the head) where `names` ask
    for them; each module swapped once, into the class of all its swaps. Returns the names of the
    rows that swapped a module."""
    plan, done = {}, set()
    for row in SWAPS:
        if (row.slot not in slots or row.name not in names or not set(row.also) <= names
                or set(row.unless) & done):
            continue
        modules = [m for m in SLOTS[row.slot](root)
                   if m is not None and (row.where is None or row.where(m))]
        for m in modules:
            plan.setdefault(m, []).append(row.cls)
        done |= {row.name} if modules else set()
    for m, classes in plan.items():
        swap(m, *classes)
    return done


# ---------------------------------------------------------------------------------------------
# accelerate

def kernel_names(names):
    """names: an iterable of KERNELS, one name, "all", "none" or None -> a set; unknown refused."""
    names = set(KERNELS if names == "all" else () if names in (None, "none") else
                [names] if isinstance(names, str) else names)
    if names - set(KERNELS):
        raise ValueError(f"unknown kernels {sorted(names - set(KERNELS))}; choose from "
                         f"{list(KERNELS)} or 'all'")
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
        raise ValueError(f"moe='fused' needs Triton and a bf16, fp16 or float32 model on CUDA "
                         f"(or Triton's CPU interpreter, TRITON_INTERPRET=1); here: {dtype} on "
                         f"{device}, Triton {'installed' if HAVE_TRITON else 'not installed'}")
    return moe


def accelerate(target, names=(), moe="auto"):
    """Swap the fast paths into a plain model.Transformer, in place, and return the names of KERNELS
    swapped in. names: "attention" (decode-mode MLA attention), "rope_cache" (RoPE + latent norm +
    cache writes), "router" (SIMULATED uniform routing included), "add_rmsnorm" (every residual add
    with the norm that reads the sum; MLA's q_a and kv_a norms, which have none, by its kernel
    without the add), "silu_mul" (the MLPs' SwiGLU), "norm_gemv" (GEMV kernels, up to the row
    limits of kernels/gemv.py: q_b_proj with q_a_layernorm inside and decode mode's absorbed
    products over the heads, 16 rows; with fused_proj the stacked q_a + kv_a, 16 rows, and with
    add_rmsnorm too, at one row, the layer's input add and norm inside it: InputNormInQKVA; o_proj,
    2 rows),
    "shared_expert" (the shared expert inside the fused MoE launch, where
    SharedExpertInLaunch.applies; else left off and not listed), "fused_proj" (plain torch: q_a +
    kv_a and each unfolded MLP's gate + up as one GEMM, the shared expert's down GEMM adding onto
    the routed output); an iterable, "all" or "none". moe: the routed experts' path (pick_moe). The
    state dict keeps its keys and values. What was done is recorded as target.kernels and
    target.moe_impl (run.py prints them)."""
    names = kernel_names(names)
    if hasattr(target, "kernels"):
        raise ValueError(f"accelerate: this model is accelerated already (kernels "
                         f"{target.kernels}); build a plain one")
    device, dtype = target.device, target.dtype
    moe = pick_moe(moe, device, dtype)
    if names - {"fused_proj"}:
        check_available(device)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"the Triton kernels run bf16, fp16 or fp32 models, not {dtype}")
    done = set()
    for layer in target.layers:
        done |= accelerate_layer(layer, names, moe)
    apply_swaps(target, ("final_norm",), names)
    target.kernels = tuple(k for k in KERNELS if k in names and (k != "shared_expert" or k in done))
    target.moe_impl = moe
    return target.kernels


def accelerate_layer(layer, names, moe):
    """accelerate's swaps for one model.Block; returns the names of those that went in."""
    return apply_swaps(layer, LAYER_SLOTS, set(names) | {"moe=" + moe})


def compile_layers(target):
    """run.py --compile: let torch.compile fuse each decoder layer's small kernels (regional
    compilation: the layers of a kind share one compiled code, one per shape and mode), the
    Triton launches left between the compiled parts. Tested equal to the plain layers; CUDA
    graphs stay explicit (graphs.py captures these)."""
    keep_out_of_compile()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in target.layers:
        layer.compile(dynamic=False)   # Block.forward, through the module's call
    return target


def accelerate_draft(head, names=()):
    """Swap the fast paths into a plain draft.Eagle3Draft, in place, and return the names swapped
    in (of KERNELS; those of DRAFT_KERNELS): "attention" (RoPE, cache write and attention of a chain
    step or an extend), "router" (the draft token's argmax and d2t map), "add_rmsnorm" (the input
    norms in one launch, each residual add in the norm that reads the sum), "silu_mul" (the MLP's
    SwiGLU), "fused_proj" (plain torch: q/k/v and gate/up as one GEMM each); an iterable, "all" or
    "none", as accelerate. The state dict keeps its keys and values; head.kernels records what was
    done (run.py prints it)."""
    names = kernel_names(names) & set(DRAFT_KERNELS)
    if hasattr(head, "kernels"):
        raise ValueError(f"accelerate_draft: this head is accelerated already (kernels "
                         f"{head.kernels}); build a plain one")
    device, dtype = head.norm.weight.device, head.norm.weight.dtype
    if names - {"fused_proj"}:
        check_available(device)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"the Triton kernels run bf16, fp16 or fp32 heads, not {dtype}")
    apply_swaps(head, HEAD_SLOTS, names)
    head.kernels = tuple(k for k in DRAFT_KERNELS if k in names)
    return head.kernels
