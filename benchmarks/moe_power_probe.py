"""Probe: does the routed MoE's time depend on the GPU's power state? bench_moe.py's operator and
inputs (real dims, uniform routing) as one CUDA graph and as eager calls, each timed by events
around the call (L2 flushed before it), 8 calls back to back and 8 spaced --gap seconds apart,
twice; then each kernel's duration from the profiler, back to back and spaced; and the driver's
power-capping counter over each phase (timing.power_capped_us; the driver updates it in bursts and
late, so a sub-second phase's value may belong to the phase before).

Back to back, long fp8 GEMMs can pass the board's power limit; the driver then lowers the SM clock
and the later calls run slower than the first. Spaced calls each start from an idle GPU. Sample
nvidia-smi beside it for the clock and power (`--query-gpu=timestamp,clocks.sm,power.draw.instant,
clocks_event_reasons.active --format=csv -lms 20`). docs/history/2026-12-07-fp8-gemm-feed.md §5.

Usage: python benchmarks/moe_power_probe.py [--tokens 16384] [--gap 0.2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench_moe import D, Moe, load_and_experts, uniform_routing
from timing import capture_graph, flush_l2, power_capped_us


def event_times(run, flush, n: int, gap: float) -> list[float]:
    out = []
    for _ in range(n):
        if gap:
            time.sleep(gap)
        flush_l2(flush)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return out


def kernel_times(run, flush, n: int, gap: float) -> dict[str, list[float]]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            if gap:
                time.sleep(gap)
            flush_l2(flush)
            run()
            torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA and "bitwise_not" not in e.name():
            per.setdefault(e.name()[:80], []).append((e.end_ns() - e.start_ns()) / 1e3)
    return per


def capped_ms(before: int | None) -> str:
    after = power_capped_us()
    return "—" if None in (before, after) else f"{(after - before) / 1e3:.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between spaced calls")
    args = ap.parse_args()
    g, flush, (w13, s13, w2, s2) = load_and_experts()
    x = torch.randn(args.tokens, D, generator=g, device="cuda").to(torch.bfloat16)
    ids, weights = uniform_routing(args.tokens, g, "cuda")
    op = Moe(x, ids, weights, w13, s13, w2, s2)
    graph = capture_graph(op)
    torch.cuda.synchronize()
    print(f"T={args.tokens}, {torch.cuda.get_device_name()}; µs per call, events", flush=True)
    for label, run in (("graph", graph.replay), ("eager", op)):
        for gap in (0.0, args.gap, 0.0, args.gap):
            cap = power_capped_us()
            v = event_times(run, flush, 8, gap)
            print(f"{label} {'back to back' if gap == 0 else f'{gap * 1e3:.0f} ms apart':>13}: median "
                  f"{statistics.median(v):9.1f}  min {min(v):9.1f}  max {max(v):9.1f}  power-capped {capped_ms(cap)}  "
                  f"calls {' '.join(f'{u:.0f}' for u in v)}", flush=True)
    for label, run in (("graph", graph.replay), ("eager", op)):
        for gap in (0.0, args.gap):
            cap = power_capped_us()
            per = kernel_times(run, flush, 6, gap)
            print(f"-- {label}, {'back to back' if gap == 0 else f'{gap * 1e3:.0f} ms apart'}, per kernel median µs "
                  f"(power-capped {capped_ms(cap)})")
            total = 0.0
            for name, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
                total += statistics.median(v)
                print(f"   {statistics.median(v):9.1f}  {name}")
            print(f"   {total:9.1f}  sum", flush=True)


if __name__ == "__main__":
    main()
