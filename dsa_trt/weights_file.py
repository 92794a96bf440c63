"""A rank's weights outside its compiled program: ``rank<N>.weights.safetensors`` (docs/architecture.md §2).

The AOTInductor package is compiled with ``package_constants_in_so=False``: its wrapper .so holds
no weights, only a table of the constants it expects (name, original FQN, dtype, shape, stride;
``constants_info_`` in the packaged wrapper .cpp the .so was built from). The builder streams the
rank's weights into one safetensors file under those FQNs, in the program's dtypes (e4m3 stays
e4m3); the runtime maps the file and hands the tensors to ``load_constants``.

AOTInductor's ``load_constants`` checks neither dtypes nor shapes (a short tensor is taken as is,
and read past its end), so :func:`check_against_table` checks every constant before the load, and
:func:`map_weights` validates the file's header against the file's size first: a truncated or
garbled file is an error naming the file and tensor, never a crash. A bit flipped inside the data
cannot be seen without hashing: manifest.json's sha256 catches it (DSA_VERIFY_ENGINE=full, the
default); with DSA_VERIFY_ENGINE=size|off such a file loads and serves wrong weights.

Writer: the header is computed from the specs before any data exists, so tensors can be written
one at a time in any order (a layer's, then the next) and only one is in memory. The file is a
standard safetensors file (``safetensors.safe_open`` reads it): tensors laid out by descending
element size, so every tensor starts on a multiple of its element size, with no holes.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
import zipfile
from pathlib import Path
from typing import Iterable, NamedTuple

import torch

WEIGHTS_SUFFIX = ".weights.safetensors"
HEADER_ALIGN = 8  # safetensors pads its JSON header so the data starts 8-byte aligned
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit: anything larger is garbage

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class WeightsFileError(ValueError):
    """The weights file cannot serve its program; the message names the file, the tensor and the fix.
    (The runtime re-raises it as EngineDirError.)"""


class ConstantSpec(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] = ()

    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def weights_file_name(rank: int, draft: bool = False) -> str:
    """rank<N>.weights.safetensors, or the MTP draft program's rank<N>.mtp.weights.safetensors."""
    return f"rank{rank}{'.mtp' if draft else ''}{WEIGHTS_SUFFIX}"


def is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major dense (a size-1 dim's stride is irrelevant, as torch treats it)."""
    acc = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != acc:
            return False
        acc *= n
    return True


# ------------------------------------------------------------------------------ the writer
def _layout(specs: dict[str, ConstantSpec]) -> tuple[bytes, dict[str, int]]:
    """(padded header bytes, name -> absolute file offset of its data)."""
    order = sorted(specs, key=lambda n: (-specs[n].dtype.itemsize, n))  # aligned, as safetensors orders
    header, offsets, pos = {}, {}, 0
    for name in order:
        s = specs[name]
        if s.dtype not in DTYPE_NAMES:
            raise WeightsFileError(f"{name}: dtype {s.dtype} has no safetensors name")
        header[name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes()]}
        offsets[name] = pos
        pos += s.nbytes()
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
    base = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {n: base + o for n, o in offsets.items()}


class WeightsWriter:
    """Write a safetensors file whose tensors arrive one at a time, in any order.

    ``put(name, tensor)`` checks the tensor against its spec and writes its bytes at their final
    offset; ``close()`` refuses a file with a tensor never written (its bytes would be zeros)."""

    def __init__(self, path: str | Path, specs: dict[str, ConstantSpec]):
        self.path = Path(path)
        self.specs = dict(specs)
        header, self._offsets = _layout(self.specs)
        self.size = len(header) + sum(s.nbytes() for s in self.specs.values())
        self._pending = set(self.specs)
        self._f = open(self.path, "wb")
        self._f.write(header)
        self._f.truncate(self.size)  # sparse until written

    def put(self, name: str, t: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise WeightsFileError(f"{self.path.name}: {name} is not a constant of the program")
        if name not in self._pending:
            raise WeightsFileError(f"{self.path.name}: {name} written twice")
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise WeightsFileError(f"{self.path.name}: {name} is {ConstantSpec(t.dtype, tuple(t.shape)).describe()}, "
                                   f"the program wants {spec.describe()}")
        data = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        self._f.seek(self._offsets[name])
        self._f.write(memoryview(data))
        self._pending.discard(name)

    def close(self) -> None:
        self._f.close()
        if self._pending:
            missing = sorted(self._pending)
            raise WeightsFileError(f"{self.path}: {len(missing)} constant(s) never written, e.g. {missing[:3]}")

    def __enter__(self) -> "WeightsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def write_weights(path: str | Path, specs: dict[str, ConstantSpec], tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
    with WeightsWriter(path, specs) as w:
        for name, t in tensors:
            w.put(name, t)
    return Path(path)


# ------------------------------------------------------------------------------ the reader
def _bad(path: Path, what: str) -> WeightsFileError:
    return WeightsFileError(f"{path}: {what}; the file is truncated or corrupted: rebuild the engine "
                            "(or restore the file)")


def read_header(path: Path, mm) -> tuple[int, dict[str, dict]]:
    """(data start, name -> header entry), every entry checked against the file's size."""
    size = len(mm)
    if size < 8:
        raise _bad(path, f"{size} bytes, less than a safetensors header")
    (n,) = struct.unpack_from("<Q", mm, 0)
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise _bad(path, f"header length {n:,} does not fit the file's {size:,} bytes")
    try:
        header = json.loads(bytes(mm[8:8 + n]))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"unreadable header ({type(e).__name__}: {e})") from None
    header.pop("__metadata__", None)
    base = 8 + n
    spans = []
    for name, meta in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _bad(path, f"tensor {name}: malformed header entry {meta!r} ({type(e).__name__})") from None
        if min(shape, default=0) < 0 or end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise _bad(path, f"tensor {name}: {meta['dtype']}{list(shape)} but data_offsets {[begin, end]}")
        if base + end > size:
            raise _bad(path, f"tensor {name} ends at byte {base + end:,} but the file has {size:,}")
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise _bad(path, f"tensor {name} starts at data offset {begin:,}, expected {pos:,} (holes or overlaps)")
        pos = end
    if base + pos != size:
        raise _bad(path, f"{size:,} bytes but its header describes {base + pos:,}")
    return base, header


