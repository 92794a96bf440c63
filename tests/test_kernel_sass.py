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


def listings() -> list[tuple[str, str]]:
    """(object name, cuobjdump -sass listing) of every kernel object; skips without objects or tool."""
    objs = sorted(OBJ_DIR.glob("*.o"))
    if not objs:
        pytest.skip(f"no kernel objects in {OBJ_DIR}: run `make kernels` (CI does, before the tests)")
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found: `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` (the test extras) "
                    "or put cuobjdump on PATH")
    out = []
    for obj in objs:
        run = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"cuobjdump -sass {obj.name} failed: {run.stderr.strip()[:500]}"
        out.append((obj.name, run.stdout))
    return out


def test_memory_descriptors_are_register_pairs():
    checked, bad = 0, []
    for name, sass in listings():
        checked += sum(1 for line in sass.splitlines() if DESC.match(line))
        bad += [f"{name}: {b}" for b in odd_descriptors(sass)]
    assert checked > 100, f"only {checked} memory instructions found: is the listing parsed?"
    assert not bad, "memory instructions with an odd (unwritten) descriptor register:\n" + "\n".join(bad[:20])


# The warp-specialised kernels' consumers wait on a ring of mbarriers, then issue a wgmma chain.
# The ring's stage and phase live in uniform registers as long as ptxas can prove them warp-uniform;
# once it cannot (a branch on a value loaded from global memory that advances the ring, or too much
# code inside the K loop), every wait takes a per-thread address ([R26+URZ]) and every wgmma
# descriptor goes through R2UR: correct, and on the H100 10-17% slower (2026-12-07: the MoE GEMMs'
# dead-warpgroup skip, docs/history/2026-12-07-moe-gemm-padding-and-epilogue.md). Shared-memory
# addresses and loop counts read from shared memory do the same (the prefill indexer's group
# kernel). The check: the last mbarrier wait before each wgmma chain (its first wgmma
# zero-initialises: "RZ, !UPT"; A from shared memory or, in sparse MLA, registers) takes its address
# from a uniform register.
RING_KERNELS = re.compile(r"fp8_gemm_ws_kernel|sparse_mla_fp8|indexer_logits_group_kernel")
TRYWAIT = re.compile(r"SYNCS\.PHASECHK\.TRANS64(?:\.TRYWAIT)?\s+\S+,\s*\[([^\]]+)\]")
CHAIN_START = re.compile(r"\b[QH]GMMA\.\S+\s+R\d+,\s*(?:R\d+,\s*)?gdesc\[UR\d+\],\s*RZ,\s*!UPT")


def ring_waits(sass: str) -> tuple[int, list[str]]:
    """(wgmma chains checked, the chains whose preceding ring wait has a per-thread address) of the
    RING_KERNELS functions of a cuobjdump -sass listing."""
    checked, bad, function, last = 0, [], "?", None
    for line in sass.splitlines():
        if "Function :" in line:
            function, last = line.split("Function :", 1)[1].strip(), None
            continue
        if not RING_KERNELS.search(function):
            continue
        m = TRYWAIT.search(line)
        if m:
            last = (m.group(1), line.strip())
        elif CHAIN_START.search(line) and last is not None:
            checked += 1
            if not last[0].startswith("UR"):
                bad.append(f"{function}: {last[1]}")
    return checked, bad


def test_divergent_ring_wait_is_detected():
    """The checker flags the listing of the fault (its shape as cuobjdump 13 prints it)."""
    listing = """\t\tFunction : _ZN10dsa_fp8_ws18fp8_gemm_ws_kernelILb0ELi128E_good
        /*0a20*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R5 ;                 /* 0x00000005ff0075a7 */
        /*0ad0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR20], RZ, !UPT ;     /* 0x01e00000145879f3 */
        /*0ae0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR24], R88 ;          /* 0x01e00000185879f3 */
\t\tFunction : _ZN10dsa_fp8_ws18fp8_gemm_ws_kernelILb0ELi128E_bad
        /*1610*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R32+URZ], R31 ;            /* 0x0000001f200075a7 */
        /*1a00*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR8], RZ, !UPT ;      /* 0x01e00000085879f3 */
\t\tFunction : _ZN14dsa_sparse_mla21sparse_mla_fp8_kernelILi64E_rs
        /*2e00*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR10+0x36018], R19 ;       /* 0x03601813ff0075a7 */
        /*3470*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, R216, gdesc[UR16], RZ, !UPT ; /* 0x00e00010d8187df3 */
\t\tFunction : some_other_kernel
        /*0100*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R3+URZ], R4 ;              /* 0x0000001f200075a7 */
        /*0200*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;            /* 0x01e00000085879f3 */
"""
    checked, bad = ring_waits(listing)
    assert checked == 3 and len(bad) == 1 and "_bad:" in bad[0] and "[R32+URZ]" in bad[0]


def over_listings(check) -> tuple[int, list[str]]:
    """check(listing) -> (checked, bad), summed over every kernel object (bad named by object)."""
    checked, bad = 0, []
    for name, sass in listings():
        n, b = check(sass)
        checked += n
        bad += [f"{name}: {x}" for x in b]
    return checked, bad


def test_ring_waits_are_uniform():
    checked, bad = over_listings(ring_waits)
    assert checked >= 70, f"only {checked} wgmma chains found after a ring wait: is the listing parsed?"
    assert not bad, ("ring waits with a per-thread address before a wgmma chain (the K loop lost its uniform "
                     "registers):\n" + "\n".join(bad[:20]))


