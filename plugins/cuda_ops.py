"""CUDA implementations of ``torch.ops.dsa.*`` through the kernel library's C API (docs/architecture.md §4).

The library (``build/libdsa_kernels.so``, built by ``make kernels``; ``DSA_KERNEL_LIB`` overrides
the path) is loaded with ctypes; the params structs below mirror ``plugins/csrc/dsa_kernels.h``
field for field. Inputs are validated once here (dtype, shape, strides, device, int32 range) with
messages naming the bad value; kernels launch on ``torch.cuda.current_stream()``; a non-zero
launcher status raises RuntimeError carrying ``dsa_last_error_message()``.

``load()`` registers the CUDA kernels of the ops (``torch.library.register_kernel``). Knob
``DSA_KERNELS``:

* ``auto`` (default): use the library when it is present; otherwise keep the plain-torch
  reference on CUDA and warn once.
* ``cuda``: the library must be present (and export every launcher), else RuntimeError.
* ``reference``: never load it; the reference serves CUDA tensors too.

Combinations the kernels do not implement (fp32 pools of the exact-comparison mode, non-bf16
activations) run the reference and warn once per op and reason. Importing this module never
touches CUDA, so it works on CPU-only machines.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from ctypes import POINTER, c_char_p, c_float, c_int, c_int64, c_size_t, c_void_p
from pathlib import Path

import torch

from dsa_trt.config import PAGE_SIZE

from . import ops  # noqa: F401  (defines the torch.ops.dsa.* schemas this module overrides)
from . import reference as ref

KNOB = "DSA_KERNELS"
LIB_ENV = "DSA_KERNEL_LIB"
DEFAULT_LIB = Path(__file__).resolve().parents[1] / "build" / "libdsa_kernels.so"

# dsa_kernels.h constants
CACHE_FP8, CACHE_BF16 = 0, 1
MLA_DIM, MLA_V_DIM, MLA_PE_DIM = 576, 512, 64
INDEX_DIM = 128
INDEX_ROW_BYTES = INDEX_DIM + 4
INDEX_PAGE_BYTES = PAGE_SIZE * INDEX_ROW_BYTES  # 8448
INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------- params structs (dsa_kernels.h)
class MlaCacheWriteParams(ctypes.Structure):
    _fields_ = [
        ("kv_latent", c_void_p),
        ("k_pe", c_void_p),
        ("slot_mapping", c_void_p),
        ("pool", c_void_p),
        ("num_tokens", c_int64),
        ("kv_latent_stride", c_int64),
        ("k_pe_stride", c_int64),
        ("num_slots", c_int64),
        ("kv_scale", c_float),
        ("format", c_int),
    ]


class IndexerKCacheWriteParams(ctypes.Structure):
    _fields_ = [
        ("index_k", c_void_p),
        ("slot_mapping", c_void_p),
        ("pool", c_void_p),
        ("num_tokens", c_int64),
        ("index_k_stride", c_int64),
        ("num_slots", c_int64),
        ("format", c_int),
    ]


class IndexerLogitsParams(ctypes.Structure):
    _fields_ = [
        ("q", c_void_p),
        ("weights", c_void_p),
        ("pool", c_void_p),
        ("page_table", c_void_p),
        ("req_idx", c_void_p),
        ("seq_lens", c_void_p),
        ("logits", c_void_p),
        ("num_tokens", c_int64),
        ("num_heads", c_int),
        ("max_pages", c_int),
        ("logits_stride", c_int64),
        ("format", c_int),
        ("num_requests", c_int),
    ]


class TopkTranslateParams(ctypes.Structure):
    _fields_ = [
        ("logits", c_void_p),
        ("lengths", c_void_p),
        ("page_table", c_void_p),
        ("req_idx", c_void_p),
        ("slots", c_void_p),
        ("indices", c_void_p),
        ("rows", c_int64),
        ("logits_stride", c_int64),
        ("k", c_int),
        ("max_pages", c_int),
        ("workspace", c_void_p),
    ]


class IndexerTopkParams(ctypes.Structure):
    _fields_ = [
        ("q", c_void_p),
        ("weights", c_void_p),
        ("pool", c_void_p),
        ("page_table", c_void_p),
        ("req_idx", c_void_p),
        ("seq_lens", c_void_p),
        ("slots", c_void_p),
        ("indices", c_void_p),
        ("num_tokens", c_int64),
        ("num_heads", c_int),
        ("max_pages", c_int),
        ("k", c_int),
        ("format", c_int),
        ("path", c_int),
        ("cluster_size", c_int),
        ("warpgroups", c_int),
        ("workspace", c_void_p),
    ]


INDEXER_TOPK_PATHS = {"auto": 0, "fused": 1, "unfused": 2}  # DsaIndexerTopkPath


class SparseMlaParams(ctypes.Structure):
    _fields_ = [
        ("q", c_void_p),
        ("pool", c_void_p),
        ("slots", c_void_p),
        ("out", c_void_p),
        ("lse", c_void_p),
        ("num_tokens", c_int64),
        ("num_heads", c_int),
        ("topk", c_int),
        ("q_stride_token", c_int64),
        ("q_stride_head", c_int64),
        ("num_slots", c_int64),
        ("kv_scale", c_float),
        ("sm_scale", c_float),
        ("format", c_int),
        ("num_splits", c_int),
        ("workspace", c_void_p),
    ]


LAUNCHERS = {  # op -> (C symbol, params struct)
    "mla_cache_write": ("dsa_launch_mla_cache_write", MlaCacheWriteParams),
    "indexer_k_cache_write": ("dsa_launch_indexer_k_cache_write", IndexerKCacheWriteParams),
    "indexer_logits": ("dsa_launch_indexer_logits", IndexerLogitsParams),
    "topk_translate": ("dsa_launch_topk_translate", TopkTranslateParams),
    "indexer_topk": ("dsa_launch_indexer_topk", IndexerTopkParams),
    "sparse_mla": ("dsa_launch_sparse_mla", SparseMlaParams),
}


# ---------------------------------------------------------------- the library
class KernelLibrary:
    """ctypes view of libdsa_kernels.so; `launch(op, params)` runs one launcher on the current stream."""

    def __init__(self, path: Path):
        self.path = path
        self._dll = ctypes.CDLL(str(path))
        self._dll.dsa_last_error_message.restype = c_char_p
        self._dll.dsa_last_error_message.argtypes = []
        self.launchers = {}
        for op, (symbol, struct) in LAUNCHERS.items():
            fn = getattr(self._dll, symbol, None)
            if fn is None:
                continue
            fn.restype = c_int
            fn.argtypes = [POINTER(struct), c_void_p]
            self.launchers[op] = fn
        ws = getattr(self._dll, "dsa_topk_translate_workspace_size", None)
        if ws is not None:
            ws.restype = c_size_t
            ws.argtypes = [c_int64, c_int64, c_int]
        self.topk_workspace_size = ws
        ws = getattr(self._dll, "dsa_indexer_topk_workspace_size", None)
        if ws is not None:
            ws.restype = c_size_t
            ws.argtypes = [c_int64, c_int, c_int, c_int, c_int, c_int]
        self.indexer_topk_workspace_size = ws
        describe = getattr(self._dll, "dsa_indexer_topk_describe", None)
        if describe is not None:
            describe.restype = c_int
            describe.argtypes = [POINTER(IndexerTopkParams), ctypes.c_char_p, c_size_t]
        self.indexer_topk_describe = describe
        ws = getattr(self._dll, "dsa_sparse_mla_workspace_size", None)
        if ws is not None:
            ws.restype = c_size_t
            ws.argtypes = [c_int64, c_int, c_int, c_int]
        self.sparse_mla_workspace_size = ws

    def last_error(self) -> str:
        msg = self._dll.dsa_last_error_message()
        return msg.decode(errors="replace") if msg else "(no message)"

    def launch(self, op: str, params: ctypes.Structure, device: torch.device) -> None:
        fn = self.launchers.get(op)
        if fn is None:
            raise RuntimeError(f"dsa::{op}: {self.path} exports no {LAUNCHERS[op][0]} (rebuild with `make kernels`)")
        stream = torch.cuda.current_stream(device).cuda_stream
        status = fn(ctypes.byref(params), c_void_p(stream))
        if status != 0:
            raise RuntimeError(f"dsa::{op}: kernel library returned {status}: {self.last_error()}")


_lib: KernelLibrary | None = None
_lib_error: str | None = None
_registered: set[str] = set()
_warned: set[str] = set()


def lib_path() -> Path:
    return Path(os.environ.get(LIB_ENV) or DEFAULT_LIB)


def library() -> KernelLibrary | None:
    """The loaded kernel library, or None (reason in `library_error()`)."""
    global _lib, _lib_error
    if _lib is None and _lib_error is None:
        path = lib_path()
        if not path.is_file():
            _lib_error = f"kernel library {path} not found (build it with `make kernels`; {LIB_ENV} overrides the path)"
        else:
            try:
                _lib = KernelLibrary(path)
            except OSError as e:
                _lib_error = f"kernel library {path} failed to load: {e}"
    return _lib


def library_error() -> str | None:
    library()
    return _lib_error


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _require_lib() -> KernelLibrary:
    lib = library()
    if lib is None:
        raise RuntimeError(f"DSA CUDA kernels unavailable: {_lib_error}")
    return lib


def load(mode: str | None = None) -> bool:
    """Register the CUDA kernels of torch.ops.dsa.* per DSA_KERNELS; True when the library serves them."""
    mode = (mode or os.environ.get(KNOB, "auto")).strip().lower()
    if mode not in ("auto", "cuda", "reference"):
        raise ValueError(f"{KNOB}={mode!r} not in ('auto', 'cuda', 'reference')")
    if mode == "reference":
        return False
    lib = library()
    if lib is None:
        if mode == "cuda":
            raise RuntimeError(f"{KNOB}=cuda but the {_lib_error}")
        _warn_once("nolib", f"{_lib_error}; {KNOB}=auto keeps the slow plain-torch reference for CUDA tensors")
        return False
    missing = [op for op in LAUNCHERS if op not in lib.launchers]
    if missing:
        msg = f"{lib.path} lacks the launchers of {missing} (stale build?)"
        if mode == "cuda":
            raise RuntimeError(f"{KNOB}=cuda but {msg}")
        _warn_once("missing", f"{msg}; those ops keep the plain-torch reference on CUDA")
    for op, fn in _KERNELS.items():
        if op in lib.launchers and op not in _registered:
            torch.library.register_kernel(f"dsa::{op}", "cuda", fn)
            _registered.add(op)
    return True


# ---------------------------------------------------------------- validation helpers
def _ptr(t: torch.Tensor | None) -> c_void_p:
    return c_void_p(t.data_ptr() if t is not None else None)


def _fail(op: str, msg: str):
    raise ValueError(f"dsa::{op}: {msg}")


def _check_tensor(op, name, t, *, dtypes, ndim, device, shape=None, contiguous=False, inner_contiguous=True):
    """Messages are only formatted on failure: this runs on every decode step."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.device != device:
        _fail(op, f"{name} on {t.device}, expected {device}")
    if t.dtype not in dtypes:
        _fail(op, f"{name} dtype {t.dtype} not in {tuple(dtypes)}")
    if t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, want in enumerate(shape):
            if want is not None and t.shape[i] != want:
                _fail(op, f"{name} shape {tuple(t.shape)}: dim {i} must be {want}")
    if contiguous:
        if not t.is_contiguous():
            _fail(op, f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    elif inner_contiguous and t.numel() > 0 and t.stride(-1) != 1:
        _fail(op, f"{name} innermost stride {t.stride(-1)} must be 1")


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[-1]


def _fallback(op: str, reason: str):
    _warn_once(f"{op}:{reason}", f"dsa::{op}: {reason}; no CUDA kernel for this combination, running the reference")


def _mla_pool_format(pool: torch.Tensor) -> int | None:
    return {torch.uint8: CACHE_FP8, torch.bfloat16: CACHE_BF16}.get(pool.dtype)


# ---------------------------------------------------------------- the five operators
def mla_cache_write(kv_latent, k_pe, slot_mapping, pool, kv_scale: float) -> None:
    op = "mla_cache_write"
    fmt = _mla_pool_format(pool)
    if fmt is None or kv_latent.dtype != torch.bfloat16 or k_pe.dtype != torch.bfloat16:
        _fallback(op, f"pool {pool.dtype}, kv_latent {kv_latent.dtype}, k_pe {k_pe.dtype}")
        return ref.mla_cache_write(kv_latent, k_pe, slot_mapping, pool, kv_scale)
    dev = pool.device
    _check_tensor(op, "pool", pool, dtypes=(pool.dtype,), ndim=3, device=dev, shape=(None, PAGE_SIZE, MLA_DIM),
                  contiguous=True)
    num_tokens = kv_latent.shape[0]
    _check_tensor(op, "kv_latent", kv_latent, dtypes=(torch.bfloat16,), ndim=2, device=dev, shape=(None, MLA_V_DIM))
    _check_tensor(op, "k_pe", k_pe, dtypes=(torch.bfloat16,), ndim=2, device=dev, shape=(num_tokens, MLA_PE_DIM))
    _check_tensor(op, "slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1, device=dev, shape=(num_tokens,),
                  contiguous=True)
    if not kv_scale > 0:
        _fail(op, f"kv_scale={kv_scale} must be > 0")
    if num_tokens == 0:
        return
    p = MlaCacheWriteParams(
        _ptr(kv_latent), _ptr(k_pe), _ptr(slot_mapping), _ptr(pool), num_tokens, _row_stride(kv_latent),
        _row_stride(k_pe), pool.shape[0] * PAGE_SIZE, float(kv_scale), fmt,
    )
    with torch.cuda.device(dev):
        _require_lib().launch(op, p, dev)


def indexer_k_cache_write(index_k, slot_mapping, pool) -> None:
    op = "indexer_k_cache_write"
    fmt = _mla_pool_format(pool)
    if fmt is None or index_k.dtype != torch.bfloat16:
        _fallback(op, f"pool {pool.dtype}, index_k {index_k.dtype}")
        return ref.indexer_k_cache_write(index_k, slot_mapping, pool)
    dev = pool.device
    if fmt == CACHE_FP8:
        _check_tensor(op, "pool", pool, dtypes=(torch.uint8,), ndim=2, device=dev, shape=(None, INDEX_PAGE_BYTES),
                      contiguous=True)
    else:
        _check_tensor(op, "pool", pool, dtypes=(torch.bfloat16,), ndim=3, device=dev,
                      shape=(None, PAGE_SIZE, INDEX_DIM), contiguous=True)
    num_tokens = index_k.shape[0]
    _check_tensor(op, "index_k", index_k, dtypes=(torch.bfloat16,), ndim=2, device=dev, shape=(None, INDEX_DIM))
    _check_tensor(op, "slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1, device=dev, shape=(num_tokens,),
                  contiguous=True)
    if num_tokens == 0:
        return
    p = IndexerKCacheWriteParams(
        _ptr(index_k), _ptr(slot_mapping), _ptr(pool), num_tokens, _row_stride(index_k), pool.shape[0] * PAGE_SIZE, fmt
    )
    with torch.cuda.device(dev):
        _require_lib().launch(op, p, dev)


def _check_indexer_inputs(op, fmt, q_dtype, q, weights, pool, page_table, req_idx, seq_lens):
    """Shapes/dtypes of the paged indexer inputs (indexer_logits, indexer_topk) -> (device, T, heads, max_pages)."""
    dev = pool.device
    if fmt == CACHE_FP8:
        _check_tensor(op, "pool", pool, dtypes=(torch.uint8,), ndim=2, device=dev, shape=(None, INDEX_PAGE_BYTES),
                      contiguous=True)
    else:
        _check_tensor(op, "pool", pool, dtypes=(torch.bfloat16,), ndim=3, device=dev,
                      shape=(None, PAGE_SIZE, INDEX_DIM), contiguous=True)
    _check_tensor(op, "q", q, dtypes=(q_dtype,), ndim=3, device=dev, shape=(None, None, INDEX_DIM), contiguous=True)
    num_tokens, heads = q.shape[0], q.shape[1]
    if heads not in (32, 64):
        _fail(op, f"num_heads={heads} unsupported (32, 64)")
    _check_tensor(op, "weights", weights, dtypes=(torch.float32,), ndim=2, device=dev, shape=(num_tokens, heads),
                  contiguous=True)
    _check_tensor(op, "page_table", page_table, dtypes=(torch.int32,), ndim=2, device=dev, contiguous=True)
    max_pages = page_table.shape[1]
    if max_pages * PAGE_SIZE > INT32_MAX:
        _fail(op, f"max_pages={max_pages}: max_pages*64 overflows int32")
    _check_tensor(op, "req_idx", req_idx, dtypes=(torch.int32,), ndim=1, device=dev, shape=(num_tokens,),
                  contiguous=True)
    _check_tensor(op, "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=dev, shape=(num_tokens,),
                  contiguous=True)
    return dev, num_tokens, heads, max_pages


def indexer_logits(q, weights, pool, page_table, req_idx, seq_lens, out: torch.Tensor | None = None):
    """[T, max_pages*64] fp32 logits; `out` (optional) may be a preallocated (e.g. poisoned) buffer."""
    op = "indexer_logits"
    fmt = _mla_pool_format(pool)
    q_dtype = {CACHE_FP8: torch.float8_e4m3fn, CACHE_BF16: torch.bfloat16}.get(fmt)
    if fmt is None or q.dtype != q_dtype:
        _fallback(op, f"pool {pool.dtype}, q {q.dtype}")
        return ref.indexer_logits(q, weights, pool, page_table, req_idx, seq_lens)
    dev, num_tokens, heads, max_pages = _check_indexer_inputs(op, fmt, q_dtype, q, weights, pool, page_table,
                                                              req_idx, seq_lens)
    width = max_pages * PAGE_SIZE
    if out is None:
        out = torch.empty((num_tokens, width), dtype=torch.float32, device=dev)
    else:
        _check_tensor(op, "out", out, dtypes=(torch.float32,), ndim=2, device=dev, shape=(num_tokens, None))
        if out.shape[1] < width:
            _fail(op, f"out width {out.shape[1]} < max_pages*64={width}")
    if num_tokens == 0 or max_pages == 0:
        return out
    p = IndexerLogitsParams(
        _ptr(q), _ptr(weights), _ptr(pool), _ptr(page_table), _ptr(req_idx), _ptr(seq_lens), _ptr(out), num_tokens,
        heads, max_pages, _row_stride(out), fmt, page_table.shape[0],
    )
    with torch.cuda.device(dev):
        _require_lib().launch(op, p, dev)
    return out


def topk_translate(logits, lengths, page_table, req_idx, k: int, *, slots=None, indices=None,
                   return_indices: bool = False):
    """slots [rows, k] int32 (and raw indices [rows, k] when return_indices or `indices` is given)."""
    op = "topk_translate"
    dev = logits.device
    if not (isinstance(k, int) and 1 <= k <= INT32_MAX):
        _fail(op, f"k={k} must be an int in [1, 2^31)")
    _check_tensor(op, "logits", logits, dtypes=(torch.float32,), ndim=2, device=dev)
    rows, width = logits.shape
    _check_tensor(op, "lengths", lengths, dtypes=(torch.int32,), ndim=1, device=dev, shape=(rows,), contiguous=True)
    _check_tensor(op, "page_table", page_table, dtypes=(torch.int32,), ndim=2, device=dev, contiguous=True)
    _check_tensor(op, "req_idx", req_idx, dtypes=(torch.int32,), ndim=1, device=dev, shape=(rows,), contiguous=True)
    max_pages = page_table.shape[1]
    if max_pages * PAGE_SIZE > INT32_MAX or width > INT32_MAX:
        _fail(op, f"max_pages={max_pages} / width={width} overflow int32")
    if slots is None:
        slots = torch.empty((rows, k), dtype=torch.int32, device=dev)
    _check_tensor(op, "slots", slots, dtypes=(torch.int32,), ndim=2, device=dev, shape=(rows, k), contiguous=True)
    if indices is None and return_indices:
        indices = torch.empty((rows, k), dtype=torch.int32, device=dev)
    if indices is not None:
        _check_tensor(op, "indices", indices, dtypes=(torch.int32,), ndim=2, device=dev, shape=(rows, k),
                      contiguous=True)
    if rows > 0:
        lib = _require_lib()
        ws_bytes = lib.topk_workspace_size(rows, width, k) if lib.topk_workspace_size else 0
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
        p = TopkTranslateParams(
            _ptr(logits), _ptr(lengths), _ptr(page_table), _ptr(req_idx), _ptr(slots), _ptr(indices), rows,
            _row_stride(logits), k, max_pages, _ptr(workspace),
        )
        with torch.cuda.device(dev):
            lib.launch(op, p, dev)
    return (slots, indices) if (return_indices or indices is not None) else slots


MLA_SPLITS_ENV = "DSA_MLA_SPLITS"


def _mla_splits(num_splits: int | None) -> int:
    """The params' num_splits: the argument, else DSA_MLA_SPLITS, else 0 (auto; dsa_kernels.h)."""
    if num_splits is None:
        raw = os.environ.get(MLA_SPLITS_ENV, "0")
        try:
            num_splits = int(raw)
        except ValueError:
            _fail("sparse_mla", f"{MLA_SPLITS_ENV}={raw!r} is not an integer (0 = auto, 1 = unsplit, n = n chunks)")
    if not (isinstance(num_splits, int) and 0 <= num_splits <= INT32_MAX):
        _fail("sparse_mla", f"num_splits={num_splits!r} must be an int >= 0 (0 = auto, 1 = unsplit, n = n chunks)")
    return num_splits


def _indexer_topk_params(q, weights, pool, page_table, req_idx, seq_lens, k, slots, indices, path, cluster_size,
                         warpgroups):
    """Validated IndexerTopkParams (workspace unset), or None where no CUDA kernel serves the dtypes."""
    op = "indexer_topk"
    fmt = _mla_pool_format(pool)
    q_dtype = {CACHE_FP8: torch.float8_e4m3fn, CACHE_BF16: torch.bfloat16}.get(fmt)
    if fmt is None or q.dtype != q_dtype:
        return None
    if path not in INDEXER_TOPK_PATHS:
        _fail(op, f"path={path!r} not in {tuple(INDEXER_TOPK_PATHS)}")
    if not (isinstance(k, int) and 1 <= k <= INT32_MAX):
        _fail(op, f"k={k} must be an int in [1, 2^31)")
    dev, num_tokens, heads, max_pages = _check_indexer_inputs(op, fmt, q_dtype, q, weights, pool, page_table,
                                                              req_idx, seq_lens)
    _check_tensor(op, "slots", slots, dtypes=(torch.int32,), ndim=2, device=dev, shape=(num_tokens, k),
                  contiguous=True)
    if indices is not None:
        _check_tensor(op, "indices", indices, dtypes=(torch.int32,), ndim=2, device=dev, shape=(num_tokens, k),
                      contiguous=True)
    return IndexerTopkParams(
        _ptr(q), _ptr(weights), _ptr(pool), _ptr(page_table), _ptr(req_idx), _ptr(seq_lens), _ptr(slots),
        _ptr(indices), num_tokens, heads, max_pages, k, fmt, INDEXER_TOPK_PATHS[path], int(cluster_size),
        int(warpgroups), None,
    )


def indexer_topk(q, weights, pool, page_table, req_idx, seq_lens, k: int, *, indices: bool = False,
                 path: str = "auto", cluster_size: int = 0, warpgroups: int = 0):
    """slots [T, k] int32 (and raw indices [T, k] when indices=True): the same selection as
    topk_translate(indexer_logits(q, weights, pool, page_table, req_idx, seq_lens), seq_lens,
    page_table, req_idx, k) as a set per row, without the [T, S] logits in memory on the fused path.

    path: "auto" (the launcher's cost estimate), "fused" or "unfused" (the two kernels through a
    workspace); cluster_size / warpgroups (0 = auto) force the fused shape (tests, tuning)."""
    op = "indexer_topk"
    dev = pool.device
    num_tokens = q.shape[0] if isinstance(q, torch.Tensor) else 0
    slots = torch.empty((num_tokens, k), dtype=torch.int32, device=dev) if isinstance(k, int) and k > 0 else None
    idx = torch.empty_like(slots) if (indices and slots is not None) else None
    p = _indexer_topk_params(q, weights, pool, page_table, req_idx, seq_lens, k, slots, idx, path, cluster_size,
                             warpgroups)
    if p is None:
        _fallback(op, f"pool {pool.dtype}, q {q.dtype}")
        logits = ref.indexer_logits(q, weights, pool, page_table, req_idx, seq_lens)
        s, i = ref.topk_translate(logits, seq_lens, page_table, req_idx, k)
        return (s, i) if indices else s
    if num_tokens > 0:
        lib = _require_lib()
        if lib.indexer_topk_workspace_size is None:
            raise RuntimeError(f"dsa::{op}: {lib.path} lacks dsa_indexer_topk_workspace_size (rebuild: `make kernels`)")
        ws_bytes = lib.indexer_topk_workspace_size(num_tokens, p.num_heads, p.max_pages, k, p.format, p.path)
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
        p.workspace = _ptr(workspace)
        with torch.cuda.device(dev):
            lib.launch(op, p, dev)
    return (slots, idx) if indices else slots


def indexer_topk_plan(q, weights, pool, page_table, req_idx, seq_lens, k: int, *, path: str = "auto",
                      cluster_size: int = 0, warpgroups: int = 0) -> str:
    """What indexer_topk(...) with these arguments runs (fused cluster shapes or unfused, estimates)."""
    op = "indexer_topk"
    dev = pool.device
    slots = torch.empty((q.shape[0], k), dtype=torch.int32, device=dev)
    p = _indexer_topk_params(q, weights, pool, page_table, req_idx, seq_lens, k, slots, None, path, cluster_size,
                             warpgroups)
    if p is None:
        return f"reference (pool {pool.dtype}, q {q.dtype})"
    lib = _require_lib()
    if lib.indexer_topk_describe is None or lib.indexer_topk_workspace_size is None:
        raise RuntimeError(f"dsa::{op}: {lib.path} exports no dsa_indexer_topk_describe (rebuild with `make kernels`)")
    ws_bytes = lib.indexer_topk_workspace_size(q.shape[0], p.num_heads, p.max_pages, k, p.format, p.path)
    p.workspace = c_void_p(256 if ws_bytes else None)  # only NULL-ness matters to the plan
    buf = ctypes.create_string_buffer(512)
    with torch.cuda.device(dev):
        status = lib.indexer_topk_describe(ctypes.byref(p), buf, len(buf))
    if status != 0:
        raise RuntimeError(f"dsa::{op}: kernel library returned {status}: {lib.last_error()}")
    return buf.value.decode()


def sparse_mla(q, pool, slots, kv_scale: float, sm_scale: float, *, num_splits: int | None = None):
    """(out [T, H, 512] bf16, lse [T, H] fp32). num_splits: split-KV chunks of the fp8 kernel (0 = auto
    from T, H and the SM count, 1 = unsplit, n = about n chunks); None reads DSA_MLA_SPLITS (default 0)."""
    op = "sparse_mla"
    fmt = _mla_pool_format(pool)
    if fmt is None or q.dtype != torch.bfloat16:
        _fallback(op, f"pool {pool.dtype}, q {q.dtype}")
        return ref.sparse_mla(q, pool, slots, kv_scale, sm_scale)
    dev = pool.device
    _check_tensor(op, "pool", pool, dtypes=(pool.dtype,), ndim=3, device=dev, shape=(None, PAGE_SIZE, MLA_DIM),
                  contiguous=True)
    _check_tensor(op, "q", q, dtypes=(torch.bfloat16,), ndim=3, device=dev, shape=(None, None, MLA_DIM))
    num_tokens, heads = q.shape[0], q.shape[1]
    _check_tensor(op, "slots", slots, dtypes=(torch.int32,), ndim=2, device=dev, shape=(num_tokens, None),
                  contiguous=True)
    topk = slots.shape[1]
    if pool.shape[0] * PAGE_SIZE > INT32_MAX:
        _fail(op, f"pool of {pool.shape[0]} pages: slot ids overflow int32")
    out = torch.empty((num_tokens, heads, MLA_V_DIM), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((num_tokens, heads), dtype=torch.float32, device=dev)
    splits = _mla_splits(num_splits)
    if num_tokens == 0 or heads == 0:
        return out, lse
    lib = _require_lib()
    ws_bytes = lib.sparse_mla_workspace_size(num_tokens, heads, topk, fmt) if lib.sparse_mla_workspace_size else 0
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None  # [ws_bytes] split-KV partials
    p = SparseMlaParams(
        _ptr(q), _ptr(pool), _ptr(slots), _ptr(out), _ptr(lse), num_tokens, heads, topk,
        q.stride(0) if num_tokens > 1 else heads * MLA_DIM, q.stride(1) if heads > 1 else MLA_DIM,
        pool.shape[0] * PAGE_SIZE, float(kv_scale), float(sm_scale), fmt, splits, _ptr(workspace),
    )
    with torch.cuda.device(dev):
        lib.launch(op, p, dev)
    return out, lse


def _topk_translate_op(logits, lengths, page_table, req_idx, k):
    return topk_translate(logits, lengths, page_table, req_idx, k)


MLA_KERNEL_HEADS = (16, 32, 64, 128)  # head counts the fp8 kernel is instantiated for


def _sparse_mla_op(q, pool, slots, kv_scale, sm_scale):
    """dsa::sparse_mla on CUDA. Other head counts below 128 (the tiny test model has 4) run the kernel
    on q zero-padded to the next instantiated count; heads are independent, so the real ones are exact."""
    heads = q.shape[1]
    padded = next((h for h in MLA_KERNEL_HEADS if h >= heads), heads)
    if padded == heads or _mla_pool_format(pool) is None:
        return sparse_mla(q, pool, slots, kv_scale, sm_scale)
    qp = q.new_zeros((q.shape[0], padded, q.shape[2]))
    qp[:, :heads] = q
    out, lse = sparse_mla(qp, pool, slots, kv_scale, sm_scale)
    return out[:, :heads].contiguous(), lse[:, :heads].contiguous()


_KERNELS = {  # the functions registered as the "cuda" kernels of dsa::<op> (schemas in ops.py)
    "mla_cache_write": mla_cache_write,
    "indexer_k_cache_write": indexer_k_cache_write,
    "indexer_logits": lambda q, weights, pool, page_table, req_idx, seq_lens: indexer_logits(
        q, weights, pool, page_table, req_idx, seq_lens
    ),
    "topk_translate": _topk_translate_op,
    "sparse_mla": _sparse_mla_op,
}
