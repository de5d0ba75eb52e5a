"""What every kernel family shares: the Triton import guard, _jit, the interpreter switch,
programmatic dependent launch (PDL, _wait_for_prior), the last-program counters, the check of 1-D
arguments read as contiguous (check_unit_stride), and `launch`, the kernels as the swaps call
them."""
import functools
import math
import os
from contextlib import contextmanager
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU / CI machines without triton: the plain paths run
    triton = None
    HAVE_TRITON = False

    class tl:  # lets the kernel signatures below evaluate; no kernel runs without triton
        constexpr = None


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_available(device):
    """A clear error where the kernels cannot run on `device`."""
    device = torch.device(device)
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kernels need the triton package, which is not installed "
                           "(pip install triton; or leave the kernels off)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the Triton kernels run on CUDA devices; on {device} only under the "
                           "Triton interpreter (TRITON_INTERPRET=1 before import; slow, for tests)")


def _jit(fn):
    """triton.jit where triton exists; else the function stays a plain def (no kernel)."""
    return triton.jit(fn) if HAVE_TRITON else fn


# Programmatic dependent launch (PDL; sm_90 and later). A decode step runs ~800 kernels of a few us,
# and a kernel normally starts only once the one before it on the stream has finished (chained tiny
# kernels in a CUDA graph: ~0.9 us a launch on the H200). Every Triton kernel here is launched with
# launch_pdl=PDL, so the GPU may start it while its predecessor still runs, and before its first
# load it calls _wait_for_prior(): griddepcontrol.wait returns once the prerequisite grid (the
# kernel before it) has completed and its memory writes are visible (PTX ISA, griddepcontrol). The
# rule every kernel follows: nothing before the wait reads memory an earlier kernel writes, or
# writes memory an earlier kernel reads or writes. Every kernel waits, so its predecessor had waited
# for its own: all earlier kernels have completed too. Right after the wait,
# griddepcontrol.launch_dependents lets the next kernel launch: its programs take the SM slots this
# one leaves free and sit in their own wait, so its launch and start overlap this kernel's tail. A
# kernel launched without PDL (cuBLAS, torch's) starts after whole kernels as always, and in a
# kernel launched without PDL both instructions return at once. GDC: the kernels hold the
# instructions (sm_90 on; Triton's CPU interpreter has neither); PDL: the launches ask for it. Every
# launch reads common.PDL when it runs, so setting it False here turns PDL off everywhere (`python
# -m kernels.bench --pdl` times run.py's phases with it off and on). The wait comes before every
# load, even of a weight tile that no kernel writes: no caller must then promise that its weights
# are not being written. Before it a kernel only computes addresses and may ask the L2 for bytes
# (the prefetch below).
PDL = (HAVE_TRITON and not interpreting() and torch.cuda.is_available()
       and torch.cuda.get_device_capability() >= (9, 0))
GDC = tl.constexpr(PDL) if HAVE_TRITON else PDL


@contextmanager
def pdl_off():
    """Launches inside without programmatic dependent launch: each kernel starts after the one
    before it has finished. What a profile of kernel times needs: with PDL a kernel's programs start
    early and wait, and the profiler counts the wait as that kernel's time. The kernels keep their
    prefetches (PREFETCH): the profile times the code the graphs replay."""
    global PDL
    on, PDL = PDL, False
    try:
        yield
    finally:
        PDL = on


# A prefetch before the wait. A kernel's programs can be resident and waiting while the kernel
# before it still runs; those that read the checkpoint's weights (and MLA's decode kernel, which
# reads cache slots that earlier steps wrote) first ask the L2 for the first PREFETCH_ROW_BYTES of
# each row they will read (a 32-byte sector an instruction), so that their loads after the wait
# find those bytes there: the memory's idle time in the predecessor's tail carries them. A
# prefetch moves bytes into the L2 only and returns nothing: the L2 is where every SM's writes
# meet, so it can hand no stale value to a later load, and the rule above holds (no load before
# the wait). 0: none. Only where PDL runs (PREFETCH: without it the programs start after the
# predecessor, and a prefetch would come just before the load it serves; pdl_off leaves it, so that
# a profile times the kernels the graphs replay). 1024 bytes: the INT4 decode step and verify
# of 3 each 0.08 ms less than without; 4096 bytes gave back three quarters and half of that, 512
# and 2048 a little (BENCHMARKS.md: Verify sweep, its Kept table; Tried and not kept).
PREFETCH_ROW_BYTES = 1024
PREFETCH = PDL


def prefetch_bytes(row_bytes, contiguous=True):
    """The bytes of each weight row a launch asks the L2 for before its wait (_prefetch_rows'
    ROW_BYTES): PREFETCH_ROW_BYTES, at most the row's (its slice's) bytes, a power of 2 from 32; 0
    where PDL cannot run (PREFETCH) or the row is not contiguous."""
    most = min(PREFETCH_ROW_BYTES, row_bytes)
    if not (PREFETCH and contiguous) or most < 32:
        return 0
    return 1 << (most.bit_length() - 1)      # a power of 2 (tl.arange's length)


