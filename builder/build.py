"""`make engine`: checkpoint -> calibrate -> export -> compile, one engine per rank (DESIGN §2).

    python -m dsa_trt.builder.build --checkpoint DIR --out ENGINE_DIR [--tp 1] [--cache fp8]

Calibration (fp8 cache) runs ModelOpt fp8 PTQ once on the full network (the MLA latent is
replicated across ranks, so every rank gets the same per-layer scales) and writes
quant/fp8-kv-per-layer.json. With --tp N every rank's network is sliced from the checkpoint at
export time (export/sharding.py) and exported and compiled into rank<r>.* files.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dsa_trt.calibration.kv_scale import KV_RECIPE, token_sequences
from dsa_trt.calibration.modelopt_kv import CalibrationError, KVCalibration, calibrate_kv_cache
from dsa_trt.config import ConfigError
from dsa_trt.engine_config import EngineConfig
from dsa_trt.export.checkpoint import Checkpoint, CheckpointError
from dsa_trt.export.program import build_network, export_program
from dsa_trt.export.sharding import check_tp
from dsa_trt.runtime.tokenizer import Tokenizer

DEFAULT_CALIB_TEXT = Path(__file__).resolve().parent.parent / "export" / "data" / "corpus.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class BuildError(RuntimeError):
    pass


def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


def _bar(desc: str, **kw) -> functools.partial:
    """A tqdm progress wrapper for an iterable (stderr; the log lines above stay on stdout)."""
    return functools.partial(tqdm, desc=f"{desc:<22}", dynamic_ncols=True, file=sys.stderr, **kw)


def calibration_sequences(tok: Tokenizer, text: str) -> list[list[int]]:
    try:
        return token_sequences(tok.encode(text, add_bos=False), tok.bos_token_id)
    except ValueError as e:
        raise BuildError(str(e)) from e


def calibrate(ckpt: Checkpoint, calib_text: str, device: str, calib_source: str = "") -> KVCalibration:
    """ModelOpt fp8 PTQ of the per-layer MLA-cache scale on the full (TP=1) network, fp32 caches."""
    net = build_network(ckpt, cache_mode="fp32", dtype=torch.float32, device=device, progress=_bar("load (calibration)"))
    tok = Tokenizer(ckpt.tokenizer_path, ckpt.config.bos_token_id, ckpt.config.eos_token_id)
    seqs = calibration_sequences(tok, calib_text)
    return calibrate_kv_cache(net, seqs, progress=_bar("calibrate (ModelOpt)"), calib_source=calib_source)


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
    if device == "cuda":
        from dsa_trt.plugins import cuda_ops

        cuda_ops.load()

    ckpt = Checkpoint(checkpoint)
    cfg = ckpt.config
    check_tp(cfg, tp)
    _log(f"checkpoint {checkpoint}: {cfg.model_type}, {cfg.num_hidden_layers} layers, validated", t0)

    kv_scales = [1.0] * cfg.num_hidden_layers
    out.mkdir(parents=True, exist_ok=True)
    if cache_mode == "fp8":
        calib_path = Path(calib_file or DEFAULT_CALIB_TEXT)
        cal = calibrate(ckpt, calib_path.read_text(encoding="utf-8"), device, calib_source=calib_path.name)
        kv_scales = cal.kv_scales
        artifact = cal.save(out / "quant")
        _log(f"ModelOpt {cal.modelopt_version} calibrated {cal.num_tokens} tokens -> {artifact.relative_to(out)}: "
             f"MLA cache scales {[f'{s:.3g}' for s in kv_scales]}", t0)

    torch_dtype = getattr(torch, dtype)
    cfg_out = EngineConfig(
        model=cfg, cache_mode=cache_mode, dtype=dtype, device=device, compiler=compiler, tp_size=tp,
        max_num_tokens=max_num_tokens, kv_scales=kv_scales, quant_recipe=KV_RECIPE if cache_mode == "fp8" else None,
        versions={"torch": torch.__version__, "python": sys.version.split()[0]},
    )
    for rank in range(tp):
        # one load per rank; the sparse and dense-prefill programs differ only in net.dense_prefill
        net = build_network(ckpt, cache_mode, torch_dtype, kv_scales, device=device, tp_rank=rank, tp_size=tp,
                            progress=_bar(f"load rank {rank}/{tp}", unit="tensor"))
        bar = tqdm(total=4, desc=f"{f'export+compile rank {rank}':<22}", unit="step", dynamic_ncols=True,
                   file=sys.stderr)
        for dense in (False, True):
            net.dense_prefill = dense
            kind = "dense-prefill" if dense else "sparse"
            bar.set_postfix_str(f"export {kind}")
            ep = export_program(net, max_num_tokens=max_num_tokens, device=device)
            bar.update()
            name = cfg_out.rank_file(rank, dense=dense)
            bar.set_postfix_str(f"compile {name}")
            torch._inductor.aoti_compile_and_package(ep, package_path=str(out / name))
            bar.update()
            del ep
        bar.close()
        del net
    for f in TOKENIZER_FILES:
        src = Path(checkpoint) / f
        if src.is_file():
            shutil.copy(src, out / f)
    cfg_out.save(out)
    _log(f"engine -> {out}", t0)
    print(build_summary(out, cfg_out), flush=True)
    return cfg_out


def build_summary(out: Path, cfg: EngineConfig) -> str:
    """The closing table: ranks and their program sizes, cache bytes per token, tokens per GiB."""
    bpt = cfg.cache_bytes_per_token
    lines = [f"  engine      {out}  ({cfg.model.model_type}, {cfg.compiler} on {cfg.device}, {cfg.dtype}, "
             f"cache {cfg.cache_mode})"]
    for rank in range(cfg.tp_size):
        files = [cfg.rank_file(rank), cfg.rank_file(rank, dense=True)]
        sizes = [(out / f).stat().st_size / 2**20 for f in files if (out / f).is_file()]
        lines.append(f"  rank {rank:<6} {' + '.join(f'{f} {s:.1f} MiB' for f, s in zip(files, sizes))}")
    lines.append(f"  cache       {bpt:,} B/token on every rank ({cfg.model.num_hidden_layers} layers x "
                 f"{bpt // cfg.model.num_hidden_layers} B: MLA latent + indexer key, replicated across ranks)")
    lines.append(f"  capacity    {2**30 // bpt:,} tokens per GiB of cache memory per rank")
    if cfg.quant_recipe:
        lines.append(f"  quant       quant/{cfg.quant_recipe}.json (scales {', '.join(f'{s:.3g}' for s in cfg.kv_scales)})")
    return "build summary\n" + "\n".join(lines)


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
    except (BuildError, CalibrationError, CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
