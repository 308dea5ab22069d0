"""CUDA-graph timing shared by the kernel benchmarks: capture a body on a side stream, time
replays with CUDA events (the kernel time without host launch overhead)."""

from __future__ import annotations

import statistics

import torch


def capture(stream: "torch.cuda.Stream", body) -> "torch.cuda.CUDAGraph":
    """capture_begin/end on ``stream``: torch.cuda.graph() would also run gc.collect() and
    empty_cache() per capture (~0.2 s each with torch.compile's heap)."""
    g = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        g.capture_begin()
        try:
            body()
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return g


def replay_ms(g: "torch.cuda.CUDAGraph", reps: int = 5) -> float:
    """Median of ``reps`` timed replays after one warm replay."""
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)
