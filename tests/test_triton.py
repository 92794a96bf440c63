"""The Triton deployment end to end: a real tritonserver (the PyTriton wheel's, 2.51) on loopback
serving a CPU fp8 engine built here, talked to over gRPC streams and the HTTP generate endpoints.

Oracle: the offline ``LLM.generate`` on the same engine directory with the same seeds. Prompts and
seeds are distinct per request, so a mixed-up stream cannot match by accident. Also: the bad-input
table interleaved with good requests, a load test (LOAD_REQUESTS concurrent streams), and the
generated config.pbtxt of the python and tensorrt_plan models.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np
import pytest
import requests

from dsa_trt.engine_config import EngineConfig, EngineDirError
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.runtime.llm import LLM
from dsa_trt.runtime.sampling import SamplingParams
from dsa_trt.runtime.triton import (INPUTS, RequestError, TritonServer, free_ports, parse_request,
                                    write_model_repository)
from dsa_trt.runtime.triton.repository import python_model_config, tensorrt_step_config

pytestmark = pytest.mark.slow

MODEL = "dsa_trt"
NUM_PAGES = 256  # 16K tokens of cache: holds the load test, refuses the too-long prompt
MAX_TOKENS = 8  # small: 200 requests in tens of seconds on 2 CPU cores
LOAD_REQUESTS = 200
LOAD_STREAMS = 8  # gRPC streams the load is spread over (25 requests in flight on each)
LOAD_DEADLINE_S = 240.0
REPO = Path(__file__).resolve().parent.parent
RESULTS_HEADING = "## Triton load test (CPU)"
GRPC_DTYPES = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64", "TYPE_FP32": "FP32",
               "TYPE_UINT64": "UINT64", "TYPE_BOOL": "BOOL"}
NP_DTYPES = {"BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "UINT64": np.uint64,
             "BOOL": np.bool_}


def prompt(i: int) -> str:
    return f"Request {i}: the {['quick', 'lazy', 'old', 'small'][i % 4]} fox number {i * 7919 % 1000} says"


def request(i: int, **kw) -> dict:
    """Sampled and seeded (temperature, top-k/top-p vary with i): the oracle checks per-request RNG."""
    return {"text_input": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0.7 + 0.1 * (i % 3),
            "top_p": 0.9 if i % 2 else 1.0, "top_k": 0 if i % 3 else 50, "random_seed": 10_000 + i, **kw}


def sampling(r: dict) -> SamplingParams:
    return SamplingParams(temperature=r["temperature"], top_p=r["top_p"], top_k=r["top_k"],
                          max_tokens=r["max_tokens"], seed=r["random_seed"])


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def engine_dir(fp8_engine):
    return fp8_engine  # the session's CPU fp8 engine (tests/conftest.py); the server only reads it


@pytest.fixture(scope="module")
def oracle(engine_dir):
    """Offline outputs of requests 0..LOAD_REQUESTS-1, computed once (one batch)."""
    llm = LLM(engine_dir, num_pages=NUM_PAGES)
    reqs = [request(i) for i in range(LOAD_REQUESTS)]
    outs = llm.generate([r["text_input"] for r in reqs], [sampling(r) for r in reqs])
    return {"llm": llm, "outputs": outs}


@pytest.fixture(scope="module")
def server(engine_dir, oracle, tmp_path_factory):
    work = tmp_path_factory.mktemp("triton")
    repo = write_model_repository(engine_dir, work / "model_repository", MODEL, num_pages=NUM_PAGES)
    http, grpc, metrics = free_ports(3)
    srv = TritonServer(repo.path, http, grpc, metrics, extra_args=["--exit-timeout-secs=5"])
    try:
        srv.start(work).wait_ready()
        yield srv
    finally:
        srv.stop()
    assert srv.returncode() is not None, "tritonserver is still running after stop()"


class Streams:
    """gRPC streams of one client each; responses collected per request id, errors in arrival order."""

    def __init__(self, url: str, n: int = 1):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.cv = threading.Condition()
        self.chunks: dict[str, list[str]] = defaultdict(list)
        self.counts: dict[str, list[int]] = defaultdict(list)
        self.sent: dict[str, float] = {}
        self.final: dict[str, float] = {}
        self.errors: list[str] = []
        self.clients = []
        for _ in range(n):
            c = grpcclient.InferenceServerClient(url)
            c.start_stream(callback=self._on_response)
            self.clients.append(c)

    def _on_response(self, result, error) -> None:
        now = time.perf_counter()
        with self.cv:
            if error is not None:
                self.errors.append(str(error))
            else:
                resp = result.get_response()
                self.chunks[resp.id].append(result.as_numpy("text_output").reshape(-1)[0].decode("utf-8"))
                if "num_output_tokens" in {o.name for o in resp.outputs}:
                    self.counts[resp.id].append(int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
                if resp.parameters["triton_final_response"].bool_param:
                    self.final[resp.id] = now
            self.cv.notify_all()

    def send(self, rid: str, fields: dict, stream_index: int = 0, raw: dict | None = None) -> None:
        """fields: schema inputs by name (types from the schema); raw: name -> (np array, dtype)."""
        types = {f.name: GRPC_DTYPES[f.data_type] for f in INPUTS}
        inputs = []
        for name, value in list(fields.items()) + list((raw or {}).items()):
            if raw and name in raw:
                arr, dt = value
            else:
                dt = types[name]
                vals = value if isinstance(value, list) else [value]
                vals = [v.encode() if isinstance(v, str) else v for v in vals]
                arr = np.array([vals], dtype=NP_DTYPES[dt])
            inp = self._grpc.InferInput(name, list(arr.shape), dt)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        self.sent[rid] = time.perf_counter()
        self.clients[stream_index].async_stream_infer(MODEL, inputs, request_id=rid,
                                                      enable_empty_final_response=True)

    def wait(self, done, timeout: float) -> None:
        with self.cv:
            if not self.cv.wait_for(done, timeout):
                pytest.fail(f"timed out after {timeout} s: {len(self.final)} final responses, errors {self.errors}")

    def close(self) -> None:
        for c in self.clients:
            c.stop_stream()
            c.close()


def http_generate(srv: TritonServer, body: dict, stream: bool = False) -> tuple[int, list[dict]]:
    url = f"http://{srv.http_url}/v2/models/{MODEL}/generate{'_stream' if stream else ''}"
    r = requests.post(url, json=body, timeout=120)
    if not stream:
        return r.status_code, [r.json()]
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    return r.status_code, events


# ------------------------------------------------------------------------------------------ protocols
def test_grpc_stream_equals_offline(server, oracle):
    s = Streams(server.grpc_url)
    try:
        for i in range(4):
            s.send(f"g{i}", {**request(i), "stream": True, "return_num_output_tokens": True})
        s.wait(lambda: len(s.final) == 4, 120)
    finally:
        s.close()
    assert not s.errors
    for i in range(4):
        want = oracle["outputs"][i]
        got = "".join(s.chunks[f"g{i}"])
        assert got == want.text, f"request {i}: streamed {got!r} != LLM.generate {want.text!r} (seed {10_000 + i})"
        assert len(s.chunks[f"g{i}"]) == MAX_TOKENS and s.counts[f"g{i}"] == [1] * MAX_TOKENS


def test_http_generate_and_generate_stream_equal_offline(server, oracle):
    want = oracle["outputs"]
    status, [body] = http_generate(server, {**request(0), "return_num_input_tokens": True,
                                            "return_num_output_tokens": True})
    assert status == 200, body
    assert body["text_output"] == want[0].text
    assert body["num_input_tokens"] == len(want[0].prompt_token_ids)
    assert body["num_output_tokens"] == MAX_TOKENS
    status, events = http_generate(server, {**request(1), "stream": True}, stream=True)
    assert status == 200 and len(events) == MAX_TOKENS, events
    assert "".join(e["text_output"] for e in events) == want[1].text
    # the same sampling values as request parameters (the generate extension's "parameters" object)
    r = request(2)
    status, [body] = http_generate(server, {"text_input": r.pop("text_input"), "parameters": r})
    assert status == 200 and body["text_output"] == want[2].text, body
    # exclude_input_in_output=false: TRT-LLM's default form, the prompt then the completion
    status, [body] = http_generate(server, {**request(3), "exclude_input_in_output": False})
    assert body["text_output"] == prompt(3) + want[3].text


BAD_INPUTS = [  # (name, fields, expected substring of the error)
    ("empty prompt", {"text_input": ""}, "text_input is empty"),
    ("negative temperature", {"temperature": -0.5}, "temperature=-0.5"),
    ("top_p 0", {"top_p": 0.0}, "top_p=0.0"),
    ("top_p > 1", {"top_p": 1.5}, "top_p=1.5"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens=0"),
    ("negative top_k", {"top_k": -1}, "top_k=-1"),
    ("unknown field", {"foo": 1}, "unknown field(s) 'foo'"),
    ("bad_words", {"bad_words": ["fox"]}, "bad_words"),
    ("beam search", {"beam_width": 4}, "beam_width=4"),
    ("seed conflict", {"seed": 5}, "random_seed=10"),
]


def too_long_prompt(llm: LLM) -> str:
    """A prompt with more tokens than the engine's cache can hold (NUM_PAGES * 64)."""
    words = 2000
    while True:
        text = " ".join(f"w{j}x" for j in range(words))
        if len(llm.tokenizer.encode(text)) > NUM_PAGES * 64:
            return text
        words *= 2


