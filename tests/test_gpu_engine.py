"""The tiny model's compiled engine on the GPU (AOTInductor + our CUDA kernels, bf16, fp8 caches)
against the GPU reference path, and CUDA-graph decode against eager decode. Runs on the H200."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import requires_cuda
from tests.helpers.engine_checks import PROMPTS, STEPS, teacher_forced_greedy

pytestmark = [requires_cuda, pytest.mark.gpu]


def _greedy(llm, prompts=PROMPTS, steps=STEPS):
    from dsa_trt.runtime.sampling import SamplingParams

    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps,
                                                                       ignore_eos=True))]


def test_compiled_engine_matches_gpu_reference(gpu_engine, tiny_ckpt, capsys):
    def report(r):
        with capsys.disabled():
            print(f"[gpu-step] prompt {r['prompt']} pos {r['pos']:3d}: compiled vs eager rel {r['rel']:.3g} "
                  f"max|diff| {r['diff']:.3g} margin {r['margin']:.3g} same {r['same']}; vs fp32: compiled "
                  f"{r['err_compiled']:.3g} eager {r['err_eager']:.3g}")

    t = teacher_forced_greedy(gpu_engine, tiny_ckpt, "cuda", torch.bfloat16, report=report)
    with capsys.disabled():
        print(f"\n[gpu] compiled vs eager GPU network, teacher-forced greedy: {t['same']}/{t['steps']} steps same "
              f"token, {t['near_ties']} near ties (eager vs its fp32 twin: {t['floor_flips']}); logits rel. L2 vs "
              f"the fp32 twin, RMS over steps: compiled {t['rms_compiled']:.3g}, eager {t['rms_eager']:.3g}; worst compiled vs eager {t['worst_rel']:.3g}")


def test_cuda_graph_decode_equals_eager(gpu_engine, capsys):
    from dsa_trt.runtime.llm import LLM

    llm = LLM(gpu_engine, num_pages=64)
    assert llm.graphs is not None
    graphed = _greedy(llm)
    assert len(llm.graphs._graphs) > 0, "no decode step went through a CUDA graph"
    os.environ["DSA_CUDA_GRAPHS"] = "0"
    try:
        eager = _greedy(LLM(gpu_engine, num_pages=64))
    finally:
        del os.environ["DSA_CUDA_GRAPHS"]
    assert graphed == eager


def test_speculative_steps_replay_cuda_graphs(gpu_engine, monkeypatch):
    """MTP speculative decoding on the GPU, the draft pass a call of its own (DSA_MTP_FUSED=0): the
    verify steps (q = n + 1 rows per sequence) and the draft passes replay CUDA graphs, and greedy
    output equals plain greedy decoding, token for token (deterministic mode: a row's logits do not
    depend on how many rows its step has, so a verify row and a decode row of the same position
    agree bitwise)."""
    from dsa_trt.runtime.llm import LLM

    monkeypatch.setenv("DSA_MTP_FUSED", "0")
    plain = _greedy(LLM(gpu_engine, num_pages=64, deterministic=True))
    for n in (1, 2):
        llm = LLM(gpu_engine, num_pages=64, speculative=f"mtp:{n}", deterministic=True)
        assert llm.graphs is not None and llm.speculator.graphs is not None
        assert _greedy(llm) == plain, f"mtp:{n}"
        assert any(shape.q == n + 1 and shape.all_logits for shape, _, _ in llm.graphs.captured), \
            f"mtp:{n}: no verify step went through a CUDA graph ({llm.graphs.captured})"
        assert llm.speculator.graphs.captured, f"mtp:{n}: no draft pass went through a CUDA graph"


def test_fused_verify_and_draft_replays_one_cuda_graph(gpu_engine, monkeypatch):
    """DSA_MTP_FUSED=1 (the default): a greedy verify step and the next step's draft passes (the MTP
    pass, then n - 1 recurrent ones) replay as one CUDA graph (runtime/speculative.py fused_call);
    greedy output equals plain greedy decoding, and the drafts are the separate passes' (the same
    acceptance, deterministic mode)."""
    from dsa_trt.runtime.llm import LLM

    plain = _greedy(LLM(gpu_engine, num_pages=64, deterministic=True))
    for n in (1, 3):
        monkeypatch.setenv("DSA_MTP_FUSED", "0")
        separate = LLM(gpu_engine, num_pages=64, speculative=f"mtp:{n}", deterministic=True)
        assert _greedy(separate) == plain, f"mtp:{n}"
        monkeypatch.setenv("DSA_MTP_FUSED", "1")
        llm = LLM(gpu_engine, num_pages=64, speculative=f"mtp:{n}", deterministic=True)
        assert llm.speculator.fused_graphs is not None
        assert _greedy(llm) == plain, f"fused mtp:{n}"
        assert llm.speculator.fused_steps > 0 and llm.speculator.fused_graphs.captured, "no fused step replayed a graph"
        a, b = llm.spec_stats, separate.spec_stats
        assert (a.drafted, a.accepted) == (b.drafted, b.accepted), f"fused mtp:{n} drafts differ: {a} vs {b}"
        print(f"\n[gpu] fused MTP:{n}: {llm.speculator.fused_steps} fused steps, acceptance "
              f"{a.acceptance_rate:.1%}, buckets {llm.speculator.fused_graphs.captured}")
