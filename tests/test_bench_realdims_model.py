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


def test_tokens_per_step(model):
    """tau = 1 + a_1 + a_1 a_2 + ...: the last rate repeats; 0.85 then 0.63 over 7 drafts gives the 3.20
    that the module docstring derives 0.63 from (nebius/MTP-DeepSeek-V3-0324, K = 7, temperature 0)."""
    assert model.tokens_per_step(0.85, 1) == pytest.approx(1.85)
    assert model.tokens_per_step([0.85, 0.63], 2) == pytest.approx(1 + 0.85 + 0.85 * 0.63)
    assert model.tokens_per_step([0.85, 0.63], 3) == pytest.approx(1 + 0.85 + 0.85 * 0.63 + 0.85 * 0.63 ** 2)
    assert model.tokens_per_step([0.85, 0.63], 7) == pytest.approx(3.20, abs=0.01)
    assert model.tokens_per_step([0.5, 1.0], 0) == 1.0


def _mtp_inputs(q):
    dec = {"dense": _cats(10, 20, 300, 0, 70), "MoE": _cats(10, 20, 100, 1000, 70)}
    ver = {"dense": _cats(12, 30, 310, 0, 75), "MoE": _cats(12, 30, 110, 1500, 75)}
    experts = {20: 900.0, 160: 2400.0, 20 * q: 1400.0, 160 * q: 2800.0}
    decode = {(20, 32768): ({}, 0, 0.0)}
    verify = {(q, 20, 32768): ({}, 0, 0.0)}
    graph_rows = {(20, 32768): {"per_kind": dec, "outside": 450.0},
                  ("verify", q, 20, 32768): {"per_kind": ver, "outside": 480.0}}
    return decode, verify, graph_rows, experts


def _comm(tokens):
    return 2 * tokens * 8 * 7168 * 2 * 7 / 8 / 450e9 * 1e6


@pytest.mark.parametrize("drafts", [1, 2, 3])
def test_mtp_dp_rows_arithmetic(model, drafts):
    """The MTP model with N drafts: the main model at the verify shape (61 layers at (N+1)B query
    tokens, experts alone at (N+1)B and 8(N+1)B, + its outside), the first MTP pass at the verify
    shape and N - 1 at the decode shape (each an MoE layer + outside), tau tokens per sequence."""
    from dsa_trt.plan import load_config

    cfg = load_config(model.REAL_CONFIG)
    q = drafts + 1
    decode, verify, graph_rows, experts = _mtp_inputs(q)
    rows = model.mtp_dp_rows(decode, verify, graph_rows, experts, cfg, lambda ctx: 20, [0.85, 0.63], drafts)
    assert len(rows) == 1
    r = rows[0]
    ver_moe_layer = 12 + 30 + 110 + 75 + (1500 - 1400 + 2800 / 8) + _comm(20 * q)
    dec_moe_layer = 10 + 20 + 100 + 70 + (1000 - 900 + 2400 / 8) + _comm(20)
    draft = ver_moe_layer + 480 + (drafts - 1) * (dec_moe_layer + 450)
    step = 3 * (12 + 30 + 310 + 75) + 58 * ver_moe_layer + 480 + draft
    tau = model.tokens_per_step([0.85, 0.63], drafts)
    assert r["source"] == "graph" and r["drafts"] == drafts
    assert r["draft_us"] == pytest.approx(draft)
    assert r["step_us"] == pytest.approx(step)
    assert r["tau"] == pytest.approx(tau)
    assert r["tok_s_per_gpu"] == pytest.approx(20 * tau / (step / 1e6))
    assert r["tau_for_1000"] == pytest.approx(1000 * step / 1e6 / 20)
    # a batch the cache cannot hold keeps only what it holds
    rows = model.mtp_dp_rows(decode, verify, graph_rows, experts, cfg, lambda ctx: 19, [0.85, 0.63], drafts)
    assert rows == [{"b": 20, "ctx": 32768, "drafts": drafts, "held": 19, "source": "graph"}]


def test_mtp_dp_rows_need_the_verify_shape_of_n_drafts(model):
    """A model of N drafts reads only the verify step of N + 1 query tokens: measured for 1 draft,
    a 2-draft model has no row."""
    from dsa_trt.plan import load_config

    cfg = load_config(model.REAL_CONFIG)
    decode, verify, graph_rows, experts = _mtp_inputs(2)
    assert model.mtp_dp_rows(decode, verify, graph_rows, experts, cfg, lambda ctx: 20, 0.85, 2) == []


def test_dp_ep_rows_count_the_outside(model):
    """A graph row's "outside the layers" (embedding, final norm, lm_head) is part of the step."""
    from dsa_trt.plan import load_config

    cfg = load_config(model.REAL_CONFIG)
    per_kind = {"MoE": _cats(10, 20, 100, 1000, 70)}
    experts = {32: 900.0, 256: 2400.0}
    with_out = model.dp_ep_rows({(32, 4096): ({}, 0, 0.0)}, {(32, 4096): {"per_kind": per_kind, "outside": 400.0}},
                                experts, cfg, lambda ctx: 1000)[0]
    without = model.dp_ep_rows({(32, 4096): ({}, 0, 0.0)}, {(32, 4096): {"per_kind": per_kind}},
                               experts, cfg, lambda ctx: 1000)[0]
    assert with_out["step_us"] == pytest.approx(without["step_us"] + 400.0)
    assert with_out["outside_us"] == 400.0 and without["outside_us"] is None


@pytest.mark.parametrize("query", [2, 4])
def test_verify_step_has_n_plus_one_query_tokens_per_sequence(bench, query):
    import random

    from dsa_trt.plan import load_config

    cfg = load_config(bench.REAL_CONFIG)
    step = bench.decode_step(cfg, 3, 100, 64, random.Random(0), "cpu", query=query)
    assert step.input_ids.numel() == 3 * query
    assert step.positions.tolist() == list(range(100, 100 + query)) * 3


@pytest.mark.parametrize("argv, message", [
    (["--mtp", "0"], "--mtp 0: each N must be in 1..8"),
    (["--mtp", "1", "9"], "--mtp 1 9: each N must be in 1..8"),
    (["--mtp-acceptance", "1.2"], "--mtp-acceptance 1.2: each value must be in (0, 1]"),
])
def test_bad_mtp_flags_are_named(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