class MappedWeights(NamedTuple):
    tensors: dict[str, torch.Tensor]  # views of ``mapping``: keep it alive as long as they are used
    mapping: mmap.mmap


def map_weights(path: str | Path) -> MappedWeights:
    """The file's tensors as views of one private mapping (MAP_PRIVATE: pages come from the page
    cache on first touch, nothing is copied unless written; the programs never write constants)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsFileError(f"{path}: missing; rebuild the engine directory with `make engine`")
    with open(path, "rb") as f:
        if path.stat().st_size == 0:
            raise _bad(path, "0 bytes")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base, header = read_header(path, mm)
    tensors = {}
    for name, meta in header.items():
        dtype = SAFETENSORS_DTYPES[meta["dtype"]]
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mm, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=base + begin)
        tensors[name] = flat.view(shape)
    return MappedWeights(tensors, mm)


# ------------------------------------------------------------------------------ the program's table
_INFO = re.compile(r"constants_info_\[(\d+)\]\.(name|dtype|shape|stride|original_fqn|from_folded) = (.*?);\s*$",
                   re.MULTILINE)


def _dtype_of(token: str, where: str) -> torch.dtype:
    name = token.removeprefix("cached_torch_dtype_")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsFileError(f"{where}: constant dtype {token!r} is not a torch dtype this runtime knows")
    return dtype


def _ints(text: str) -> tuple[int, ...]:
    inner = text.strip().removeprefix("{").removesuffix("}").strip()
    return tuple(int(x) for x in inner.split(",") if x.strip())


def constant_table(package: str | Path) -> dict[str, ConstantSpec]:
    """FQN -> what the compiled program expects, from the ``constants_info_`` table of the wrapper
    source packaged beside its .so (the same compile wrote both). Folded constants (computed by
    the program itself) are left out: nobody loads them."""
    package = Path(package)
    try:
        with zipfile.ZipFile(package) as zf:
            sources = [n for n in zf.namelist() if n.endswith(".wrapper.cpp")]
            if len(sources) != 1:
                raise WeightsFileError(f"{package}: {len(sources)} wrapper .cpp files in the package, expected 1; "
                                       "rebuild the engine with this dsa_trt")
            text = zf.read(sources[0]).decode()
    except (zipfile.BadZipFile, OSError) as e:
        raise WeightsFileError(f"{package}: not a readable AOTInductor package ({e}); rebuild the engine") from None
    fields: dict[int, dict[str, str]] = {}
    for m in _INFO.finditer(text):
        fields.setdefault(int(m.group(1)), {})[m.group(2)] = m.group(3).strip()
    table = {}
    for i, f in sorted(fields.items()):
        where = f"{package}: constant {i}"
        if not {"dtype", "shape", "stride", "original_fqn"} <= set(f):
            raise WeightsFileError(f"{where}: incomplete entry in the program's constant table {sorted(f)}")
        if f.get("from_folded", "false") == "true":
            continue
        fqn = json.loads(f["original_fqn"])
        table[fqn] = ConstantSpec(_dtype_of(f["dtype"], where), _ints(f["shape"]), _ints(f["stride"]))
    return table


def check_against_table(path: Path, tensors: dict[str, torch.Tensor], table: dict[str, ConstantSpec],
                        program_fqns: Iterable[str] | None = None) -> None:
    """Every constant the program wants is in the file with its dtype and shape (and the program
    reads it contiguously). ``program_fqns``: the loaded .so's own list (get_constant_fqns), which
    must be the table's, so a table read from a foreign source cannot pass."""
    if program_fqns is not None and set(program_fqns) != set(table):
        odd = sorted(set(program_fqns) ^ set(table))
        raise WeightsFileError(f"{path}: the program's constants {odd[:3]} disagree with its packaged table; "
                               "the package is inconsistent: rebuild the engine")
    problems = []
    for name, spec in table.items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"{name}: missing (the program wants {spec.describe()})")
        elif t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            problems.append(f"{name}: {ConstantSpec(t.dtype, tuple(t.shape)).describe()} in the file, "
                            f"the program wants {spec.describe()}")
        elif spec.stride and not is_contiguous(spec.shape, spec.stride):
            problems.append(f"{name}: the program reads it with strides {spec.stride}, the file is contiguous")
    if problems:
        raise WeightsFileError(f"{path}: {len(problems)} tensor(s) do not match the compiled program: "
                               f"{'; '.join(problems[:4])}; the weights file belongs to another build: rebuild the engine")
