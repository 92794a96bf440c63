"""`dsa-trt` command line: generate, serve (Triton) and bench over an engine directory."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

from dsa_trt.engine_config import EngineConfig, EngineDirError

from .sampling import SamplingParams


def _generate(a: argparse.Namespace) -> int:
    from .llm import LLM

    cfg = EngineConfig.load(a.engine)
    if cfg.world_size == 1:
        return _generate_with(LLM(a.engine, speculative=a.speculative), a)
    from . import distributed  # one process per rank; rank 0 schedules, samples and prints

    if "RANK" not in os.environ:
        print(f"multi-rank engine ({cfg.layout}): launching {cfg.world_size} ranks with torchrun", file=sys.stderr,
              flush=True)
        return distributed.relaunch_with_torchrun(cfg.world_size, ["dsa_trt.runtime.cli", *a.argv])
    try:
        return distributed.run_engine_dir(
            a.engine, lambda engine: _generate_with(LLM(engine, speculative=a.speculative), a)) or 0
    except distributed.EPCapacityError as e:  # every rank raised it: rank 0 says so, once
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate_with(llm, a: argparse.Namespace) -> int:
    params = SamplingParams(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, max_tokens=a.max_tokens, seed=a.seed,
        stop=a.stop or [],
    )
    prompts = a.prompt or ["Hello"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for o in outs:
        print(f"--- {o.request_id} ({len(o.prompt_token_ids)} prompt tokens, {len(o.token_ids)} generated, "
              f"finish={o.finish_reason})")
        print(f"{o.prompt}\u2502{o.text}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"--- {len(outs)} prompts, {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s) on {llm.device}; "
          f"cache holds {llm.tokens_that_fit:,} tokens")
    if llm.spec_stats is not None:
        print(f"--- {_spec_line(llm.spec_stats)}")
    return 0


def _spec_line(st) -> str:
    return (f"speculative (MTP): acceptance rate {st.acceptance_rate:.1%} ({st.accepted}/{st.drafted} drafts), "
            f"mean accepted length {st.mean_accepted_length:.2f} tokens per verify step")


def _serve(a: argparse.Namespace) -> int:
    """Write the Triton model repository for the engine and run the bundled tritonserver."""
    import tempfile
    import uuid
    from pathlib import Path

    from .triton import TritonServer, write_model_repository
    from .triton.server import ServerError

    launch_id = uuid.uuid4().hex
    server = TritonServer(Path("."), a.http_port, a.grpc_port, a.metrics_port, address=a.address,
                          inherit_output=True, model=a.model_name, launch_id=launch_id)
    try:
        server.check_ports()  # before writing anything or printing any banner
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="dsa-trt-serve-"))
    repo = write_model_repository(a.engine, a.model_repository or work / "model_repository", a.model_name,
                                  num_pages=a.num_pages, launch_id=launch_id, speculative=a.speculative)
    server.repo, server.extra_args = repo.path, repo.server_args
    try:
        server.start(work).wait_ready(a.ready_timeout)
    except ServerError as e:
        server.stop()
        print(f"error: {e}", file=sys.stderr)
        return 2
    gen = f"http://{server.http_url}/v2/models/{a.model_name}"
    print(f"dsa-trt serve: model repository {repo.path} ({', '.join(repo.models)})\n"
          f"  HTTP     {gen}/generate   {gen}/generate_stream\n"
          f"  gRPC     {server.grpc_url}   (decoupled: use a stream)\n"
          f"  metrics  {server.metrics_url}\n"
          f"  limits   max_model_len {_advertised_max_model_len(repo.path, a.model_name)} (prompt + max_tokens)\n"
          f"  example  curl -s {gen}/generate -d '{{\"text_input\": \"Hello\", \"max_tokens\": 16}}'\n"
          "Ctrl-C stops the server.", flush=True)
    # The server runs in its own session: stop it on Ctrl-C and on SIGTERM, not only on our exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        why = server.supervise()  # returns when tritonserver exits or a backend stub dies
        code = server.returncode()  # None: a stub died, the server still runs (stopped below)
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
    if code == 0:
        return 0
    print(f"error: {why}", file=sys.stderr, flush=True)
    return 3


def _advertised_max_model_len(repo, model: str) -> str:
    import re

    m = re.search(r'key: "max_model_len" value \{ string_value: "(\d+)"', (repo / model / "config.pbtxt").read_text())
    return m.group(1) if m else "sized at load (see the server log)"


def _percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, math.ceil(len(ys) * q / 100) - 1))]


def _prompt_lines(path: str) -> list[str]:
    """The non-empty lines of a --prompt-file, or a ValueError naming what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompt-file {path}: no such file (give a text file, one prompt per line)")
    try:
        lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not lines:
        raise ValueError(f"--prompt-file {path}: no non-empty line (one prompt per line)")
    return lines


