"""Probe: how much of a kernel's time is the GPU's power state? Long fp8 GEMMs run back to back
pass the board's power limit; the driver then lowers the SM clock. Two probes, results on stdout;
sample nvidia-smi beside them for the clock and power (`--query-gpu=timestamp,clocks.sm,
power.draw.instant,clocks_event_reasons.active --format=csv -lms 20`; each phase prints its wall
span). docs/history/2026-12-07-fp8-gemm-feed.md §5-6.

  moe     bench_moe.py's operator and inputs (real dims, uniform routing) as one CUDA graph and as
          eager calls, each timed by events around the call (L2 flushed before it), 8 calls back to
          back and 8 spaced --gap seconds apart, twice; then each kernel's duration from the
          profiler, back to back and spaced; and the driver's power-capping counter over each phase
          (timing.power_capped_us; the driver updates it in bursts and late, so a sub-second
          phase's value may belong to the phase before).
  linear  one linear shape (default dense gate+up, T=8192), ours (act_quant included) and cuBLASLt's
          blockwise _scaled_mm on the same inputs, each a CUDA graph of 10 calls replayed back to
          back for --secs seconds, 2 s idle between phases, ours / cuBLASLt twice: µs per call under
          a sustained load, whose clock the power cap sets.

Usage: python benchmarks/power_probe.py moe [--tokens 16384] [--gap 0.2]
       python benchmarks/power_probe.py linear [--tokens 8192] [--n 36864] [--k 7168] [--secs 3]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench_fp8_linear import Linear, random_weight, scaled_mm_fn
from bench_moe import D, Moe, load_and_experts, uniform_routing
from timing import capture_graph, event_times_us, flush_l2, power_capped_us

from dsa_trt.plugins import cuda_ops


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


def probe_moe(tokens: int, gap_s: float) -> None:
    g, flush, (w13, s13, w2, s2) = load_and_experts()
    x = torch.randn(tokens, D, generator=g, device="cuda").to(torch.bfloat16)
    ids, weights = uniform_routing(tokens, g, "cuda")
    op = Moe(x, ids, weights, w13, s13, w2, s2)
    graph = capture_graph(op)
    torch.cuda.synchronize()
    print(f"T={tokens}, {torch.cuda.get_device_name()}; µs per call, events", flush=True)
    for label, run in (("graph", graph.replay), ("eager", op)):
        for gap in (0.0, gap_s, 0.0, gap_s):
            cap = power_capped_us()
            v = event_times_us(run, 8, flush, gap)
            print(f"{label} {'back to back' if gap == 0 else f'{gap * 1e3:.0f} ms apart':>13}: median "
                  f"{statistics.median(v):9.1f}  min {min(v):9.1f}  max {max(v):9.1f}  power-capped {capped_ms(cap)}  "
                  f"calls {' '.join(f'{u:.0f}' for u in v)}", flush=True)
    for label, run in (("graph", graph.replay), ("eager", op)):
        for gap in (0.0, gap_s):
            cap = power_capped_us()
            per = kernel_times(run, flush, 6, gap)
            print(f"-- {label}, {'back to back' if gap == 0 else f'{gap * 1e3:.0f} ms apart'}, per kernel median µs "
                  f"(power-capped {capped_ms(cap)})")
            total = 0.0
            for name, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
                total += statistics.median(v)
                print(f"   {statistics.median(v):9.1f}  {name}")
            print(f"   {total:9.1f}  sum", flush=True)


def probe_linear(t: int, n: int, k: int, secs: float) -> None:
    try:
        cuda_ops.load("cuda")
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    g = torch.Generator(device="cuda").manual_seed(0)
    w8, ws = random_weight(n, k, g)
    x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
    sm, why = scaled_mm_fn(x, w8, ws)
    graphs = {"ours": capture_graph(Repeat(Linear(x, w8, ws)))}
    if sm is None:
        print(f"_scaled_mm blockwise refused: {why}; ours only", flush=True)
    else:
        graphs["cuBLASLt"] = capture_graph(Repeat(sm))
    print(f"T={t} N={n} K={k}, {torch.cuda.get_device_name()}; back to back for {secs:.1f} s each", flush=True)
    for name in [name for _ in range(2) for name in graphs]:
        time.sleep(2.0)
        graph, calls = graphs[name], 0
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start, t0 = clock(), time.perf_counter()
        a.record()
        while time.perf_counter() - t0 < secs:
            for _ in range(5):
                graph.replay()
            calls += 5 * Repeat.CALLS
            torch.cuda.synchronize()
        b.record()
        b.synchronize()
        us = a.elapsed_time(b) * 1e3 / calls
        print(f"{name:9s} {start} -> {clock()}  {calls} calls  {us:8.1f} µs per call  "
              f"{2 * t * n * k / us / 1e6:7.1f} TFLOP/s", flush=True)


class Repeat:
    """CALLS calls of fn, one CUDA graph replay."""

    CALLS = 10

    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        for _ in range(self.CALLS):
            self.fn()


def clock() -> str:
    return datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="probe", required=True)
    moe = sub.add_parser("moe")
    moe.add_argument("--tokens", type=int, default=16384)
    moe.add_argument("--gap", type=float, default=0.2, help="seconds between spaced calls")
    lin = sub.add_parser("linear")
    lin.add_argument("--tokens", type=int, default=8192)
    lin.add_argument("--n", type=int, default=36864)
    lin.add_argument("--k", type=int, default=7168)
    lin.add_argument("--secs", type=float, default=3.0, help="seconds of back-to-back calls per phase")
    args = ap.parse_args()
    if args.probe == "moe":
        probe_moe(args.tokens, args.gap)
    else:
        probe_linear(args.tokens, args.n, args.k, args.secs)


if __name__ == "__main__":
    main()
