"""The fast path: Triton kernels for the hot paths of a decode or verify step, and the module swaps
that put them in place of model.py's plain code, which stays the readable specification.

One module a kernel family, each with its kernels, launchers, constants and swaps:

  moe.py, moe_gemv.py  routed experts: fused_moe (tiles; GEMV for a few tokens, INT4 unpacked in
                       registers, the shared expert in the launch); GroupedExperts, FusedExperts,
                       SharedExpertInLaunch (twins: model.Experts, model.MoE)
  mla.py               MLA's decode step: mla_decode_attention, mla_merge_absorb,
                       mla_rope_cache_write; DecodeAttentionKernel, RopeCacheKernel (twins:
                       model.MLA.attend, write_cache)
  router.py            router_topk; RouterKernel (twin: model.Router)
  gemv.py              norm_gemv (RMSNorm and a residual add inside the GEMV), head_gemv;
                       NormGemvMLA, NormGemvQKVA, InputNormInQKVA, GemvRowParallel (twins:
                       model.MLA's projections, model.Block's input norm, tp.RowParallelLinear)
  elementwise.py       add_rmsnorm, rmsnorm, silu_mul; AddRMSNorm, SiluMulKernel (twins:
                       model.RMSNorm, model.MLP.act)
  stacked.py           "fused_proj", plain torch: StackedQKVA, StackedGateUp, SharedDownAddsRouted
  eagle.py             the EAGLE-3 head: draft_input_norms, draft_attention, draft_top1 and their
                       swaps (twins: draft.py's modules)
  common.py            the Triton guard, _jit, programmatic dependent launch (and the weights'
                       L2 prefetch before its wait), shared counters
  swaps.py             SWAPS, the one table of every swap and its prerequisites; accelerate
  bench.py             the kernels' micro-benchmarks (python -m kernels.bench --help); the fused
                       MoE's (--moe) in bench_moe.py, their timing in bench_timing.py

A swap is a subclass of a model.py (or tp.py, draft.py) module that overrides only the methods
that differ and keeps the parameter names, so one state dict loads into both and each test
compares a module with its swap on the same weights. accelerate(model, names, moe=...) puts them
in place (run.py --kernels, --moe-impl); accelerate_draft(head, names) does the same for the
EAGLE-3 head; compile_layers(model) is run.py --compile's regional torch.compile.

Triton is imported only where it exists: without it this package still imports (HAVE_TRITON is
False) and the plain paths run. On a CPU the kernels run only under the Triton interpreter
(TRITON_INTERPRET=1, set before import; slow, for tests). This package imports model.py, draft.py
and tp.py, never the reverse.

Shape legend: B batch rows, T query tokens per row, H local heads, M = T*H query rows of one
batch row, C kv_lora_rank (latent width), R qk_rope_head_dim, S cache slots, N tokens, D hidden,
E routed experts, G expert groups, K experts per token, I expert intermediate (this rank's
slice), P = N*K token-expert pairs (gemv.py's GEMVs use GEMM's M rows, N outputs, K inputs;
eagle.py's G is the head's kv heads). Every kernel keeps a fixed launch shape for given input
shapes and reads no device value on the host, so all of them can be captured in CUDA graphs.
Every kernel begins with _wait_for_prior(), preceded at most by an L2 prefetch (of weight rows;
in MLA's decode kernel, of cached slots: common.py), and every launch passes
launch_pdl=common.PDL: on Hopper a kernel starts while the one before it finishes (programmatic
dependent launch, common.py).
"""

from .common import HAVE_TRITON, PDL, check_available, interpreting, launch
from .eagle import (DraftAttentionKernel, DraftHeadNorm, DraftNormsKernel, DraftTop1Kernel,
                    StackedQKV, compile_head, draft_attention, draft_split_len, draft_top1)
from .elementwise import AddRMSNorm, SiluMulKernel, add_rmsnorm, rmsnorm, silu_mul
from .gemv import (HEAD_GEMV_MAX_ROWS, INPUT_NORM_QKVA_MAX_ROWS, NORM_GEMV_MAX_ROWS,
                   O_PROJ_GEMV_MAX_ROWS, Q_B_GEMV_MAX_ROWS, QKVA_GEMV_MAX_ROWS, GemvRowParallel,
                   InputNormInQKVA, NormGemvMLA, NormGemvQKVA, head_gemv, norm_gemv)
from .mla import (MLA_MERGE_ABSORB_MAX_ROWS, DecodeAttentionKernel, RopeCacheKernel, mla_combine,
                  mla_decode_attention, mla_merge_absorb, mla_rope_cache_write)
from .moe import (FusedExperts, GroupedExperts, SharedExpertInLaunch, expert_weights, fused_moe,
                  fused_moe_available, grouped_mm_available, with_shared_slot)
from .moe_gemv import GEMV_MAX_PAIRS, GEMV_MAX_TOKENS, ExpertWeights, gemv_max_tokens, nibble_planes
from .router import RouterKernel
from .stacked import SharedDownAddsRouted, StackedGateUp, StackedQKVA
from .swaps import (DRAFT_KERNELS, KERNELS, SWAPS, accelerate, accelerate_draft, accelerate_layer,
                    compile_layers, pick_moe, swap)
from .common import _counters  # noqa: F401  (the tests check the counters are left zero)
