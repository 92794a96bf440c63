"""AOTInductor packages that load: compile an exported program and check the wrapper it links.

Why this exists (seen on the H200 image, torch 2.11.0+cu130, Ubuntu g++): when the C++ compiler
finds only ``libstdc++.a`` where it looks for ``-lstdc++``, the package's ``wrapper.so`` gets a
private static copy of the C++ runtime. Its ``std::regex`` / ``std::locale`` code then mixes
with the process's shared libstdc++ (loaded by torch), and the first regex in
``AOTInductorModel``'s constructor (``parse_device_str``) segfaults inside
``aoti_load_package`` — for any package, CPU or CUDA, with or without our ops. We link the
shared C++ runtime the process already uses (``-l:libstdc++.so.6``, its directory on the link
path) and refuse a package whose wrapper does not list ``libstdc++.so.6`` as NEEDED
(dsa_trt/package_check.py, which the runtime runs again before loading a package).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

# the check lives in the engine-directory contract, where the runtime reads it too
from dsa_trt.package_check import LIBSTDCXX, PackageLinkError, check_package, elf_needed  # noqa: F401


EXTERNAL_WEIGHTS_CONFIGS = {
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,  # no constant inlined into the code as literal values
    "joint_graph_constant_folding": False,  # no uniform-valued constant replaced by its value
}


def loaded_libstdcxx() -> Path | None:
    """The shared libstdc++ mapped into this process (torch loads it), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libstdc++.so" in path and os.path.isfile(path):
                    return Path(path)
    except OSError:
        return None
    return None


@contextmanager
def _library_path(extra: Path | None):
    old = os.environ.get("LIBRARY_PATH")
    if extra is not None:
        os.environ["LIBRARY_PATH"] = str(extra) + (os.pathsep + old if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LIBRARY_PATH", None)
        else:
            os.environ["LIBRARY_PATH"] = old


def compile_package(ep, package_path: Path, external_weights: bool = False) -> Path:
    """torch.export program -> AOTInductor package at ``package_path``, linked and checked.

    ``external_weights``: the package holds no constants (its .so only their table); the runtime
    hands them over from rank<N>.weights.safetensors (dsa_trt/weights_file.py). Inductor then
    neither copies the weights into the .so nor reads their data, so compile time and package size
    do not grow with the weights. Inductor must then not bake weight values into the code either:
    it inlines small 1-D constants (<= 8 elements, e.g. a router bias of few experts) and folds
    uniform-valued ones, which would ignore the file's values; both are turned off."""
    configs = dict(EXTERNAL_WEIGHTS_CONFIGS) if external_weights else {}
    lib = loaded_libstdcxx() if sys.platform.startswith("linux") else None
    if lib is not None:
        configs["aot_inductor.custom_op_libs"] = [":" + LIBSTDCXX]
    with _library_path(lib.parent if lib is not None else None):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(package_path), inductor_configs=configs)
    if sys.platform.startswith("linux"):
        check_package(Path(package_path))
    return Path(package_path)