def _bench(a: argparse.Namespace) -> int:
    """Offline throughput: N prompts (random token ids, or the lines of --prompt-file) submitted at
    once to AsyncLLM (continuous batching, at most --max-num-seqs sequences in flight)."""
    import asyncio

    import torch

    from .async_llm import AsyncLLM
    from .speculative import SpecStats

    bad = [f"--{n.replace('_', '-')} {getattr(a, n)}" for n in ("num_prompts", "prompt_len", "max_num_seqs")
           if getattr(a, n) < 1]
    if bad:
        raise ValueError(f"{', '.join(bad)}: must be >= 1")
    lines = _prompt_lines(a.prompt_file) if a.prompt_file else None
    engine = AsyncLLM(a.engine, num_pages=a.num_pages, speculative=a.speculative, max_num_seqs=a.max_num_seqs)
    vocab = engine.llm.model_config.vocab_size
    try:
        if lines is not None:  # line i % len(lines), cut to its first --prompt-len tokens
            prompts = [engine.llm.tokenizer.encode(lines[i % len(lines)])[: a.prompt_len]
                       for i in range(a.num_prompts)]
        else:
            g = torch.Generator().manual_seed(a.seed)
            prompts = torch.randint(2, vocab, (a.num_prompts, a.prompt_len), generator=g).tolist()
        params = [SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed + i, ignore_eos=True)
                  for i in range(a.num_prompts)]
        # warm-up, a batch of the same shape (other ids: no prefix-cache hits later): first-call costs
        # and the CUDA-graph captures of its decode / verify / draft buckets stay out of the timing
        g = torch.Generator().manual_seed(a.seed + 1)
        warm = [engine.submit(torch.randint(2, vocab, (len(p),), generator=g).tolist(),
                              SamplingParams(temperature=a.temperature, max_tokens=min(a.max_tokens, 4), ignore_eos=True))
                for p in prompts]
        for w in warm:
            w.result()
        if engine.llm.speculator is not None:  # acceptance of the timed requests only
            engine.llm.speculator.stats = SpecStats()
        first: list[float] = []  # seconds from t0 to a request's first token
        last: list[float] = []  # ... to its last one
        counts: list[int] = []

        async def one(prompt: list[int], sp: SamplingParams, t0: float) -> None:
            n = 0
            async for d in engine.generate_async(prompt, sp):
                if n == 0:
                    first.append(time.perf_counter() - t0)
                n += len(d.token_ids)
            last.append(time.perf_counter() - t0)
            counts.append(n)

        async def run_all() -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(p, sp, t0) for p, sp in zip(prompts, params, strict=True)))
            return time.perf_counter() - t0

        wall = asyncio.run(run_all())
    finally:
        engine.shutdown()
    gen = sum(counts)
    ms = 1e3  # seconds -> milliseconds
    source = f"the lines of {a.prompt_file}, <= {a.prompt_len} tokens" if lines is not None else f"{a.prompt_len} tokens"
    print(f"dsa-trt bench: {a.num_prompts} prompts x {source} -> {a.max_tokens} tokens each, "
          f"temperature {a.temperature}, on {engine.llm.device}")
    print(f"  {gen} tokens in {wall:.2f} s: {gen / wall:.1f} output tok/s, "
          f"{(gen + sum(map(len, prompts))) / wall:.1f} total tok/s, {a.num_prompts / wall:.2f} requests/s")
    print(f"  latency p50 {_percentile(last, 50) * ms:.0f} ms  p99 {_percentile(last, 99) * ms:.0f} ms; "
          f"first token p50 {_percentile(first, 50) * ms:.0f} ms  p99 {_percentile(first, 99) * ms:.0f} ms "
          "(all submitted at t=0)")
    if engine.llm.spec_stats is not None:
        print(f"  {_spec_line(engine.llm.spec_stats)}")
    return 0


