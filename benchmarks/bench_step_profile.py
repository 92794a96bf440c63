"""Where every µs of one decode step goes (issue 25 item 7): torch.profiler over ``LLM.step()``.

    python benchmarks/bench_step_profile.py ENGINE_DIR [--batches 1 32 128] [--context 512] [--quick]
        [--speculative mtp]

B requests of ``--context`` prompt tokens are prefilled, a few decode steps warm up (CUDA-graph
capture), then single decode steps of the real runtime (scheduler, step inputs, the engine or its
CUDA-graph runner, sampling, token read-back, detokenisation) run under torch.profiler (CPU + CUDA
activities); the step with the median wall time is accounted for. The step's wall time W (host
clock, ``record_function`` around it) is split exactly into:

- GPU busy, by kernel group: DSA attention ops (indexer logits, top-k, sparse MLA, cache writes),
  linears / GEMMs (our fp8 linear, cuBLAS), MoE (our routed-expert kernels), norms / elementwise
  (the compiled program's generated kernels), copies (memcpy, memset, copy kernels), sampling
  (kernels launched by the sampler), other. Overlapping kernels count once (the earliest).
- GPU idle, by what the host was doing meanwhile. The host timeline is cut into consecutive
  phases by the runtime's own calls (the LLM's methods are wrapped in ``record_function``, not
  changed): scheduler + step-input build (``Scheduler.schedule``), H2D of the step inputs
  (``StepInputs.to``), forward launch (``Engine.run`` / ``CudaGraphRunner.run``, which copies a graph step's inputs itself), sampling
  (``sample`` and the sample-rows copy before it), D2H / sync (the ``.tolist()`` of the sampled
  tokens: it waits for the GPU), update + detokenise (``Scheduler.update``, the text deltas).

With ``--speculative mtp`` every column is an MTP step of one greedy draft (the default fused
verify + next-draft call, or DSA_MTP_FUSED=0's separate passes): its target / draft / fused CUDA
graph runners are the "forward" phase, and the verify's argmax read-back is "D2H / sync".

The rows of each column sum to W; the host phases' own durations are a second table (they also
sum to W). Without a GPU every µs is host time (the CPU engine computes inside "forward").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import dsa_trt.runtime.llm as llm_module
from dsa_trt.runtime.engine import Engine
from dsa_trt.runtime.llm import LLM
from dsa_trt.runtime.sampling import SamplingParams
from dsa_trt.step import StepInputs

STEP = "bench:step"
# (label, the wrapped call whose end closes the phase); each phase runs from the previous one's end
PHASES = (("scheduler + step-input build", "bench:schedule"), ("H2D step inputs (eager; graphs: in forward)", "bench:h2d"),
          ("forward launch", "bench:forward"), ("sampling (launch + rows H2D)", "bench:sample"),
          ("D2H / sync (tokens .tolist())", None), ("update + detokenise", STEP))
GROUPS = ("DSA attention ops", "linears / GEMMs", "MoE", "norms / elementwise", "copies / memsets", "sampling",
          "other kernels")
_DSA = ("indexer_", "topk_translate", "sparse_mla", "cache_write", "topk_fused", "fused_kernel")
_GEMM = ("linear_kernel", "act_quant_kernel", "splitk_reduce", "gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_",
         "sm80_", "ampere_", "wgmma", "matmul", "splitkreduce", "kernel2")
_GENERATED = ("triton_", "elementwise", "reduce_kernel", "vectorized", "norm", "softmax", "fused")


def kernel_group(name: str, launched_in: str | None) -> str:
    n = name.lower()
    if launched_in == "bench:sample":
        return "sampling"
    if n.startswith("memcpy") or n.startswith("memset") or "copy" in n:
        return "copies / memsets"
    if "moe_" in n:  # dsa_moe::moe_gemm_kernel, moe_* helpers
        return "MoE"
    if any(k in n for k in _DSA):
        return "DSA attention ops"
    if any(k in n for k in _GEMM):
        return "linears / GEMMs"
    if any(k in n for k in _GENERATED):
        return "norms / elementwise"
    return "other kernels"


@contextlib.contextmanager
def phases_recorded(llm: LLM):
    """Wrap the calls that bound the step's phases in record_function ranges (restored after)."""
    patched = []  # (object, attribute, its own value before or None: then the class's was used)

    def wrap(obj, attr, label):
        orig = getattr(obj, attr)
        own = vars(obj).get(attr)

        def wrapped(*a, **k):
            with record_function(label):
                return orig(*a, **k)

        patched.append((obj, attr, own))
        setattr(obj, attr, wrapped)

    wrap(llm.scheduler, "schedule", "bench:schedule")
    wrap(StepInputs, "to", "bench:h2d")
    wrap(llm.graphs if llm.graphs is not None else llm.engine, "run", "bench:forward")
    spec = llm.speculator
    if spec is not None:  # the draft pass and the fused verify + draft call launch GPU work too
        for obj, attr in ((spec, "propose"), (spec, "run_fused")):
            wrap(obj, attr, f"bench:forward:{attr}")
    wrap(llm_module, "sample", "bench:sample")  # LLM.step calls the module's name
    wrap(llm.scheduler, "update", "bench:update")
    try:
        yield
    finally:
        for obj, attr, own in reversed(patched):
            if own is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)


