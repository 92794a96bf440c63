"""Host costs that grow with context and output length: a decode step's inputs, an output's text (CPU).

    python benchmarks/bench_host.py [--lengths 128 1024 8192 32768] [--tokens 200]

Table 1, the scheduler's step inputs (StepInputs.build) of one decode step of B sequences at a
context of C tokens, µs (median of 20): page rows as Python lists (what the scheduler passed before)
and as Request.page_row() tensors (what the scheduler passes now: grown in place as pages are
appended).

Table 2, µs per generated token of an output's text at L tokens (median over --tokens tokens past L):
- whole decode: ``Tokenizer.decode`` of the whole output, what LLM._advance did at every token
  before the incremental decoder (and still does once, when a request finishes);
- TextDecoder.add: the incremental decoder (dsa_trt/tokenizer.py);
- LLM._advance + stream: the runtime's whole per-token text path now (the decoder, a stop-string
  search, the CompletionOutput's text, AsyncLLM's delta), on an eager tiny engine.
Text: the embedded corpus repeated (byte-level BPE, the tiny checkpoint's tokenizer).

Table 3, the token histories the penalties read (repetition / presence / frequency), one decode step
of B penalised sequences with C-token prompts, vocabulary 129,280 (V3.2's), ms: rebuilt from the id
lists (before) against each request's TokenHistory synced with its one new token (now), CPU tensors.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsa_trt.export.tiny_checkpoint import CORPUS_PATH, write_tiny_checkpoint


def per_token_us(fn, ids: list[int], start: int, n: int) -> float:
    times = []
    for t in ids[start : start + n]:
        t0 = time.perf_counter()
        fn(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 8192, 32768])
    ap.add_argument("--tokens", type=int, default=200, help="tokens timed past each length")
    a = ap.parse_args()
    if min(a.lengths) < 1 or a.tokens < 1:
        ap.error("--lengths and --tokens must be >= 1")

    from dsa_trt.engine_config import EngineConfig
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network
    from dsa_trt.runtime.async_llm import RequestHandle
    from dsa_trt.runtime.engine import eager_engine
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.sampling import SamplingParams

    ckpt_dir = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    ckpt = Checkpoint(ckpt_dir)
    cfg = EngineConfig(model=ckpt.config, cache_mode="fp32", dtype="float32", device="cpu", compiler="eager",
                       kv_scales=[1.0] * ckpt.config.num_hidden_layers)
    engine = eager_engine(build_network(ckpt, "fp32", torch.float32, cfg.kv_scales), cfg, torch.device("cpu"),
                          ckpt.tokenizer_path)
    need = max(a.lengths) + a.tokens
    llm = LLM(engine, num_pages=need // 64 + 2)  # the pool holds the longest output (never stepped)
    tok = llm.tokenizer
    corpus = tok.encode(CORPUS_PATH.read_text(encoding="utf-8"), add_bos=False)
    ids = (corpus * (need // len(corpus) + 1))[:need]

    from dsa_trt.runtime.scheduler import Request
    from dsa_trt.step import StepInputs

    sp = SamplingParams(max_tokens=need + 1, ignore_eos=True, stop=["\x00never"])

    print("decode step inputs (StepInputs.build), µs, median of 20")
    print("| batch | context | rows as lists | rows as Request.page_row() (the scheduler now) | lists / page_row |")
    print("|---:|---:|---:|---:|---:|")
    for batch, context in ((1, 4096), (32, 4096), (32, 32768), (32, 131072), (128, 32768)):
        reqs = []
        for b in range(batch):
            r = Request(f"r{b}", [2] * (context + 1), context, sp, b)
            r.pages = list(range(b * 2100, b * 2100 + context // 64 + 1))
            r.page_row()  # the row exists from the earlier steps; a step appends at most one page
            reqs.append(r)
        lists = [([5], context, r.pages) for r in reqs]
        cost = []
        for make in (lambda: lists, lambda: [([5], context, r.page_row()) for r in reqs]):
            times = []
            for _ in range(21):
                t0 = time.perf_counter()
                StepInputs.build(make(), logits_for="all")
                times.append(time.perf_counter() - t0)
            cost.append(statistics.median(times[1:]) * 1e6)
        print(f"| {batch} | {context:,} | {cost[0]:.0f} | {cost[1]:.0f} | {cost[0] / cost[1]:.0f}x |", flush=True)

    from dsa_trt.runtime.sampling import TokenHistory, _history_rows

    print("\npenalty histories (counts and seen rows [B, 129,280]), ms, median of 5")
    print("| batch | prompt tokens | from the id lists (before) | TokenHistory (now) | before / now |")
    print("|---:|---:|---:|---:|---:|")
    vocab, cpu = 129_280, torch.device("cpu")
    for batch, context in ((1, 4096), (8, 32768), (32, 32768)):
        g = torch.Generator().manual_seed(batch)
        reqs = [Request(f"p{b}", torch.randint(vocab, (context + 64,), generator=g).tolist(), context, sp, b)
                for b in range(batch)]
        hist = [r.token_history() for r in reqs]
        for h in hist:
            h.rows(vocab, cpu)
        cost = []
        for fn in (lambda: _history_rows(batch, vocab, cpu, [r.output_token_ids for r in reqs],
                                         [r.prompt_token_ids for r in reqs]),
                   lambda: [torch.stack(t) for t in zip(*(h.rows(vocab, cpu) for h in hist))]):
            times = []
            for _ in range(5):
                for r in reqs:
                    r.token_ids.append(7)  # the step's new token
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            cost.append(statistics.median(times) * 1e3)
        print(f"| {batch} | {context:,} | {cost[0]:.1f} | {cost[1]:.2f} | {cost[0] / cost[1]:.0f}x |", flush=True)

    print(f"\nhost µs per generated token, median of {a.tokens} tokens past each output length "
          f"({Path(CORPUS_PATH).name}, the tiny tokenizer)")
    print("| output tokens | whole decode (before) | TextDecoder.add | LLM._advance + stream (now) | before / now |")
    print("|---:|---:|---:|---:|---:|")
    for length in sorted(a.lengths):
        out: list[int] = ids[:length]
        whole = per_token_us(lambda t: (out.append(t), tok.decode(out)), ids, length, a.tokens)
        dec = tok.decoder()
        for t in ids[:length]:
            dec.add(t)
        inc = per_token_us(dec.add, ids, length, a.tokens)
        rid = llm.add_request([2], sp)
        req, handle = llm.scheduler.get(rid), RequestHandle(None, rid, [2], sp)
        for t in ids[:length]:
            handle._on_step(llm._advance(req, [t], None))
        handle._items.clear()
        path = per_token_us(lambda t: (handle._on_step(llm._advance(req, [t], None)), handle._items.clear()),
                            ids, length, a.tokens)
        llm.cancel(rid)
        llm.pop_output(rid)
        print(f"| {length:,} | {whole:.1f} | {inc:.1f} | {path:.1f} | {whole / path:.0f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
