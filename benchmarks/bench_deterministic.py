"""The cost of the deterministic mode (LLM(deterministic=True), DSA_DETERMINISTIC=1): one table.

    python benchmarks/bench_deterministic.py ENGINE_DIR_OR_CHECKPOINT [--quick] [--build-dir DIR]

The argument is an engine directory (engine_config.json) or a checkpoint; a checkpoint is built
first (fp8 caches; CUDA + bf16 where a GPU is present, else CPU + fp32) into --build-dir. Rows:

- throughput: LLM.generate of a fixed batch (mixed prompt lengths, greedy, ignore_eos), generated
  tokens / wall s, after one warm-up run of the same batch per mode, the timed runs of the two
  modes alternating (at least 3 each); the whole runtime (scheduler, sampling, CUDA graphs on a GPU).
- decode step at B = 1 / 32 / 128 (``--context`` cached tokens each, pages scattered): on a GPU
  through the CUDA-graph runner as the LLM drives it (deterministic: batch buckets start at 16),
  CUDA events; on the CPU one eager Engine.forward, wall clock. Deterministic = the step padded
  to a multiple of 16 tokens (runtime/llm.py, DETERMINISTIC_TOKEN_BLOCK).
- mixed step: 8 decodes + a 512-token prefill chunk (eager, as the LLM runs every non-decode step).

Median of the iterations; the last column is deterministic time / default time (for throughput:
default tok/s / deterministic tok/s), > 1 where the mode costs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py, when run from the repository root

from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime import knobs
from dsa_trt.runtime.engine import Engine
from dsa_trt.runtime.llm import DETERMINISTIC_TOKEN_BLOCK, LLM
from dsa_trt.runtime.sampling import SamplingParams
from dsa_trt.step import StepInputs

WORDS = "the old fisherman walked down to the harbour and looked at the boats while gulls cried".split()


def resolve_engine(path: Path, build_dir: Path | None) -> Path:
    if (path / "engine_config.json").is_file():
        return path
    if not (path / "config.json").is_file():
        sys.exit(f"bench_deterministic: {path} is neither an engine directory (engine_config.json) nor a "
                 "checkpoint (config.json); give one, e.g. checkpoints/tiny-v32")
    from dsa_trt.builder.build import build_engine

    cuda = torch.cuda.is_available()
    out = (build_dir or Path(tempfile.mkdtemp(prefix="dsa-det-"))) / ("engine-cuda" if cuda else "engine-cpu")
    if not (out / "engine_config.json").is_file():
        print(f"building {out} from {path} ...", flush=True)
        build_engine(path, out, cache_mode="fp8", compiler="aoti", device="cuda" if cuda else "cpu",
                     dtype="bfloat16" if cuda else "float32")
    return out


def median_us(fn, iters: int, warmup: int, cuda: bool) -> float:
    from timing import time_eager_us, time_wall_us

    return (time_eager_us if cuda else time_wall_us)(fn, iters=iters, warmup=warmup)


def throughput(engine: Engine, prompts: list[str], max_tokens: int, runs: int) -> tuple[float, float]:
    """(default, deterministic) tokens/s: both LLMs warmed up first (CUDA graph capture, allocator,
    AOTI and cuBLAS first-run work), then their timed runs alternate, so neither mode pays the
    process's first-use costs or sees the GPU in another clock state; median of the runs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llms = [LLM(engine, num_pages=512, deterministic=d) for d in (False, True)]
    for llm in llms:
        llm.generate(prompts, params)
    rates: list[list[float]] = [[], []]
    for _ in range(runs):
        for i, llm in enumerate(llms):
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[i].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return statistics.median(rates[0]), statistics.median(rates[1])


