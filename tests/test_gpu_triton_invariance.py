"""Batch invariance through the real tritonserver on the CUDA engine (issue 26; the H200 half of
tests/test_triton_invariance.py): the same 100 requests (short and long prompts, greedy and seeded,
6-20 tokens) sent at once to a tritonserver serving the CUDA engine each give the tokens they give
run alone offline (``LLM.generate`` on the same engine directory and GPU), in the deterministic and
in the default mode. The engine: DSA_TEST_GPU_ENGINE, or the tiny one built here (tests/conftest.py).

The requests travel as HTTP generate_stream requests (one server-sent event per token), where the CPU
test uses gRPC streams: the HTTP client is `requests` alone, while tritonclient's gRPC stubs need
grpcio >= 1.81.1 and protobuf >= 6.33.5, which the H200 image does not promise and which do not fit
its 64 MiB working tree beside the server wheel (benchmarks/gpu_triton_check.sh). What the model
sees is the same: Triton turns either into the same input tensors. The test also checks that the
streams were served together (MIN_IN_FLIGHT generating at once), not one after another.

The python backend stub must import numpy < 2 (runtime/triton/model.py refuses to load otherwise);
where the machine's venv has numpy 2, run pytest from a venv that puts numpy 1.26 first (the stub
takes the venv of the first python3 on PATH, which the launcher makes this interpreter's):
benchmarks/gpu_triton_check.sh does. Skips without a GPU.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import pytest
import requests

from tests.conftest import requires_cuda
from tests.test_triton import MODEL
from tests.test_triton_invariance import NUM_REQUESTS, differences, fields, run_alone, serving

pytestmark = [requires_cuda, pytest.mark.gpu, pytest.mark.slow]

DEADLINE_S = 120.0  # all 100 streams together (seconds of work on the GPU)
# Triton's HTTP frontend runs 8 worker threads (--http-thread-count): more streams generating at once
# shows that they share the engine's batch rather than waiting for a thread each.
MIN_IN_FLIGHT = 16


@dataclass
class HttpStream:
    """One generate_stream request: its events' texts and token counts, when they came, or an error."""

    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    first: float | None = None  # perf_counter of the first event
    final: float | None = None  # ... and of the last
    error: str | None = None


def stream(url: str, body: dict, start: threading.Barrier, out: HttpStream) -> None:
    try:
        start.wait(DEADLINE_S)
        with requests.post(url, json=body, stream=True, timeout=DEADLINE_S) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return
            for line in r.iter_lines():  # the body is chunked: each event is read as it arrives
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: "):].decode("utf-8"))
                if "error" in event:
                    out.error = event["error"]
                    return
                now = time.perf_counter()
                out.first = out.first if out.first is not None else now
                out.final = now
                out.pieces.append(event["text_output"])
                out.tokens += event["num_output_tokens"]
    except (requests.RequestException, threading.BrokenBarrierError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"


def max_in_flight(spans: list[tuple[float, float]]) -> int:
    """The most [first event, last event] spans that overlap at one moment."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])  # an end before a start at a tie
    best = now = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return best


@pytest.fixture(scope="module", params=[True, False], ids=["deterministic", "default"])
def deterministic(request):
    return request.param


@pytest.fixture(scope="module")
def alone(gpu_engine, deterministic):
    return run_alone(gpu_engine, deterministic)


@pytest.fixture(scope="module")
def server(gpu_engine, deterministic, tmp_path_factory):
    with serving(gpu_engine, deterministic, tmp_path_factory.mktemp("gpu-triton")) as srv:
        yield srv


def test_concurrent_http_streams_equal_each_request_alone(alone, server, gpu_engine, deterministic, capsys):
    url = f"http://{server.http_url}/v2/models/{MODEL}/generate_stream"
    start = threading.Barrier(NUM_REQUESTS)
    results = [HttpStream() for _ in range(NUM_REQUESTS)]
    threads = [threading.Thread(target=stream, args=(url, fields(i), start, results[i]), daemon=True)
               for i in range(NUM_REQUESTS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + DEADLINE_S - time.perf_counter()))
    wall = time.perf_counter() - t0
    errors = [f"r{i}: {r.error}" for i, r in enumerate(results) if r.error]
    unfinished = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not errors and not unfinished, f"{len(errors)} errors {errors[:5]}, unfinished after {DEADLINE_S} s: " \
                                          f"{unfinished[:10]}"
    differ = differences(alone, [("".join(r.pieces), r.tokens) for r in results], gpu_engine)
    overlap = max_in_flight([(r.first, r.final) for r in results if r.first is not None])
    mode = "deterministic" if deterministic else "default"
    with capsys.disabled():
        print(f"\n[gpu-triton] {mode} mode, {gpu_engine.name}: {NUM_REQUESTS} concurrent HTTP streams, "
              f"{len(differ)} differ from alone (greedy {sum('greedy' in d for d in differ)}/{NUM_REQUESTS // 2}, "
              f"seeded {sum('seed ' in d for d in differ)}/{NUM_REQUESTS // 2}); up to {overlap} generating at once; "
              f"{sum(r.tokens for r in results)} tokens in {wall:.2f} s")
    assert not differ, f"{len(differ)}/{NUM_REQUESTS} served requests differ from alone ({mode} mode):\n" + \
        "\n".join(differ[:10])
    assert overlap >= MIN_IN_FLIGHT, f"at most {overlap} streams generated at once: they were not batched together"
