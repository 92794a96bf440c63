"""The CUDA kernels of ``torch.ops.dsa.*``: loading the C++ torch binding (docs/architecture.md §4).

``build/libdsa_torch_ops.so`` (``make kernels torch-ops``; plugins/torch_binding/dsa_torch_ops.cpp)
registers the CUDA implementations of the ``dsa`` ops from C++ and links the kernel library
(build/libdsa_kernels.so). ``load()`` loads it with ``torch.ops.load_library``; from then on a
CUDA tensor reaches the kernels through the dispatcher, with validation done once in C++. The
schemas stay in plugins/ops.py (the reference and fake kernels too), so this module is all the
Python the CUDA path has, and a compiled engine needs none of it at run time.

Knobs:

* ``DSA_KERNELS``: ``cuda`` (default where a GPU is visible) loads the binding, and a missing or
  stale library is an error naming the fix; ``reference`` never loads it, the plain-torch
  reference then serves CUDA tensors too. ``auto`` is an alias of the default.
* ``DSA_TORCH_OPS_LIB``: path of the binding (default build/libdsa_torch_ops.so).
* ``DSA_KERNEL_LIB``: path of the kernel library the binding links (default: the one next to it,
  through its rpath); preloaded when set.
* ``DSA_MLA_SPLITS``: default split-KV chunk count of sparse MLA (read by the C++ op).

Combinations no kernel implements (fp32 pools, non-bf16 activations on CUDA) raise
NotImplementedError from the op, and ``check_engine()`` refuses such an engine at load.

The functions below keep the signatures tests and benchmarks use (extra knobs: caller-owned
outputs, forced paths) as thin wrappers over the binding's ``dsa_lab`` ops. Importing this module
never touches CUDA, so it works on CPU-only machines.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_trt.config import PAGE_SIZE

from . import ops

KNOB = "DSA_KERNELS"
LIB_ENV = "DSA_TORCH_OPS_LIB"
KERNEL_LIB_ENV = "DSA_KERNEL_LIB"
MLA_SPLITS_ENV = "DSA_MLA_SPLITS"
BUILD_DIR = Path(__file__).resolve().parents[1] / "build"
DEFAULT_LIB = BUILD_DIR / "libdsa_torch_ops.so"
ABI_VERSION = 3  # = kAbiVersion of dsa_torch_ops.cpp: another value means a stale build
MODES = ("cuda", "reference")
FIX = "build it with `make kernels torch-ops`, or set DSA_KERNELS=reference for the slow plain-torch reference"

# dsa_kernels.h constants
CACHE_FP8, CACHE_BF16 = 0, 1
MLA_DIM, MLA_V_DIM, MLA_PE_DIM = 576, 512, 64
INDEX_DIM = 128
INDEX_ROW_BYTES = INDEX_DIM + 4
INDEX_PAGE_BYTES = PAGE_SIZE * INDEX_ROW_BYTES  # 8448
INT32_MAX = 2**31 - 1
INDEXER_TOPK_PATHS = {"auto": 0, "fused": 1, "unfused": 2}  # DsaIndexerTopkPath
MLA_KERNEL_HEADS = (16, 32, 64, 128)  # head counts sparse MLA is instantiated for (others: padded by the launcher)


class TorchOpsLibrary:
    """The loaded binding: what it serves, its workspace sizes and the launcher's last message."""

    def __init__(self, path: Path):
        self.path = path
        lab = torch.ops.dsa_lab
        abi = lab.abi_version()
        if abi != ABI_VERSION:
            raise RuntimeError(f"{path} is a stale build (ABI version {abi}, this checkout expects {ABI_VERSION}): "
                               f"rebuild it with `make kernels torch-ops`")
        missing = [n for n in ops.OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dsa::{n}", "CUDA")]
        if missing:
            raise RuntimeError(f"{path} registers no CUDA kernel for dsa::{', dsa::'.join(missing)} (stale build?): "
                               "rebuild it with `make kernels torch-ops`")
        self.launchers = frozenset(ops.OPS)  # the ops with a CUDA kernel

    def last_error(self) -> str:
        return torch.ops.dsa_lab.last_error()

    def sparse_mla_workspace_size(self, num_tokens: int, num_heads: int, topk: int, fmt: int) -> int:
        return torch.ops.dsa_lab.sparse_mla_workspace_size(num_tokens, num_heads, topk, fmt)

    def topk_workspace_size(self, rows: int, max_len: int, k: int) -> int:
        return torch.ops.dsa_lab.topk_translate_workspace_size(rows, max_len, k)


_lib: TorchOpsLibrary | None = None
_lib_error: str | None = None


def lib_path() -> Path:
    return Path(os.environ.get(LIB_ENV) or DEFAULT_LIB)


def default_mode() -> str:
    return "cuda" if torch.cuda.is_available() else "reference"


def resolve_mode(value: str | None = None) -> str:
    """DSA_KERNELS (or `value`) resolved to 'cuda' or 'reference'."""
    raw = (value if value is not None else os.environ.get(KNOB, "")).strip().lower()
    if raw in ("", "auto"):
        return default_mode()
    if raw not in MODES:
        raise ValueError(f"{KNOB}={raw!r} not in {MODES} ('auto' = the default: cuda where a GPU is visible)")
    return raw


def library() -> TorchOpsLibrary | None:
    """The loaded binding (loading it on first call), or None (reason in `library_error()`)."""
    global _lib, _lib_error
    if _lib is None and _lib_error is None:
        path = lib_path()
        if not path.is_file():
            _lib_error = f"the torch binding {path} is missing ({LIB_ENV} overrides the path)"
        else:
            try:
                kernel_lib = os.environ.get(KERNEL_LIB_ENV)
                if kernel_lib:  # the binding's NEEDED libdsa_kernels.so then resolves to this one
                    ctypes.CDLL(kernel_lib, mode=ctypes.RTLD_GLOBAL)
                torch.ops.load_library(str(path))
                _lib = TorchOpsLibrary(path)
            except (OSError, RuntimeError) as e:
                _lib_error = f"the torch binding {path} failed to load: {e}"
    return _lib


def library_error() -> str | None:
    library()
    return _lib_error


def load(mode: str | None = None) -> bool:
    """Serve torch.ops.dsa.* on CUDA with the binding per DSA_KERNELS; True when it does.

    'cuda': the binding must load (RuntimeError naming the fix otherwise); 'reference': nothing is
    loaded and False is returned (the reference serves CUDA tensors)."""
    if resolve_mode(mode) == "reference":
        return False
    if library() is None:
        raise RuntimeError(f"{KNOB}=cuda: {_lib_error}; {FIX}")
    return True


def check_engine(device: torch.device | str, cache_mode: str, dtype: str, what: str = "engine") -> bool:
    """load() for a CUDA engine of this cache mode and activation dtype; refuses what no kernel serves."""
    if torch.device(device).type != "cuda" or not load():
        return False
    problems = []
    if cache_mode not in ("fp8", "bf16"):
        problems.append(f"cache_mode {cache_mode!r} (the kernels serve fp8 and bf16 pools)")
    if dtype != "bfloat16":
        problems.append(f"dtype {dtype!r} (the kernels take bfloat16 activations)")
    if problems:
        raise RuntimeError(f"{what}: {' and '.join(problems)} has no CUDA kernel; build it for the CPU "
                           f"(--device cpu), or set {KNOB}=reference for the plain-torch reference on the GPU")
    return True


class _ReferenceMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = ops.OPS.get(func._opname) if func.namespace == ops.NAMESPACE else None
        return op.reference(*args, **(kwargs or {})) if op is not None else func(*args, **(kwargs or {}))


@contextlib.contextmanager
def reference_ops():
    """Inside: torch.ops.dsa.* run the plain-torch reference on every device, the binding loaded or
    not (a precision reference, e.g. an fp32 network on the GPU beside the bf16 one)."""
    with _ReferenceMode():
        yield


# ---------------------------------------------------------------- entry points with extra knobs
def _lab():
    if library() is None:
        raise RuntimeError(f"DSA CUDA kernels unavailable: {_lib_error}; {FIX}")
    return torch.ops.dsa_lab


def mla_cache_write(kv_latent, k_pe, slot_mapping, pool, kv_scale: float) -> None:
    _lab()
    torch.ops.dsa.mla_cache_write(kv_latent, k_pe, slot_mapping, pool, float(kv_scale))


def indexer_k_cache_write(index_k, slot_mapping, pool) -> None:
    _lab()
    torch.ops.dsa.indexer_k_cache_write(index_k, slot_mapping, pool)


def indexer_logits(q, weights, pool, page_table, req_idx, seq_lens, out: torch.Tensor | None = None):
    """[T, max_pages*64] fp32 logits; `out` (optional) may be a preallocated (e.g. poisoned) buffer."""
    lab = _lab()
    if out is None:
        return torch.ops.dsa.indexer_logits(q, weights, pool, page_table, req_idx, seq_lens)
    lab.indexer_logits_into(q, weights, pool, page_table, req_idx, seq_lens, out)
    return out


def _k(op: str, k) -> int:
    if not (isinstance(k, int) and 1 <= k <= INT32_MAX):
        raise ValueError(f"dsa::{op}: k={k!r} must be an int in [1, 2^31)")
    return k


def topk_translate(logits, lengths, page_table, req_idx, k: int, *, slots=None, indices=None,
                   return_indices: bool = False):
    """slots [rows, k] int32 (and raw indices [rows, k] when return_indices or `indices` is given)."""
    lab = _lab()
    k = _k("topk_translate", k)
    rows = logits.shape[0] if isinstance(logits, torch.Tensor) and logits.dim() > 0 else 0
    if slots is None:
        slots = torch.empty((rows, k), dtype=torch.int32, device=logits.device)
    if indices is None and return_indices:
        indices = torch.empty((rows, k), dtype=torch.int32, device=logits.device)
    lab.topk_translate_into(logits, lengths, page_table, req_idx, k, slots, indices)
    return (slots, indices) if (return_indices or indices is not None) else slots


def _mla_splits(num_splits: int | None) -> int:
    """The params' num_splits: the argument, else DSA_MLA_SPLITS, else 0 (auto; dsa_kernels.h)."""
    if num_splits is None:
        raw = os.environ.get(MLA_SPLITS_ENV, "0")
        try:
            num_splits = int(raw)
        except ValueError:
            raise ValueError(f"dsa::sparse_mla: {MLA_SPLITS_ENV}={raw!r} is not an integer "
                             "(0 = auto, 1 = unsplit, n = n chunks)") from None
    if not (isinstance(num_splits, int) and 0 <= num_splits <= INT32_MAX):
        raise ValueError(f"dsa::sparse_mla: num_splits={num_splits!r} must be an int >= 0 "
                         "(0 = auto, 1 = unsplit, n = n chunks)")
    return num_splits


def sparse_mla(q, pool, slots, kv_scale: float, sm_scale: float, *, num_splits: int | None = None):
    """(out [T, H, 512] bf16, lse [T, H] fp32). num_splits: split-KV chunks of the fp8 kernel (0 = auto
    from T, H and the SM count, 1 = unsplit, n = about n chunks); None reads DSA_MLA_SPLITS (default 0).
    Any head count <= 128 (the launcher pads the others to the next instantiated count)."""
    return _lab().sparse_mla(q, pool, slots, float(kv_scale), float(sm_scale), _mla_splits(num_splits))


def sparse_mla_launch(q, pool, slots, out, lse=None, *, num_heads: int | None = None, topk: int | None = None,
                      fmt: int = CACHE_FP8, num_splits: int = 0, workspace=None, kv_scale: float = 1.0,
                      sm_scale: float = 1.0) -> tuple[int, str]:
    """dsa_launch_sparse_mla itself on caller-owned buffers with arbitrary params (no validation
    beyond the device): (status, dsa_last_error_message()). For tests of the launcher's checks and
    allocation-free timing."""
    lab = _lab()
    status = lab.sparse_mla_launch(q, pool, slots, out, lse, workspace,
                                   q.shape[1] if num_heads is None else num_heads,
                                   slots.shape[1] if topk is None else topk, fmt, num_splits, float(kv_scale),
                                   float(sm_scale))
    return status, (lab.last_error() if status != 0 else "")
