"""GLM-5 family (model_type glm_moe_dsa) against HF GlmMoeDsaForCausalLM on the tiny GLM checkpoint:
32 indexer heads, interleaved indexer RoPE, no group limiting, default RoPE. Exact mode (fp32
caches), same bound as the V3.2 fidelity tests (1e-4; fp32 summation order only)."""

from __future__ import annotations

import pytest
import torch

from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.step_inputs import StepInputs

EXACT_TOL = 1e-4


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    from transformers import GlmMoeDsaForCausalLM

    from dsa_trt.export.tiny_checkpoint import write_dequantized_hf_copy, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("glm")
    ckpt_dir = write_tiny_checkpoint(root / "tiny-glm", seed=0, model_type="glm_moe_dsa")
    write_dequantized_hf_copy(ckpt_dir, root / "tiny-glm-bf16")
    hf = GlmMoeDsaForCausalLM.from_pretrained(root / "tiny-glm-bf16", dtype=torch.float32).eval()
    return Checkpoint(ckpt_dir), hf


@pytest.mark.parametrize("length", [12, 90])
def test_glm_prefill_and_decode_match_hf(glm, length):
    ckpt, hf = glm
    cfg = ckpt.config
    assert cfg.model_type == "glm_moe_dsa" and cfg.indexer_rope_interleave and cfg.index_n_heads == 32
    g = torch.Generator().manual_seed(length)
    ids = [0] + torch.randint(2, cfg.vocab_size, (length + 3,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    net = build_network(ckpt, "fp32", torch.float32)
    pools = allocate_pools(cfg, "fp32", 16)
    pages = [9, 4]
    n = len(ids) - 3
    step = StepInputs.build([(ids[:n], 0, pages)], logits_for="all")
    with torch.no_grad():
        out = net(*step.as_tuple(), *pools)
        errs = [(out - ref[:n]).abs().max().item()]
        for p in range(n, len(ids)):  # decode through the same pages
            o = net(*StepInputs.build([([ids[p]], p, pages)]).as_tuple(), *pools)
            errs.append((o[0] - ref[p]).abs().max().item())
    assert max(errs) < EXACT_TOL, f"GLM T={length}: max |logit diff| per stage {['%.2g' % e for e in errs]}"
