"""The same request gives the same tokens whatever it is batched with (docs/architecture.md §8).

Every token takes one path (indexer -> top-k -> sparse MLA) whatever else the step holds, and the
kernels work per row, so a request's output depends neither on its batch neighbours nor on being
chunked or preempted and recomputed. The default path promises the same program and per-row
kernels; the deterministic mode (LLM(deterministic=True), DSA_DETERMINISTIC=1, --deterministic)
also pads every step to a whole number of 16-token blocks, so the CPU linears round every row the
same way: its logprobs are bitwise equal alone and batched. Real CPU engines (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.engine import Engine
from dsa_trt.runtime.llm import DETERMINISTIC_TOKEN_BLOCK, LLM
from dsa_trt.runtime.sampling import SamplingParams
from dsa_trt.step import StepInputs

pytestmark = pytest.mark.slow

LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning walked down"
# short and long prompts (index_topk is 16 in the tiny model: the long ones select among their keys)
MIXED = ["The quick brown fox", LONG, "ab", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "x",
         "Once upon a time, in a small village", LONG + " to the harbour and looked at the boats", "Hi there"]
TARGET = "Hello"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module", params=["exact_engine", "fp8_engine"])
def engine(request):
    return Engine.load(request.getfixturevalue(request.param))


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams, at: int) -> list[int]:
    return llm.generate(prompts, [params if i == at else GREEDY for i in range(len(prompts))])[at].token_ids


def test_the_issue_example(engine):
    llm = LLM(engine, num_pages=256)
    s = SamplingParams(temperature=0, max_tokens=24)
    assert llm.generate(["Hello"], s)[0].text == llm.generate(["Once upon a time, in a small village", "Hello"], s)[1].text


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_alone_mixed_and_preempted_agree(engine, params, deterministic):
    alone = LLM(engine, num_pages=256, deterministic=deterministic)
    want = _tokens(alone, [TARGET], params, 0)
    got_mixed = _tokens(alone, MIXED[:4] + [TARGET] + MIXED[4:7], params, 4)  # a batch of 8
    assert got_mixed == want, f"in a mixed batch of 8: {got_mixed} != alone {want}"
    # 6 pages for 8 requests of up to ~60 tokens each: requests are preempted and recomputed
    tight = LLM(engine, num_pages=6, deterministic=deterministic)
    outs = tight.generate(MIXED[:3] + [TARGET] + MIXED[3:7],
                          [params if i == 3 else GREEDY for i in range(8)])
    assert tight.scheduler.num_preemptions > 0, "the tiny pool should have forced a preemption"
    assert outs[3].token_ids == want, f"with preemptions: {outs[3].token_ids} != alone {want}"


def test_deterministic_mode_is_bitwise(engine):
    """Logprobs of the same request, alone and beside 7 others, bitwise equal in the deterministic mode."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    llm = LLM(engine, num_pages=256, deterministic=True)
    alone = llm.generate([TARGET], params)[0]
    mixed = llm.generate(MIXED[:4] + [TARGET] + MIXED[4:7], params)[4]
    assert mixed.token_ids == alone.token_ids
    assert mixed.logprobs == alone.logprobs, "deterministic mode: logprobs differ between alone and batched"


def test_padded_step_leaves_the_real_rows_unchanged(engine):
    """pad_tokens: the padding rows write no cache slot, and the real rows' logits do not depend on
    the rest of the step (bitwise: a 15-token step and a 31-token one, padded to 16 and 32)."""
    cfg = engine.config
    step = StepInputs.build([(list(range(5, 12)), 0, [1]), (list(range(20, 28)), 0, [2])])  # 15 tokens
    padded = step.pad_tokens(DETERMINISTIC_TOKEN_BLOCK)
    assert padded.input_ids.shape[0] == 16 and padded.slot_mapping[15].item() == -1
    assert padded.logits_indices.shape[0] == 16 and torch.equal(padded.logits_indices[:2], step.logits_indices)
    assert step.pad_tokens(1) is step
    pools_a = allocate_pools(cfg.model, cfg.cache_mode, 8)
    pools_b = allocate_pools(cfg.model, cfg.cache_mode, 8)
    a = engine.forward(padded, *pools_a)
    b = engine.forward(StepInputs.build([(list(range(5, 12)), 0, [1]), (list(range(20, 28)), 0, [2]),
                                         (list(range(40, 56)), 0, [3])]).pad_tokens(16), *pools_b)  # 31 -> 32
    assert torch.equal(a[:2], b[:2]), f"max |diff| {(a[:2] - b[:2]).abs().max().item():.3g}"
    for p, q in zip(pools_a[0] + pools_a[1], pools_b[0] + pools_b[1]):
        assert torch.equal(p[:3], q[:3]), "the padding rows wrote into the caches"


def test_deterministic_kernel_plans_around_steps(engine, monkeypatch):
    """The deterministic mode's kernel plans (knobs.DETERMINISTIC_KERNEL_ENV: the CUDA fp8 linear and
    sparse MLA unsplit) are set while its steps run and restored after; a default-mode LLM's steps
    see the process's own values."""
    from dsa_trt.runtime import knobs

    monkeypatch.setenv("DSA_MLA_SPLITS", "3")
    monkeypatch.delenv("DSA_FP8_LINEAR_SPLITS", raising=False)
    monkeypatch.delenv("DSA_F32_LINEAR_ROWS", raising=False)
    seen = []
    for deterministic in (True, False):
        llm = LLM(engine, num_pages=64, deterministic=deterministic)
        run = llm._run

        def spy(*args, run=run, **kwargs):
            seen.append((deterministic, {k: os.environ.get(k) for k in knobs.DETERMINISTIC_KERNEL_ENV}))
            return run(*args, **kwargs)

        llm._run = spy
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2))
        assert os.environ.get("DSA_MLA_SPLITS") == "3" and "DSA_FP8_LINEAR_SPLITS" not in os.environ
        assert "DSA_F32_LINEAR_ROWS" not in os.environ
    assert {d for d, _ in seen} == {True, False}
    for deterministic, env in seen:
        want = knobs.DETERMINISTIC_KERNEL_ENV if deterministic else {"DSA_MLA_SPLITS": "3",
                                                                       "DSA_FP8_LINEAR_SPLITS": None,
                                                                       "DSA_F32_LINEAR_ROWS": None}
        assert env == want, (deterministic, env)
