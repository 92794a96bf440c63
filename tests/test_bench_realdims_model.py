"""The attention-DP + EP8 decode model of benchmarks/realdims_model.py (issue 25 item 7): its
arithmetic over measured per-layer numbers, and the plan it caps the batch with. CPU only: the
numbers here are made up; the H200 run feeds it measured ones."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model():
    return _load("realdims_model")


@pytest.fixture(scope="module")
def bench():
    return _load("bench_realdims")


def _cats(indexer, mla, linears, moe, rest):
    return {"DSA indexer + top-k": indexer, "DSA sparse MLA": mla, "linears": linears, "MoE": moe, "rest": rest}


def test_dp_ep_rows_arithmetic(model):
    from dsa_trt.plan import load_config

    cfg = load_config(model.REAL_CONFIG)
    per_kind = {"dense": _cats(10, 20, 300, 0, 70), "MoE": _cats(10, 20, 100, 1000, 70)}
    decode = {(32, 4096): ({}, 0, 0.0), (128, 4096): ({}, 0, 0.0)}
    graph_rows = {(32, 4096): {"per_kind": per_kind}}  # (128, 4096): eager rows, empty -> skipped
    experts = {32: 900.0, 256: 2400.0}
    rows = model.dp_ep_rows(decode, graph_rows, experts, cfg, lambda ctx: 1000)
    assert len(rows) == 1
    r = rows[0]
    moe = 1000 - 900 + 2400 / 8  # router + shared-free MoE: row's MoE - experts(B) + experts(8B) / 8
    comm = 2 * 32 * 8 * 7168 * 2 * 7 / 8 / 450e9 * 1e6
    moe_layer = 10 + 20 + 100 + 70 + moe + comm
    step = 3 * 400 + 58 * moe_layer
    assert r["source"] == "graph" and r["moe_us"] == pytest.approx(moe)
    assert r["step_us"] == pytest.approx(step)
    assert r["comm_us"] == pytest.approx(58 * comm)
    assert r["tok_s_per_gpu"] == pytest.approx(32 / (step / 1e6))


def test_dp_ep_rows_refuse_what_the_cache_cannot_hold(model):
    from dsa_trt.plan import load_config

    cfg = load_config(model.REAL_CONFIG)
    per_kind = {"MoE": _cats(1, 1, 1, 1, 1)}
    rows = model.dp_ep_rows({(128, 32768): (per_kind, 0, 0.0)}, {}, {128: 1.0, 1024: 1.0}, cfg, lambda ctx: 27)
    assert rows == [{"b": 128, "ctx": 32768, "source": "eager", "held": 27}]


def test_dp_ep_plan_fits_v32(model):
    """The plan the model uses: V3.2 on 8 x 141 GB with attention replicated per GPU and 32 experts
    each fits, and its cache holds 128 sequences of 4K on a GPU (the model's B=128 rows at 4K)."""
    from dsa_trt.plan import load_config, make_plan

    plan = make_plan(load_config(model.REAL_CONFIG), tp=1, ep=8, gpu_memory_gb=141.0)
    assert plan.fits and plan.dp == 8
    assert plan.tokens_per_group // 4096 >= 128


def test_dp_ep_rows_never_charge_a_negative_router(model):
    """A graph row whose MoE region is below the experts timed alone (the H200's B=32 row gave a
    negative "routed MoE per layer") keeps only the experts' share at 8B tokens."""
    from dsa_trt.plan import load_config

    cfg = load_config(model.REAL_CONFIG)
    per_kind = {"MoE": _cats(10, 20, 100, 1290, 70)}
    rows = model.dp_ep_rows({(32, 4096): ({}, 0, 0.0)}, {(32, 4096): {"per_kind": per_kind}},
                            {32: 1796.7, 256: 2904.7}, cfg, lambda ctx: 1000)
    assert rows[0]["moe_us"] == pytest.approx(2904.7 / 8)


def test_mtp_dp_rows_arithmetic(model):
    """The MTP model: 61 layers at the verify shape (2B query tokens, experts alone at 2B and 16B)
    plus one MoE layer at the decode shape, 1 + a tokens per sequence per step."""
    from dsa_trt.plan import load_config

    cfg = load_config(model.REAL_CONFIG)
    dec = {"dense": _cats(10, 20, 300, 0, 70), "MoE": _cats(10, 20, 100, 1000, 70)}
    ver = {"dense": _cats(12, 30, 310, 0, 75), "MoE": _cats(12, 30, 110, 1500, 75)}
    experts = {20: 900.0, 160: 2400.0, 40: 1400.0, 320: 2800.0}
    decode = {(20, 32768): ({}, 0, 0.0)}
    verify = {(20, 32768): ({}, 0, 0.0)}
    graph_rows = {(20, 32768): {"per_kind": dec}, ("verify", 20, 32768): {"per_kind": ver}}
    rows = model.mtp_dp_rows(decode, verify, graph_rows, experts, cfg, lambda ctx: 20, 0.85)
    assert len(rows) == 1
    r = rows[0]

    def comm(tokens):
        return 2 * tokens * 8 * 7168 * 2 * 7 / 8 / 450e9 * 1e6

    ver_moe_layer = 12 + 30 + 110 + 75 + (1500 - 1400 + 2800 / 8) + comm(40)
    draft = 10 + 20 + 100 + 70 + (1000 - 900 + 2400 / 8) + comm(20)
    step = 3 * (12 + 30 + 310 + 75) + 58 * ver_moe_layer + draft
    assert r["source"] == "graph"
    assert r["draft_us"] == pytest.approx(draft)
    assert r["step_us"] == pytest.approx(step)
    assert r["tok_s_per_gpu"] == pytest.approx(20 * 1.85 / (step / 1e6))
    assert r["acceptance_for_1000"] == pytest.approx(1000 * step / 1e6 / 20 - 1)
    # a batch the cache cannot hold keeps only what it holds
    rows = model.mtp_dp_rows(decode, verify, graph_rows, experts, cfg, lambda ctx: 19, 0.85)
    assert rows == [{"b": 20, "ctx": 32768, "source": "graph", "held": 19}]


def test_verify_step_has_two_query_tokens_per_sequence(bench):
    import random

    from dsa_trt.plan import load_config

    cfg = load_config(bench.REAL_CONFIG)
    step = bench.decode_step(cfg, 3, 100, 64, random.Random(0), "cpu", query=2)
    assert step.input_ids.numel() == 6
    assert step.positions.tolist() == [100, 101] * 3
