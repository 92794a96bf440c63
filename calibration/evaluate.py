"""How much the calibrated MLA-cache scale helps, measured on held-out text.

For each candidate per-layer scale set (the ModelOpt-calibrated one and the uncalibrated 1.0):
* cache: relative error ||dequant(quant(x)) - x|| / ||x|| of the 576-d latents of held-out tokens,
  per layer, with the fp8 cache write's own rounding (x / scale, clamp to +-448, e4m3);
* logits, MLA cache only: the exact network (fp32 caches) with only the latent fake-quantized at
  the cache write (the rest exact), against the exact network: isolates the cache scale;
* logits, deployed fp8 mode: the network in the fp8 cache mode (576-byte MLA + 132-byte indexer
  caches, fp8 indexer queries), against the exact network.
Logit errors are relative L2 over every position of every held-out sequence, with top-1 agreement.

    python -m dsa_trt.calibration.evaluate --checkpoint DIR [--calib-file FILE]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from dsa_trt.config import FP8_E4M3_MAX, PAGE_SIZE
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.network import DSAForCausalLM, KVCacheQuantizerSlot
from dsa_trt.export.program import build_network
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import StepInputs

from .kv_scale import CALIB_SEQ_LEN, run_sequences, token_sequences

HELDOUT_SEQS = 4
SWEEP = (1 / 4, 1 / 2, 1, 4, 64, 1024, 4096)  # multipliers of the calibrated scale
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "export" / "data" / "corpus.txt"


def fp8_roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """dequant(quant(x)) exactly as the fp8 MLA cache write and read do it (fp32)."""
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


class _FakeQuantSlot(KVCacheQuantizerSlot):
    """The cache-write slot with the latent rounded through fp8 at a fixed scale."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, c_kv, k_pe):
        lat = fp8_roundtrip(torch.cat([c_kv, k_pe], dim=-1), self.scale).to(c_kv.dtype)
        return lat[..., : c_kv.shape[-1]], lat[..., c_kv.shape[-1] :]


def split_calibration_heldout(ids: list[int], bos: int | None, heldout_seqs: int = HELDOUT_SEQS
                              ) -> tuple[list[list[int]], list[list[int]]]:
    """(calibration sequences, held-out sequences): the builder's calibration slice from the start
    of the text, the held-out slice from its end; raises when they would overlap."""
    calib = token_sequences(ids, bos)
    used = sum(len(s) - 1 for s in calib)
    tail = heldout_seqs * (CALIB_SEQ_LEN - 1)
    if used + tail > len(ids):
        raise ValueError(f"text of {len(ids)} tokens is too short for {used} calibration + {tail} held-out tokens")
    return calib, token_sequences(ids[len(ids) - tail :], bos, max_seqs=heldout_seqs)


