"""`make engine`: checkpoint -> calibrate -> export -> compile, one engine per rank (DESIGN §2).

    python -m dsa_trt.builder.build --checkpoint DIR --out ENGINE_DIR [--tp 1] [--cache fp8]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from dsa_trt.calibration.kv_scale import KV_RECIPE, kv_amax_per_layer, kv_scales_from_amax
from dsa_trt.config import ConfigError
from dsa_trt.engine_config import EngineConfig
from dsa_trt.export.checkpoint import Checkpoint, CheckpointError
from dsa_trt.export.program import build_network, export_program
from dsa_trt.runtime.tokenizer import Tokenizer

DEFAULT_CALIB_TEXT = Path(__file__).resolve().parent.parent / "export" / "data" / "corpus.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class BuildError(RuntimeError):
    pass


def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


def calibration_sequences(tok: Tokenizer, text: str, seq_len: int = 256, max_seqs: int = 8) -> list[list[int]]:
    ids = tok.encode(text, add_bos=False)
    if len(ids) < 16:
        raise BuildError(f"calibration text has only {len(ids)} tokens; give a longer --calib-file")
    seqs = [[tok.bos_token_id or 0] + ids[i : i + seq_len - 1] for i in range(0, len(ids), seq_len - 1)]
    return [s for s in seqs if len(s) > 8][:max_seqs]


def calibrate(ckpt: Checkpoint, calib_text: str, device: str) -> list[float]:
    net = build_network(ckpt, cache_mode="fp32", dtype=torch.float32, device=device)
    tok = Tokenizer(ckpt.tokenizer_path, ckpt.config.bos_token_id, ckpt.config.eos_token_id)
    return kv_scales_from_amax(kv_amax_per_layer(net, calibration_sequences(tok, calib_text)))


def resolve_compiler(name: str) -> str:
    has_trt = importlib.util.find_spec("tensorrt") is not None
    if name == "auto":
        return "tensorrt" if has_trt else "aoti"
    if name == "tensorrt" and not has_trt:
        raise BuildError("--compiler tensorrt: `import tensorrt` fails on this machine; use --compiler aoti")
    return name


def build_engine(checkpoint: str | Path, out: str | Path, tp: int = 1, cache_mode: str = "fp8",
                 compiler: str = "auto", device: str | None = None, dtype: str | None = None,
                 calib_file: str | Path | None = None, max_num_tokens: int = 8192) -> EngineConfig:
    t0 = time.perf_counter()
    out = Path(out)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    compiler = resolve_compiler(compiler)
    if compiler != "aoti":
        raise BuildError(f"compiler {compiler!r} is not wired into this builder yet; use --compiler aoti")
    if tp != 1:
        raise BuildError(f"--tp {tp}: only tp=1 is built by this version")
    if device == "cuda":
        from dsa_trt.plugins import cuda_ops

        cuda_ops.load()

    ckpt = Checkpoint(checkpoint)
    cfg = ckpt.config
    _log(f"checkpoint {checkpoint}: {cfg.model_type}, {cfg.num_hidden_layers} layers, validated", t0)

    kv_scales = [1.0] * cfg.num_hidden_layers
    out.mkdir(parents=True, exist_ok=True)
    if cache_mode == "fp8":
        text = Path(calib_file or DEFAULT_CALIB_TEXT).read_text(encoding="utf-8")
        kv_scales = calibrate(ckpt, text, device)
        (out / "quant").mkdir(exist_ok=True)
        (out / "quant" / f"{KV_RECIPE}.json").write_text(
            json.dumps({"recipe": KV_RECIPE, "kv_scales": kv_scales}, indent=2) + "\n"
        )
        _log(f"calibrated per-layer MLA cache scales: {[f'{s:.3g}' for s in kv_scales]}", t0)

    torch_dtype = getattr(torch, dtype)
    cfg_out = EngineConfig(
        model=cfg, cache_mode=cache_mode, dtype=dtype, device=device, compiler=compiler, tp_size=tp,
        max_num_tokens=max_num_tokens, kv_scales=kv_scales, quant_recipe=KV_RECIPE if cache_mode == "fp8" else None,
        versions={"torch": torch.__version__, "python": sys.version.split()[0]},
    )
    for rank in range(tp):
        for dense in (False, True):
            net = build_network(ckpt, cache_mode, torch_dtype, kv_scales, dense_prefill=dense, device=device)
            ep = export_program(net, max_num_tokens=max_num_tokens, device=device)
            name = cfg_out.rank_file(rank, dense=dense)
            _log(f"rank {rank}: exported {'dense-prefill' if dense else 'sparse'} program; compiling {name}", t0)
            torch._inductor.aoti_compile_and_package(ep, package_path=str(out / name))
            del net, ep
    for f in TOKENIZER_FILES:
        src = Path(checkpoint) / f
        if src.is_file():
            shutil.copy(src, out / f)
    cfg_out.save(out)
    sizes = sum(p.stat().st_size for p in out.glob("rank*"))
    bpt = cfg_out.cache_bytes_per_token
    _log(
        f"engine -> {out}: {tp} rank(s), {compiler} on {device}, {sizes / 2**20:.1f} MiB of programs, "
        f"cache {bpt} B/token ({cache_mode}), {2**30 // bpt:,} tokens per GiB of cache",
        t0,
    )
    return cfg_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsa-trt build", description=__doc__)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cache", choices=("fp8", "bf16", "fp32"), default="fp8")
    ap.add_argument("--compiler", choices=("auto", "aoti", "tensorrt"), default="auto")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--calib-file", default=None)
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    a = ap.parse_args(argv)
    try:
        build_engine(a.checkpoint, a.out, a.tp, a.cache, a.compiler, a.device, a.dtype, a.calib_file, a.max_num_tokens)
    except (BuildError, CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
