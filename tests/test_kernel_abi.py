"""The ctypes params structs of plugins/kernel_abi.py agree with the C header they mirror.

Two checks, both on any machine: (1) the header's ``typedef struct {...} Name;`` parsed here gives
the same field names, order and types as the ctypes struct; (2) a C++ compiler builds a small
program over the header that prints sizeof and every offsetof, and ctypes computes the same layout
(skips where no C++ compiler or CUDA headers are found). A field added, removed, reordered or
retyped on one side only fails both.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsa_trt.plugins import kernel_abi

# C field type -> the ctypes type its mirror must use (any pointer: c_void_p)
C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "size_t": ctypes.c_size_t}


def header_structs(text: str) -> dict[str, list[tuple[str, str]]]:
    """{struct name: [(field, C type)]} of every ``typedef struct { ... } Name;`` in text."""
    structs = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        fields = []
        for line in body.splitlines():
            decl = line.split("//")[0].strip()
            if not decl:
                continue
            m = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)\s*;", decl)
            assert m, f"{name}: cannot parse the field declaration {decl!r} (extend header_structs)"
            fields.append((m.group(3), "pointer" if m.group(2) else m.group(1)))
        structs[name] = fields
    return structs


def mismatches(c_fields: list[tuple[str, str]], struct: type[ctypes.Structure]) -> list[str]:
    py = [(name, typ) for name, typ in struct._fields_]
    if [n for n, _ in c_fields] != [n for n, _ in py]:
        return [f"fields {[n for n, _ in c_fields]} in the header, {[n for n, _ in py]} in ctypes"]
    problems = []
    for (name, ctype), (_, pytype) in zip(c_fields, py):
        want = ctypes.c_void_p if ctype == "pointer" else C_TYPES.get(ctype)
        if want is None:
            problems.append(f"{name}: C type {ctype} has no entry in C_TYPES")
        elif pytype is not want:
            problems.append(f"{name}: {ctype} in the header, {pytype.__name__} in ctypes")
    return problems


def test_every_header_struct_has_a_mirror():
    assert set(header_structs(kernel_abi.HEADER.read_text())) == set(kernel_abi.STRUCTS)


@pytest.mark.parametrize("c_name", sorted(kernel_abi.STRUCTS))
def test_fields_match_header(c_name):
    c_fields = header_structs(kernel_abi.HEADER.read_text())[c_name]
    problems = mismatches(c_fields, kernel_abi.STRUCTS[c_name])
    assert not problems, f"{kernel_abi.HEADER.name} {c_name} vs kernel_abi: " + "; ".join(problems)


def test_mismatch_is_reported():
    """The comparison itself, on a made-up struct: a retyped and a renamed field are both caught."""

    class Params(ctypes.Structure):
        _fields_ = [("a", ctypes.c_void_p), ("n", ctypes.c_int64)]

    c_fields = header_structs("typedef struct {\n  const float* a;  // [n]\n  int n;\n} P;")["P"]
    assert c_fields == [("a", "pointer"), ("n", "int")]
    [problem] = mismatches(c_fields, Params)
    assert problem.startswith("n: int in the header, "), problem
    renamed = [("b", "pointer"), ("n", "int64_t")]
    assert mismatches(renamed, Params) == ["fields ['b', 'n'] in the header, ['a', 'n'] in ctypes"]


def test_layout_matches_compiled_header(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    cuda_include = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    if cxx is None or not (cuda_include / "cuda_runtime.h").is_file():
        pytest.skip("needs a C++ compiler and the CUDA headers (CUDA_HOME) to compile dsa_moe_kernels.h")
    lines = []
    for c_name, struct in kernel_abi.STRUCTS.items():
        lines.append(f'  std::printf("{c_name} size %zu\\n", sizeof({c_name}));')
        lines += [f'  std::printf("{c_name} {f} %zu\\n", offsetof({c_name}, {f}));' for f, _ in struct._fields_]
    src = tmp_path / "layout.cpp"
    src.write_text(f'#include <cstddef>\n#include <cstdio>\n#include "{kernel_abi.HEADER}"\n'
                   "int main() {\n" + "\n".join(lines) + "\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cxx, f"-I{cuda_include}", str(src), "-o", str(exe)], check=True, capture_output=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    want = []
    for c_name, struct in kernel_abi.STRUCTS.items():
        want.append(f"{c_name} size {ctypes.sizeof(struct)}")
        want += [f"{c_name} {f} {getattr(struct, f).offset}" for f, _ in struct._fields_]
    assert got == want
