"""AsyncLLM: the background stepping loop against the offline LLM.generate oracle (CPU).

The engine is the eager reference network over the embedded tiny checkpoint (fp32 caches): the
same Engine interface as compiled engines, built in seconds, so these tests run the real runtime.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from dsa_trt.engine_config import EngineConfig
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network
from dsa_trt.runtime.async_llm import AsyncLLM
from dsa_trt.runtime.engine import eager_engine
from dsa_trt.runtime.llm import LLM
from dsa_trt.runtime.sampling import SamplingParams

NUM_PAGES = 64  # 4096 tokens of cache: a prompt longer than that must be refused
MAX_TOKENS = 12
PROMPTS = ["Hello", "The quick brown fox", "Once upon a time, in a small village by the sea,", "ab", "Numbers: 1 2 3"]


@pytest.fixture(scope="module")
def eager(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    cfg = EngineConfig(model=ckpt.config, cache_mode="fp32", dtype="float32", device="cpu", compiler="eager",
                       kv_scales=[1.0] * ckpt.config.num_hidden_layers)
    net = build_network(ckpt, "fp32", torch.float32, cfg.kv_scales)
    return eager_engine(net, cfg, torch.device("cpu"), ckpt.tokenizer_path)


def new_llm(engine) -> LLM:
    return LLM(engine, num_pages=NUM_PAGES)


def params(i: int, **kw) -> SamplingParams:
    """Sampled (not greedy) and seeded: equality with the oracle then checks per-request RNGs."""
    return SamplingParams(**{"temperature": 0.9, "top_p": 0.95, "max_tokens": MAX_TOKENS, "seed": 100 + i,
                             "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def offline(eager):
    return new_llm(eager).generate(PROMPTS, [params(i) for i in range(len(PROMPTS))])


def test_threads_submitting_concurrently_get_the_offline_outputs(eager, offline):
    results: dict[int, tuple[str, list[int], object]] = {}

    def client(i: int) -> None:
        h = engine.submit(PROMPTS[i], params(i))
        deltas = list(h)
        results[i] = ("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], h.result())

    with AsyncLLM(new_llm(eager)) as engine:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert engine.num_unfinished == 0
    for i, want in enumerate(offline):
        text, ids, out = results[i]
        assert out.token_ids == want.token_ids, f"prompt {i}: tokens differ from LLM.generate with seed {100 + i}"
        assert ids == want.token_ids and text == want.text == out.text, f"prompt {i}: stream != final output"
        assert out.finish_reason == "length"


def test_generate_async_in_one_event_loop(eager, offline):
    async def one(engine: AsyncLLM, i: int) -> tuple[str, str | None]:
        text, reason = "", None
        async for d in engine.generate_async(PROMPTS[i], params(i)):
            text += d.text
            reason = d.finish_reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        with AsyncLLM(new_llm(eager)) as engine:
            return await asyncio.gather(*(one(engine, i) for i in range(len(PROMPTS))))

    got = asyncio.run(main())
    assert got == [(o.text, "length") for o in offline]


def test_bad_requests_fail_alone_and_the_loop_keeps_serving(eager, offline):
    tok = new_llm(eager).tokenizer
    too_long = " ".join(f"w{i}" for i in range(3000))
    assert len(tok.encode(too_long)) > NUM_PAGES * 64
    with AsyncLLM(new_llm(eager)) as engine:
        good = [engine.submit(PROMPTS[i], params(i)) for i in range(2)]
        bad = {
            "empty": engine.submit("", params(0)),
            "too long": engine.submit(too_long, params(0)),
            "token id": engine.submit([0, 10**6], params(0)),
        }
        good += [engine.submit(PROMPTS[i], params(i)) for i in range(2, len(PROMPTS))]
        messages = {}
        for name, h in bad.items():
            with pytest.raises(ValueError) as e:
                list(h)
            with pytest.raises(ValueError):
                h.result()
            messages[name] = str(e.value)
        assert [h.result(120).token_ids for h in good] == [o.token_ids for o in offline]
        late = engine.submit(PROMPTS[0], params(0))
        assert late.result(120).text == offline[0].text
        engine.submit(PROMPTS[1], params(1, max_tokens=200), request_id="dup")
        with pytest.raises(ValueError, match="already in use"):
            engine.submit("x", params(0), request_id="dup")
    assert "empty" in messages["empty"]
    assert "pages" in messages["too long"] and "shorten the prompt" in messages["too long"]
    assert "1000000" in messages["token id"]


def test_cancel_ends_one_stream_with_abort(eager, offline):
    with AsyncLLM(new_llm(eager)) as engine:
        victim = engine.submit(PROMPTS[2], params(2, max_tokens=200))
        others = [engine.submit(PROMPTS[i], params(i)) for i in (0, 1)]
        it = iter(victim)
        first = next(it)
        victim.cancel()
        rest = list(it)
        assert rest[-1].finish_reason == "cancelled"
        out = victim.result(60)
        assert out.finish_reason == "cancelled" and len(out.token_ids) < 200
        assert first.text + "".join(d.text for d in rest) == out.text
        assert [h.result(120).text for h in others] == [offline[0].text, offline[1].text]
        victim.cancel()  # finished: no-op


def test_stop_string_never_leaks_into_the_stream(eager, offline):
    text = offline[2].text
    stop = text[5:8]  # occurs in the offline output, so generation stops on it
    assert stop and stop in text
    want = new_llm(eager).generate([PROMPTS[2]], [params(2, stop=[stop])])[0]
    assert want.finish_reason == "stop" and stop not in want.text
    with AsyncLLM(new_llm(eager)) as engine:
        h = engine.submit(PROMPTS[2], params(2, stop=[stop]))
        streamed = "".join(d.text for d in h)
    assert streamed == want.text == h.result().text


def test_shutdown_aborts_running_requests_and_refuses_new_ones(eager):
    engine = AsyncLLM(new_llm(eager))
    h = engine.submit(PROMPTS[0], params(0, max_tokens=4_000))  # fits the 4096-token pool
    next(iter(h))
    engine.shutdown()
    assert h.result(1).finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit("Hello")


def test_engine_failure_fails_the_step_requests_not_the_loop(eager, offline):
    class Flaky:
        """The real engine, failing its first step (Engine.run: every step goes through it)."""

        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def run(self, *a):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("injected device fault")
            return self.inner.run(*a)

    llm = new_llm(eager)
    llm.engine = Flaky(llm.engine)
    with AsyncLLM(llm) as engine:
        h = engine.submit(PROMPTS[0], params(0))
        with pytest.raises(RuntimeError, match="injected device fault"):
            h.result(60)
        assert engine.num_unfinished == 0
        again = engine.submit(PROMPTS[0], params(0))
        assert again.result(120).token_ids == offline[0].token_ids
    assert llm.engine.calls > 1
