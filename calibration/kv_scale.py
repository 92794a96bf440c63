"""Per-layer MLA-cache scale for the fp8 576-byte layout: amax([c_kv; k_pe]) / 448.

Two independent ways to get the amax over the calibration tokens:
* ModelOpt (calibration/modelopt_kv.py, what the builder uses): a TensorQuantizer on the cache
  write's input, calibrated by ``mtq.quantize``.
* The pool read-back here (the cross-check): the network runs in the exact fp32 cache mode, so
  the fp32 MLA pools hold every token's 576-d latent exactly as the fp8 cache write would receive
  it, and the amax is read from the pools (no hooks into the network).
Calibration data (token sequences from a text) is cut here too, so that the builder, the tests
and the held-out evaluation slice the same corpus the same way.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from dsa_trt.config import FP8_E4M3_MAX, PAGE_SIZE
from dsa_trt.export.network import DSAForCausalLM
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import StepInputs

KV_RECIPE = "fp8-kv-per-layer"
KV_AMAX_FLOOR = 1e-4  # an all-zero layer still gets a finite, positive scale
CALIB_SEQ_LEN = 256
CALIB_MAX_SEQS = 8
MIN_CALIB_TOKENS = 16

Progress = Callable[[Iterable], Iterable]


def token_sequences(ids: list[int], bos: int | None, seq_len: int = CALIB_SEQ_LEN,
                    max_seqs: int = CALIB_MAX_SEQS) -> list[list[int]]:
    """Consecutive chunks of ``ids``, each prefixed with BOS: ``[bos] + ids[i : i + seq_len - 1]``."""
    if len(ids) < MIN_CALIB_TOKENS:
        raise ValueError(f"calibration text has only {len(ids)} tokens; give a longer --calib-file")
    step = seq_len - 1
    seqs = [[bos or 0] + ids[i : i + step] for i in range(0, len(ids), step)]
    return [s for s in seqs if len(s) > 8][:max_seqs]


def run_sequences(net: DSAForCausalLM, sequences: list[list[int]], progress: Progress | None = None
                  ) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    """Runs each sequence as one prefill step on fresh fp32 pools; yields (sequence, the per-layer
    cached latents [len, 576] fp32 read back from the MLA pools)."""
    if net.cache_mode != "fp32":
        raise ValueError("calibration runs the network in the exact fp32 cache mode")
    cfg, device = net.cfg, net.inv_freq.device
    for seq in progress(sequences) if progress else sequences:
        pages = list(range(-(-len(seq) // PAGE_SIZE)))
        mla, idx = allocate_pools(cfg, "fp32", len(pages), device=device)
        step = StepInputs.build([(seq, 0, pages)], device=device)
        with torch.no_grad():
            net(*step.as_tuple(), mla, idx)
        # pages 0.. in order: slots 0..len-1
        yield seq, [pool.view(-1, pool.shape[-1])[: len(seq)] for pool in mla]


def kv_amax_per_layer(net: DSAForCausalLM, sequences: list[list[int]]) -> list[float]:
    """amax of the cached 576-d latent per layer over the token sequences (net in cache_mode fp32)."""
    amax = torch.zeros(net.cfg.num_hidden_layers)
    for _, latents in run_sequences(net, sequences):
        for layer, lat in enumerate(latents):
            amax[layer] = torch.maximum(amax[layer], lat.abs().max().cpu())
    return amax.tolist()


def kv_scales_from_amax(amax: list[float]) -> list[float]:
    return [max(a, KV_AMAX_FLOOR) / FP8_E4M3_MAX for a in amax]
