"""Tensor parallelism you can read: process-group setup and Megatron-style parallel layers.

Every collective is written in a `forward` below: `RowParallelLinear` and `VocabParallelEmbedding`
all-reduce, `ParallelLMHead` all-gathers full-vocabulary rows (a swap of one of them, as
kernels.GemvRowParallel, keeps its collective in its own forward). The model's one other
collective is model.MoE.forward's single all-reduce of the routed and shared experts' partial
sums. A `TP` object (rank, world size, simulated or not, which all-reduce) is passed explicitly to
every layer; nothing reads a module global.

Two all-reduces: NCCL's (the default), and a one-shot all-reduce over torch's symmetric memory
(`TP.from_env("one-shot")`) for small messages, as SGLang's and vLLM's custom all-reduce do: every
rank copies its partial sum into its own buffer, which its peers can read over NVLink, and each
rank reads the others' rows and sums them, one kernel with a barrier on each side. Messages above
`ONE_SHOT_MAX_BYTES` (prefill) and dtypes the kernel lacks go to NCCL. It needs CUDA GPUs and NCCL
(no NVLink multicast); on gloo it is refused.

A *simulated rank* (`TP.simulate(world_size=8)`) builds exactly one rank's shard of a TP-N model
in a single process and skips the collectives, so that one GPU can time one rank of an N-GPU
deployment. Its numbers are not the model's numbers; every output of run.py says "simulated".

Shape legend: B batch, T new tokens, D hidden, V vocab, N world size.
"""
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def init_distributed(device=None):
    """Set up from the torchrun environment. Returns (rank, world_size, device).

    The device is bound before the process group (NCCL needs it); gloo on CPU (also when
    device="cpu" is asked for on a GPU machine), with the CPU's cores shared among the ranks;
    without torchrun a world of 1 and no process group. Calling it again returns the same answer."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device is not None:
        device = torch.device(device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif world_size > 1:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(cpu_threads_per_rank(local_world))
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return rank, world_size, device


def leave_group(orderly):
    """Leave the process group, if there is one. An orderly exit (every rank at the same point)
    first meets its peers at a barrier: a rank that tears its connections down while a peer still
    talks to it can abort that peer under gloo ("terminate called without an active exception").
    An exit on an error leaves at once: its peers may never reach a barrier."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if orderly:
        dist.barrier()
    dist.destroy_process_group()


def cpu_threads_per_rank(local_world_size):
    """OMP_NUM_THREADS if set (torchrun sets 1), else this rank's share of the cores: torch's own
    default, every core in every process, oversubscribes them. Set explicitly, since torch reads
    the variable only when it starts."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // local_world_size)


def print0(*args, **kwargs):
    """print on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


ALLREDUCES = ("nccl", "one-shot")
ONE_SHOT_MAX_BYTES = 1 << 20  # 73 rows of 7168 bf16: decode and verify up to batch 16 x 4 tokens


class OneShotAllReduce:
    """Sum over the ranks of a message of at most max_bytes, read from peers' symmetric memory.

    The buffer is allocated and exchanged once (a collective: every rank constructs it); a call
    copies the partial sum into it and runs torch's one-shot kernel, which waits until every rank
    has written, sums the ranks' rows into a new tensor, and waits until every rank has read
    before it returns, so the next call may overwrite the buffer. No host sync: graphs capture
    it. The copy is a launch of its own: torch's kernel can copy the input in itself
    (one_shot_all_reduce_copy_out), but there each block signals its peers from a few threads
    with no block barrier after the copy (one_shot_all_reduce_kernel in torch's
    c10d/symm_mem/CUDASymmetricMemoryOps.cu: the copy loop, then sync_remote_blocks without a
    __syncthreads), so a peer may read a vector another thread has not yet stored; a kernel
    boundary orders every store before the signal."""

    def __init__(self, device, max_bytes=ONE_SHOT_MAX_BYTES):
        device = torch.device(device)
        backend = dist.get_backend() if dist.is_initialized() else "no process group"
        if backend != "nccl" or device.type != "cuda":
            raise NotImplementedError(f"one-shot all-reduce: needs torch's symmetric memory on "
                                      f"CUDA GPUs under NCCL; this run has {backend} on "
                                      f"{device.type} (use the NCCL all-reduce)")
        import torch.distributed._symmetric_memory as symm_mem
        self.group, self.max_bytes = dist.group.WORLD.group_name, max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group)

    def fits(self, x):
        return one_shot_fits(x.numel(), x.element_size(), x.dtype, self.max_bytes)

    def __call__(self, x):
        x = x.contiguous()
        shared = self.buffer.view(x.dtype)[:x.numel()].view(x.shape)
        out = torch.empty_like(x)
        shared.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(shared, "sum", self.group, out)


def one_shot_fits(numel, element_size, dtype, max_bytes):
    """Whether the one-shot kernel takes this message: float32 or bf16 (its dtypes), at most
    max_bytes, a whole number of 16-byte vectors (its widest loads); the rest goes to NCCL."""
    nbytes = numel * element_size
    return dtype in (torch.float32, torch.bfloat16) and nbytes <= max_bytes and nbytes % 16 == 0


