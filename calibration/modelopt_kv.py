"""ModelOpt fp8 PTQ of the MLA cache: per-layer scale = amax([c_kv; k_pe]) / 448 (docs/architecture.md §8).

How ModelOpt is driven (research/ecosystem.md §4):
* Our network marks the cache write's input with ``DSAAttention.kv_cache_quantizer``, an identity
  ``KVCacheQuantizerSlot`` (no node in the exported program). Registered here with ModelOpt's
  ``QuantModuleRegistry``, ``mtq.quantize`` converts each slot into a quant module whose
  TensorQuantizer ``kv_bmm_quantizer`` sees the concatenated 576-d latent [c_kv; k_pe].
* The recipe is ModelOpt's own ``FP8_KV_CFG`` (pattern ``*[kv]_bmm_quantizer``: fp8 e4m3,
  per-tensor) after ``{"*": disabled}``, algorithm ``max``: only the cache quantizers calibrate.
  Weights and activations stay unquantized (the fp8 block weights of the checkpoint are used as
  they are), so the forward pass during calibration is the exact fp32 network.
* The forward loop runs the calibration sequences through the network in the fp32 cache mode;
  each quantizer's ``amax`` is then the per-layer absmax over the calibration tokens, and the
  deployed scale is amax / 448. The same run reads the amax back from the fp32 pools as well
  (calibration/kv_scale.py) and the two must agree: the artifact records both.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dsa_trt.config import FP8_E4M3_MAX, MLA_LATENT_DIM
from dsa_trt.export.network import DSAForCausalLM, KVCacheQuantizerSlot

from .kv_scale import KV_AMAX_FLOOR, KV_RECIPE, Progress, run_sequences

QUANTIZER_NAME = "kv_bmm_quantizer"  # matched by FP8_KV_CFG's "*[kv]_bmm_quantizer"
AMAX_AGREEMENT_RTOL = 1e-6  # ModelOpt and pool amax are maxima of the same fp32 values


class CalibrationError(RuntimeError):
    pass


@dataclass
class KVCalibration:
    """The named artifact ``quant/fp8-kv-per-layer.json`` of an fp8 engine."""

    amax: list[float]  # per layer, ModelOpt TensorQuantizer amax over [c_kv; k_pe]
    pool_amax: list[float]  # per layer, the cross-check read back from the fp32 pools
    num_tokens: int
    num_sequences: int
    modelopt_version: str
    quant_cfg: list = field(default_factory=list)
    calib_source: str = ""
    recipe: str = KV_RECIPE
    format: str = "fp8_e4m3"
    granularity: str = f"per layer, per tensor over the {MLA_LATENT_DIM}-d cached latent [c_kv; k_pe]"
    algorithm: str = "max"

    @property
    def kv_scales(self) -> list[float]:
        return [max(a, KV_AMAX_FLOOR) / FP8_E4M3_MAX for a in self.amax]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kv_scales"] = self.kv_scales
        d["layers"] = [{"layer": i, "amax": a, "scale": s, "pool_amax": p}
                       for i, (a, s, p) in enumerate(zip(self.amax, self.kv_scales, self.pool_amax))]
        return d

    @classmethod
    def load(cls, path: str | Path, num_layers: int) -> "KVCalibration":
        """A saved artifact (``quant/fp8-kv-per-layer.json`` of an earlier build), checked."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
            amax = [float(a) for a in d["amax"]]
            cal = cls(amax=amax, pool_amax=[float(a) for a in d.get("pool_amax", amax)],
                      num_tokens=int(d["num_tokens"]), num_sequences=int(d["num_sequences"]),
                      modelopt_version=str(d["modelopt_version"]), quant_cfg=d.get("quant_cfg", []),
                      calib_source=str(d.get("calib_source", "")))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CalibrationError(f"{path}: not a KV calibration artifact ({type(e).__name__}: {e}); pass the "
                                   f"quant/{KV_RECIPE}.json of an fp8 engine built from this checkpoint") from e
        if d.get("recipe", KV_RECIPE) != KV_RECIPE:
            raise CalibrationError(f"{path}: recipe {d.get('recipe')!r}, expected {KV_RECIPE!r}")
        if len(amax) != num_layers or not all(a == a and 0.0 <= a < float("inf") for a in amax):
            raise CalibrationError(f"{path}: {len(amax)} per-layer amax values {amax[:4]}...; the checkpoint has "
                                   f"{num_layers} layers and each amax must be finite and >= 0")
        return cal

    def save(self, quant_dir: str | Path) -> Path:
        path = Path(quant_dir) / f"{self.recipe}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


