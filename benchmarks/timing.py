"""Kernel timing shared by the benchmarks: CUDA events, warm-up, median (STYLE.md, METHOD.md)."""

from __future__ import annotations

import statistics

import torch


def flush_l2(buf: torch.Tensor) -> None:
    """Overwrite a buffer larger than the L2 (60 MB on the H200) so no input stays cached."""
    buf.bitwise_not_()


def time_us(fn, flush_buf, iters: int) -> float:
    """Median µs of one call, replayed from a CUDA graph with the L2 flushed before each replay
    (the GPU is still busy with the flush when the replay is queued, so launch overhead is not in
    the timed region)."""
    fn()  # first call: one-time kernel attributes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        flush_l2(flush_buf)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_eager_us(fn, iters: int = 50, warmup: int = 10) -> float:
    """Median µs of one eager call (launch path included), no L2 flush."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)