def test_bad_http_requests_interleaved_with_good_ones(server, oracle):
    long_text = too_long_prompt(oracle["llm"])
    cases = BAD_INPUTS + [("prompt too long", {"text_input": long_text}, "shorten the prompt")]
    jobs = []
    for k, (_, fields, _) in enumerate(cases):
        jobs.append(("bad", k, {**request(k), **fields}))
        jobs.append(("good", k, request(k)))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda j: (j, http_generate(server, j[2])), jobs))
    for (kind, k, _), (status, [body]) in results:
        if kind == "good":
            assert status == 200 and body["text_output"] == oracle["outputs"][k].text, body
        else:
            name, _, expected = cases[k]
            assert status == 400 and expected in body.get("error", ""), f"{name}: {status} {body}"
    assert requests.get(f"http://{server.http_url}/v2/health/ready").status_code == 200
    metrics = requests.get(server.metrics_url, timeout=10).text
    assert "nv_inference_request_success" in metrics and f'model="{MODEL}"' in metrics


def test_bad_grpc_requests_interleaved_with_good_ones(server, oracle):
    s = Streams(server.grpc_url)
    bad = {  # raw tensors a JSON body cannot carry, and Triton's own input checks
        "non-UTF-8": ({"text_input": (np.array([[b"caf\xe9 \xff"]], dtype=np.object_), "BYTES")},
                      "text_input is not valid UTF-8: byte 0xe9 at offset 3"),
        "undeclared input": ({"text_input": (np.array([[b"Hi"]], dtype=np.object_), "BYTES"),
                              "foo": (np.array([[1]], dtype=np.int32), "INT32")}, "unexpected inference input 'foo'"),
        "wrong dtype": ({"text_input": (np.array([[b"Hi"]], dtype=np.object_), "BYTES"),
                         "max_tokens": (np.array([[8]], dtype=np.int32), "INT32")}, "expects 'INT64'"),
        "negative temperature": ({}, "temperature=-1.0"),
    }
    try:
        for k, (raw, _) in enumerate(bad.values()):
            if raw:
                s.send(f"bad{k}", {}, raw=raw)
            else:
                s.send(f"bad{k}", {**request(k), "temperature": -1.0})
            s.send(f"good{k}", {**request(k), "stream": True})
        s.wait(lambda: len(s.final) == len(bad) and len(s.errors) == len(bad), 120)
    finally:
        s.close()
    for k, (name, (_, expected)) in enumerate(bad.items()):
        assert "".join(s.chunks[f"good{k}"]) == oracle["outputs"][k].text
        assert any(expected in e for e in s.errors), f"{name}: no error containing {expected!r} in {s.errors}"


