"""Shared fixtures: the embedded tiny checkpoint, its HF oracle copy, engines built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add barrier waits (seconds on a busy 2-core CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The embedded default checkpoint; DSA_TEST_CHECKPOINT points at a pre-written copy (the GPU
    machine's transformers may predate DeepseekV32, so the checkpoint travels there ready-made)."""
    if os.environ.get("DSA_TEST_CHECKPOINT"):
        return Path(os.environ["DSA_TEST_CHECKPOINT"])
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


@pytest.fixture(scope="session")
def exact_engine(tiny_ckpt, tmp_path_factory) -> Path:
    """CPU AOTInductor engine with fp32 caches (the HF-oracle mode), built once per session."""
    from dsa_trt.builder.build import build_engine

    out = tmp_path_factory.mktemp("engines") / "tiny-fp32"
    build_engine(tiny_ckpt, out, cache_mode="fp32", compiler="aoti", device="cpu", dtype="float32")
    return out


@pytest.fixture(scope="session")
def fp8_engine(tiny_ckpt, tmp_path_factory) -> Path:
    """CPU AOTInductor engine with the deployed fp8 caches (576-B MLA + 132-B indexer), built once."""
    from dsa_trt.builder.build import build_engine

    out = tmp_path_factory.mktemp("engines") / "tiny-fp8"
    build_engine(tiny_ckpt, out, cache_mode="fp8", compiler="aoti", device="cpu", dtype="float32")
    return out


@pytest.fixture(scope="session")
def gpu_engine(request, tmp_path_factory) -> Path:
    """The tiny CUDA engine (AOTInductor, our kernels, bf16, fp8 caches), built once per session;
    DSA_TEST_GPU_ENGINE points at one built earlier in the same device run (saves a compile, and
    needs no checkpoint: the tiny one is asked for only to build)."""
    from dsa_trt.builder.build import build_engine
    from dsa_trt.plugins import cuda_ops

    assert cuda_ops.load("cuda"), "the CUDA kernel library must be built (make kernels) for GPU tests"
    if os.environ.get("DSA_TEST_GPU_ENGINE"):
        return Path(os.environ["DSA_TEST_GPU_ENGINE"])
    out = tmp_path_factory.mktemp("gpu") / "tiny-fp8-cuda"
    build_engine(request.getfixturevalue("tiny_ckpt"), out, cache_mode="fp8", compiler="aoti", device="cuda",
                 dtype="bfloat16")
    return out
