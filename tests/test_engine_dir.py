"""Engine directories check themselves: manifest.json (written by the builder) holds the size and
sha256 of every file and the engine_config.json the compiled programs were built from; Engine.load
refuses a flipped block, swapped programs or an edited config with an error naming the file or field.

Real engine (the session's CPU fp8 build, tests/conftest.py), copied per test and then corrupted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dsa_trt.engine_config import (ENGINE_CONFIG_NAME, MANIFEST_NAME, EngineConfig, EngineDirError, config_sha256,
                                   file_sha256, verify_engine_files)
from dsa_trt.runtime import knobs
from dsa_trt.runtime.engine import Engine

pytestmark = pytest.mark.slow

FLIP_BYTES = 4096


@pytest.fixture
def engine(fp8_engine, tmp_path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(fp8_engine, dst)
    return dst


def edit_config(engine: Path, **changes) -> None:
    path = engine / ENGINE_CONFIG_NAME
    d = json.loads(path.read_text())
    for key, value in changes.items():
        if key in d["model"]:
            d["model"][key] = value
        else:
            d[key] = value
    path.write_text(json.dumps(d, indent=2))


def test_manifest_records_every_file_and_the_config(fp8_engine):
    manifest = json.loads((fp8_engine / MANIFEST_NAME).read_text())
    on_disk = sorted(p.relative_to(fp8_engine).as_posix() for p in fp8_engine.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [n for n in on_disk if n not in (MANIFEST_NAME, ENGINE_CONFIG_NAME)]
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == file_sha256(fp8_engine / name), name
        assert entry["size"] == (fp8_engine / name).stat().st_size
    raw = json.loads((fp8_engine / ENGINE_CONFIG_NAME).read_text())
    assert manifest["built_with"] == raw and manifest["config_sha256"] == config_sha256(raw)
    cfg = EngineConfig.load(fp8_engine)
    programs = {n for n, e in manifest["files"].items() if "built_from" in e}
    assert programs == set(cfg.rank_files(0))  # the program, its weights file, its MTP draft program
    assert {manifest["files"][p]["built_from"] for p in programs} == {manifest["config_sha256"]}
    verify_engine_files(fp8_engine, cfg, mode="full")  # the intact engine passes


def test_bit_flip_in_program_is_an_error_naming_the_file(engine):
    path = engine / "rank0.pt2"
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid: mid + FLIP_BYTES] = bytes(b ^ 0xFF for b in data[mid: mid + FLIP_BYTES])
    path.write_bytes(bytes(data))
    with pytest.raises(EngineDirError, match=r"rank0\.pt2: sha256 .* content changed since the build"):
        Engine.load(engine)
    # size mode does not hash (it cannot see this flip), but it still catches a truncated file
    verify_engine_files(engine, EngineConfig.load(engine), mode="size")
    path.write_bytes(bytes(data[: -FLIP_BYTES]))
    with pytest.raises(EngineDirError, match=r"rank0\.pt2: [\d,]+ bytes but manifest\.json recorded"):
        verify_engine_files(engine, EngineConfig.load(engine), mode="size")


def test_a_program_of_another_engine_is_an_error_naming_it(engine, exact_engine):
    shutil.copy(exact_engine / "rank0.pt2", engine / "rank0.pt2")  # swapped between two engine dirs
    with pytest.raises(EngineDirError, match=r"rank0\.pt2: .*(manifest\.json recorded|does not match manifest)"):
        Engine.load(engine)


def test_swapped_files_are_an_error_naming_both(engine):
    a, b = engine / "tokenizer.json", engine / "tokenizer_config.json"
    if not b.is_file():
        pytest.skip("the tiny checkpoint ships no tokenizer_config.json")
    shutil.copy(a, b)  # same bytes under another name: the hash names the file it really holds
    with pytest.raises(EngineDirError, match=r"tokenizer_config\.json: .*(recorded|records for tokenizer\.json)"):
        Engine.load(engine)


@pytest.mark.parametrize("field, value, shown", [
    ("index_topk", 1234, "model.index_topk is 1234 but the programs were built with"),
    ("cache_mode", "bf16", "cache_mode is 'bf16' but the programs were built with 'fp8'"),
])
def test_edited_config_is_an_error_naming_the_field(engine, field, value, shown):
    edit_config(engine, **{field: value})
    with pytest.raises(EngineDirError, match=shown):
        EngineConfig.load(engine)  # also what write_model_repository and the CLI read: no hashing needed
    with pytest.raises(EngineDirError, match=shown):
        Engine.load(engine)


def test_verify_knob(engine, monkeypatch):
    edit_config(engine, max_batch=7)  # harmless to the programs, but not the config they were built from
    monkeypatch.setenv("DSA_VERIFY_ENGINE", "off")
    assert EngineConfig.load(engine).max_batch == 7
    monkeypatch.setenv("DSA_VERIFY_ENGINE", "sometimes")
    with pytest.raises(EngineDirError, match="DSA_VERIFY_ENGINE='sometimes' must be one of full, size, off"):
        EngineConfig.load(engine)
    with pytest.raises(knobs.KnobError, match="DSA_VERIFY_ENGINE='sometimes' must be one of full, size, off"):
        knobs.validate_environment()


def test_missing_manifest_warns(engine):
    (engine / MANIFEST_NAME).unlink()
    with pytest.warns(RuntimeWarning, match="no manifest.json"):
        verify_engine_files(engine, EngineConfig.load(engine))
    (engine / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(EngineDirError, match="manifest.json: unreadable manifest"):
        EngineConfig.load(engine)
