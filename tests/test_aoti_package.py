"""AOTInductor packages link the shared C++ runtime (builder/aoti.py): a wrapper with a private
static libstdc++ segfaults in `aoti_load_package` next to torch's shared one (torch 2.11 image)."""

from __future__ import annotations

import sys
import zipfile

import pytest
import torch

from dsa_trt.builder.aoti import LIBSTDCXX, PackageLinkError, check_package, compile_package, elf_needed, loaded_libstdcxx

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF/ld specifics")


class _Plain(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


def test_package_needs_shared_libstdcxx_and_loads(tmp_path, one_thread):
    ep = torch.export.export(_Plain(), (torch.randn(4, 8),))
    pkg = compile_package(ep, tmp_path / "p.pt2")
    with zipfile.ZipFile(pkg) as zf:
        sos = [n for n in zf.namelist() if n.endswith(".so")]
        assert sos and all(LIBSTDCXX in elf_needed(zf.read(n)) for n in sos)
    x = torch.randn(4, 8)
    assert torch.equal(torch._inductor.aoti_load_package(str(pkg))(x), torch.relu(x) * 2)


def test_static_runtime_is_refused(tmp_path):
    """A package whose .so does not list libstdc++.so.6 (here: libstdc++ itself, which does not
    NEED itself) gets an error naming the file and the fix."""
    lib = loaded_libstdcxx()
    assert lib is not None, "torch maps libstdc++ into the process on Linux"
    assert "libc.so.6" in elf_needed(lib.read_bytes())  # the parser reads a real library
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("p/data/aotinductor/model/x.wrapper.so", lib.read_bytes())  # libstdc++ does not NEED itself
    with pytest.raises(PackageLinkError, match=r"x\.wrapper\.so links the C\+\+ runtime statically"):
        check_package(bad)