# Every kernel's wgmma chains: each k32 step's descriptor is the chain's first plus a constant,
# which ptxas adds in uniform registers (UIADD3.64) when the first is uniform. Built from a generic
# pointer or from threadIdx (the consumer warpgroup's operand offset), it is not, and every step
# goes through R2UR: on the H100 0-5% slower GEMMs and ~2% slower sparse MLA decode (2026-12-07,
# docs/history/2026-12-07-fp8-gemm-stages-raster-order.md). The check: no R2UR between a chain's
# first wgmma and its last (the one that commits the group: "gsb0").
GMMA = re.compile(r"\b[QH]GMMA\.")


def wgmma_chains(sass: str) -> list[tuple[str, list[str]]]:
    """(function, its lines from the chain's first wgmma, which zero-initialises, to the one that
    commits the group, "gsb0") of each wgmma chain of a cuobjdump -sass listing."""
    out, function, chain = [], "?", None
    for line in sass.splitlines():
        if "Function :" in line:
            function, chain = line.split("Function :", 1)[1].strip(), None
            continue
        if CHAIN_START.search(line):
            chain = []
        if chain is None:
            continue
        chain.append(line.strip())
        if GMMA.search(line) and "gsb0" in line:
            out.append((function, chain))
            chain = None
    return out


def chain_r2ur(sass: str) -> tuple[int, list[str]]:
    """(wgmma chains checked, the chains with an R2UR inside) of a listing."""
    chains = wgmma_chains(sass)
    bad = [f"{function}: {lines[0]} ... {next(x for x in lines if 'R2UR' in x)}"
           for function, lines in chains if any("R2UR" in x for x in lines)]
    return len(chains), bad


def test_chain_r2ur_is_detected():
    """The checker flags the listing of the fault (its shape as cuobjdump 13 prints it)."""
    listing = """\t\tFunction : _ZN10dsa_fp8_ws18fp8_gemm_ws_kernelILb0ELi128E_good
        /*0ad0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR12], RZ, !UPT ;     /* 0x01e000000c5879f3 */
        /*0ae0*/                   UIADD3.64 UR24, UR12, 0x2, URZ ;                               /* 0x0000000218187890 */
        /*0af0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR24], R88, gsb0 ;    /* 0x01e00000185879f3 */
        /*0b00*/                   R2UR UR12, R5 ;                                                /* 0x00000000050c72ca */
\t\tFunction : _ZN10dsa_fp8_ws18fp8_gemm_ws_kernelILb0ELi128E_bad
        /*49c0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ, !UPT ;     /* 0x01e00000101879f3 */
        /*49e0*/                   R2UR UR25, R227 ;                                              /* 0x00000000e31972ca */
        /*4a80*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR24], R24, gsb0 ;    /* 0x01e00000181879f3 */
"""
    checked, bad = chain_r2ur(listing)
    assert checked == 2 and len(bad) == 1 and "_bad:" in bad[0] and "R2UR UR25" in bad[0]


def test_wgmma_chain_descriptors_are_uniform():
    checked, bad = over_listings(chain_r2ur)
    assert checked >= 90, f"only {checked} wgmma chains found: is the listing parsed?"
    assert not bad, ("wgmma chains whose descriptors go through R2UR (build them from a lane-0 broadcast "
                     "32-bit shared address):\n" + "\n".join(bad[:20]))


# docs/kernels.md "wgmma serialisation": an accumulator group in flight across a loop's back edge,
# or a branch around a wgmma, makes ptxas commit and wait after every wgmma (sometimes warning
# C7514, sometimes silently). A chain then ends at its first wgmma. The check: every chain has at
# least two wgmmas up to the one that commits the group (today 4 in the GEMMs and the indexer,
# 9 in sparse MLA).
def chain_lengths(sass: str) -> list[tuple[str, int]]:
    """(function, wgmmas up to and including the committing one) of each chain of a listing."""
    return [(function, sum(1 for x in lines if GMMA.search(x))) for function, lines in wgmma_chains(sass)]


def test_serialised_chain_is_detected():
    listing = """\t\tFunction : _ZN10dsa_fp8_ws18fp8_gemm_ws_kernelILb0ELi128E_serialised
        /*0ad0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR12], RZ, !UPT, gsb0 ; /* 0x01e000000c5879f3 */
        /*0ae0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                                /* 0x00000000000079af */
        /*0af0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR24], R88, gsb0 ;    /* 0x01e00000185879f3 */
\t\tFunction : _ZN10dsa_fp8_ws18fp8_gemm_ws_kernelILb0ELi128E_good
        /*0ad0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR12], RZ, !UPT ;     /* 0x01e000000c5879f3 */
        /*0af0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR24], R88, gsb0 ;    /* 0x01e00000185879f3 */
"""
    assert [n for _, n in chain_lengths(listing)] == [1, 2]


def test_wgmma_chains_are_not_serialised():
    chains, short = 0, []
    for name, sass in listings():
        for function, n in chain_lengths(sass):
            chains += 1
            if n < 2:
                short.append(f"{name}: {function}")
    assert chains >= 90, f"only {chains} wgmma chains found: is the listing parsed?"
    assert not short, "wgmma chains that commit after their first wgmma (serialised):\n" + "\n".join(short[:20])