# ------------------------------------------------------------------------------------------ load
def test_load_concurrent_streams(server, oracle):
    s = Streams(server.grpc_url, LOAD_STREAMS)
    try:
        t0 = time.perf_counter()
        for i in range(LOAD_REQUESTS):
            s.send(f"load{i}", {**request(i), "stream": True}, stream_index=i % LOAD_STREAMS)
        s.wait(lambda: len(s.final) == LOAD_REQUESTS or s.errors, LOAD_DEADLINE_S)
        wall = max(s.final.values()) - t0
    finally:
        s.close()
    assert not s.errors, s.errors[:5]
    lost = [i for i in range(LOAD_REQUESTS) if f"load{i}" not in s.final]
    assert not lost, f"{len(lost)} requests never finished: {lost[:10]}"
    mixed = [i for i in range(LOAD_REQUESTS) if "".join(s.chunks[f"load{i}"]) != oracle["outputs"][i].text]
    assert not mixed, f"{len(mixed)} streams differ from their offline output: {mixed[:10]}"
    assert all(len(s.chunks[f"load{i}"]) == MAX_TOKENS for i in range(LOAD_REQUESTS))
    lat = np.array([s.final[f"load{i}"] - s.sent[f"load{i}"] for i in range(LOAD_REQUESTS)])
    rps = LOAD_REQUESTS / wall
    p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
    prompt_tokens = np.mean([len(o.prompt_token_ids) for o in oracle["outputs"]])
    line = (f"{LOAD_REQUESTS} concurrent streaming requests ({LOAD_STREAMS} gRPC streams), {prompt_tokens:.0f} prompt "
            f"tokens and {MAX_TOKENS} generated tokens each: {wall:.1f} s, {rps:.2f} requests/s, "
            f"{rps * MAX_TOKENS:.1f} output tok/s, "
            f"latency p50 {p50:.2f} s, p99 {p99:.2f} s; none lost, none mixed")
    print("\n" + line)
    if os.environ.get("DSA_RESULTS_DIR"):  # opt-in; a test never writes into the tracked tree
        write_results(line, Path(os.environ["DSA_RESULTS_DIR"]))


