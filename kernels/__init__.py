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

from .common import HAVE_TRITON, PDL, check_available, interpreting, launch
from .eagle import (DraftAttentionKernel, DraftHeadNorm, DraftNormsKernel, DraftTop1Kernel, StackedQKV,
                    compile_head, draft_attention, draft_input_norms, draft_split_len, draft_top1)
from .elementwise import AddRMSNorm, SiluMulKernel, add_rmsnorm, silu_mul
from .gemv import (HEAD_GEMV_MAX_ROWS, INPUT_NORM_QKVA_MAX_ROWS, NORM_GEMV_MAX_ROWS,
                   O_PROJ_GEMV_MAX_ROWS, QKVA_GEMV_MAX_ROWS, GemvRowParallel, InputNormInQKVA,
                   NormGemvMLA, NormGemvQKVA, head_gemv, norm_gemv)
from .mla import (MLA_MERGE_ABSORB_MAX_ROWS, DecodeAttentionKernel, MLAParts, RopeCacheKernel,
                  mla_combine, mla_decode_attention, mla_merge_absorb, mla_rope_cache_write,
                  mla_split_len)
from .moe import (FusedExperts, GroupedExperts, SharedExpertInLaunch, expert_weights, fused_moe,
                  fused_moe_available, gemv_rule, grouped_mm_available, with_shared_slot)
from .moe_gemv import GEMV_MAX_PAIRS, GEMV_MAX_TOKENS, ExpertWeights, nibble_planes
from .router import RouterKernel, router_topk
from .stacked import SharedDownAddsRouted, StackedGateUp, StackedQKVA, stack_rows
from .swaps import (COMBINED, DRAFT_KERNELS, KERNELS, MOE_IMPLS, SWAPS, accelerate, accelerate_draft,
                    accelerate_layer, compile_layers, kernel_names, pick_moe, swap)
from .common import _counters  # noqa: F401  (the tests check the counters are left zero)
