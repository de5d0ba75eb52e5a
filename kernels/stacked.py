"""fused_proj: plain torch, one GEMM over the stacked weights of projections that read one input."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import model

from .common import AttachAgain


def stack_rows(*linears):
    """Make the linears' weights [out_i, in] row blocks of one new buffer [sum out_i, in] and return
    it: each weight becomes a view of its block (no second copy), so a checkpoint still loads, and
    random init still writes, by each linear's own name, while one GEMM over the buffer reads the
    linears' shared input once."""
    buf = torch.cat([linear.weight.detach() for linear in linears])
    for linear, block in zip(linears, buf.split([linear.weight.shape[0] for linear in linears])):
        view = nn.Parameter(block, requires_grad=False)
        view.shard_dim = linear.weight.shard_dim
        linear.weight = view
    return buf


def training(*linears):
    """Whether autograd wants the linears' gradients: their weights are views of the stacked
    buffer, but a product over the buffer has no autograd link to those Parameters, so a forward
    that trains them takes the plain per-linear products."""
    return torch.is_grad_enabled() and any(linear.weight.requires_grad for linear in linears)


class StackedQKVA(AttachAgain, model.MLA):
    """"fused_proj" (plain torch; MLA with q_lora_rank): q_a_proj and kv_a_proj_with_mqa, which
    both read x, as one GEMM over their weights stacked (stack_rows)."""

    def attach(self):
        self.q_kv_a_weight = stack_rows(self.q_a_proj, self.kv_a_proj_with_mqa)

    def q_kv_a(self, x):                       # [..., q_lora_rank + kv_lora_rank + rope dim]
        if training(self.q_a_proj, self.kv_a_proj_with_mqa):
            return torch.cat([self.q_a_proj(x), self.kv_a_proj_with_mqa(x)], -1)
        return F.linear(x, self.q_kv_a_weight)

    def project(self, x):
        return self.split_q_kv_a(self.q_kv_a(x))

    def split_q_kv_a(self, q_kv_a):
        """project's outputs from the stacked product: the queries of its q_a part, and kv_a."""
        a = self.args
        q_a, kv_a = q_kv_a.split([a.q_lora_rank, a.kv_lora_rank + a.qk_rope_head_dim], -1)
        return self.query(q_a), kv_a


class StackedGateUp(AttachAgain, model.MLP):
    """"fused_proj": gate_proj and up_proj as one GEMM over their stacked weights (stack_rows).
    add_to (a shared expert, reduce=False): a tensor [N, dim], the MoE's routed output, that the
    down GEMM adds its product into, in place, instead of an add after it."""

    def attach(self):
        self.gate_up_weight = stack_rows(self.gate_proj, self.up_proj)

    def gate_up(self, x):                                  # one GEMM: [..., 2 I] = [gate | up]
        if training(self.gate_proj, self.up_proj):
            return super().gate_up(x)
        return F.linear(x, self.gate_up_weight).chunk(2, -1)

    def forward(self, x, add_to=None):
        if add_to is None:
            return super().forward(x)
        assert not self.down_proj.reduce, "add_to needs reduce=False: the caller reduces the sum"
        gate, up = self.gate_up(x)
        return add_to.addmm_(self.act(gate, up), self.down_proj.weight.t())


class SharedDownAddsRouted(model.MoE):
    """"fused_proj" on an MoE: the shared expert's down GEMM (StackedGateUp) adds onto the routed
    output; one kernel less a layer."""

    def partial_sum(self, x):
        ids, weights = self.gate(x)
        return self.shared_experts(x, add_to=self.experts(x, ids, weights))


