"""The fp8 block linear's plan (plugins/csrc/fp8_linear.cu) through the kernel library's host
functions, on any machine (no GPU: dsa_fp8_block_linear_path and _workspace_size are host code):
which GEMM each T gets, that DSA_FP8_LINEAR_PATH forces it, and that the workspace a TensorRT
profile sizes for its largest T holds every smaller T's plan (it grows with T)."""

from __future__ import annotations

import pytest

from dsa_trt.plugins.kernel_abi import KernelLibrary, library_path

BLOCK = 128
REAL_LINEAR_SHAPES = [(1536, 7168), (24576, 1536), (576, 7168), (32768, 512), (7168, 16384), (8192, 1536),
                      (36864, 7168), (7168, 18432)]


@pytest.fixture(scope="module")
def lib() -> KernelLibrary:
    path = library_path()
    if not path.exists():
        pytest.skip(f"{path} not built (make kernels)")
    try:
        return KernelLibrary(path)
    except RuntimeError as e:  # a stale build
        pytest.fail(str(e))


def path_of(lib: KernelLibrary, t: int, n: int, k: int) -> str:
    return lib.linear_path(t, n, k)


def test_auto_paths(lib, monkeypatch):
    monkeypatch.delenv("DSA_FP8_LINEAR_PATH", raising=False)
    assert path_of(lib, 1, 24576, 1536).startswith("tma-swap 128x8 ")
    assert path_of(lib, 16, 24576, 1536).startswith("tma-swap 128x16 ")
    assert path_of(lib, 64, 24576, 1536).startswith("tma-swap 128x64 ")
    assert path_of(lib, 65, 24576, 1536) == "tma-store 128x128 split 1"  # one token tile: no CTA pairs
    assert path_of(lib, 4096, 36864, 7168) == "tma-store 128x128 x2 split 1"
    assert not path_of(lib, 1, 576, 7168).endswith(" split 1")  # 5 weight tiles: K is split


@pytest.mark.parametrize("knob,prefix", [("tma", "tma 128x128 "), ("tma-nomc", "tma-nomc 128x128 split"),
                                         ("tma-pipe", "tma-pipe 128x128 x2 "), ("tma-store", "tma-store 128x128 x2 "),
                                         ("tma-swap", "tma-swap 128x64 "), ("legacy", "legacy 128x128 "),
                                         ("auto", "tma-store 128x128 x2 ")])
def test_forced_paths(lib, monkeypatch, knob, prefix):
    monkeypatch.setenv("DSA_FP8_LINEAR_PATH", knob)
    assert path_of(lib, 4096, 7168, 16384).startswith(prefix)


def test_bad_knob_is_named(lib, monkeypatch):
    monkeypatch.setenv("DSA_FP8_LINEAR_PATH", "fastest")
    assert path_of(lib, 1, 576, 7168) == "invalid DSA_FP8_LINEAR_PATH"


@pytest.mark.parametrize("t,n,k,splits", [(512, 1536, 7168, 2), (512, 576, 7168, 6), (2048, 1536, 7168, 1),
                                          (2048, 576, 7168, 1), (384, 7168, 16384, 1), (384, 7168, 18432, 1)])
def test_prefill_splits_as_measured(lib, monkeypatch, t, n, k, splits):
    """Where an H100 timed each split against unsplit (fp8_linear.cu pick_splits_tma): q_a / kv_a
    (2026-12-06): at T=512 their few MB of fp32 partials pay for the split, at T=2048 not; o_proj /
    dense down at T=384 (2026-12-07): 3 token tiles make 2 cluster units per weight tile, so a split
    adds waves instead of filling one."""
    monkeypatch.delenv("DSA_FP8_LINEAR_PATH", raising=False)
    monkeypatch.delenv("DSA_FP8_LINEAR_SPLITS", raising=False)
    assert path_of(lib, t, n, k) == f"tma-store 128x128 x2 split {splits}"


@pytest.mark.parametrize("t,n,k", [(1, 576, 7168), (16, 1536, 7168), (64, 7168, 16384), (4096, 576, 7168)])
def test_split_cap(lib, monkeypatch, t, n, k):
    """DSA_FP8_LINEAR_SPLITS caps the K splits (the deterministic mode's 1: the same sums at every T);
    the path and tile stay the plan's; it only lowers a split count, never raises it."""
    monkeypatch.delenv("DSA_FP8_LINEAR_PATH", raising=False)
    monkeypatch.delenv("DSA_FP8_LINEAR_SPLITS", raising=False)
    own = path_of(lib, t, n, k)
    own_splits = int(own.rsplit(" ", 1)[1])
    for cap in (1, 2, 32):
        monkeypatch.setenv("DSA_FP8_LINEAR_SPLITS", str(cap))
        capped = path_of(lib, t, n, k)
        assert capped.rsplit(" ", 1)[0] == own.rsplit(" ", 1)[0]
        assert int(capped.rsplit(" ", 1)[1]) <= min(cap, own_splits)
    monkeypatch.setenv("DSA_FP8_LINEAR_SPLITS", "1")
    assert path_of(lib, t, n, k).endswith(" split 1")


