"""AOTInductor packages that load: compile an exported program and check the wrapper it links.

Why this exists (seen on the H200 image, torch 2.11.0+cu130, Ubuntu g++): when the C++ compiler
finds only ``libstdc++.a`` where it looks for ``-lstdc++``, the package's ``wrapper.so`` gets a
private static copy of the C++ runtime. Its ``std::regex`` / ``std::locale`` code then mixes
with the process's shared libstdc++ (loaded by torch), and the first regex in
``AOTInductorModel``'s constructor (``parse_device_str``) segfaults inside
``aoti_load_package`` — for any package, CPU or CUDA, with or without our ops. We link the
shared C++ runtime the process already uses (``-l:libstdc++.so.6``, its directory on the link
path) and refuse a package whose wrapper does not list ``libstdc++.so.6`` as NEEDED.
"""

from __future__ import annotations

import os
import struct
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

LIBSTDCXX = "libstdc++.so.6"


class PackageLinkError(RuntimeError):
    pass


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


def elf_needed(data: bytes) -> list[str]:
    """DT_NEEDED entries of a little-endian ELF64 shared object."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, off, size, link, _info, _align, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        str_off = sections[link][4]
        for pos in range(off, off + size, entsize or 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", str_off + val)
                needed.append(data[str_off + val:end].decode())
    return needed


def check_package(path: Path) -> None:
    """Every wrapper .so in the package must use the shared C++ runtime (see module doc)."""
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if not name.endswith(".so"):
                continue
            needed = elf_needed(zf.read(name))
            if LIBSTDCXX not in needed:
                raise PackageLinkError(
                    f"{path}: {name} links the C++ runtime statically (NEEDED: {', '.join(needed)}); "
                    "it would crash when loaded next to torch's shared libstdc++. Install the "
                    "compiler's shared libstdc++ link (e.g. `apt-get install libstdc++-<ver>-dev`) "
                    "or set CXX to a g++ that links libstdc++.so.6, then rebuild")


def compile_package(ep, package_path: Path) -> Path:
    """torch.export program -> AOTInductor package at ``package_path``, linked and checked."""
    configs = {}
    lib = loaded_libstdcxx() if sys.platform.startswith("linux") else None
    if lib is not None:
        configs["aot_inductor.custom_op_libs"] = [":" + LIBSTDCXX]
    with _library_path(lib.parent if lib is not None else None):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(package_path), inductor_configs=configs)
    if sys.platform.startswith("linux"):
        check_package(Path(package_path))
    return Path(package_path)