@torch.no_grad()
def _all_logits(net: DSAForCausalLM, sequences: list[list[int]]) -> torch.Tensor:
    cfg, out = net.cfg, []
    for seq in sequences:
        pages = list(range(-(-len(seq) // PAGE_SIZE)))
        pools = allocate_pools(cfg, net.cache_mode, len(pages))
        step = StepInputs.build([(seq, 0, pages)], logits_for="all")
        out.append(net(*step.as_tuple(), *pools))
    return torch.cat(out)  # [sum of lengths, V]


@dataclass
class ScaleReport:
    name: str
    kv_scales: list[float]
    cache_rel_err: list[float]  # per layer
    cache_only_logits_rel_err: float
    cache_only_top1: float
    fp8_logits_rel_err: float
    fp8_top1: float


def _logit_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    rel = ((got - want).norm() / want.norm()).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return rel, top1


def heldout_latents(net: DSAForCausalLM, heldout: list[list[int]]) -> list[torch.Tensor]:
    """Per layer, the cached 576-d latents of every held-out token, [N, 576] fp32 (net: fp32 caches)."""
    latents = [[] for _ in range(net.cfg.num_hidden_layers)]
    for _, per_layer in run_sequences(net, heldout):
        for layer, lat in enumerate(per_layer):
            latents[layer].append(lat.clone())
    return [torch.cat(x) for x in latents]


def cache_rel_err(latents: list[torch.Tensor], scales: list[float]) -> list[float]:
    return [((fp8_roundtrip(x, s) - x).norm() / x.norm()).item() for x, s in zip(latents, scales)]


def scale_sweep(latents: list[torch.Tensor], scales: list[float], multipliers=SWEEP) -> dict[float, float]:
    """Mean over layers of the cache error at scales * m: where the calibrated scale sits."""
    return {m: sum(cache_rel_err(latents, [s * m for s in scales])) / len(scales) for m in multipliers}


def evaluate_scales(ckpt: Checkpoint, heldout: list[list[int]], candidates: dict[str, list[float]]
                    ) -> tuple[list[ScaleReport], list[torch.Tensor]]:
    """Reports per candidate scale set, and the held-out latents they were measured on."""
    exact = build_network(ckpt, "fp32", torch.float32)
    latents = heldout_latents(exact, heldout)
    want = _all_logits(exact, heldout)
    reports = []
    for name, scales in candidates.items():
        cache_err = cache_rel_err(latents, scales)
        iso = build_network(ckpt, "fp32", torch.float32)
        for layer, s in zip(iso.model.layers, scales):
            layer.self_attn.kv_cache_quantizer = _FakeQuantSlot(s)
        iso_err, iso_top1 = _logit_err(_all_logits(iso, heldout), want)
        fp8_err, fp8_top1 = _logit_err(_all_logits(build_network(ckpt, "fp8", torch.float32, scales), heldout), want)
        reports.append(ScaleReport(name, scales, cache_err, iso_err, iso_top1, fp8_err, fp8_top1))
    return reports, latents


def format_reports(reports: list[ScaleReport], num_tokens: int, sweep: dict[float, float] | None = None) -> str:
    lines = [f"held-out: {num_tokens} tokens; errors vs the exact (fp32-cache) network",
             f"{'scale':<12} {'cache rel err per layer':<30} {'logits rel err (MLA cache only)':<34} "
             f"{'logits rel err (fp8 mode)':<28}"]
    for r in reports:
        per_layer = " ".join(f"{e:.4f}" for e in r.cache_rel_err)
        lines.append(f"{r.name:<12} {per_layer:<30} {r.cache_only_logits_rel_err:.5f} (top-1 {r.cache_only_top1:.3f})"
                     f"{'':<9} {r.fp8_logits_rel_err:.5f} (top-1 {r.fp8_top1:.3f})")
    if sweep:
        lines.append("cache rel err (mean over layers) at calibrated scale x m: "
                     + ", ".join(f"x{m:g}: {e:.4f}" for m, e in sweep.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dsa_trt.tokenizer import Tokenizer

    from .modelopt_kv import calibrate_kv_cache

    ap = argparse.ArgumentParser(prog="python -m dsa_trt.calibration.evaluate", description=__doc__)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--calib-file", default=None, help="text; default: the embedded corpus")
    a = ap.parse_args(argv)
    ckpt = Checkpoint(a.checkpoint)
    cfg = ckpt.config
    text_path = Path(a.calib_file) if a.calib_file else DEFAULT_CORPUS
    tok = Tokenizer(ckpt.tokenizer_path, cfg.bos_token_id, cfg.eos_token_id)
    calib, heldout = split_calibration_heldout(tok.encode(text_path.read_text(encoding="utf-8"), add_bos=False),
                                               tok.bos_token_id)
    cal = calibrate_kv_cache(build_network(ckpt, "fp32", torch.float32), calib)
    reports, latents = evaluate_scales(ckpt, heldout, {"calibrated": cal.kv_scales,
                                                       "1.0": [1.0] * cfg.num_hidden_layers})
    print(format_reports(reports, sum(map(len, heldout)), scale_sweep(latents, cal.kv_scales)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
