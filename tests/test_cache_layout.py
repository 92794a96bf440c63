"""The cache layout is defined once (dsa_trt/cache_layout.py) and the kernel library agrees.

The kernel headers state the same sizes as ``#define DSA_*`` and ``enum DsaCacheFormat``; these
tests parse the headers (no compiler needed) and compare every value with the Python constant it
mirrors, then check that the pools, the model config and the engine config derive from them.
"""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

import pytest
import torch

from dsa_trt import cache_layout as L
from dsa_trt.engine_config import EngineConfig
from dsa_trt.config import ModelConfig
from dsa_trt.export.tiny_checkpoint import tiny_config_dict
from dsa_trt.plugins.pools import allocate_pools

CSRC = Path(__file__).resolve().parents[1] / "plugins" / "csrc"
HEADERS = ("dsa_kernels.h", "dsa_moe_kernels.h")
# header macro -> the cache_layout constant it mirrors: every numeric DSA_* macro must be listed
MIRRORS = {
    "DSA_PAGE_SIZE": "PAGE_SIZE",
    "DSA_MLA_DIM": "MLA_LATENT_DIM",
    "DSA_MLA_V_DIM": "MLA_V_DIM",
    "DSA_INDEX_DIM": "INDEX_DIM",
    "DSA_INDEX_ROW_BYTES": "INDEX_K_ROW_BYTES",
    "DSA_INDEX_PAGE_BYTES": "INDEX_PAGE_BYTES",
    "DSA_FP8_BLOCK": "FP8_BLOCK",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.LShift: operator.lshift}


def _eval(expr: str, known: dict[str, int]) -> int:
    """A C integer constant expression of literals, + - * / << and earlier macros."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in known:
            return known[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"cannot evaluate {ast.dump(node)} in {expr!r}")

    return ev(ast.parse(expr.replace("/", "//"), mode="eval").body)


def header_macros(csrc: Path = CSRC) -> dict[str, int]:
    """Every object-like ``#define DSA_<NAME> <int expr>`` of the kernel headers, evaluated."""
    macros: dict[str, int] = {}
    for header in HEADERS:
        for line in (csrc / header).read_text().splitlines():
            m = re.match(r"\s*#define\s+(DSA_\w+)(\(?)\s*(.*)", line)
            if not m or m.group(2):  # function-like macros are code, not layout
                continue
            expr = m.group(3).split("//")[0].strip()
            if expr:
                macros[m.group(1)] = _eval(expr, macros)
    return macros


def header_cache_formats() -> dict[str, int]:
    """``enum DsaCacheFormat`` of dsa_kernels.h: {"fp8": 0, "bf16": 1}."""
    text = (CSRC / "dsa_kernels.h").read_text()
    body = re.search(r"enum\s+DsaCacheFormat\s*\{(.*?)\}", text, re.S)
    assert body, "dsa_kernels.h: enum DsaCacheFormat not found"
    return {name.lower(): int(v) for name, v in re.findall(r"DSA_CACHE_(\w+)\s*=\s*(\d+)", body.group(1))}


def disagreements(macros: dict[str, int]) -> list[str]:
    """What differs between the header macros and their cache_layout mirrors (empty: they agree)."""
    problems = [f"{m}: a kernel header constant with no Python mirror; define it in dsa_trt/cache_layout.py "
                "and list it in MIRRORS" for m in sorted(set(macros) - set(MIRRORS))]
    problems += [f"{m}: no longer defined in {HEADERS}; drop it from MIRRORS"
                 for m in sorted(set(MIRRORS) - set(macros))]
    problems += [f"{m} = {v} in the header but cache_layout.{MIRRORS[m]} = {getattr(L, MIRRORS[m])}"
                 for m, v in sorted(macros.items()) if m in MIRRORS and getattr(L, MIRRORS[m]) != v]
    return problems


def test_header_macros_equal_the_python_constants():
    problems = disagreements(header_macros())
    assert not problems, "\n".join(problems)


def test_a_changed_header_is_caught(tmp_path):
    """The check on edited copies of the headers: a changed value and a new constant both fail it."""
    for h in HEADERS:
        text = (CSRC / h).read_text()
        if h == "dsa_kernels.h":
            row = f"#define DSA_INDEX_ROW_BYTES {L.INDEX_K_ROW_BYTES}"
            assert row in text, "dsa_kernels.h: the row-bytes define changed form; update this test"
            text = text.replace(row, "#define DSA_INDEX_ROW_BYTES 136")
            text += "\n#define DSA_NEW_LIMIT (DSA_PAGE_SIZE * 2)\n#define DSA_CHECK(x) do {} while (0)\n"
        (tmp_path / h).write_text(text)
    macros = header_macros(tmp_path)
    assert macros["DSA_INDEX_PAGE_BYTES"] == L.PAGE_SIZE * 136 and macros["DSA_NEW_LIMIT"] == 128
    problems = disagreements(macros)
    assert [p.split(":")[0].split(" ")[0] for p in problems] == ["DSA_NEW_LIMIT", "DSA_INDEX_PAGE_BYTES",
                                                                 "DSA_INDEX_ROW_BYTES"]


def test_header_cache_formats_equal_the_python_table():
    assert header_cache_formats() == L.CACHE_FORMATS


def test_eval_of_header_expressions():
    assert _eval("(A * B)", {"A": 3, "B": 5}) == 15
    assert _eval("1 << 4", {}) == 16
    with pytest.raises(ValueError, match="cannot evaluate"):
        _eval("UNKNOWN + 1", {})


def test_layout_is_self_consistent():
    assert L.MLA_LATENT_DIM == L.MLA_NOPE_DIM + L.MLA_ROPE_DIM
    assert L.INDEX_PAGE_BYTES == L.INDEX_KEYS_BYTES + L.PAGE_SIZE * L.INDEX_SCALE_BYTES
    assert L.INDEX_SCALE_BYTES == torch.float32.itemsize
    for mode in L.CACHE_MODES:
        # a page of each pool holds exactly PAGE_SIZE tokens' bytes
        mla_page = torch.Size(L.mla_page_shape(mode)).numel() * L.pool_dtype(mode).itemsize
        idx_page = torch.Size(L.index_page_shape(mode)).numel() * L.pool_dtype(mode).itemsize
        assert mla_page == L.PAGE_SIZE * L.mla_bytes_per_token(mode), mode
        assert idx_page == L.PAGE_SIZE * L.index_bytes_per_token(mode), mode
    with pytest.raises(ValueError, match="cache_mode 'fp16' not in"):
        L.pool_dtype("fp16")


@pytest.mark.parametrize("mode", L.CACHE_MODES)
def test_pools_and_configs_derive_from_the_layout(mode):
    cfg = ModelConfig.from_hf_dict(tiny_config_dict())
    mla, idx = allocate_pools(cfg, mode, 3)
    assert len(mla) == len(idx) == cfg.num_hidden_layers
    assert mla[0].shape == (3, *L.mla_page_shape(mode)) and mla[0].dtype == L.pool_dtype(mode)
    assert idx[0].shape == (3, *L.index_page_shape(mode)) and idx[0].dtype == L.pool_dtype(mode)
    per_token = sum(p[0].nbytes + q[0].nbytes for p, q in zip(mla, idx)) // L.PAGE_SIZE
    assert cfg.cache_bytes_per_token(mode) == per_token
    ecfg = EngineConfig(cfg, mode, "float32", "cpu", "aoti", kv_scales=[1.0] * cfg.num_hidden_layers)
    assert ecfg.cache_bytes_per_token == per_token and ecfg.page_size == L.PAGE_SIZE