@dataclass(frozen=True)
class TP:
    """Who this process is in the tensor-parallel group, and its all-reduce."""
    rank: int = 0
    world_size: int = 1
    simulated: bool = False  # one rank's shard of a TP-N model, collectives skipped
    one_shot: OneShotAllReduce | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"TP rank {self.rank} of world size {self.world_size}: the world "
                             "size must be >= 1 and the rank in [0, world size)")

    @staticmethod
    def from_env(allreduce="nccl"):
        """From the process group; "one-shot" sets up the symmetric buffer (a collective)."""
        if allreduce not in ALLREDUCES:
            raise ValueError(f"all-reduce {allreduce!r}: choose from {', '.join(ALLREDUCES)}")
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return TP()  # nothing to reduce
        gloo = dist.get_backend() == "gloo"
        device = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
        one_shot = OneShotAllReduce(device) if allreduce == "one-shot" else None
        return TP(dist.get_rank(), dist.get_world_size(), one_shot=one_shot)

    @staticmethod
    def simulate(world_size, rank=0):
        return TP(rank, world_size, simulated=world_size > 1)

    @property
    def communicates(self):
        return self.world_size > 1 and not self.simulated

    def describe(self):
        if self.simulated:
            return (f"SIMULATED rank {self.rank} of TP {self.world_size} "
                    "(one process, collectives skipped)")
        name = f"TP {self.world_size}, rank {self.rank}"
        if self.one_shot is not None:
            return (f"{name}, one-shot all-reduce (symmetric memory) up to "
                    f"{self.one_shot.max_bytes // 1024} KB, NCCL above")
        return name + (f", {dist.get_backend()} all-reduce" if self.communicates else "")

    def split(self, size, what):
        """This rank's share of a dimension; a clear error if the world size does not divide it."""
        if size % self.world_size:
            raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel world size "
                             f"{self.world_size}")
        return size // self.world_size

    def all_reduce(self, x):
        """The sum over the ranks (NCCL in place, one-shot into a new tensor): use the result."""
        if not self.communicates:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x)
        return x


def _param(shape, shard_dim, device, dtype):
    # shard_dim tells init and the checkpoint loader how the global tensor is split (None:
    # replicated)
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)
    p.shard_dim = shard_dim
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows; the output stays split (no collective)."""

    def __init__(self, in_features, out_features, tp, what, device=None, dtype=None):
        super().__init__()
        self.out_local = tp.split(out_features, what)
        self.weight = _param((self.out_local, in_features), 0, device, dtype)

    def forward(self, x):
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced (unless reduce=False,
    for a caller that adds several partial sums before one all-reduce)."""

    def __init__(self, in_features, out_features, tp, what, reduce=True, device=None, dtype=None):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.weight = _param((out_features, tp.split(in_features, what)), 1, device, dtype)

    def forward(self, x):
        y = F.linear(x, self.weight)
        return self.tp.all_reduce(y) if self.reduce else y


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features, out_features, device=None, dtype=None):
        super().__init__()
        self.weight = _param((out_features, in_features), None, device, dtype)

    def forward(self, x):
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Rows of the table split by vocabulary; tokens of other ranks give zeros, then all-reduce.
    An id outside the vocabulary is no rank's: at TP > 1 its row is zeros, at TP 1 F.embedding
    raises (checking would read the ids on the host; verify.check_request refuses such prompts)."""

    def __init__(self, vocab_size, dim, tp, device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.vocab_local = tp.split(vocab_size, "vocab_size")
        self.start = tp.rank * self.vocab_local
        self.weight = _param((self.vocab_local, dim), 0, device, dtype)

    def forward(self, tokens):                                    # [B, T] -> [B, T, D]
        if self.tp.world_size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        if self.tp.simulated:  # every token gets a real row, so routing downstream looks real
            return F.embedding(local.remainder(self.vocab_local), self.weight)
        outside = (local < 0) | (local >= self.vocab_local)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """Logits split by vocabulary, all-gathered so every rank holds full rows (and samples
    alike)."""

    def __init__(self, dim, vocab_size, tp, what="vocab_size", device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.weight = _param((tp.split(vocab_size, what), dim), 0, device, dtype)

    def forward(self, x):                               # [..., D] -> [..., V], float32 or wider
        y = F.linear(x, self.weight)
        wide = torch.promote_types(y.dtype, torch.float32)   # widened after the gather: exact,
        if self.tp.world_size == 1:                          # and half the bytes sent in bf16
            return y.to(wide)
        if self.tp.simulated:  # the shape a gather would give, without the gather
            return y.repeat(*([1] * (y.dim() - 1)), self.tp.world_size).to(wide)
        parts = [torch.empty_like(y) for _ in range(self.tp.world_size)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, dim=-1).to(wide)
