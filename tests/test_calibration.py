"""fp8 MLA-cache calibration through NVIDIA ModelOpt (calibration/modelopt_kv.py).

* ModelOpt's per-layer amax equals the amax read back from the fp32 cache pools (the previous,
  independent path), computed here on a fresh network: both are maxima of the same fp32 values.
* The builder's calibrate() writes the named artifact quant/fp8-kv-per-layer.json with the
  recipe, per-layer amax and scale, token count and ModelOpt version.
* The slot ModelOpt quantizes is an identity in the exported network (no node, same outputs).
* Held-out text: the calibrated scale against the uncalibrated 1.0 (printed table; run with -s).
  On the tiny checkpoint the latent's amax (~5) is well inside e4m3's range at scale 1.0, where
  fp8's relative precision does not depend on the scale, so the two are about equal there; the
  sweep shows the plateau the calibrated scale sits on and the clipping just below it. The
  assertions: calibration is never worse than 1.0 (cache and logits) and is on the plateau.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsa_trt.builder.build import DEFAULT_CALIB_TEXT, calibrate
from dsa_trt.calibration.evaluate import evaluate_scales, format_reports, scale_sweep, split_calibration_heldout
from dsa_trt.calibration.kv_scale import KV_RECIPE, kv_amax_per_layer, kv_scales_from_amax
from dsa_trt.calibration.modelopt_kv import QUANTIZER_NAME, KVCalibration, calibrate_kv_cache
from dsa_trt.config import FP8_E4M3_MAX
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network
from dsa_trt.runtime.tokenizer import Tokenizer

PLATEAU_RTOL = 0.01  # calibrated cache error within 1% of the best scale in the sweep
LOGIT_SLACK = 1.05  # logits: calibrated rel. error at most 5% above scale 1.0's (sequence noise)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return Checkpoint(tiny_ckpt)


@pytest.fixture(scope="module")
def split(ckpt):
    cfg = ckpt.config
    tok = Tokenizer(ckpt.tokenizer_path, cfg.bos_token_id, cfg.eos_token_id)
    return split_calibration_heldout(tok.encode(DEFAULT_CALIB_TEXT.read_text(encoding="utf-8"), add_bos=False),
                                     tok.bos_token_id)


@pytest.fixture(scope="module")
def calibration(ckpt, split) -> KVCalibration:
    return calibrate_kv_cache(build_network(ckpt, "fp32", torch.float32), split[0])


def test_modelopt_amax_equals_pool_amax(ckpt, split, calibration):
    pool = kv_amax_per_layer(build_network(ckpt, "fp32", torch.float32), split[0])
    torch.testing.assert_close(torch.tensor(calibration.amax), torch.tensor(pool), rtol=1e-6, atol=0)
    assert calibration.pool_amax == pytest.approx(pool, rel=1e-6)
    assert calibration.kv_scales == pytest.approx(kv_scales_from_amax(pool), rel=1e-6)
    assert calibration.num_tokens == sum(map(len, split[0])) == 8 * 256
    assert calibration.modelopt_version.startswith("0.47")
    # the recipe is ModelOpt's fp8 KV config: e4m3, per tensor, on our *_bmm_quantizer
    kv_entries = [e for e in calibration.quant_cfg if e.get("cfg")]
    assert kv_entries and all(e["cfg"]["num_bits"] in ((4, 3), [4, 3]) and e["cfg"]["axis"] is None
                              for e in kv_entries)
    assert QUANTIZER_NAME == "kv_bmm_quantizer"


def test_builder_writes_the_artifact(ckpt, tmp_path):
    cal = calibrate(ckpt, DEFAULT_CALIB_TEXT.read_text(encoding="utf-8"), "cpu", calib_source="corpus.txt")
    path = cal.save(tmp_path / "quant")
    assert path.name == f"{KV_RECIPE}.json"
    d = json.loads(path.read_text())
    assert d["recipe"] == KV_RECIPE and d["format"] == "fp8_e4m3" and d["algorithm"] == "max"
    assert d["num_tokens"] == 2048 and d["modelopt_version"] and d["calib_source"] == "corpus.txt"
    assert len(d["layers"]) == ckpt.config.num_hidden_layers
    for entry, scale in zip(d["layers"], d["kv_scales"]):
        assert entry["scale"] == pytest.approx(entry["amax"] / FP8_E4M3_MAX) == pytest.approx(scale)
        assert entry["amax"] == pytest.approx(entry["pool_amax"], rel=1e-6)


def test_reused_artifact_round_trips_and_bad_ones_are_named(ckpt, calibration, tmp_path):
    """--kv-calibration: an artifact saved by one build is read back with the same scales (so a GPU
    machine without ModelOpt builds the engine the CPU calibration describes); wrong ones are refused."""
    from dsa_trt.calibration.modelopt_kv import CalibrationError

    n = ckpt.config.num_hidden_layers
    path = calibration.save(tmp_path / "quant")
    again = KVCalibration.load(path, n)
    assert again.kv_scales == calibration.kv_scales and again.num_tokens == calibration.num_tokens
    assert json.loads(again.save(tmp_path / "copy").read_text()) == json.loads(path.read_text())
    with pytest.raises(CalibrationError, match=rf"{n + 1} layers"):
        KVCalibration.load(path, n + 1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"amax": [1.0]}')
    with pytest.raises(CalibrationError, match="not a KV calibration artifact.*KeyError"):
        KVCalibration.load(bad, 1)
    d = json.loads(path.read_text())
    d["amax"][0] = float("nan")
    bad.write_text(json.dumps(d))
    with pytest.raises(CalibrationError, match="must be finite"):
        KVCalibration.load(bad, n)


def test_quantizer_slot_is_identity_in_export(ckpt):
    net = build_network(ckpt, "fp32", torch.float32)
    c_kv, k_pe = torch.randn(5, 512), torch.randn(5, 64)
    slot = net.model.layers[0].self_attn.kv_cache_quantizer
    a, b = slot(c_kv, k_pe)
    assert a is c_kv and b is k_pe  # no copy, no op: torch.export records nothing for it


def test_heldout_improvement_over_scale_one(ckpt, split, calibration):
    calib, heldout = split
    n = ckpt.config.num_hidden_layers
    reports, latents = evaluate_scales(ckpt, heldout, {"calibrated": calibration.kv_scales, "1.0": [1.0] * n})
    sweep = scale_sweep(latents, calibration.kv_scales)
    print("\n" + format_reports(reports, sum(map(len, heldout)), sweep))
    cal, one = reports
    for layer, (c, o) in enumerate(zip(cal.cache_rel_err, one.cache_rel_err)):
        assert c <= o * (1 + 1e-3), f"layer {layer}: calibrated cache error {c:.5f} > scale 1.0's {o:.5f}"
        print(f"layer {layer}: cache rel err {c:.5f} (calibrated) vs {o:.5f} (1.0): {100 * (1 - c / o):+.2f}% better")
    mean_cal = sum(cal.cache_rel_err) / n
    assert mean_cal <= min(sweep.values()) * (1 + PLATEAU_RTOL), f"calibrated {mean_cal:.5f} off the plateau: {sweep}"
    assert sweep[1 / 4] > 5 * mean_cal, "a 4x smaller scale must clip (the sweep is not measuring anything)"
    assert cal.cache_only_logits_rel_err <= one.cache_only_logits_rel_err * LOGIT_SLACK
    assert cal.fp8_logits_rel_err <= one.fp8_logits_rel_err * LOGIT_SLACK