def write_results(line: str, out_dir: Path) -> Path:
    """This run's numbers and setup as out_dir/triton_load.md (for benchmarks/RESULTS.md's Triton table)."""
    if out_dir.resolve().is_relative_to(REPO):
        raise ValueError(f"DSA_RESULTS_DIR={out_dir} is inside the repository; tests never write into tracked "
                         "files: point it at a directory outside it, e.g. /tmp/dsa-results")
    section = (
        f"{RESULTS_HEADING}\n\n"
        f"- date: {date.today().isoformat()}; machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU; "
        f"tritonserver 2.51 (nvidia-pytriton 0.7 wheel), python backend, decoupled\n"
        "- engine: tiny checkpoint (3 layers, hidden 256, vocab 512), fp8 caches, AOTInductor on CPU; "
        f"{NUM_PAGES} cache pages\n"
        "- requests: distinct prompts, seeded sampling (temperature 0.7-0.9, top-p/top-k varied), all sent at "
        "t=0 over loopback, so they share one continuous batch and finish together; latency = send -> final "
        "response\n"
        "- command: `DSA_RESULTS_DIR=/tmp/dsa-results .venv/bin/python -m pytest -q -s tests/test_triton.py -k load`"
        "\n\n"
        f"{line}\n"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "triton_load.md"
    path.write_text(section)
    print(f"wrote {path}")
    return path


# ------------------------------------------------------------------------------------------ configs
def test_schema_parses_and_names_problems():
    one = lambda v: np.array([[v]])  # noqa: E731 - the [batch, 1] shape Triton hands the model
    p = parse_request({"text_input": np.array([[b"Hi"]], dtype=object), "max_tokens": one(np.int64(4)),
                       "seed": one(np.uint64(7)), "stop_words": np.array([[b"a", b""]], dtype=object),
                       "end_id": one(np.int64(3)), "stream": one(True)}, {"temperature": 0.5}, vocab_size=512)
    assert (p.prompt, p.params.max_tokens, p.params.seed, p.params.stop, p.stream) == ("Hi", 4, 7, ["a"], True)
    assert p.params.stop_token_ids == [3] and p.params.ignore_eos and p.params.temperature == 0.5
    for tensors, params, msg in [
        ({}, {}, "text_input is missing"),
        ({"text_input": np.array([[b"a"], [b"b"]], dtype=object)}, {}, "batch size 1"),
        ({"text_input": one(b"x"), "end_id": one(np.int64(9999))}, {}, "end_id=9999"),
        ({"text_input": one(b"x"), "max_tokens": one(np.int64(2))}, {"max_tokens": 3}, "both as input"),
        ({"text_input": one(b"x"), "return_log_probs": one(True)}, {}, "return_log_probs"),
        ({"text_input": one(b"x")}, {"top_k": 1.5}, "top_k must be an integer"),
        ({"text_input": one(b"x")}, {"temperature": "hot"}, "temperature must be a number"),
        ({"text_input": one(b"x"), "temperature": one(np.float32("nan"))}, {}, "temperature must be finite"),
    ]:
        with pytest.raises(RequestError, match=msg.replace("(", r"\(")):
            parse_request(tensors, params, vocab_size=512)


def test_python_model_config_text(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = python_model_config("dsa_trt", Path("/engines/x"), num_pages=64, site_packages=["/venv/site"])
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert cfg.backend == "python" and cfg.max_batch_size == 1 and cfg.model_transaction_policy.decoupled
    assert [i.name for i in cfg.input] == [f.name for f in INPUTS]
    assert [i.name for i in cfg.input if not i.optional] == ["text_input"]
    assert {o.name for o in cfg.output} == {"text_output", "num_input_tokens", "num_output_tokens", "finish_reason"}
    assert cfg.parameters["engine_dir"].string_value == "/engines/x"
    assert cfg.parameters["num_pages"].string_value == "64"


def test_tensorrt_plan_model_config_text(tiny_ckpt, tmp_path):
    """An engine dir of TensorRT plans gets two `tensorrt_plan` step models and the plugin library
    in the TensorRT backend config (cannot run here: no TensorRT backend in the wheel, no GPU)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    model = Checkpoint(tiny_ckpt).config
    engine = tmp_path / "trt-engine"
    engine.mkdir()
    cfg = EngineConfig(model=model, cache_mode="fp8", dtype="bfloat16", device="cuda", compiler="tensorrt",
                       kv_scales=[1.0] * model.num_hidden_layers, plugin_library="libdsa_trt_plugins.so")
    cfg.save(engine)
    for f in ("rank0.plan", "tokenizer.json"):
        (engine / f).write_bytes(b"")
    with pytest.raises(EngineDirError, match="plugin library"):
        write_model_repository(engine, tmp_path / "repo")
    (engine / "libdsa_trt_plugins.so").write_bytes(b"")
    repo = write_model_repository(engine, tmp_path / "repo", "dsv32")
    assert repo.models == ["dsv32", "dsv32_step"]
    assert repo.server_args == [f"--backend-config=tensorrt,plugins={(engine / 'libdsa_trt_plugins.so').resolve()}"]
    assert (repo.path / "dsv32_step" / "1" / "model.plan").resolve() == (engine / "rank0.plan").resolve()
    text = (repo.path / "dsv32_step" / "config.pbtxt").read_text()
    assert text == tensorrt_step_config("dsv32_step", cfg)
    assert text.startswith('name: "dsv32_step"\nplatform: "tensorrt_plan"\nmax_batch_size: 0\n')
    assert '{ name: "page_table" data_type: TYPE_INT32 dims: [ -1, -1 ] }' in text
    assert '{ name: "mla_pools_0" data_type: TYPE_INT32 dims: [ -1, 64, 144 ] }' in text  # 576 bytes as int32
    assert '{ name: "index_pools_2" data_type: TYPE_INT32 dims: [ -1, 2112 ] }' in text  # 64 * 132 bytes
    assert '{ name: "index_pools_2_out" data_type: TYPE_INT32 dims: [ -1, 2112 ] }' in text
    assert '{ name: "logits" data_type: TYPE_FP32 dims: [ -1, 512 ] }' in text
    assert 'instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]' in text
    parsed = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert parsed.platform == "tensorrt_plan" and len(parsed.input) == 6 + 2 * model.num_hidden_layers
    assert [o.name for o in parsed.output][:2] == ["logits", "mla_pools_0_out"]