def _plan(a: argparse.Namespace) -> int:
    """Whether and how a model fits before anything is built (dsa_trt/plan.py); exit 1 when it does not."""
    import json

    from dsa_trt.plan import format_plan, load_config, make_plan

    plan = make_plan(load_config(a.model), a.tp, a.ep, a.gpu_memory_gb, batch=a.batch, cache_mode=a.cache,
                     weights=a.weights, vocab_split=a.vocab_split, include_mtp=a.mtp, reserve_gb=a.reserve_gb,
                     min_cache_tokens=a.min_cache_tokens, cp=a.cp)
    print(json.dumps(plan.to_dict(), indent=2) if a.json else format_plan(plan))
    return 0 if plan.fits else 1


def _add_plan_parser(sub) -> None:
    from dsa_trt.plan import CACHE_MODES, DEFAULT_MIN_CACHE_TOKENS, DEFAULT_RESERVE_GB, WEIGHT_MODES

    p = sub.add_parser("plan", help="per-rank weights, cache and context of a parallel layout, before building",
                       formatter_class=_HelpFormatter)
    p.add_argument("model", help="checkpoint directory or a config.json")
    p.add_argument("--tp", type=int, default=1, help="attention heads / dense MLP split over N ranks")
    p.add_argument("--ep", type=int, default=None,
                   help="routed experts split over N ranks (default: --tp, or 1 with --cp); --tp 1 --ep N alone "
                        "plans data-parallel attention, which the builder does not build: add --cp N")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel attention over N ranks (tp 1; with --ep N: the builder's --ep N --cp N)")
    p.add_argument("--gpu-memory-gb", type=float, required=True, help="memory per GPU, decimal GB")
    p.add_argument("--batch", type=int, default=1, help="sequences for the longest-context column")
    p.add_argument("--cache", choices=CACHE_MODES, default="fp8", help="cache format the bytes per token are counted for")
    p.add_argument("--weights", choices=WEIGHT_MODES, default="stored",
                   help="stored: as the checkpoint keeps them (fp8 blocks stay fp8); bf16: dequantised")
    p.add_argument("--vocab-split", action="store_true", help="split embed/lm_head rows over tp (default: replicated)")
    p.add_argument("--mtp", action="store_true", help="count the MTP layer too")
    p.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB,
                   help="per rank: activations, workspace, CUDA graphs, NCCL")
    p.add_argument("--min-cache-tokens", type=int, default=DEFAULT_MIN_CACHE_TOKENS,
                   help="a rank fits when its cache holds at least this many tokens")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (ranks[].weight_bytes, fits, ...)")
    p.set_defaults(fn=_plan)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, unless its help states it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "default" in text:
            return text
        return super()._get_help_string(action)


# The sampling flags' defaults are SamplingParams' (one set for the CLI, the Python API and the
# Triton model).
_SAMPLING = SamplingParams()
DETERMINISTIC_HELP = ("pad every step to a multiple of 16 tokens: a request's output does not depend on what it is "
                      "batched with, bitwise on the CPU engine (sets DSA_DETERMINISTIC=1; README: cost)")


SPECULATIVE_HELP = ("speculative decoding with the engine's MTP layer: draft N tokens per step (mtp = mtp:1) and "
                    "verify them in one step; needs an engine built with its MTP draft program (default: off)")


