"""The compiled-package check of the engine-directory contract: a pure-Python ELF reader.

Why (seen on the H200 image, torch 2.11.0+cu130, Ubuntu g++): when the C++ compiler finds only
``libstdc++.a`` where it looks for ``-lstdc++``, an AOTInductor package's ``wrapper.so`` gets a
private static copy of the C++ runtime. Its ``std::regex`` / ``std::locale`` code then mixes with
the process's shared libstdc++ (loaded by torch), and the first regex in ``AOTInductorModel``'s
constructor segfaults inside ``aoti_load_package``. The builder (builder/aoti.py) links the shared
runtime and checks the package it wrote; the runtime checks every package before loading it, so a
bad package is an error naming the fix instead of a crash. Nothing here needs the build tools.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

LIBSTDCXX = "libstdc++.so.6"
SHT_DYNAMIC = 6
DT_NULL, DT_NEEDED = 0, 1


class PackageLinkError(RuntimeError):
    """A compiled package's shared objects would not load safely next to torch."""


def elf_needed(data: bytes) -> list[str]:
    """DT_NEEDED entries of a little-endian ELF64 shared object."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, off, size, link, _info, _align, entsize in sections:
        if sh_type != SHT_DYNAMIC:
            continue
        str_off = sections[link][4]
        for pos in range(off, off + size, entsize or 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
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
