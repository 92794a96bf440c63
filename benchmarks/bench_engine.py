"""Decode-step latency of a compiled engine: eager vs CUDA-graph replay, per batch size.

    python benchmarks/bench_engine.py ENGINE_DIR [--batches 1 8 32 128] [--context 512]

Each row times one decode step (B sequences, one token each, `context` tokens already cached,
pages scattered in the pool) with CUDA events: median of 50 after 10 warm-ups. The engine-level
floor is launch-bound at this model size, so the table reports µs/step and the graph speed-up.
"""

from __future__ import annotations

import argparse
import random


from timing import time_eager_us

from dsa_trt.plugins import cuda_ops
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.cuda_graphs import CudaGraphRunner
from dsa_trt.runtime.engine import Engine
from dsa_trt.runtime.step_inputs import StepInputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--context", type=int, default=512)
    a = ap.parse_args()
    cuda_ops.load("cuda")
    engine = Engine.load(a.engine)
    cfg = engine.config
    pages_per_seq = -(-(a.context + 1) // 64)
    num_pages = max(b for b in a.batches) * pages_per_seq + 8
    pools = allocate_pools(cfg.model, cfg.cache_mode, num_pages, device="cuda")
    for p in pools[0] + pools[1]:
        p.random_(0, 120)  # finite e4m3 bytes / values: never time on zeros
    runner = CudaGraphRunner(engine, *pools)
    rng = random.Random(0)
    print("| batch | context | eager µs/step | CUDA graph µs/step | speed-up |")
    print("|---|---|---|---|---|")
    for b in a.batches:
        page_ids = rng.sample(range(num_pages), b * pages_per_seq)
        seqs = [([rng.randrange(2, cfg.model.vocab_size)], a.context, page_ids[i * pages_per_seq:(i + 1) * pages_per_seq])
                for i in range(b)]
        host = StepInputs.build(seqs)  # the graph runner takes the scheduler's host step
        step = host.to("cuda")
        eager = time_eager_us(lambda: engine.forward(step, *pools))
        graph = time_eager_us(lambda: runner.forward(host))
        print(f"| {b} | {a.context} | {eager:.0f} | {graph:.0f} | {eager / graph:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
