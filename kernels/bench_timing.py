"""Timing for the kernels' micro-benchmarks (bench.py, bench_moe.py): device time of one eager
call's kernels, the median of a captured graph's replays, and the copy bandwidth the floors are
counted against. On a GPU only."""
import statistics

import torch

from . import common


def kernel_ms(fn):
    """Device time of the kernels of one eager fn() (torch.profiler), in ms: no launch gaps. Without
    programmatic dependent launch (common.pdl_off), so that each kernel's time is its own."""
    from torch.profiler import ProfilerActivity, profile
    with common.pdl_off():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA}
    return sum(kernels.values()), kernels


def graph_ms(calls, reps=30):
    """Median ms of one call: `calls` (one per input set) captured in one graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    stamps = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        stamps.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in stamps) / len(calls)


def copy_bandwidth_GBps(reps=20):
    """Device-to-device copy of 1 GiB (bytes read + written), launched eagerly between events as
    run.py does: captured in a graph the copy becomes a memcpy node, which read ~2.7 TB/s on the
    H200 (2026-11-29) against ~4.2 TB/s eagerly in the same call."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(5):
        y.copy_(x)
    stamps = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        stamps.append((a, b))
    torch.cuda.synchronize()
    return 2 * x.numel() / statistics.median(a.elapsed_time(b) for a, b in stamps) / 1e6
