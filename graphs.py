"""Explicit CUDA graph capture and replay (torch.cuda.CUDAGraph; no torch.compile graph modes).

One graph per key (a GraphKey: phase, attention mode, batch, tokens, cache slots read): inputs are
copied into static buffers, a few warm-up runs go on a side stream, and every graph allocates
from one shared memory pool. A key with no graph is captured on first use, with the real inputs,
so the warm-up writes to the KV cache are the very writes the replay makes. A captured function
must therefore give the same result run again: a tree's cache move, which along a path that skips
a node reads a slot its first run overwrote, runs outside the graphs (verify.tree_cycle).

Outputs are copied out of the pool right after each replay. With one shared pool, a graph's static
output may sit in memory that an earlier-captured graph uses as scratch, so it would be clobbered
by that graph's next replay (the verify's replay can overwrite the draft chain's output before
acceptance reads it). The copies are small (logits and hidden states of a few tokens).

A graph replays the function it captured, whatever `fn` a later call passes; so each key remembers
which function it holds, and a call with another function under the same key is refused.
"""
from functools import partial
from inspect import ismethod
from typing import NamedTuple

import torch

from tp import print0


class GraphKey(NamedTuple):
    """What one graph captures, named so that no reader takes one field for another.
    phase: what the function does; verify.py's are "decode_step" (the target reads one token a
    row), "verify" (the newest token and the k drafts), "accept_chain", "draft_extend" (the head
    reads the verified rows), "draft" (the head's chain of steps), and a tree's "verify_tree",
    "accept_tree", "draft_extend_tree" and "draft_tree"; timing.py adds its own;
    mode: the target's attention, "extend" or "decode" (None where no target runs);
    batch: rows; tokens: the tokens a row reads (for "draft", the head steps; for "draft_tree",
    the nodes the head passes write);
    kv_len: the cache slots each forward reads (None: all, or no cache)."""
    phase: str
    mode: str | None
    batch: int
    tokens: int
    kv_len: int | None = None


def function_id(fn):
    """What makes two calls the same function for a graph, without reading the device: a partial
    is its function, arguments and keywords; a bound method its object and function; anything
    else itself. Tensors among the arguments count by identity (comparing values would sync)."""
    def arg(v):
        return ("tensor", id(v)) if isinstance(v, torch.Tensor) else v
    if isinstance(fn, partial):
        return (function_id(fn.func), tuple(map(arg, fn.args)),
                tuple(sorted((k, arg(v)) for k, v in fn.keywords.items())))
    if ismethod(fn):
        return (fn.__self__, fn.__func__)
    return fn


def function_name(fn):
    """A short name for messages, e.g. partial(Transformer, mode='decode')."""
    if isinstance(fn, partial):
        kws = [f"{k}={v!r}" for k, v in fn.keywords.items() if not isinstance(v, torch.Tensor)]
        return f"partial({', '.join([function_name(fn.func), *kws])})"
    f = fn.__func__ if ismethod(fn) else fn
    return getattr(f, "__qualname__", type(f).__name__)


def signature(inputs):
    """What a graph's inputs must match: each one's (shape, dtype), host metadata."""
    return [(tuple(x.shape), x.dtype) for x in inputs]


def check_inputs(key, want, inputs):
    """A replay's inputs against the signature of those its graph captured: a copy into the
    static buffers would broadcast a smaller input or cast another dtype, and a missing input
    would leave the last call's in place."""
    have = signature(inputs)
    if have != want:
        raise ValueError(f"CUDA graph {key} captured inputs {want} (shape, dtype), and this call "
                         f"passes {have}: give each shape its own key")


def copy_out(out):
    """A graph's output copied out of the pool: a tensor, or a tuple or named tuple (such as
    model.TargetOutput) of tensors and Nones."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    copies = [None if t is None else t.clone() for t in out]
    return type(out)(*copies) if hasattr(out, "_fields") else tuple(copies)


class CudaGraphs:
    def __init__(self, device, warmup=3):
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, and this model is on {device}: "
                               "run with use_graphs=False (run.py: --cuda-graph off)")
        self.device, self.warmup = device, warmup
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs = {}  # key -> (graph, static inputs, static outputs)
        # key -> (function_id, function_name, function) of what its graph captured; holding the
        # function keeps the tensors it binds alive, so no later tensor takes their ids
        self.functions = {}
        self.signatures = {}  # key -> its inputs' (shape, dtype)s (check_inputs)
        self.before_replay = None  # a callable (fn, inputs) run before each replay, if set

    def capture(self, key, fn, *inputs):
        static_in = [x.clone() for x in inputs]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn(*static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = fn(*static_in)
        self.graphs[key] = (graph, static_in, static_out)
        self.signatures[key] = signature(static_in)
        self.functions[key] = (function_id(fn), function_name(fn), fn)
        print0(f"captured CUDA graph {key}")

    def run(self, key, fn, *inputs):
        """Replay the graph for `key` (a GraphKey, or any hashable) on these inputs, capturing it
        on first use."""
        if key not in self.graphs:
            self.capture(key, fn, *inputs)
        elif self.functions[key][0] != function_id(fn):
            raise ValueError(f"CUDA graph {key} replays {self.functions[key][1]}, and this call "
                             f"passes {function_name(fn)}: give each function its own key")
        graph, static_in, static_out = self.graphs[key]
        check_inputs(key, self.signatures[key], inputs)
        for buf, x in zip(static_in, inputs):
            buf.copy_(x)
        if self.before_replay is not None:
            self.before_replay(fn, inputs)
        graph.replay()
        return copy_out(static_out)
