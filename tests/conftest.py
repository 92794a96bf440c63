"""Shared fixtures: the embedded tiny checkpoint, its HF oracle copy, engines built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    from dsa_trt.export.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-v32", seed=0)


@pytest.fixture(scope="session")
def hf_oracle(tiny_ckpt, tmp_path_factory):
    """HF DeepseekV32ForCausalLM on the same (dequantised) weights, fp32 compute."""
    from transformers import DeepseekV32ForCausalLM

    from dsa_trt.export.tiny_checkpoint import write_dequantized_hf_copy

    dst = tmp_path_factory.mktemp("hf") / "tiny-v32-bf16"
    write_dequantized_hf_copy(tiny_ckpt, dst)
    return DeepseekV32ForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