def parser() -> argparse.ArgumentParser:
    """The `dsa-trt` argument parser: subcommands generate, serve, bench and plan."""
    ap = argparse.ArgumentParser(prog="dsa-trt", formatter_class=_HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts", formatter_class=_HelpFormatter)
    g.add_argument("--engine", required=True, help="engine directory written by `make engine`")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; default: one prompt, 'Hello')")
    g.add_argument("--max-tokens", type=int, default=_SAMPLING.max_tokens, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=_SAMPLING.temperature, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=_SAMPLING.top_k, help="sample among the k most likely tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=_SAMPLING.top_p, help="nucleus sampling mass in (0, 1]; 1 = off")
    g.add_argument("--seed", type=int, default=_SAMPLING.seed,
                   help="sampling seed, each prompt's generator seeded with it (default: unseeded)")
    g.add_argument("--stop", action="append", help="a stop string (repeat for several; default: none)")
    g.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    g.add_argument("--speculative", default=None, metavar="mtp[:N]", help=SPECULATIVE_HELP)
    g.set_defaults(fn=_generate)
    s = sub.add_parser("serve", help="serve the engine with Triton (decoupled python model, TRT-LLM schema)",
                       formatter_class=_HelpFormatter)
    s.add_argument("--engine", required=True, help="engine directory written by `make engine`")
    s.add_argument("--model-repository", default=None, help="where to write it (default: in --work-dir)")
    s.add_argument("--work-dir", default=None, help="backend dir and repository (default: a new temp dir)")
    s.add_argument("--model-name", default="dsa_trt", help="the Triton model's name (URL path and gRPC model_name)")
    s.add_argument("--address", default="127.0.0.1", help="address the server binds (0.0.0.0: every interface)")
    s.add_argument("--http-port", type=int, default=8000, help="HTTP/REST port (generate, generate_stream, health)")
    s.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (streaming: a decoupled model)")
    s.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port")
    s.add_argument("--num-pages", type=int, default=None, help="cache pages (default: DSA_NUM_PAGES or sized)")
    s.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the server to be ready")
    s.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    s.add_argument("--speculative", default=None, metavar="mtp[:N]", help=SPECULATIVE_HELP)
    s.set_defaults(fn=_serve)
    b = sub.add_parser("bench", help="offline throughput and latency over N prompts", formatter_class=_HelpFormatter)
    b.add_argument("--engine", required=True, help="engine directory written by `make engine`")
    b.add_argument("--num-prompts", type=int, default=64, help="prompts submitted at once")
    b.add_argument("--max-num-seqs", type=int, default=256,
                   help="sequences decoded at once, the rest wait their turn (1: batch size 1 over every prompt)")
    b.add_argument("--prompt-len", type=int, default=32,
                   help="tokens per prompt (random ids; with --prompt-file the most taken from a line)")
    b.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="text prompts, one per line (cycled to --num-prompts) instead of random token ids")
    b.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (EOS ignored)")
    b.add_argument("--temperature", type=float, default=_SAMPLING.temperature, help="sampling temperature; 0 = greedy")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts; prompt i samples with seed + i")
    b.add_argument("--num-pages", type=int, default=None, help="cache pages (default: DSA_NUM_PAGES or sized)")
    b.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    b.add_argument("--speculative", default=None, metavar="mtp[:N]", help=SPECULATIVE_HELP)
    b.set_defaults(fn=_bench)
    _add_plan_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if getattr(a, "deterministic", False):  # read by every LLM this process or its children start
        os.environ["DSA_DETERMINISTIC"] = "1"
    try:
        return a.fn(a)
    except (EngineDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    if "RANK" in os.environ:
        # A torchrun rank whose work is done and whose process group is destroyed: skip the
        # interpreter's teardown, where the collectives' C++ threads can still abort a clean run
        # (SIGABRT, "terminate called without an active exception", once in CI after rank 0 had
        # printed every completion).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)
