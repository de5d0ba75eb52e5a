"""One pass over a few rows: the residual add with the RMSNorm that reads it, and SwiGLU's
silu(gate) * up; their swaps."""
import torch

import model

from . import common
from .common import _jit, _pow2, _wait_for_prior, launch, tl, triton


# Fused residual + RMSNorm: the residual add and the norm that reads its result, one pass.


@_jit
def _add_rmsnorm_kernel(x_ptr, y_ptr, w_ptr, h_ptr, out_ptr, D, eps, s_x, s_y, s_h, s_out,
                        ADD: tl.constexpr, BLOCK_D: tl.constexpr):
    """h = x + y (rounded to x's dtype, as the plain add), out = h * rsqrt(mean(h^2) + eps) * w,
    computed in float32 and rounded once. x, y, h, out [N, D] (last dim contiguous), w [D]. ADD
    False: h = x, and y and h are not touched (RMSNorm alone). Grid: (N,)."""
    _wait_for_prior()
    n = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + n * s_x + d, mask=ok, other=0.0)
    if ADD:
        y = tl.load(y_ptr + n * s_y + d, mask=ok, other=0.0)
    # with x and y: its latency not after the sum
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        h = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + n * s_h + d, h, mask=ok)
    else:
        h = x
    hf = h.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / D + eps)
    tl.store(out_ptr + n * s_out + d, (hf * r * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rmsnorm(x, y, weight, eps):
    """(x + y, RMSNorm(x + y)) for x, y [..., D] of one dtype and weight [D]: one read of x and
    y."""
    D = x.shape[-1]
    if y.shape != x.shape or y.dtype != x.dtype or weight.shape != (D,):
        raise ValueError(f"add_rmsnorm: x {x.dtype} {list(x.shape)}, y {y.dtype} {list(y.shape)}, "
                         f"weight {list(weight.shape)} do not fit")
    common.check_unit_stride("add_rmsnorm", "weight", weight)
    x2, y2 = _rows(x), _rows(y)
    h, out = x2.new_empty(x2.shape), x2.new_empty(x2.shape)        # contiguous, as x2 need not be
    _launch_norm(x2, y2, weight, h, out, eps, add=True)
    return h.view(x.shape), out.view(x.shape)


def rmsnorm(x, weight, eps):
    """RMSNorm(x) for x [..., D] and weight [D] of x's dtype: add_rmsnorm's kernel without the add
    (one read of x), where no residual comes with the input (a model's first layer; MLA's q_a and
    kv_a norms). In a profiled verify of 3 tokens on the H200 torch's rms_norm took 9 us a call,
    add_rmsnorm 2. x is read in place (_rows: MLA's q_a and kv_a are column slices of the stacked
    projection's output); the output is contiguous."""
    D = x.shape[-1]
    if weight.shape != (D,) or weight.dtype != x.dtype:
        raise ValueError(f"rmsnorm: x {x.dtype} {list(x.shape)} and weight {weight.dtype} "
                         f"{list(weight.shape)} do not fit")
    common.check_unit_stride("rmsnorm", "weight", weight)
    x2 = _rows(x)
    out = x2.new_empty(x2.shape)
    _launch_norm(x2, x2, weight, x2, out, eps, add=False)     # y and h: not touched
    return out.view(x.shape)


def _rows(x):
    """x [..., D] as the kernel's rows [N, D]: a view wherever the leading dims merge and the last
    is contiguous (a column slice of a wider output too), else a copy."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_norm(x2, y2, weight, h, out, eps, add):
    """_add_rmsnorm_kernel over the rows of x2 [N, D] (add: y2 added, the sum stored into h)."""
    N, D = x2.shape
    if N:
        _add_rmsnorm_kernel[(N,)](x2, y2, weight, h, out, D, float(eps), x2.stride(0),
                                  y2.stride(0), h.stride(0), out.stride(0), ADD=add,
                                  BLOCK_D=_pow2(D), launch_pdl=common.PDL,
                                  num_warps=8 if D >= 4096 else 4)


# ---------------------------------------------------------------------------------------------
# SwiGLU activation: silu(gate) * up in one pass (the dense MLP's and the shared expert's).


@_jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, s_g, s_u, s_out, BLOCK: tl.constexpr):
    """out[n] = silu(g[n]) * u[n], in float32, rounded once. g, u, out [N, I] (rows strided, the
    last dim contiguous; g and u may be the two halves of one [N, 2I] GEMM output).
    Grid: (N, cdiv(I, BLOCK))."""
    _wait_for_prior()
    n, b = tl.program_id(0), tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    ok = i < I
    g = tl.load(g_ptr + n * s_g + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + n * s_u + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * s_out + i, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ok)


# elements a program: I = 256 (Kimi-K2's shared expert at TP 8) is one program a row (python -m
# kernels.bench --small)
SILU_MUL_BLOCK = 1024


def silu_mul(gate, up):
    """silu(gate) * up for gate, up [..., I] of one dtype (views with a contiguous last dim, e.g.
    the halves of one GEMM output): one read of each, one write."""
    I = gate.shape[-1]
    if (up.shape != gate.shape or up.dtype != gate.dtype or gate.stride(-1) != 1
            or up.stride(-1) != 1):
        raise ValueError(f"silu_mul: gate {gate.dtype} {list(gate.shape)} and up {up.dtype} "
                         f"{list(up.shape)} must match, each with a contiguous last dim")
    g2, u2 = gate.reshape(-1, I), up.reshape(-1, I)  # views for the halves of a [..., 2I] output
    out = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    if g2.shape[0]:
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(I, SILU_MUL_BLOCK))](
            g2, u2, out, I, g2.stride(0), u2.stride(0), out.stride(0), BLOCK=min(SILU_MUL_BLOCK,
            _pow2(I)),
            launch_pdl=common.PDL, num_warps=4)
    return out.view(gate.shape)


launch.add_rmsnorm = add_rmsnorm
launch.rmsnorm = rmsnorm
launch.silu_mul = silu_mul

class AddRMSNorm(model.RMSNorm):
    """"add_rmsnorm": the residual add and the norm of the sum in one kernel (without a residual,
    the norm alone in the same kernel)."""

    def forward(self, x, residual=None):
        if residual is None:
            return launch.rmsnorm(x, self.weight, self.eps)
        summed, normed = launch.add_rmsnorm(residual, x, self.weight, self.eps)
        return normed, summed


class SiluMulKernel(model.MLP):
    """"silu_mul": SwiGLU's silu(gate) * up in one kernel."""

    def act(self, gate, up):
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return super().act(gate, up)    # training: the kernel has no backward
        return launch.silu_mul(gate, up)


