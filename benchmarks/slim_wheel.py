"""Repack a wheel so it fits the H200 machine's 64 MiB working tree: drop members, LZMA-compress the rest.

    python3 benchmarks/slim_wheel.py IN.whl OUT_DIR --drop GLOB [GLOB ...]

GLOB is an fnmatch pattern over member paths (``*`` crosses ``/``). The kept members are
byte-identical to IN's, with their permission bits (pip sets the executable bit from them); RECORD
is rewritten with their sha256 and the wheel gets the build tag ``1slim`` (IN's name otherwise), so
the dist-info stays IN's. pip reads LZMA members (zip method 14) as it reads deflated ones: it opens
wheels with Python's zipfile. benchmarks/gpu_triton_check.sh lists the wheels it needs and how
they were made.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import re
import sys
import zipfile
from pathlib import Path

BUILD_TAG = "1slim"
# name-version(-build)?-python-abi-platform.whl (PEP 427)
WHEEL_NAME = re.compile(r"^(?P<nv>[^-]+-[^-]+)(?:-\d[^-]*)?-(?P<tags>[^-]+-[^-]+-[^-]+)\.whl$")


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim(src: Path, out_dir: Path, drop: list[str]) -> Path:
    m = WHEEL_NAME.match(src.name)
    if m is None:
        raise SystemExit(f"{src.name}: not a wheel file name (name-version-python-abi-platform.whl)")
    dst = out_dir / f"{m['nv']}-{BUILD_TAG}-{m['tags']}.whl"
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        dist_info = {i.filename.split("/", 1)[0] for i in infos if i.filename.split("/", 1)[0].endswith(".dist-info")}
        if len(dist_info) != 1:
            raise SystemExit(f"{src.name}: {len(dist_info)} .dist-info folders, expected one")
        record_name, wheel_name = f"{dist_info.pop()}/RECORD", None
        kept, dropped, rows = [], 0, []
        for info in infos:
            name = info.filename
            if name == record_name or name.endswith("/"):
                continue
            if any(fnmatch.fnmatch(name, g) for g in drop):
                dropped += 1
                continue
            data = zin.read(info)
            if name.endswith(".dist-info/WHEEL"):
                wheel_name = name
                data = re.sub(rb"(?m)^Build:.*\n", b"", data).rstrip(b"\n") + f"\nBuild: {BUILD_TAG}\n".encode()
            kept.append((info, data))
            rows.append(f"{name},{record_hash(data)},{len(data)}")
    if wheel_name is None:
        raise SystemExit(f"{src.name}: no .dist-info/WHEEL member")
    if dropped == 0:
        raise SystemExit(f"{src.name}: no member matches {drop}: nothing to slim (check the patterns)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_LZMA) as zout:
        for info, data in kept:
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr = info.external_attr  # the permission bits
            out.compress_type = zipfile.ZIP_LZMA
            zout.writestr(out, data)
        record = zipfile.ZipInfo(record_name, date_time=kept[0][0].date_time)
        record.compress_type = zipfile.ZIP_LZMA
        zout.writestr(record, "\n".join(rows + [f"{record_name},,"]) + "\n")
    print(f"{dst.name}: kept {len(kept)} members ({sum(len(d) for _, d in kept) / 2**20:.1f} MiB), dropped {dropped}; "
          f"{src.stat().st_size / 2**20:.1f} -> {dst.stat().st_size / 2**20:.1f} MiB")
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--drop", nargs="+", required=True, metavar="GLOB", help="member paths to leave out")
    args = ap.parse_args(argv)
    slim(args.wheel, args.out_dir, args.drop)


if __name__ == "__main__":
    sys.exit(main())
