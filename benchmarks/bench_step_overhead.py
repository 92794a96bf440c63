"""Per-step host overhead of a mixed eager step (one prefill chunk + decode sequences, no CUDA graph).

    python benchmarks/bench_step_overhead.py ENGINE_DIR [--decode 8] [--context 512] [--chunk 256]

overhead = CPU wall time of Engine.forward (synchronised) - GPU busy time of its kernels (the
union of the device intervals torch.profiler records for one forward). It is what the host adds
per step: Python, the dispatcher, op validation, launches the GPU waits for. Uses only
Engine.load, StepInputs and allocate_pools, so the same script measures any revision of the
operator binding (e.g. main's ctypes path against the C++ binding). GPU only.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.engine import Engine
from dsa_trt.runtime.step_inputs import StepInputs


def gpu_busy_us(fn) -> float:
    """Union of the CUDA kernel / memcpy / memset intervals of one fn() call, in microseconds."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def wall_us(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", help="a CUDA engine directory")
    ap.add_argument("--decode", type=int, default=8, help="decode sequences in the step (default 8)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens of each decode sequence (default 512)")
    ap.add_argument("--chunk", type=int, default=256, help="tokens of the prefill chunk (default 256)")
    ap.add_argument("--iters", type=int, default=30, help="timed steps (default 30, after 5 warm-ups)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_step_overhead: needs a CUDA GPU")
    engine = Engine.load(a.engine)
    cfg = engine.config
    rng = random.Random(0)
    ppd = -(-(a.context + 1) // 64)
    ppc = -(-(2 * a.chunk) // 64)  # the chunk continues a sequence already holding `chunk` tokens
    num_pages = a.decode * ppd + ppc + 4
    pools = allocate_pools(cfg.model, cfg.cache_mode, num_pages, device="cuda")
    for p in pools[0] + pools[1]:
        p.random_(0, 120)  # finite e4m3 bytes / values: never time on zeros
    pages = rng.sample(range(num_pages), a.decode * ppd + ppc)
    seqs = [([rng.randrange(2, cfg.model.vocab_size)], a.context, pages[i * ppd:(i + 1) * ppd]) for i in range(a.decode)]
    chunk = [rng.randrange(2, cfg.model.vocab_size) for _ in range(a.chunk)]
    seqs.append((chunk, a.chunk, pages[a.decode * ppd:]))  # a chunked prefill: start > 0, sparse program
    step = StepInputs.build(seqs, device="cuda")

    def forward():
        return engine.forward(step, *pools)

    for _ in range(5):
        forward()
    walls = [wall_us(forward) for _ in range(a.iters)]
    busy = [gpu_busy_us(forward) for _ in range(max(3, a.iters // 5))]
    w, g = statistics.median(walls), statistics.median(busy)
    print("| engine | step | wall µs | GPU busy µs | host overhead µs |")
    print("|---|---|---|---|---|")
    print(f"| {cfg.compiler}/{cfg.cache_mode} | {a.decode} decode @ {a.context} + {a.chunk}-token chunk "
          f"({step.input_ids.numel()} tokens) | {w:.0f} | {g:.0f} | {w - g:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