def scattered_step(cfg, rng: random.Random, num_pages: int, decode: int, context: int, chunk: int = 0) -> StepInputs:
    ppd = -(-(context + 1) // 64)
    ppc = -(-(2 * chunk) // 64) if chunk else 0
    pages = rng.sample(range(num_pages), decode * ppd + ppc)
    seqs = [([rng.randrange(2, cfg.model.vocab_size)], context, pages[i * ppd:(i + 1) * ppd]) for i in range(decode)]
    if chunk:  # a chunked prefill continuing a sequence that holds `chunk` tokens already
        seqs.append(([rng.randrange(2, cfg.model.vocab_size) for _ in range(chunk)], chunk, pages[decode * ppd:]))
    return StepInputs.build(seqs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", type=Path, help="engine directory, or a checkpoint to build one from")
    ap.add_argument("--build-dir", type=Path, default=None, help="where a checkpoint's engine is built")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=512, help="cached tokens per decode sequence (default 512)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk of the mixed step (default 512)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations and a smaller batch workload")
    a = ap.parse_args(argv)
    engine = Engine.load(resolve_engine(a.engine, a.build_dir))
    cfg, dev = engine.config, engine.device
    cuda = dev.type == "cuda"
    iters, warmup, runs = (10, 3, 1) if a.quick else (50, 10, 3)
    n_prompts, max_tokens = (16, 16) if a.quick else (32, 32)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 120))) for _ in range(n_prompts)]
    rows = []
    tp = throughput(engine, prompts, max_tokens, max(runs, 3))
    rows.append((f"throughput: {n_prompts} prompts (2-120 words) x {max_tokens} tokens, greedy", "tok/s", *tp))

    num_pages = max(a.batches) * -(-(a.context + 1) // 64) + 8 + 2 * -(-(2 * a.chunk) // 64)
    pools = allocate_pools(cfg.model, cfg.cache_mode, num_pages, device=dev)
    for p in pools[0] + pools[1]:
        p.random_(0, 120)  # finite e4m3 bytes / values: never time on zeros
    runners = {}
    if cuda:
        from dsa_trt.runtime.cuda_graphs import CudaGraphRunner

        runners = {d: CudaGraphRunner(engine, *pools, min_batch=DETERMINISTIC_TOKEN_BLOCK if d else 1)
                   for d in (False, True)}

    def step_fn(step: StepInputs, deterministic: bool, graph: bool):
        def kernels(fn):  # the deterministic mode's kernel plans around each call, as LLM.step does
            def call():
                with knobs.deterministic_kernels(deterministic):
                    return fn()
            return call

        if graph:  # the graph runner takes the scheduler's host step and copies it in itself
            return kernels(lambda: runners[deterministic].forward(step))
        step = step.to(dev)
        padded = step.pad_tokens(DETERMINISTIC_TOKEN_BLOCK) if deterministic else step
        return kernels(lambda: engine.forward(padded, *pools))

    how = "CUDA graph" if cuda else "eager"
    for b in a.batches:
        step = scattered_step(cfg, rng, num_pages, b, a.context)
        t = [median_us(step_fn(step, d, cuda), iters, warmup, cuda) for d in (False, True)]
        rows.append((f"decode step B={b} ctx={a.context} ({how})", "µs", *t))
    step = scattered_step(cfg, rng, num_pages, 8, a.context, a.chunk)
    t = [median_us(step_fn(step, d, False), iters, warmup, cuda) for d in (False, True)]
    rows.append((f"mixed step: 8 decodes @ {a.context} + {a.chunk}-token chunk (eager)", "µs", *t))

    where = torch.cuda.get_device_name(dev) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"\nengine {cfg.compiler}/{cfg.device}/{cfg.dtype}, {cfg.cache_mode} caches, "
          f"{cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}; {where}; "
          f"median of {iters} steps / {runs} runs")
    print("| workload | unit | default | deterministic | time: deterministic / default |")
    print("|---|---|---:|---:|---:|")
    for name, unit, d0, d1 in rows:
        ratio = d0 / d1 if unit == "tok/s" else d1 / d0  # > 1: the deterministic mode takes that much longer
        print(f"| {name} | {unit} | {d0:,.1f} | {d1:,.1f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
