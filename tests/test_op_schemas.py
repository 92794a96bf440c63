"""The operator schemas are one table: plugins/ops.py (Python processes) and
plugins/torch_binding/dsa_schemas.cpp (the Python-free step runner) must define the same ops with
the same schema strings, and the binding must implement every one of them for CUDA. CPU only:
parses the C++ sources, no compiler needed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from dsa_trt.plugins import ops

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS_CPP = ROOT / "plugins" / "torch_binding" / "dsa_schemas.cpp"
BINDING_CPP = ROOT / "plugins" / "torch_binding" / "dsa_torch_ops.cpp"
# every source of libdsa_torch_ops.so (the Makefile's TORCH_OPS_SRC): all of torch_binding/ but the schemas
BINDING_SRCS = sorted(p for p in (ROOT / "plugins" / "torch_binding").glob("*.cpp") if p != SCHEMAS_CPP)
# modules beside ops.py that add ops to the dsa namespace with ops.define_op (imported when present)
OP_MODULES = ("dsa_trt.plugins.fp8_ops",)


def _all_ops() -> dict[str, ops.OpDef]:
    for name in OP_MODULES:
        if (ROOT / "plugins" / f"{name.rsplit('.', 1)[1]}.py").is_file():
            importlib.import_module(name)
    return dict(ops.OPS)


def _block(text: str, macro: str) -> str:
    """Body of `MACRO { ... }` (first match; braces balanced)."""
    m = re.search(re.escape(macro) + r"\s*\{", text)
    assert m, f"no `{macro} {{` block"
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1]


def _cpp_strings(call: str) -> str:
    """The C++ string literal argument of m.def(...)/m.impl(...): adjacent literals concatenated."""
    return "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', call))


def cpp_schemas(text: str, macro: str = "TORCH_LIBRARY(dsa, m)") -> dict[str, str]:
    """{op name: schema after the name} of every m.def in the block."""
    out = {}
    for call in re.findall(r"m\.def\((.*?)\);", _block(text, macro), flags=re.S):
        full = _cpp_strings(call.split(", &")[0])  # the literal(s) before a catch-all kernel argument
        name, _, rest = full.partition("(")
        assert name not in out, f"{name} defined twice"
        out[name.strip()] = "(" + rest
    return out


def test_cpp_schemas_equal_python():
    py = {name: op.schema for name, op in _all_ops().items()}
    cpp = cpp_schemas(SCHEMAS_CPP.read_text())
    assert sorted(cpp) == sorted(py), (
        f"ops only in plugins/ops.py: {sorted(set(py) - set(cpp))}; only in dsa_schemas.cpp: "
        f"{sorted(set(cpp) - set(py))}: add the m.def line (the OpDef's name + schema) to {SCHEMAS_CPP}")
    for name in py:
        assert cpp[name] == py[name], f"dsa::{name}: dsa_schemas.cpp has\n  {cpp[name]}\nplugins/ops.py has\n  {py[name]}"


def test_python_schemas_are_the_registered_ones():
    """What the dispatcher holds is the table's string (parsed back: alias sets, SymInt kept)."""
    for name, op in _all_ops().items():
        expect = torch._C.parse_schema(f"dsa::{name}{op.schema}")
        assert str(getattr(torch.ops.dsa, name).default._schema) == str(expect), name


def test_binding_implements_every_op_for_cuda():
    impls = [name for src in BINDING_SRCS
             for name in re.findall(r'm\.impl\("(\w+)"', _block(src.read_text(), "TORCH_LIBRARY_IMPL(dsa, CUDA, m)"))]
    assert sorted(impls) == sorted(_all_ops()), (
        f"TORCH_LIBRARY_IMPL(dsa, CUDA, m) of {[p.name for p in BINDING_SRCS]} implements {sorted(impls)}; "
        f"the schema table has {sorted(_all_ops())}")
    for src in BINDING_SRCS:
        assert "TORCH_LIBRARY(dsa," not in src.read_text(), (
            f"{src.name}: the binding must not define dsa schemas: it loads into Python processes where "
            "plugins/ops.py did")


def test_lab_schemas_parse():
    """The binding's own dsa_lab schemas are valid schema strings (a typo would only show at load on the GPU)."""
    lab = cpp_schemas(BINDING_CPP.read_text(), "TORCH_LIBRARY(dsa_lab, m)")
    assert {"abi_version", "sparse_mla", "indexer_logits_into", "sparse_mla_launch"} <= set(lab)
    for name, schema in lab.items():
        torch._C.parse_schema(f"dsa_lab::{name}{schema}")


def test_checker_catches_a_drift(tmp_path):
    """The comparison fails on a changed argument (not a test that cannot fail)."""
    text = SCHEMAS_CPP.read_text().replace("float sm_scale", "float softmax_scale")
    assert cpp_schemas(text)["sparse_mla"] != ops.OPS["sparse_mla"].schema


def test_define_op_refuses_a_duplicate():
    op = ops.OPS["sparse_mla"]
    with pytest.raises(ValueError, match="defined twice"):
        ops.define_op(op)
