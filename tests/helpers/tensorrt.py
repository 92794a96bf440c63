"""What the TensorRT tests share: the `tensorrt` import (or a skip saying why) and where the plugin
library is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN_LIB_ENV = "DSA_TRT_PLUGIN_LIB"


def import_tensorrt():
    """TensorRT's Python package, or a skip: the builder is not installable on the development machines."""
    try:
        import tensorrt as trt
    except ImportError as e:
        pytest.skip(f"`import tensorrt` fails ({e}): the full TensorRT builder is not installable "
                    "here; these engine tests run on machines with TensorRT (e.g. NGC containers)")
    if not hasattr(trt, "Builder"):
        pytest.skip("the `tensorrt` module found is not TensorRT's Python package (no trt.Builder)")
    return trt


def plugin_library_path() -> Path:
    """build/libdsa_trt_plugins.so ($DSA_TRT_PLUGIN_LIB overrides), built or not."""
    return Path(os.environ.get(PLUGIN_LIB_ENV) or REPO / "build" / "libdsa_trt_plugins.so")