@_jit
def _prefetch_rows(rows, nbytes, ROW_BYTES: tl.constexpr):
    """Ask the L2 for the first ROW_BYTES (a multiple of 32; 0: nothing) of the rows starting at
    the pointers rows [R] (valid rows: callers clamp their row indices; contiguous, at least nbytes
    long, a run-time bound that keeps every address inside the row). Reads nothing."""
    if GDC and ROW_BYTES > 0:
        sector = tl.minimum(tl.arange(0, ROW_BYTES // 32) * 32, nbytes - 1)
        p = rows.to(tl.pointer_type(tl.int8))[:, None] + sector[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p],
                                  dtype=tl.int32, is_pure=False, pack=1)


@_jit
def _prefetch_matrix_rows(w_ptr, rows, R, s_row, lo, hi, ROW_BYTES: tl.constexpr):
    """Before the wait: the L2 asked for the first ROW_BYTES of W's rows `rows` (those past R: row
    R - 1; `s_row` elements apart, each contiguous) from column lo, at most up to hi
    (_prefetch_rows)."""
    elem: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    _prefetch_rows(w_ptr + tl.minimum(rows, R - 1) * s_row + lo, (hi - lo) * elem, ROW_BYTES)


@_jit
def _wait_for_prior():
    """Before every kernel's first load: wait for the kernels before it, let the next one launch."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@_jit
def _last_program(count_ptr, i, n):
    """After a program's stores: True in the last of the n programs sharing counter i of count_ptr
    to get here, which sets the counter back to 0 for the next launch (_counters); False in the
    others. The add is acquire-release (the last program sees the others' stores), the reset
    relaxed."""
    tl.debug_barrier()  # every thread's stores before the counter's release
    last = tl.atomic_add(count_ptr + i, 1) == n - 1
    if last:
        tl.atomic_xchg(count_ptr + i, 0, sem="relaxed")
    return last


@_jit
def _silu_mul(g, u):
    """SwiGLU's silu(g) * u as the MoE kernels compute it: g / (1 + exp(-g)) * u."""
    return g / (1.0 + tl.exp(-g)) * u


def _pow2(n, least=16):
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


# The counters of the kernels that end in a last program (_last_program: norm_gemv, the GEMV MoE's
# shared expert, the draft attention kernel; the router's the same steps written out): one per
# program group a launch adds into; a launch that would need more refuses (no sweep: a capacity,
# far above Kimi-K2's largest need).
COUNTERS = 4096


@functools.cache
def _counters(device):
    """Zeroed int32 counters that every call of the kernels above (COUNTERS) on `device` shares: the
    calls run one after another on a stream, and each call's last programs leave them zero again.
    The last program's counter add is acquire-release (it must see the others' partial sums); its
    reset is relaxed: only a later launch reads the counter, after the kernel boundary (with
    programmatic dependent launch, after its wait for this grid), so no fence is needed there."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def check_unit_stride(launcher, name, t):
    """A ValueError naming `launcher`'s argument `name` where the 1-D tensor t has a stride other
    than 1: the kernels read such a tensor as contiguous, and a copy made here instead would run
    inside a captured graph at every replay."""
    if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{launcher}: {name} must be contiguous (stride 1), got stride "
                         f"{t.stride(0)}")


def sm_count(device):
    """The SMs of a CUDA device, which the attention kernels' splits fill; 8 elsewhere (Triton's
    CPU interpreter), so that its tests still split a cache. device: a torch.device."""
    return (torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else 8)


def rows(x):
    """The rows of x [..., K] (the product of its leading dims)."""
    return math.prod(x.shape[:-1])


class AttachAgain:
    """For a swap that keeps tensors built from its weights (stacked views, attach()): .to() and
    the like move each parameter and buffer on its own, so build them again afterwards."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.attach()
        return self


# The kernels as the swaps call them: the families' modules add their entry points here, by name,
# beside their definitions. torch.compile (run.py --compile) must not trace into them (a graph
# break), so that their Triton launches run as written between the compiled parts: compile_layers
# and compile_head wrap them first (keep_out_of_compile), so that these launches import
# torch._dynamo (about a second of CPU) only in runs that compile. The fused MoE is the exception:
# FusedExperts.forward wraps its fused call in torch.compiler.disable itself, which imports
# torch._dynamo at the first fused MoE forward.
launch = SimpleNamespace()
_kept_out = False


def keep_out_of_compile():
    """Wrap every entry of `launch` in torch.compiler.disable, once."""
    global _kept_out
    if not _kept_out:
        for name, fn in vars(launch).items():
            setattr(launch, name, torch.compiler.disable(fn))
        _kept_out = True
