"""Tensor parallelism you can read: process-group setup and Megatron-style parallel layers.

Every collective is written in a `forward` below: `RowParallelLinear` and `VocabParallelEmbedding`
all-reduce, `ParallelLMHead` all-gathers full-vocabulary rows (a swap of one of them, as
kernels.GemvRowParallelLinear, keeps its collective in its own forward). The model's one other
collective is model.MoE.forward's single all-reduce of the routed and shared experts' partial
sums. A `TP` object (rank, world size, simulated or not) is passed explicitly to every layer;
nothing reads a module global.

A *simulated rank* (`TP.simulate(world_size=8)`) builds exactly one rank's shard of a TP-N model
in a single process and skips the collectives, so that one GPU can time one rank of an N-GPU
deployment. Its numbers are not the model's numbers; every output of run.py says "simulated".

Shape legend: B batch, T new tokens, D hidden, V vocab, N world size.
"""
import os
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TP:
    """Who this process is in the tensor-parallel group."""
    rank: int = 0
    world_size: int = 1
    simulated: bool = False  # one rank's shard of a TP-N model, collectives skipped

    @staticmethod
    def from_env():
        if dist.is_initialized():
            return TP(dist.get_rank(), dist.get_world_size())
        return TP()

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
        return f"TP {self.world_size}, rank {self.rank}"

    def split(self, size, what):
        """This rank's share of a dimension; a clear error if the world size does not divide it."""
        if size % self.world_size:
            raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel world size "
                             f"{self.world_size}")
        return size // self.world_size

    def all_reduce(self, x):
        if self.communicates:
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
    """Rows of the table split by vocabulary; tokens of other ranks give zeros, then all-reduce."""

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
        y = y.to(torch.promote_types(y.dtype, torch.float32))
        if self.tp.world_size == 1:
            return y
        if self.tp.simulated:  # the shape a gather would give, without the gather
            return y.repeat(*([1] * (y.dim() - 1)), self.tp.world_size)
        parts = [torch.empty_like(y) for _ in range(self.tp.world_size)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, dim=-1)