@pytest.mark.parametrize("bad", ["0", "33", "two", "-1"])
def test_bad_split_cap_is_named(lib, monkeypatch, bad):
    monkeypatch.setenv("DSA_FP8_LINEAR_SPLITS", bad)
    assert path_of(lib, 1, 576, 7168) == "invalid DSA_FP8_LINEAR_SPLITS"


@pytest.mark.parametrize("n,k", REAL_LINEAR_SHAPES + [(576, 208), (300, 384), (64, 1008)])
def test_workspace_grows_with_tokens(lib, n, k):
    nkb = -(-k // BLOCK)
    prev = 0
    for t in list(range(0, 300)) + [511, 512, 513, 2048, 4095, 4096, 8192, 16384]:
        size = lib.dll.dsa_fp8_block_linear_workspace_size(t, n, k)
        assert size >= prev, f"N={n} K={k}: workspace({t}) = {size} < workspace of fewer tokens {prev}"
        assert size >= t * nkb * BLOCK + t * nkb * 4, f"N={n} K={k} T={t}: no room for the quantised x"
        prev = size


# ---------------------------------------------------------------- the MoE's expert GEMMs (moe_experts.cu)
def test_moe_auto_paths(lib, monkeypatch):
    """Prefill (more than 64 pairs per local expert on average) takes the grouped TMA GEMM with
    SwiGLU fused into the gate/up epilogue (unfused where I is no multiple of 128), decode the
    cp.async tile with BN from the pairs per expert."""
    monkeypatch.delenv("DSA_MOE_GEMM_PATH", raising=False)
    assert lib.moe_path(1, 8, 256) == "legacy 128x8"
    assert lib.moe_path(32, 8, 256) == "legacy 128x8"
    assert lib.moe_path(512, 8, 256) == "legacy 128x16"
    assert lib.moe_path(2048, 8, 256) == "legacy 128x64"
    assert lib.moe_path(2049, 8, 256) == "tma-fused 128x128 x2"
    assert lib.moe_path(16384, 8, 256) == "tma-fused 128x128 x2"
    assert lib.moe_path(129, 8, 8) == "tma-fused 128x128 x2"  # an EP rank's 8 experts: the pairs of all 256 bound it
    assert lib.moe_path(16384, 8, 256, 192) == "tma-pipe 128x128"


@pytest.mark.parametrize("knob,want", [("tma", "tma 128x128"), ("tma-pipe", "tma-pipe 128x128"),
                                       ("tma-fused", "tma-fused 128x128 x2"),
                                       ("tma-fused-nomc", "tma-fused-nomc 128x128"), ("legacy", "legacy 128x128"),
                                       ("auto", "tma-fused 128x128 x2")])
def test_moe_forced_paths(lib, monkeypatch, knob, want):
    monkeypatch.setenv("DSA_MOE_GEMM_PATH", knob)
    assert lib.moe_path(4096, 8, 16) == want
    if knob.startswith("tma"):
        assert lib.moe_path(1, 8, 256) == want


def test_moe_bad_knob_is_named(lib, monkeypatch):
    monkeypatch.setenv("DSA_MOE_GEMM_PATH", "fastest")
    assert lib.moe_path(1, 8, 256) == "invalid DSA_MOE_GEMM_PATH"


@pytest.mark.parametrize("e_local,d,i", [(256, 7168, 2048), (8, 7168, 2048), (16, 256, 128), (12, 384, 256)])
def test_moe_workspace_grows_with_tokens(lib, e_local, d, i):
    """The workspace of the largest T holds every smaller T's, whichever path either takes."""
    prev = 0
    for t in [0, 1, 2, 7, 8, 9, 31, 64, 65, 129, 511, 2048, 2049, 4096, 16384]:
        size = lib.dll.dsa_moe_experts_workspace_size(t, 8, e_local, d, i, 0)
        assert size >= prev, f"E={e_local} D={d} I={i}: workspace({t}) = {size} < workspace of fewer tokens {prev}"
        # the tma path's per-position x alone: P rows of ceil(D / 128) blocks
        assert size >= t * 8 * (-(-d // BLOCK)) * BLOCK
        prev = size
