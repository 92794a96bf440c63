"""The fp8 sparse MLA's split-KV plan (plugins/csrc/sparse_mla.cu) on any machine: the workspace that
dsa_sparse_mla_workspace_size (host code) promises holds the partials of every chunk count a launch
of T' <= T tokens may run, auto (ref_sparse_mla.fp8_auto_splits, the launcher's rule mirrored) or
forced (at most kMaxSplitCtas items), and the auto rule's choices at the shapes it was set on."""

from __future__ import annotations

import pytest

from dsa_trt.plugins.kernel_abi import KernelLibrary, library_path
from tests.helpers import ref_sparse_mla as R

FP8 = 0
PART_BYTES = R.MLA_V_DIM * 2 + 4  # per (chunk, token, head): fp16 out + fp32 lse


@pytest.fixture(scope="module")
def lib() -> KernelLibrary:
    path = library_path()
    if not path.exists():
        pytest.skip(f"{path} not built (make kernels)")
    return KernelLibrary(path)


def test_auto_rule_choices():
    """One wave where two chunks per token fit (decode), two waves at the verify step's 34..44 tokens
    x 128 heads, unsplit past that; small top-k lists (2 tiles) split in one wave only."""
    auto = R.fp8_auto_splits
    assert [auto(t, 128, 2048, 132) for t in (1, 8, 20, 33)] == [32, 8, 3, 2]
    assert [auto(t, 128, 2048, 132) for t in (34, 40, 44)] == [3, 3, 3]
    assert [auto(t, 128, 2048, 132) for t in (45, 64, 66, 128)] == [1, 1, 1, 1]
    assert auto(80, 64, 2048, 132) == 3 and auto(89, 64, 2048, 132) == 1
    assert auto(4, 128, 128, 132) == 2


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("topk", [2048, 1000, 77])
def test_workspace_holds_every_plan(lib, heads, topk):
    hb = -(-heads // 64)
    need = 0  # the most partial bytes of any launch of T' <= t tokens
    for t in range(1, 141):
        for sms in (132, 114, 78):
            n = len(R.fp8_split_chunks(t, heads, topk, 0, sms))
            need = max(need, (n if n > 1 else 0) * t * heads * PART_BYTES)
        for forced in range(2, 33):
            n = len(R.fp8_split_chunks(t, heads, topk, forced, 132))
            if n > 1 and n * t * hb <= R.MAX_SPLIT_CTAS:
                need = max(need, n * t * heads * PART_BYTES)
        size = lib.dll.dsa_sparse_mla_workspace_size(t, heads, topk, FP8)
        assert size >= need, f"T={t} H={heads} k={topk}: workspace {size} < {need} bytes of partials"
