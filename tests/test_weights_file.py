"""Weights outside the compiled program: rank<N>.weights.safetensors (dsa_trt/weights_file.py).

The builder writes each rank's weights as a standard safetensors file under the program's constant
FQNs and compiles the package without them; Engine.load maps the file (no copy on the CPU), checks
every constant against the package's table and hands them to AOTInductor's load_constants, which
checks nothing itself. Bad files are real files of the session's CPU fp8 engine (tests/conftest.py),
copied per test, then truncated, flipped or rewritten.
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsa_trt.engine_config import MANIFEST_NAME, EngineConfig, EngineDirError
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network, example_step
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.engine import Engine
from dsa_trt.weights_file import (ConstantSpec, WeightsFileError, WeightsWriter, constant_table, map_weights,
                                  weights_file_name)

WEIGHTS = weights_file_name(0)
DRAFT_WEIGHTS = weights_file_name(0, draft=True)
FLIP_BYTES = 64


@pytest.fixture
def engine(fp8_engine, tmp_path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(fp8_engine, dst)
    return dst


def logits(engine: Engine) -> torch.Tensor:
    cfg = engine.config
    mla, idx = allocate_pools(cfg.model, cfg.cache_mode, 8)
    return engine.forward(example_step(cfg.model), mla, idx)


def header_len(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


# ------------------------------------------------------------------------------ the writer, alone
def test_writer_is_standard_safetensors_in_any_order(tmp_path):
    torch.manual_seed(0)
    tensors = {"b.fp8": (torch.randn(130, 260) * 10).to(torch.float8_e4m3fn), "a.scale": torch.rand(2, 3),
               "c.bf16": torch.randn(7, dtype=torch.bfloat16), "d.empty": torch.empty(0, 4)}
    specs = {n: ConstantSpec(t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    path = tmp_path / "w.safetensors"
    with WeightsWriter(path, specs) as w:
        for name in ["c.bf16", "b.fp8", "d.empty", "a.scale"]:  # not the file's order
            w.put(name, tensors[name])
    with safe_open(str(path), framework="pt") as f:  # the real library reads it
        assert sorted(f.keys()) == sorted(tensors)
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name).view(torch.uint8), t.view(torch.uint8)), name
    mapped = map_weights(path)
    for name, t in tensors.items():
        assert mapped.tensors[name].dtype == t.dtype and torch.equal(mapped.tensors[name].view(torch.uint8),
                                                                      t.view(torch.uint8)), name
        assert mapped.tensors[name].data_ptr() % t.element_size() == 0, f"{name} misaligned"


def test_writer_refuses_wrong_and_missing_tensors(tmp_path):
    specs = {"x": ConstantSpec(torch.float32, (4, 4)), "y": ConstantSpec(torch.float8_e4m3fn, (2,))}
    with pytest.raises(WeightsFileError, match=r"x is float32\[4, 3\], the program wants float32\[4, 4\]"):
        with WeightsWriter(tmp_path / "a", specs) as w:
            w.put("x", torch.zeros(4, 3))
    with pytest.raises(WeightsFileError, match=r"y is float32\[2\], the program wants float8_e4m3fn\[2\]"):
        with WeightsWriter(tmp_path / "b", specs) as w:
            w.put("y", torch.zeros(2))
    with pytest.raises(WeightsFileError, match=r"1 constant\(s\) never written, e.g. \['y'\]"):
        with WeightsWriter(tmp_path / "c", specs) as w:
            w.put("x", torch.zeros(4, 4))


# ------------------------------------------------------------------------------ the built engine
def test_engine_dir_keeps_weights_beside_a_program_without_them(fp8_engine, tiny_ckpt):
    cfg = EngineConfig.load(fp8_engine)
    assert cfg.weights == "safetensors" and cfg.rank_weights_file(0) == WEIGHTS
    package, wfile = fp8_engine / cfg.rank_file(0), fp8_engine / WEIGHTS
    table = constant_table(package)
    mapped = map_weights(wfile)
    weight_bytes = sum(s.nbytes() for s in table.values())
    # the package holds no constants: it is smaller than the weights it uses
    assert package.stat().st_size < weight_bytes, (package.stat().st_size, weight_bytes)
    for name, spec in table.items():
        t = mapped.tensors[name]
        assert (t.dtype, tuple(t.shape)) == (spec.dtype, spec.shape), name
    # the values are the network's, as the builder's eager network holds them
    net = build_network(Checkpoint(tiny_ckpt), cfg.cache_mode, torch.float32)
    state = dict(net.named_parameters()) | dict(net.named_buffers())
    for name in table:
        assert torch.equal(mapped.tensors[name], state[name]), name
    manifest = json.loads((fp8_engine / MANIFEST_NAME).read_text())
    assert manifest["files"][WEIGHTS]["size"] == wfile.stat().st_size  # the manifest covers the weights


def test_cpu_load_maps_the_file_without_copying(fp8_engine):
    engine = Engine.load(fp8_engine)
    program = engine.program
    lo = ctypes.addressof(ctypes.c_char.from_buffer(program.mapping))
    hi = lo + len(program.mapping)
    assert program.weights and all(lo <= t.data_ptr() < hi for t in program.weights.values() if t.numel())
    assert torch.isfinite(logits(engine)).all()


# ------------------------------------------------------------------------------ bad files
def test_truncated_weights(engine, monkeypatch):
    wfile = engine / WEIGHTS
    data = wfile.read_bytes()
    wfile.write_bytes(data[: len(data) - 1000])
    with pytest.raises(EngineDirError, match=r"rank0\.weights\.safetensors: .*(bytes but manifest\.json recorded|"
                                             r"does not match manifest)"):
        Engine.load(engine)  # the manifest sees it first (DSA_VERIFY_ENGINE=full, the default)
    monkeypatch.setenv("DSA_VERIFY_ENGINE", "off")  # without the manifest, the reader still does
    with pytest.raises(EngineDirError, match=r"rank0\.weights\.safetensors: .*ends at byte [\d,]+ but the file has "
                                             r"[\d,]+; the file is truncated or corrupted"):
        Engine.load(engine)
    wfile.write_bytes(data[:5])
    with pytest.raises(EngineDirError, match=r"5 bytes, less than a safetensors header"):
        Engine.load(engine)


def test_flipped_header_bytes(engine, monkeypatch):
    wfile = engine / WEIGHTS
    data = bytearray(wfile.read_bytes())
    n = header_len(wfile)
    data[8 + n // 2: 8 + n // 2 + FLIP_BYTES] = bytes(b ^ 0xFF for b in data[8 + n // 2: 8 + n // 2 + FLIP_BYTES])
    wfile.write_bytes(bytes(data))
    with pytest.raises(EngineDirError, match=r"rank0\.weights\.safetensors: sha256 .* content changed"):
        Engine.load(engine)
    monkeypatch.setenv("DSA_VERIFY_ENGINE", "off")
    with pytest.raises(EngineDirError, match=r"rank0\.weights\.safetensors: unreadable header"):
        Engine.load(engine)
    data[:8] = struct.pack("<Q", 1 << 40)  # a header length past the end of the file
    wfile.write_bytes(bytes(data))
    with pytest.raises(EngineDirError, match=r"header length [\d,]+ does not fit the file's [\d,]+ bytes"):
        Engine.load(engine)


def test_flipped_data_bytes(engine, fp8_engine, monkeypatch):
    """Only the manifest's sha256 sees a flip inside the data; with DSA_VERIFY_ENGINE=size|off the
    file is well formed, loads, and the engine computes with the flipped weights."""
    wfile = engine / WEIGHTS
    data = bytearray(wfile.read_bytes())
    table = constant_table(engine / "rank0.pt2")
    name = "model.norm.weight"  # every logit goes through it
    header = json.loads(data[8: 8 + header_len(wfile)])
    begin = 8 + header_len(wfile) + header[name]["data_offsets"][0]
    assert name in table
    data[begin: begin + FLIP_BYTES] = bytes(b ^ 0x40 for b in data[begin: begin + FLIP_BYTES])
    wfile.write_bytes(bytes(data))
    with pytest.raises(EngineDirError, match=r"rank0\.weights\.safetensors: sha256 .* content changed since the build"):
        Engine.load(engine)
    want = logits(Engine.load(fp8_engine))
    for mode in ("size", "off"):
        monkeypatch.setenv("DSA_VERIFY_ENGINE", mode)
        got = logits(Engine.load(engine))
        assert not torch.equal(got, want), f"DSA_VERIFY_ENGINE={mode}: the flipped norm weights changed nothing?"


@pytest.mark.parametrize("change, shown", [
    ("shape", r"model\.layers\.0\.self_attn\.q_a_proj\.weight: float32\[\d+, \d+\] in the file, the program wants"),
    ("dtype", r"model\.layers\.0\.self_attn\.q_a_proj\.weight: bfloat16\[\d+, \d+\] in the file, the program wants float32"),
    ("missing", r"model\.layers\.0\.self_attn\.q_a_proj\.weight: missing \(the program wants float32"),
])
def test_weights_that_do_not_fit_the_program(engine, monkeypatch, change, shown):
    """A well-formed file of other tensors: AOTI would take a short tensor as is and read past it."""
    wfile = engine / WEIGHTS
    tensors = {n: t.clone() for n, t in map_weights(wfile).tensors.items()}
    name = "model.layers.0.self_attn.q_a_proj.weight"
    if change == "shape":
        tensors[name] = tensors[name][:-1].contiguous()
    elif change == "dtype":
        tensors[name] = tensors[name].to(torch.bfloat16)
    else:
        del tensors[name]
    save_file(tensors, str(wfile))
    monkeypatch.setenv("DSA_VERIFY_ENGINE", "off")
    with pytest.raises(EngineDirError, match=r"rank0\.weights\.safetensors: 1 tensor\(s\) do not match the compiled "
                                             r"program: " + shown):
        Engine.load(engine)


def test_missing_weights_file(engine, monkeypatch):
    (engine / WEIGHTS).unlink()
    with pytest.raises(EngineDirError, match=r"missing rank0\.weights\.safetensors"):
        Engine.load(engine)


def test_draft_weights_file_errors_name_it(engine, monkeypatch):
    """The MTP draft program's weights file (rank0.mtp.weights.safetensors) is checked like the main
    one: missing, truncated, or without a tensor its program wants, each error names it."""
    dfile = engine / DRAFT_WEIGHTS
    data = dfile.read_bytes()
    dfile.write_bytes(data[: len(data) - 1000])
    with pytest.raises(EngineDirError, match=r"rank0\.mtp\.weights\.safetensors: .*(bytes but manifest\.json "
                                             r"recorded|does not match manifest)"):
        Engine.load(engine)
    monkeypatch.setenv("DSA_VERIFY_ENGINE", "off")
    with pytest.raises(EngineDirError, match=r"rank0\.mtp\.weights\.safetensors: .*the file is truncated"):
        Engine.load(engine)
    dfile.write_bytes(data)
    tensors = {n: t.clone() for n, t in map_weights(dfile).tensors.items()}
    name = next(n for n in tensors if n.endswith("self_attn.q_a_layernorm.weight"))
    del tensors[name]
    save_file(tensors, str(dfile))
    with pytest.raises(EngineDirError, match=r"rank0\.mtp\.weights\.safetensors: 1 tensor\(s\) do not match the "
                                             r"compiled program: " + re.escape(name) + ": missing"):
        Engine.load(engine)
    Engine.load(engine, draft=False)  # the main program alone does not read it
    dfile.unlink()
    with pytest.raises(EngineDirError, match=r"missing rank0\.mtp\.weights\.safetensors"):
        Engine.load(engine)