_registered = False


def _register_slot() -> None:
    """Teach ModelOpt our slot module: its quant version quantizes the concatenated latent."""
    global _registered
    if _registered:
        return
    from modelopt.torch.quantization.nn import QuantModule, QuantModuleRegistry, TensorQuantizer

    @QuantModuleRegistry.register({KVCacheQuantizerSlot: "dsa.KVCacheQuantizerSlot"})
    class _QuantKVCacheSlot(QuantModule):
        def _setup(self):
            self._register_temp_attribute(QUANTIZER_NAME, TensorQuantizer())

        def forward(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            latent = getattr(self, QUANTIZER_NAME)(torch.cat([c_kv, k_pe], dim=-1))  # [T, 576]
            return latent[..., : c_kv.shape[-1]], latent[..., c_kv.shape[-1] :]

    _registered = True


def kv_quant_config() -> dict:
    """ModelOpt config: every quantizer off, then ModelOpt's FP8_KV_CFG entries; max calibration."""
    import modelopt.torch.quantization as mtq

    kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *kv], "algorithm": "max"}


def calibrate_kv_cache(net: DSAForCausalLM, sequences: list[list[int]], progress: Progress | None = None,
                       calib_source: str = "") -> KVCalibration:
    """ModelOpt PTQ of the MLA-cache quantizers over ``sequences``. ``net`` (fp32 cache mode) is
    converted in place by ModelOpt and is not for further use."""
    try:
        with warnings.catch_warnings():  # "transformers X is not tested with modelopt": we use no HF model here
            warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
            import modelopt
            import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise CalibrationError(f"fp8 calibration needs NVIDIA ModelOpt ({e}); install the build extra: "
                               "pip install -e '.[build]'") from e
    _register_slot()
    num_layers = net.cfg.num_hidden_layers
    pool_amax = torch.zeros(num_layers)
    num_tokens = 0

    def forward_loop(model: DSAForCausalLM) -> None:
        nonlocal num_tokens
        for seq, latents in run_sequences(model, sequences, progress):
            num_tokens += len(seq)
            for layer, lat in enumerate(latents):
                pool_amax[layer] = torch.maximum(pool_amax[layer], lat.abs().max().cpu())

    config = kv_quant_config()
    model = mtq.quantize(net, config, forward_loop)
    quantizers = [getattr(layer.self_attn.kv_cache_quantizer, QUANTIZER_NAME, None) for layer in model.model.layers]
    if any(q is None or q.amax is None for q in quantizers):
        raise CalibrationError("ModelOpt did not calibrate every MLA-cache quantizer "
                               f"(*.self_attn.kv_cache_quantizer.{QUANTIZER_NAME}); is the slot registered?")
    amax = [float(q.amax.float().max()) for q in quantizers]
    cal = KVCalibration(amax=amax, pool_amax=pool_amax.tolist(), num_tokens=num_tokens,
                        num_sequences=len(sequences), modelopt_version=modelopt.__version__,
                        quant_cfg=config["quant_cfg"], calib_source=calib_source)
    for layer, (a, p) in enumerate(zip(cal.amax, cal.pool_amax)):
        if abs(a - p) > AMAX_AGREEMENT_RTOL * max(abs(p), KV_AMAX_FLOOR):
            raise CalibrationError(f"layer {layer}: ModelOpt amax {a!r} != amax read back from the cache {p!r}")
    return cal
