"""Expert- / context-parallel engine directories (docs/architecture.md §7): built, checked, launched.

``build_engine(ep=2, cp=2)`` writes the two rank programs of export/parallel.py (AOTInductor,
weights streamed into rank<r>.weights.safetensors) and engine_config.json with ep_size = cp_size
= 2 and no MTP draft program. ``dsa-trt generate`` on it starts two processes (torchrun, gloo) and
prints, greedy, what the one-rank engine built from the same checkpoint prints (the session's fp8
engine, whose calibration the parallel build reuses, so both have the same cache scales). Through
``run_engine_dir`` the token ids of a ragged batch, including a one-token prompt (shorter than
p: one rank holds padding only), and of a single prompt (every decode step padded) equal the
one-rank engine's. Tokens are compared exactly: the CP ranks write the one-rank caches (the
latents are gathered before fp8 quantisation) and the EP combine adds the pairs in the one-rank
order, so only fp32 row-batch rounding differs (logits within 2e-2 in test_context_parallel.py),
which would have to flip a greedy choice to fail these tests. The engine is built with a static
``ep_capacity`` that these steps fit; a prefill past it is an EPCapacityError out of the compiled
programs on every rank, handed to rank 0's caller within seconds (no rank left waiting).

The layouts the engine directory refuses, with the message that says how to fix them, and the
engine_config.json round trip need no build and run in the fast suite.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsa_trt.config import ModelConfig
from dsa_trt.engine_config import ENGINE_CONFIG_NAME, MANIFEST_NAME, EngineConfig, EngineDirError

from .helpers.ranks import join_group, spawn

P = 2
GREEDY_STEPS = 10
CLI_PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog because", "a"]
ID_PROMPTS = [[7], list(range(3, 40)), [11, 12, 13, 14, 15]]  # ragged; the first is shorter than p
SINGLE = list(range(20, 29))
NUM_PAGES = 16
# a static exchange bound: every step of the equality tests fits it (at most 58 tokens, so <= 29 a
# rank and <= 58 pairs to one destination, k = 2), OVERFLOW's prefill cannot (200 tokens a rank
# send 400 pairs over 2 destinations: >= 200 to one)
EP_CAPACITY = 96
OVERFLOW = list(range(2, 402))
OVERFLOW_TIMEOUT_S = 60  # DSA_DIST_TIMEOUT_S there: a collective left unmatched would wait this long


def _config(model: ModelConfig, **kw) -> EngineConfig:
    base = dict(model=model, cache_mode="bf16", dtype="float32", device="cpu", compiler="aoti",
                kv_scales=[1.0] * model.num_hidden_layers)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model(tiny_ckpt) -> ModelConfig:
    return ModelConfig.from_json(tiny_ckpt)


# --------------------------------------------------------------------- no build needed
def test_engine_config_round_trip(model, tmp_path):
    cfg = _config(model, ep_size=P, cp_size=P, ep_capacity=16)
    assert cfg.world_size == P and cfg.layout == "ep=2 x cp=2"
    cfg.save(tmp_path)
    back = EngineConfig.load(tmp_path, check_files=False)
    assert back == cfg and back.world_size == P
    cp_only = _config(model, cp_size=P)
    assert cp_only.world_size == P and cp_only.layout == "cp=2"


def test_old_engine_config_reads_as_one_rank(model, tmp_path):
    """An engine_config.json written before ep/cp existed has neither key: one group of one rank."""
    _config(model).save(tmp_path)
    path = tmp_path / ENGINE_CONFIG_NAME
    raw = json.loads(path.read_text())
    for key in ("ep_size", "cp_size", "ep_capacity"):
        raw.pop(key)
    path.write_text(json.dumps(raw))
    cfg = EngineConfig.load(tmp_path, check_files=False)
    assert (cfg.ep_size, cfg.cp_size, cfg.ep_capacity, cfg.world_size) == (1, 1, None, 1)


@pytest.mark.parametrize(("kw", "named"), [
    ({"tp_size": 2, "ep_size": 2, "cp_size": 2}, "combining it with tensor parallelism is not implemented"),
    ({"ep_size": 2}, "build with --ep 2 --cp 2"),
    ({"ep_size": 2, "cp_size": 4}, "give them the same size"),
    ({"ep_size": 3, "cp_size": 3}, "ep=3 does not divide n_routed_experts = 8"),
    ({"cp_size": 2, "ep_capacity": 4}, "ep_capacity 4: needs ep > 1"),
    ({"ep_size": 2, "cp_size": 2, "ep_capacity": 0}, "ep_capacity 0"),
    ({"cp_size": 2, "max_num_tokens": 8191}, "max_num_tokens 8191 is not a multiple of cp=2"),
    ({"cp_size": 2, "mtp_layers": 1}, "have no MTP draft program (build them with --no-mtp)"),
    ({"cp_size": 0}, "each must be >= 1"),
])
def test_layouts_an_engine_dir_refuses(model, kw, named):
    with pytest.raises(EngineDirError, match="engine_config.json: .*" + re.escape(named)):
        _config(model, **kw)


@pytest.mark.parametrize(("flags", "named"), [
    (["--ep", "2"], "build with --ep 2 --cp 2"),
    (["--tp", "2", "--cp", "2"], "combining it with tensor parallelism is not implemented"),
    (["--ep", "2", "--cp", "2", "--emit-onnx"], "built with --compiler aoti only"),
    (["--ep", "4", "--cp", "4", "--max-num-tokens", "102"], "not a multiple of cp=4"),
])
def test_builder_refuses_before_building(tiny_ckpt, tmp_path, capsys, flags, named):
    from dsa_trt.builder.build import main

    out = tmp_path / "engine"
    rc = main(["--checkpoint", str(tiny_ckpt), "--out", str(out), "--compiler", "aoti", "--device", "cpu",
               "--cache", "bf16", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and named in err, err
    assert not (out / "rank0.pt2").exists()


def test_plan_describes_the_built_layout(model):
    from dsa_trt.plan import make_plan

    cp = make_plan(model, 1, P, 1.0, cp=P, min_cache_tokens=64)
    assert (cp.world_size, cp.dp, cp.attention, cp.build_flags) == (P, 1, "cp", f"--ep {P} --cp {P}")
    assert cp.total_tokens == cp.tokens_per_group  # every rank caches every token
    dp = make_plan(model, 1, P, 1.0, min_cache_tokens=64)
    assert dp.build_flags is None and dp.total_tokens == P * dp.tokens_per_group
    assert [r.weight_bytes for r in cp.ranks] == [r.weight_bytes for r in dp.ranks]  # experts split alike
    assert make_plan(model, 2, 2, 1.0, weights="bf16").build_flags == "--tp 2"


# ------------------------------------------------------------------- the EP=2 x CP=2 engine
@pytest.fixture(scope="module")
def ep_cp_engine(tiny_ckpt, fp8_engine, tmp_path_factory) -> Path:
    from dsa_trt.builder.build import build_engine

    out = tmp_path_factory.mktemp("engines") / "tiny-ep2-cp2-fp8"
    build_engine(tiny_ckpt, out, cache_mode="fp8", compiler="aoti", device="cpu", dtype="float32", ep=P, cp=P,
                 ep_capacity=EP_CAPACITY, kv_calibration=fp8_engine / "quant" / "fp8-kv-per-layer.json")
    return out


@pytest.mark.slow
def test_engine_dir_holds_every_rank(ep_cp_engine, fp8_engine, tiny_ckpt):
    cfg = EngineConfig.load(ep_cp_engine)
    assert (cfg.ep_size, cfg.cp_size, cfg.ep_capacity, cfg.world_size, cfg.mtp_layers) == (P, P, EP_CAPACITY, P, 0)
    # (mtp_layers 0: --no-mtp implied)
    assert cfg.kv_scales == EngineConfig.load(fp8_engine).kv_scales
    files = json.loads((ep_cp_engine / MANIFEST_NAME).read_text())["files"]
    for r in range(P):
        assert {f"rank{r}.pt2", f"rank{r}.weights.safetensors"} <= set(files)
        assert "built_from" in files[f"rank{r}.pt2"]
    # each rank's weights file holds its own routed experts only
    from safetensors import safe_open

    n_experts = ModelConfig.from_json(tiny_ckpt).n_routed_experts
    for r in range(P):
        with safe_open(str(ep_cp_engine / f"rank{r}.weights.safetensors"), framework="pt") as f:
            experts = {int(m[1]) for k in f.keys() if (m := re.search(r"\.mlp\.experts\.(\d+)\.", k))}
        assert experts == set(range(r * n_experts // P, (r + 1) * n_experts // P)), (r, sorted(experts))


@pytest.mark.slow
def test_one_process_and_triton_refuse_a_multi_rank_engine(ep_cp_engine, tmp_path):
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.triton import write_model_repository

    with pytest.raises(EngineDirError, match=r"this ep=2 x cp=2 engine \(2 ranks\) runs one process per rank"):
        LLM(ep_cp_engine)
    with pytest.raises(EngineDirError, match=r"2 ranks \(ep=2 x cp=2\); the Triton model serves one-rank engines only"):
        write_model_repository(ep_cp_engine, tmp_path / "repo")


def _cli(engine: Path) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "dsa_trt.runtime.cli", "generate", "--engine", str(engine), "--temperature", "0",
            "--max-tokens", str(GREEDY_STEPS)]
    for p in CLI_PROMPTS:
        args += ["--prompt", p]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def _completions(stdout: str) -> list[str]:
    """The '--- req-N ...' header and completion lines (the timing summary line dropped)."""
    lines = stdout.splitlines()
    return [line for i, line in enumerate(lines) if line.startswith("--- req-")
            or (i and lines[i - 1].startswith("--- req-"))]


@pytest.mark.slow
def test_generate_cli_equals_one_rank(ep_cp_engine, fp8_engine):
    """`dsa-trt generate` relaunches itself as two torchrun ranks and prints the one-rank completions."""
    par, one = _cli(ep_cp_engine), _cli(fp8_engine)
    assert par.returncode == 0, par.stdout + par.stderr
    assert one.returncode == 0, one.stdout + one.stderr
    assert "multi-rank engine (ep=2 x cp=2): launching 2 ranks with torchrun" in par.stderr
    got, want = _completions(par.stdout), _completions(one.stdout)
    assert len(want) == 2 * len(CLI_PROMPTS) and got == want, f"EP x CP:\n{got}\none rank:\n{want}"


def _generate_worker(rank, world, port, out_dir, engine_dir):
    from dsa_trt.runtime.distributed import run_engine_dir
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.sampling import SamplingParams

    join_group(rank, world, port)

    def rank0(engine):
        llm = LLM(engine, num_pages=NUM_PAGES)
        params = SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True)
        batch = [o.token_ids for o in llm.generate(ID_PROMPTS, params)]
        single = llm.generate([SINGLE], params)[0].token_ids
        return {"batch": batch, "single": single}

    torch.save(run_engine_dir(engine_dir, rank0, device="cpu") or {}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_ragged_batch_and_short_prompt_equal_one_rank(ep_cp_engine, fp8_engine, tmp_path):
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.sampling import SamplingParams

    rank0, rank1 = spawn(_generate_worker, P, tmp_path, str(ep_cp_engine))
    assert rank1 == {}
    ref = LLM(fp8_engine, num_pages=NUM_PAGES)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True)
    want = [o.token_ids for o in ref.generate(ID_PROMPTS, params)]
    assert rank0["batch"] == want, f"EP x CP {rank0['batch']} vs one rank {want}"
    want_single = ref.generate([SINGLE], params)[0].token_ids
    assert rank0["single"] == want_single, f"EP x CP {rank0['single']} vs one rank {want_single}"


def _overflow_worker(rank, world, port, out_dir, engine_dir):
    import os
    import time

    from dsa_trt.plugins.collectives import EPCapacityError
    from dsa_trt.runtime.distributed import run_engine_dir
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.sampling import SamplingParams

    # the environment torchrun gives a rank: run_parallel forms the group with DSA_DIST_TIMEOUT_S
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DSA_DIST_TIMEOUT_S=str(OVERFLOW_TIMEOUT_S))
    torch.set_num_threads(1)

    def rank0(engine):
        try:
            LLM(engine, num_pages=NUM_PAGES).generate([OVERFLOW], SamplingParams(temperature=0.0, max_tokens=2))
        except EPCapacityError as e:
            return str(e)
        return "no error"

    t0 = time.monotonic()
    result = run_engine_dir(engine_dir, rank0, device="cpu")
    torch.save({"overflow": result, "seconds": time.monotonic() - t0}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_an_overflowing_exchange_is_an_error_not_a_hang(ep_cp_engine, tmp_path):
    """A prefill past ep_capacity raises EPCapacityError on every rank, out of the compiled programs
    (which re-raise the op's error as a RuntimeError: the driver gives it its type back): rank 0
    hands it to its caller, the other rank keeps mirroring until rank 0 stops it; no collective is
    left unmatched, so nobody waits for DSA_DIST_TIMEOUT_S."""
    rank0, rank1 = spawn(_overflow_worker, P, tmp_path, str(ep_cp_engine))
    assert f"exchange capacity of {EP_CAPACITY} pairs" in rank0["overflow"], rank0
    assert "--ep-capacity" in rank0["overflow"], rank0
    assert rank1["overflow"] is None
    assert max(rank0["seconds"], rank1["seconds"]) < OVERFLOW_TIMEOUT_S, (rank0, rank1)