def profiled_step(llm: LLM) -> dict:
    """One llm.step() under the profiler -> {"wall", "gpu": {group: µs}, "idle": {phase: µs}, "host": {...}}."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
    with phases_recorded(llm), profile(activities=acts) as prof:
        with record_function(STEP):
            deltas = llm.step()
    assert deltas, "the step ran no request: every request finished (raise max_tokens)"
    events = list(prof.profiler.kineto_results.events())
    spans = {}
    for e in events:
        if e.device_type() == DeviceType.CPU and e.name().startswith("bench:"):
            spans.setdefault(e.name(), (e.start_ns(), e.end_ns()))
    t0, t1 = spans[STEP]
    bounds, start = [], t0
    # the speculator's launches count as forward: the phase closes at the last of them
    ends = [f for n, (_, f) in spans.items() if n.startswith("bench:forward")]
    if ends:
        spans["bench:forward"] = (spans.get("bench:forward", (min(ends), 0))[0], max(ends))
    for label, closer in PHASES:  # None: the phase ends where the update starts
        # a range the step never entered (graph mode: CudaGraphRunner.run copies the host step
        # itself, inside "forward") is an empty phase
        end = t1 if closer == STEP else spans["bench:update"][0] if closer is None else spans.get(closer, (0, start))[1]
        bounds.append((label, start, max(start, end)))
        start = max(start, end)
    corr = lambda e: getattr(e, "correlation_id", lambda: 0)()  # noqa: E731 - absent in some torch builds
    launch_phase = {}  # correlation id -> the bench: range its runtime launch call ran in
    for e in events:
        if e.device_type() == DeviceType.CPU and e.name().startswith(("cuda", "cu")) and corr(e):
            inside = [n for n, (s, f) in spans.items() if n != STEP and s <= e.start_ns() <= f]
            launch_phase[corr(e)] = inside[0] if inside else None
    # the profiler mirrors our record_function ranges onto the GPU timeline (gpu_user_annotation):
    # they span the kernels they launched and are no GPU work of their own
    gpu = sorted((max(e.start_ns(), t0), min(e.end_ns(), t1), e.name(), corr(e)) for e in events
                 if e.device_type() == DeviceType.CUDA and e.end_ns() > t0 and e.start_ns() < t1
                 and not e.name().startswith("bench:"))
    busy = {g: 0.0 for g in GROUPS}
    kernels: dict[str, list[float]] = {}  # name -> [calls, µs of its own span]; overlaps not removed
    intervals, cursor = [], t0
    for s, f, name, corr in gpu:
        k = kernels.setdefault(name, [0, 0.0])
        k[0] += 1
        k[1] += (f - s) / 1e3
        s = max(s, cursor)  # overlapping kernels count once
        if f > s:
            busy[kernel_group(name, launch_phase.get(corr))] += (f - s) / 1e3
            intervals.append((s, f))
            cursor = f
    idle = {label: 0.0 for label, _, _ in bounds}
    free, cursor = [], t0
    for s, f in intervals + [(t1, t1)]:
        if s > cursor:
            free.append((cursor, s))
        cursor = max(cursor, f)
    for a, b in free:
        for label, s, f in bounds:
            idle[label] += max(0, min(b, f) - max(a, s)) / 1e3
    host = {label: (f - s) / 1e3 for label, s, f in bounds}
    return {"wall": (t1 - t0) / 1e3, "gpu": busy, "idle": idle, "host": host, "kernels": kernels}


def decode_llm(engine: Engine, batch: int, context: int, graphs: bool, warm_steps: int, max_tokens: int,
               speculative: str | None = None) -> LLM:
    os.environ["DSA_CUDA_GRAPHS"] = "1" if graphs else "0"
    pages = batch * (-(-(context + 2 * max_tokens + 1) // 64)) + 4
    llm = LLM(engine, num_pages=pages, max_num_seqs=max(batch, 1), speculative=speculative)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rids = [llm.add_request([2 + (7 * i + 13 * j) % (vocab - 2) for j in range(context)], params)
            for i in range(batch)]
    while any(not llm._outputs[r].token_ids for r in rids):  # prefill (chunked by max_num_tokens)
        llm.step()
    for _ in range(warm_steps):  # decode steps: CUDA-graph capture, allocator warm-up
        llm.step()
    return llm


def measure(engine: Engine, batch: int, context: int, graphs: bool, steps: int, plain: int,
            speculative: str | None = None) -> dict:
    llm = decode_llm(engine, batch, context, graphs, warm_steps=3, max_tokens=8 + 2 * (steps + plain),
                     speculative=speculative)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    walls = []
    for _ in range(plain):  # the same steps without the profiler: its overhead shows against these
        sync()
        t = time.perf_counter()
        llm.step()
        walls.append((time.perf_counter() - t) * 1e6)
    runs = sorted((profiled_step(llm) for _ in range(steps)), key=lambda r: r["wall"])
    r = runs[len(runs) // 2]
    r["unprofiled"] = statistics.median(walls)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each request (default 512)")
    ap.add_argument("--steps", type=int, default=5, help="profiled decode steps per column; the median is shown")
    ap.add_argument("--quick", action="store_true", help="3 profiled and 5 plain steps per column")
    ap.add_argument("--top", type=int, default=15, help="GPU activities listed per column, longest first (0: none)")
    ap.add_argument("--speculative", choices=["mtp"], default=None,
                    help="profile MTP steps of one greedy draft (the engine's draft program) instead of decode steps")
    a = ap.parse_args(argv)
    engine = Engine.load(a.engine, draft=a.speculative is not None)
    steps, plain = (3, 5) if a.quick else (a.steps, 20)
    modes = [False, True] if engine.device.type == "cuda" else [False]
    cols = {}
    for graphs in modes:
        for b in a.batches:
            cols[f"{'graph' if graphs else 'eager'} B={b}"] = measure(engine, b, a.context, graphs, steps, plain,
                                                                       a.speculative)
            print(f"measured {list(cols)[-1]}: wall {cols[list(cols)[-1]]['wall']:.0f} µs", file=sys.stderr, flush=True)
    cfg = engine.config
    print(f"\nengine {a.engine} ({cfg.compiler}/{cfg.device}/{cfg.dtype}, {cfg.cache_mode} caches, "
          f"{cfg.model.num_hidden_layers} layers); one {'MTP (one draft) ' if a.speculative else ''}decode step, "
          f"{a.context}-token contexts; µs of the profiled "
          f"step with the median wall of {steps}")
    names = list(cols)
    print("| µs | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    rows = [(f"GPU: {g}", lambda c, g=g: c["gpu"][g]) for g in GROUPS]
    rows += [(f"GPU idle during: {label}", lambda c, lab=label: c["idle"][lab]) for label, _ in PHASES]
    for label, get in rows:
        print(f"| {label} | " + " | ".join(f"{get(cols[n]):.1f}" for n in names) + " |")
    print("| **sum of the rows** | " + " | ".join(
        f"**{sum(cols[n]['gpu'].values()) + sum(cols[n]['idle'].values()):.1f}**" for n in names) + " |")
    print("| **step wall (profiled)** | " + " | ".join(f"**{cols[n]['wall']:.1f}**" for n in names) + " |")
    print("| step wall without the profiler (median) | " + " | ".join(f"{cols[n]['unprofiled']:.1f}" for n in names)
          + " |")
    print("\nhost time by phase (sums to the profiled wall):")
    print("| µs | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, _ in PHASES:
        print(f"| {label} | " + " | ".join(f"{cols[n]['host'][label]:.1f}" for n in names) + " |")
    for n in names if a.top else []:
        print(f"\nlongest GPU activities of {n} (µs of each one's own span; overlaps not removed):")
        print("| µs | calls | name |\n|---:|---:|---|")
        for name, (calls, us) in sorted(cols[n]["kernels"].items(), key=lambda kv: -kv[1][1])[: a.top]:
            print(f"| {us:.1f} | {calls} | {name[:120]} |")
    bad = [n for n in names if abs(sum(cols[n]["gpu"].values()) + sum(cols[n]["idle"].values()) - cols[n]["wall"]) > 0.5
           or abs(sum(cols[n]["host"].values()) - cols[n]["wall"]) > 0.5]
    if bad:
        print(f"accounting error: the rows of {bad} do not sum to the wall time", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
