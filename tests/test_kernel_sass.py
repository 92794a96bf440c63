"""Static checks of the compiled kernels' SASS, on any machine (no GPU): the objects `make kernels`
writes (build/kernels/*.o, sm_90a) disassembled by cuobjdump (the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels of the test extras, or a cuobjdump on PATH).

Global memory instructions on sm_90 name their memory descriptor as a 64-bit uniform register
pair, desc[URn]: n is even. ptxas 13.0 can emit LDGSTS (cp.async) with desc[UR1] and never write
UR1 when the copy carries an L2 cache policy (docs/kernels.md,
"Compiler constraints"); on the H200 that is an illegal instruction, which no CPU test would see.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OBJ_DIR = REPO / "build" / "kernels"
DESC = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(\S+).*?desc\[UR(\d+)\]")


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel: nvidia/cu13/bin/cuobjdump
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(cand)
    return None


def odd_descriptors(sass: str) -> list[str]:
    """The instructions of a cuobjdump -sass listing whose memory descriptor register is odd."""
    bad, function = [], "?"
    for line in sass.splitlines():
        if "Function :" in line:
            function = line.split("Function :", 1)[1].strip()
            continue
        m = DESC.match(line)
        if m and int(m.group(2)) % 2:
            bad.append(f"{function}: {line.strip()}")
    return bad


def test_odd_descriptor_is_detected():
    """The checker flags the listing of the miscompile (its shape as cuobjdump 13.5 prints it)."""
    listing = """\t\tFunction : kernel_a
        /*0ce0*/                   LDGSTS.E.BYPASS.LTC128B.128 [R75+UR0], desc[UR1][R34.64] ;           /* 0x00000000224b7dae */
        /*0d00*/              @!P1 LDG.E R2, desc[UR10][R2.64] ;                                        /* 0x0000000a02029981 */
\t\tFunction : kernel_b
        /*21e0*/                   LDGSTS.E.BYPASS.LTC128B.128 [R27], desc[UR6][R22.64] ;               /* 0x00000000161b7fae */
"""
    bad = odd_descriptors(listing)
    assert len(bad) == 1 and bad[0].startswith("kernel_a:") and "desc[UR1]" in bad[0]


def test_memory_descriptors_are_register_pairs():
    objs = sorted(OBJ_DIR.glob("*.o"))
    if not objs:
        pytest.skip(f"no kernel objects in {OBJ_DIR}: run `make kernels` (CI does, before the tests)")
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found: `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` (the test extras) "
                    "or put cuobjdump on PATH")
    checked, bad = 0, []
    for obj in objs:
        out = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"cuobjdump -sass {obj.name} failed: {out.stderr.strip()[:500]}"
        checked += sum(1 for line in out.stdout.splitlines() if DESC.match(line))
        bad += [f"{obj.name}: {b}" for b in odd_descriptors(out.stdout)]
    assert checked > 100, f"only {checked} memory instructions found in {len(objs)} objects: is the listing parsed?"
    assert not bad, "memory instructions with an odd (unwritten) descriptor register:\n" + "\n".join(bad[:20])
