"""Compiled engines (AOTInductor, built by the real builder) against the eager network and HF.

Engines are built once per session from the embedded tiny checkpoint: an exact one (fp32 caches,
the HF-oracle mode) and the deployed fp8 one (576-byte MLA cache + 132-byte indexer cache).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dsa_trt.engine_config import EngineConfig, EngineDirError
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.engine import Engine
from dsa_trt.runtime.llm import LLM
from dsa_trt.runtime.sampling import SamplingParams
from dsa_trt.runtime.step_inputs import StepInputs

GREEDY_STEPS = 32
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog because", "Once upon a time, in a small village "
           "by the sea, there lived an old fisherman who every morning walked down to the harbour and"]


def _steps(cfg):
    """A prefill (ragged, scattered pages), then a decode step, then a short fresh prefill."""
    prefill = StepInputs.build([(list(range(2, 92)), 0, [7, 3]), (list(range(5, 35)), 0, [11])])
    decode = StepInputs.build([([17], 90, [7, 3]), ([9], 30, [11])])
    dense = StepInputs.build([(list(range(40, 52)), 0, [5]), (list(range(60, 65)), 0, [9])])
    return [prefill, decode, dense]


@pytest.mark.parametrize("which", ["exact_engine", "fp8_engine"])
def test_compiled_engine_equals_eager_network(request, tiny_ckpt, which):
    engine_dir = request.getfixturevalue(which)
    engine = Engine.load(engine_dir)
    cfg = engine.config
    ckpt = Checkpoint(tiny_ckpt)
    net = build_network(ckpt, cfg.cache_mode, torch.float32, cfg.kv_scales)
    pools_c = allocate_pools(cfg.model, cfg.cache_mode, 16)
    pools_e = allocate_pools(cfg.model, cfg.cache_mode, 16)
    # exact modes: fp32 summation order only. fp8: a compiled (fused) product can land an input on
    # the other side of an e4m3 rounding boundary (one ulp = 2^-4 relative) -> small logit moves.
    tol = 2e-2 if cfg.cache_mode == "fp8" else 1e-4
    for i, step in enumerate(_steps(cfg.model)):
        got = engine.forward(step, *pools_c)
        with torch.no_grad():
            want = net(*step.as_tuple(), *pools_e)
        err = (got - want).abs().max().item()
        assert err < tol, f"{which} step {i}: compiled vs eager max |diff| {err:.3g}"
    for a, b in zip(pools_c[0] + pools_c[1], pools_e[0] + pools_e[1]):
        if a.dtype == torch.uint8:
            # fp8 bytes: fused (compiled) math may round an input across an e4m3 boundary
            frac = (a != b).float().mean().item()
            assert frac < 1e-3, f"{which}: {frac:.2%} of cache bytes differ from the eager network's"
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{which}: cache contents differ")


def test_teacher_forced_greedy_compiled_vs_eager(fp8_engine, tiny_ckpt):
    """The GPU check of tests/test_gpu_engine.py (compiled engine vs eager network, teacher-forced
    greedy tokens within measured noise) on the CPU fp8 engine, so its logic runs in CI too."""
    from tests.helpers.engine_checks import teacher_forced_greedy

    t = teacher_forced_greedy(fp8_engine, tiny_ckpt, "cpu", torch.float32, steps_per_prompt=6)
    assert t["steps"] == 3 * 7 and t["same"] + t["near_ties"] == t["steps"] and t["worst_rel"] < 3e-2


def test_greedy_generation_equals_hf(exact_engine, hf_oracle):
    """A batch of prompts of different lengths (dense and sparse prefill, then decode through the
    paged caches with continuous batching): identical greedy tokens to HF for 32 steps."""
    llm = LLM(exact_engine)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        # explicit attention mask: HF would otherwise treat the leading BOS (id 0 = pad id) as padding
        ref = hf_oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_STEPS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref, f"prompt {prompt[:20]!r}: ours {out.token_ids} vs HF {ref}"
        assert out.finish_reason == "length"


def test_fp8_engine_generates_text(fp8_engine):
    llm = LLM(fp8_engine)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8] * len(PROMPTS)
    again = LLM(fp8_engine).generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8,
                                                             ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in again], "seeded sampling is not reproducible"
    cfg = EngineConfig.load(fp8_engine)
    assert cfg.cache_bytes_per_token == (576 + 132) * cfg.model.num_hidden_layers
    assert all(0 < s < 1 for s in cfg.kv_scales), cfg.kv_scales


# ---------------------------------------------------------------- engine-directory errors
def _copy(engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(engine_dir, dst)
    return dst


def test_missing_rank_file(exact_engine, tmp_path):
    d = _copy(exact_engine, tmp_path)
    (d / "rank0.pt2").unlink()
    with pytest.raises(EngineDirError, match="missing rank0.pt2"):
        Engine.load(d)


def test_format_version_mismatch(exact_engine, tmp_path):
    d = _copy(exact_engine, tmp_path)
    cfg = json.loads((d / "engine_config.json").read_text())
    cfg["format_version"] = 99
    (d / "engine_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineDirError, match="format_version 99"):
        Engine.load(d)


def test_wrong_compiler_plan(exact_engine, tmp_path):
    """engine_config says TensorRT but the directory holds AOTInductor packages."""
    d = _copy(exact_engine, tmp_path)
    cfg = json.loads((d / "engine_config.json").read_text())
    cfg["compiler"] = "tensorrt"
    (d / "engine_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineDirError, match="rank0.plan"):
        Engine.load(d)


def test_corrupt_package_and_config(exact_engine, tmp_path):
    d = _copy(exact_engine, tmp_path)
    (d / "rank0.pt2").write_bytes(b"not a zip")
    with pytest.raises(EngineDirError, match="rank0.pt2"):
        Engine.load(d)
    (d / "engine_config.json").write_text("{not json")
    with pytest.raises(EngineDirError, match="not valid JSON"):
        Engine.load(d)
    with pytest.raises(EngineDirError, match="not a directory"):
        Engine.load(tmp_path / "nowhere")


# ---------------------------------------------------------------- runtime over the real engine
SHARED_PREFIX = ("In the archive of the old observatory there is a ledger in which every night of clear sky "
                 "was written down by hand, with the hour, the wind and the names of the stars observed, ")


def test_prefix_cache_hits_give_the_same_outputs(exact_engine):
    """Both caches (MLA + indexer) of a shared prefix are reused across requests; the outputs with
    hits equal the outputs of a fresh runtime without any hit."""
    prompts = [SHARED_PREFIX + "and the first keeper", SHARED_PREFIX + "while the second keeper"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    warm = LLM(exact_engine)
    first = warm.generate([prompts[0]], params)[0]
    second = warm.generate([prompts[1]], params)[0]
    assert len(first.prompt_token_ids) > 64, "the shared prefix must fill at least one page"
    assert second.num_cached_tokens >= 64, f"no prefix-cache hit ({second.num_cached_tokens} cached tokens)"
    cold = LLM(exact_engine).generate([prompts[1]], params)[0]
    assert cold.num_cached_tokens == 0
    assert second.token_ids == cold.token_ids


def test_preemption_under_page_pressure_gives_the_same_outputs(exact_engine):
    """A pool too small for the batch forces preemption (free, recompute later); nothing is lost and
    every output equals the run without pressure."""
    prompts = [SHARED_PREFIX + f"and keeper number {i} wrote" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    roomy = LLM(exact_engine, num_pages=64).generate(prompts, params)
    tight_llm = LLM(exact_engine, num_pages=3)  # one request needs 2 pages at its end
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.scheduler.num_preemptions > 0, "the tight pool did not preempt: make it smaller"
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
