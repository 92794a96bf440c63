"""Per-layer MLA-cache scale for the fp8 576-byte layout: amax([c_kv; k_pe]) / 448.

The network runs in the exact fp32 cache mode over the calibration tokens; the fp32 MLA pools
then hold every token's 576-d latent exactly as the fp8 cache write would receive it, so the
amax is read from the pools (no hooks into the network).
"""

from __future__ import annotations

import torch

from dsa_trt.config import FP8_E4M3_MAX, PAGE_SIZE
from dsa_trt.export.network import DSAForCausalLM, allocate_pools
from dsa_trt.runtime.step_inputs import StepInputs

KV_RECIPE = "fp8-kv-per-layer"


@torch.no_grad()
def kv_amax_per_layer(net: DSAForCausalLM, sequences: list[list[int]]) -> list[float]:
    """amax of the cached 576-d latent per layer over the token sequences (net in cache_mode fp32)."""
    if net.cache_mode != "fp32":
        raise ValueError("calibration runs the network in the exact fp32 cache mode")
    cfg = net.cfg
    amax = torch.zeros(cfg.num_hidden_layers)
    for seq in sequences:
        pages = list(range(-(-len(seq) // PAGE_SIZE)))
        mla, idx = allocate_pools(cfg, "fp32", len(pages), device=net.inv_freq.device)
        step = StepInputs.build([(seq, 0, pages)], cfg.index_topk, device=net.inv_freq.device)
        net(*step.as_tuple(), mla, idx)
        for layer, pool in enumerate(mla):  # pages 0.. in order: slots 0..len-1
            flat = pool.view(-1, pool.shape[-1])[: len(seq)]
            amax[layer] = torch.maximum(amax[layer], flat.abs().max().cpu())
    return amax.tolist()


def kv_scales_from_amax(amax: list[float]) -> list[float]:
    return [max(a, 1e-4) / FP8_E4M3_MAX for a in amax]
