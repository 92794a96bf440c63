"""Environment knobs of the runtime: one table (name, default, meaning) and strict parsers.

Every ``DSA_*`` variable the runtime reads is in ``KNOBS``; the README's knob table is generated
from it (``markdown_table()``) and tests check the two agree. A bad value is an error naming the
variable, the value and what is accepted, raised when the LLM starts (``validate_environment``),
not deep inside a kernel launch. Knobs read by C++/CUDA code (``DSA_TOPK_CLUSTER``, ...) are listed
and validated here too, so a typo fails in Python with a message instead of being ignored.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable

from dsa_trt.engine_config import VERIFY_MODES


class KnobError(ValueError):
    """A DSA_* environment variable holds a value the runtime cannot use; the message names it."""


@dataclass(frozen=True)
class Knob:
    name: str
    default: str  # as written in the environment; "" = unset (the default behaviour applies)
    accepted: str  # what values mean, for messages and the README
    parse: Callable[[str, str], object]  # (name, raw) -> value; raises KnobError


def _int(lo: int, hi: int | None = None) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            v = int(raw.strip(), 10)
        except ValueError:
            raise KnobError(f"{name}={raw!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise KnobError(f"{name}={v} must be {bound}")
        return v

    return parse


def _open_float(lo: float, hi: float) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        try:
            v = float(raw.strip())
        except ValueError:
            raise KnobError(f"{name}={raw!r} is not a number") from None
        if not lo < v < hi:  # also refuses nan
            raise KnobError(f"{name}={v} must be in ({lo}, {hi})")
        return v

    return parse


def _choice(*values: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in values:
            raise KnobError(f"{name}={raw!r} must be one of {', '.join(values)}")
        return v

    return parse


def _path(name: str, raw: str) -> str:
    if not raw.strip():
        raise KnobError(f"{name} is set but empty: unset it or give a file path")
    return raw


INT32_MAX = 2**31 - 1
KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("DSA_NUM_PAGES", "", "cache pages of 64 tokens, >= 2; unset: 512 on the CPU, DSA_CACHE_FRACTION of free "
         "GPU memory on CUDA; checked against available memory before allocating", _int(2)),
    Knob("DSA_CACHE_FRACTION", "0.5", "fraction of free GPU memory (after the engine loads) for the caches, in (0, 1)",
         _open_float(0.0, 1.0)),
    Knob("DSA_CUDA_GRAPHS", "1", "1: capture decode steps in CUDA graphs; 0: eager launches", _choice("0", "1")),
    Knob("DSA_MTP_FUSED", "1", "1: a greedy MTP verify step (n drafts per sequence) runs the next step's draft passes "
         "in the same call (one CUDA graph; H200, one draft: 1.13x plain at B=1 where the separate pass gives 0.84x); "
         "0: draft passes of their own",
         _choice("0", "1")),
    Knob("DSA_DETERMINISTIC", "0", "1: pad every step to a multiple of 16 tokens so a request's logits do not "
         "depend on its batch (bitwise on the CPU engine) and run the CUDA fp8 linear and sparse MLA unsplit; 0: off",
         _choice("0", "1")),
    Knob("DSA_VERIFY_ENGINE", "full", "engine-dir check at load: full (sha256 of every file of the rank), size "
         "(sizes and the config tie only), off", _choice(*VERIFY_MODES)),
    Knob("DSA_MLA_SPLITS", "0", "sparse-MLA decode split count: 0 = auto, 1 = unsplit, n = n chunks",
         _int(0, INT32_MAX)),
    Knob("DSA_FP8_LINEAR_SPLITS", "", "the most K splits of the fp8 block linear, 1..32; unset: its plan's own "
         "choice, which depends on the step's token count (the deterministic mode sets 1)", _int(1, 32)),
    Knob("DSA_F32_LINEAR_ROWS", "", "CUDA: the fp32-output linears (router, indexer weights_proj, lm_head) as GEMMs "
         "of exactly this many rows (zero-padded), so cuBLAS runs one kernel at every token count; unset: one "
         "GEMM per step (the deterministic mode sets 128)", _int(1, 65536)),
    Knob("DSA_KERNELS", "auto", "auto: our CUDA kernels when the library loads; cuda: require them; reference: "
         "plain torch", _choice("auto", "cuda", "reference")),
    Knob("DSA_KERNEL_LIB", "", "path of the kernel library (default build/libdsa_kernels.so)", _path),
    Knob("DSA_TRT_PLUGIN_LIB", "", "path of the TensorRT plugin library the builder installs", _path),
    Knob("DSA_TOPK_CLUSTER", "", "experiments: force the top-k cluster size (CTAs per row): 1, 2, 4, 8 or 16",
         _choice("1", "2", "4", "8", "16")),
    Knob("DSA_DIST_TIMEOUT_S", "600", "multi-rank engines: seconds a collective (gloo or NCCL) waits for a peer "
         "before the rank stops with an error naming the ranks that exited", _int(1)),
    Knob("DSA_TOPK_CACHE", "", "experiments: 0 / 1 forces the top-k row cache off / on", _choice("0", "1")),
)}


def get(name: str, environ: dict | None = None):
    """The parsed value of knob ``name`` (its default when unset or empty; None when it has none)."""
    knob = KNOBS[name]
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or (raw.strip() == "" and knob.parse is not _path):
        return knob.parse(name, knob.default) if knob.default else None
    return knob.parse(name, raw)


# The deterministic mode's kernel plans (benchmarks/row_invariance.py measured which op needs what):
# the fp8 block linear unsplit over K, sparse MLA unsplit over its keys, the fp32-output linears on
# fixed 128-row GEMMs (cuBLAS picks its kernel by the row count), so a row's sums run in the same
# order at every token count of a step. The kernels read them at every launch.
DETERMINISTIC_KERNEL_ENV = {"DSA_FP8_LINEAR_SPLITS": "1", "DSA_MLA_SPLITS": "1", "DSA_F32_LINEAR_ROWS": "128"}


def _apply(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def scoped_env(values: dict[str, str | None]):
    """``os.environ`` with ``values`` set (None: unset) while the block runs, restored after."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _apply(values)
        yield
    finally:
        _apply(old)


def deterministic_kernels(on: bool = True):
    """A context with DETERMINISTIC_KERNEL_ENV set while it runs (restored after) when ``on``; else a
    context that changes nothing."""
    return scoped_env(DETERMINISTIC_KERNEL_ENV) if on else contextlib.nullcontext()


def validate_environment(environ: dict | None = None) -> None:
    """Parse every knob that is set; one KnobError listing every bad one."""
    env = os.environ if environ is None else environ
    problems = []
    for name in KNOBS:
        if name in env:
            try:
                get(name, env)
            except KnobError as e:
                problems.append(str(e))
    if problems:
        raise KnobError("; ".join(problems))


def markdown_table() -> str:
    rows = ["| variable | default | values |", "|---|---|---|"]
    rows += [f"| `{k.name}` | {f'`{k.default}`' if k.default else '(unset)'} | {k.accepted} |" for k in KNOBS.values()]
    return "\n".join(rows)
