"""Kernel timing shared by the benchmarks: CUDA graph replays after an L2 flush, timed by CUDA events
and by the CUDA profiler (the peers' method), median of the iterations (STYLE.md, METHOD.md)."""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import time
import warnings
from contextlib import contextmanager

import torch


def flush_l2(buf: torch.Tensor) -> None:
    """Overwrite a buffer larger than the L2 (60 MB on the H200) so no input stays cached."""
    buf.bitwise_not_()


_POWER_CAPPED = re.compile(r"^\s*SW Power Capping\s*:\s*(\d+)\s*us\s*$", re.MULTILINE)


def parse_power_capped_us(smi_text: str) -> int | None:
    """The "SW Power Capping" counter (µs) of `nvidia-smi -q -d PERFORMANCE`'s clocks event
    reasons counters, None where the text has none (older drivers, other vendors)."""
    m = _POWER_CAPPED.search(smi_text)
    return int(m.group(1)) if m else None


def power_capped_us(device: int | None = None) -> int | None:
    """Cumulative time the driver has held this GPU's clocks down to keep the board under its power
    limit (µs since the driver loaded); its difference over a timed row says how much of the row ran
    power-capped, with lower clocks: long fp8 GEMMs back to back pass the limit. None without
    nvidia-smi or the counter."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None else device
    # by UUID first: CUDA_VISIBLE_DEVICES renumbers the devices that nvidia-smi counts
    for ident in (f"GPU-{torch.cuda.get_device_properties(index).uuid}", str(index)):
        try:
            out = subprocess.run([smi, "-q", "-d", "PERFORMANCE", "-i", ident], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        if (us := parse_power_capped_us(out)) is not None:
            return us
    return None


@contextmanager
def power_capped_share():
    """`with power_capped_share() as cap:` ... then cap["share"]: the fraction of the block's wall time
    that power_capped_us counted (at most 1; None where the counter is not readable)."""
    cap: dict[str, float | None] = {"share": None}
    before, t0 = power_capped_us(), time.perf_counter()
    yield cap
    after, wall = power_capped_us(), time.perf_counter() - t0
    if before is not None and after is not None and wall > 0:
        cap["share"] = min(1.0, (after - before) / 1e6 / wall)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """One call (one-time kernel attributes), two on a side stream, then a CUDA graph of fn."""
    fn()
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
    return graph


def event_times_us(run, iters: int, flush_buf: torch.Tensor | None = None, gap_s: float = 0.0) -> list[float]:
    """µs of each of `iters` calls of run, CUDA events around the call; before each, a gap_s sleep
    (an idle GPU) and an L2 flush where flush_buf is given."""
    times = []
    for _ in range(iters):
        if gap_s:
            time.sleep(gap_s)
        if flush_buf is not None:
            flush_l2(flush_buf)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def kernel_names(fn) -> tuple[str, ...]:
    """Names of the CUDA kernels one call of fn runs (from the profiler): e.g. a flush's, for
    kernel_span_us's flush_kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return tuple(sorted({e.name() for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA}))


def kernel_span_us(run, flush, iters: int, flush_kernels: tuple[str, ...] = ("bitwise_not",),
                   after: str | None = None) -> float | None:
    """Median over iters of the GPU span of one call: first kernel start to last kernel end, read
    from the CUDA profiler (CUPTI via torch.profiler), each call after flush() (a kernel whose name
    holds one of flush_kernels separates the calls). This is how the peers' anchors were measured
    (the peers' published timing method). None if the profiler saw no kernel of the call.
    after: the span starts where the call's last kernel whose name holds it ends instead (e.g. the
    GEMM of a linear without its activation quantiser)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")  # one profile per call here
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush()
            run()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA),
                    key=lambda e: e.start_ns())
    spans, first, last, mark = [], None, None, None
    for e in events + [None]:  # None closes the last call
        if e is None or any(f in e.name() for f in flush_kernels):  # the flush separates the calls
            if first is not None:
                spans.append((last - (first if mark is None else mark)) / 1e3)
            first = last = mark = None
        else:
            first = e.start_ns() if first is None else min(first, e.start_ns())
            last = e.end_ns() if last is None else max(last, e.end_ns())
            if after is not None and after in e.name():
                mark = e.end_ns() if mark is None else max(mark, e.end_ns())
    return statistics.median(spans) if len(spans) >= max(1, iters // 2) else None


def time_both_us(fn, flush_buf, iters: int) -> tuple[float, float | None]:
    """(events µs, kernel span µs from the profiler) of one CUDA graph of fn, the L2 flushed before
    every replay (the GPU is still busy with the flush when the replay is queued, so the launch is
    not in the timed region). Events bracket the replay: they add ~2 µs (the replay's launch and
    the end event) to a short call; the profiler span is the peers' measure.
    Falls back to profiling eager calls if the profiler reports no kernels inside graph replays."""
    graph = capture_graph(fn)
    events = statistics.median(event_times_us(graph.replay, iters, flush_buf))
    kernels = kernel_span_us(graph.replay, lambda: flush_l2(flush_buf), iters)
    if kernels is None:
        kernels = kernel_span_us(fn, lambda: flush_l2(flush_buf), iters)
    return events, kernels


def span_after_us(fn, flush_buf, iters: int, after: str) -> float | None:
    """kernel_span_us of fn's CUDA graph (replayed as in time_both_us, so no host launch gap), from
    the end of its last kernel whose name holds `after` (e.g. a linear's GEMM without act_quant)."""
    graph = capture_graph(fn)
    return kernel_span_us(graph.replay, lambda: flush_l2(flush_buf), iters, after=after)


def time_eager_us(fn, iters: int = 50, warmup: int = 10) -> float:
    """Median µs of one eager call (launch path included), no L2 flush."""
    for _ in range(warmup):
        fn()
    return statistics.median(event_times_us(fn, iters))


def time_wall_us(fn, iters: int = 50, warmup: int = 10) -> float:
    """Median µs of one call by the host clock (CPU work: a synchronous call's whole time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


# ------------------------------------------------------------- region clocks (bench_realdims.RegionClock)
@contextmanager
def patched_ops(ops, wrap):
    """torch.ops.dsa.<op> replaced by ``wrap(op, packet)`` for each op inside the block, restored after."""
    saved = {op: getattr(torch.ops.dsa, op) for op in ops}
    for op, packet in saved.items():
        setattr(torch.ops.dsa, op, wrap(op, packet))
    try:
        yield
    finally:
        for op, packet in saved.items():
            setattr(torch.ops.dsa, op, packet)


def timed_op(clock, category: str, packet, on_call=None):
    """``packet`` inside a ``category`` region of ``clock`` (a bench_realdims.RegionClock);
    ``on_call(args)`` after each call."""
    def timed(*a, **k):
        clock.push(category=category)
        out = packet(*a, **k)
        clock.pop()
        if on_call is not None:
            on_call(a)
        return out
    return timed


@contextmanager
def layer_hooks(net: torch.nn.Module, clock):
    """A ``clock`` region per decoder layer (removed after)."""
    handles = []
    for i, layer in enumerate(net.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: clock.push(layer=i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: clock.pop(end_layer=True)))
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()
