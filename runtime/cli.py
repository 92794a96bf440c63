"""`dsa-trt` command line: generate from an engine directory (serve/bench: see README)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from dsa_trt.engine_config import EngineConfig, EngineDirError

from .sampling import SamplingParams


def _generate(a: argparse.Namespace) -> int:
    from .llm import LLM

    tp = EngineConfig.load(a.engine).tp_size
    if tp == 1:
        return _generate_with(LLM(a.engine), a)
    from . import distributed  # one process per rank; rank 0 schedules, samples and prints

    if "RANK" not in os.environ:
        print(f"tensor-parallel engine (tp={tp}): launching {tp} ranks with torchrun", file=sys.stderr, flush=True)
        return distributed.relaunch_with_torchrun(tp, ["dsa_trt.runtime.cli", *a.argv])
    return distributed.run_tensor_parallel(a.engine, lambda engine: _generate_with(LLM(engine), a)) or 0


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
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsa-trt")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts")
    g.add_argument("--engine", required=True, help="engine directory written by `make engine`")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.set_defaults(fn=_generate)
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return a.fn(a)
    except (EngineDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
