"""`make engine`: checkpoint -> calibrate -> export -> compile, one engine per rank (docs/architecture.md §2).

    python -m dsa_trt.builder.build --checkpoint DIR --out ENGINE_DIR [--tp 1 | --ep P --cp P] [--cache fp8]

Calibration (fp8 cache) runs ModelOpt fp8 PTQ once on the full network (the MLA latent is
replicated across ranks, so every rank gets the same per-layer scales) and writes
quant/fp8-kv-per-layer.json. With --tp N every rank's network is sliced from the checkpoint at
export time (export/sharding.py) and exported and compiled into rank<r>.* files. With --ep P
and/or --cp P the P rank programs of one expert- / context-parallel group (export/parallel.py)
are: attention and caches whole on every rank, routed experts split over the ranks (--ep), each
step's tokens interleaved over them (--cp). Expert parallelism is built with context
parallelism only (--ep P --cp P); such engines have no MTP draft program (--no-mtp implied).
"""

from __future__ import annotations

import argparse
import contextlib
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
from dsa_trt.engine_config import EngineConfig, parallel_problems, write_manifest
from dsa_trt.export.checkpoint import Checkpoint, CheckpointError
from dsa_trt.export.parallel import ParallelConfig
from dsa_trt.export.program import build_network, export_program, network_skeleton
from dsa_trt.export.sharding import check_tp
from dsa_trt.plan import check_fits
from dsa_trt.tokenizer import Tokenizer

from dsa_trt.weights_file import WeightsFileError, weights_file_name

from .aoti import PackageLinkError
from .weights import PeakRSS, build_draft_rank, build_rank

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
    net = build_network(ckpt, cache_mode="fp32", dtype=torch.float32, device=device,
                        progress=_bar("load (calibration)", unit="tensor"))
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


def check_onnx_options(compiler: str, emit_onnx: bool, cache_mode: str, device: str, dtype: str, tp: int) -> None:
    """What the ONNX/TensorRT path supports (the plugin contract, plugins/tensorrt/PLUGINS.md)."""
    if compiler != "tensorrt" and not emit_onnx:
        return
    what = "--compiler tensorrt" if compiler == "tensorrt" else "--emit-onnx"
    if cache_mode not in ("fp8", "bf16"):
        raise BuildError(f"{what}: the TensorRT plugins hold fp8 or bf16 caches, not {cache_mode}; "
                         "use --cache fp8|bf16")
    if compiler == "tensorrt":
        if device != "cuda" or dtype != "bfloat16":
            raise BuildError(f"--compiler tensorrt builds bfloat16 plans for CUDA, not {dtype} on {device}")
        if tp != 1:
            raise BuildError("--compiler tensorrt: the plugin library has no all-reduce plugin yet; "
                             "tensor-parallel engines use --compiler aoti (--emit-onnx still writes their ONNX)")


def compile_onnx_program(onnx_ep, out: Path, name: str, compiler: str, profile, plugin_lib) -> None:
    """One exported program -> onnx/<name>.onnx (+ the TensorRT plan ``name`` with --compiler tensorrt)."""
    from .onnx_export import OnnxExportError, export_onnx
    from .tensorrt_build import TensorRTBuildError, build_plan

    try:
        onnx_path = export_onnx(onnx_ep, out / "onnx" / Path(name).with_suffix(".onnx").name)
        if compiler == "tensorrt":
            build_plan(onnx_path, out / name, plugin_lib, profile)
    except (OnnxExportError, TensorRTBuildError) as e:
        raise BuildError(f"{name}: {e}") from e


def compile_draft_program(ckpt: Checkpoint, cfg: EngineConfig, out: Path, rank: int, device: str,
                          dtype: torch.dtype, emit_onnx: bool, profile, plugin_lib,
                          expert_op: bool | None = None) -> None:
    """The MTP layer of rank ``rank`` -> its draft program ``rank<r>.mtp.*`` (export/mtp.py), with
    the engine's weight format: AOTInductor streamed like the main program, its weights in
    rank<r>.mtp.weights.safetensors but for the embedding and head it shares with the main program
    (builder/weights.py build_draft_rank); the ONNX / TensorRT graph with its weights inside.
    Returns the AOTInductor build's numbers ({} without one).

    Its MLA cache scale is the largest main-layer scale: the layer is not calibrated on its own. A
    scale only changes draft quality, never the output (speculative decoding verifies every token)."""
    from dsa_trt.export.mtp import build_mtp_network, export_mtp_program

    kv_scale = max(cfg.kv_scales)
    options = {"expert_op": expert_op, "weight_format": cfg.weight_format}
    name, stats = cfg.draft_file(rank), {}
    if cfg.compiler == "aoti":
        try:
            stats = build_draft_rank(ckpt, out, rank, name, cache_mode=cfg.cache_mode, dtype=dtype,
                                     kv_scale=kv_scale, device=device, tp_size=cfg.tp_size,
                                     max_num_tokens=cfg.max_num_tokens,
                                     progress=_bar(f"MTP weights rank {rank}", unit="tensor"), **options)
        except (PackageLinkError, WeightsFileError) as e:
            raise BuildError(str(e)) from e
    if cfg.compiler == "tensorrt" or emit_onnx:  # the ONNX is always the TensorRT graph: bf16, weights inside
        onnx_ep = export_mtp_program(build_mtp_network(ckpt, cfg.cache_mode, torch.bfloat16, kv_scale, device=device,
                                                       tp_rank=rank, tp_size=cfg.tp_size, **options),
                                     max_num_tokens=cfg.max_num_tokens, device=device)
        compile_onnx_program(onnx_ep, out, name, cfg.compiler, profile, plugin_lib)
    return stats


def build_engine(checkpoint: str | Path, out: str | Path, tp: int = 1, cache_mode: str = "fp8",
                 compiler: str = "auto", device: str | None = None, dtype: str | None = None,
                 calib_file: str | Path | None = None, max_num_tokens: int = 8192,
                 emit_onnx: bool = False, kv_calibration: str | Path | None = None,
                 gpu_memory_gb: float | None = None, expert_op: bool | None = None,
                 weight_format: str = "auto", mtp: bool = True, ep: int = 1, cp: int = 1,
                 ep_capacity: int | None = None) -> EngineConfig:
    """``weight_format`` ("auto" | "fp8" | "dequant"; export/layers.py resolve_weight_format) and
    ``expert_op`` (None: on for bf16): build_network's options, for every program of the engine.
    ``mtp``: also compile the checkpoint's MTP layer as the draft program rank<r>.mtp.* (when it
    has one). ``ep`` / ``cp`` / ``ep_capacity``: an expert- / context-parallel group
    (export/parallel.py)."""
    t0 = time.perf_counter()
    out = Path(out)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    parallel = ep * cp > 1
    compiler = "aoti" if parallel and compiler == "auto" else resolve_compiler(compiler)
    check_onnx_options(compiler, emit_onnx, cache_mode, device, dtype, tp)
    if parallel and (compiler != "aoti" or emit_onnx):
        raise BuildError(f"--ep {ep} --cp {cp}: expert / context-parallel engines are built with --compiler aoti "
                         "only (the TensorRT plugin library has no all-gather / all-to-all plugin); drop "
                         f"{'--emit-onnx' if emit_onnx else '--compiler ' + compiler}")
    if parallel and mtp:
        # the context-parallel network returns only the logits rows (the draft program needs every
        # token's hidden state, gathered), and a draft program replicated on every rank would hold
        # a whole MoE layer per rank: parallel engines decode without speculation
        _log(f"--ep {ep} --cp {cp}: no MTP draft program for expert / context-parallel engines (--no-mtp implied)", t0)
        mtp = False
    if device == "cuda":
        from dsa_trt.plugins import cuda_ops

        try:  # a CUDA build traces and calibrates through the kernels: they must serve this mode
            cuda_ops.check_engine(device, cache_mode, dtype, what=f"--device cuda --cache {cache_mode} --dtype {dtype}")
        except RuntimeError as e:
            raise BuildError(str(e)) from e

    ckpt = Checkpoint(checkpoint, include_mtp=mtp)
    cfg = ckpt.config
    mtp_layers = min(1, cfg.num_nextn_predict_layers) if mtp else 0  # one draft layer, reused recurrently
    check_tp(cfg, tp)
    if problems := parallel_problems(cfg, tp, ep, cp, ep_capacity, max_num_tokens):
        raise BuildError("; ".join(problems))
    world = max(tp, ep, cp)
    try:  # before any compile: a garbage tokenizer.json would only fail when the engine serves
        Tokenizer(ckpt.tokenizer_path, cfg.bos_token_id, cfg.eos_token_id)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions
        raise BuildError(f"{ckpt.tokenizer_path}: not a readable tokenizer.json ({e}); copy it again from the "
                         "original model repository") from None
    if gpu_memory_gb is not None:  # refuse before any work a layout whose ranks cannot hold weights + a step's cache
        plan = check_fits(cfg, tp, ep if parallel else tp, gpu_memory_gb, cp=cp, cache_mode=cache_mode,
                          min_cache_tokens=max_num_tokens, include_mtp=bool(mtp_layers))
        _log(f"plan fits: {plan.ranks[0].weight_bytes / 1e9:.1f} GB of weights per rank, "
             f"{plan.tokens_per_group:,} cache tokens in {gpu_memory_gb:g} GB", t0)
    _log(f"checkpoint {checkpoint}: {cfg.model_type}, {cfg.num_hidden_layers} layers, validated", t0)
    torch_dtype = getattr(torch, dtype)
    weight_format, dequantised = resolve_weights(ckpt, cache_mode, torch_dtype, tp, expert_op, weight_format,
                                                 bool(mtp_layers))

    kv_scales = [1.0] * cfg.num_hidden_layers
    out.mkdir(parents=True, exist_ok=True)
    if cache_mode == "fp8":
        if kv_calibration is not None:  # calibrated once (any machine with ModelOpt), reused here
            cal = KVCalibration.load(kv_calibration, cfg.num_hidden_layers)
            how = f"reused {kv_calibration} (ModelOpt {cal.modelopt_version}, {cal.num_tokens} tokens)"
        else:
            calib_path = Path(calib_file or DEFAULT_CALIB_TEXT)
            # calibration runs the exact fp32 mode, which no CUDA kernel serves: the references, explicitly
            with cuda_ops.reference_ops() if device == "cuda" else contextlib.nullcontext():
                cal = calibrate(ckpt, calib_path.read_text(encoding="utf-8"), device, calib_source=calib_path.name)
            how = f"ModelOpt {cal.modelopt_version} calibrated {cal.num_tokens} tokens"
        kv_scales = cal.kv_scales
        artifact = cal.save(out / "quant")
        _log(f"{how} -> {artifact.relative_to(out)}: MLA cache scales {[f'{s:.3g}' for s in kv_scales]}", t0)

    cfg_out = EngineConfig(
        model=cfg, cache_mode=cache_mode, dtype=dtype, device=device, compiler=compiler, tp_size=tp,
        ep_size=ep, cp_size=cp, ep_capacity=ep_capacity, max_num_tokens=max_num_tokens, kv_scales=kv_scales,
        quant_recipe=KV_RECIPE if cache_mode == "fp8" else None,
        versions={"torch": torch.__version__, "python": sys.version.split()[0]}, mtp_layers=mtp_layers,
        weight_format=weight_format,
    )
    profile = plugin_lib = None
    rank_stats: list[dict] = []
    if compiler == "tensorrt":
        from .tensorrt_build import Profile, install_plugin_library

        cfg_out.plugin_library = install_plugin_library(out)
        plugin_lib = out / cfg_out.plugin_library
        profile = Profile.from_limits(cfg_out.max_num_tokens, cfg_out.max_batch, cfg_out.max_pages_per_seq)
    net_options = {"expert_op": expert_op, "weight_format": weight_format}
    if compiler == "aoti":
        cfg_out.weights = "safetensors"  # rank<N>.weights.safetensors beside each program (dsa_trt/weights_file.py)
    for rank in range(world):
        name = cfg_out.rank_file(rank)
        group = ParallelConfig(world, rank, ep > 1, cp > 1, ep_capacity) if parallel else None
        with PeakRSS() as rss:
            stats = {}
            if compiler == "aoti":  # streamed: a tensor at a time into the weights file, then export + compile
                _log(f"rank {rank}: streaming weights -> {weights_file_name(rank)}, export, compile {name}", t0)
                try:
                    stats = build_rank(ckpt, out, rank, name, cache_mode=cache_mode, dtype=torch_dtype,
                                       kv_scales=kv_scales, device=device, tp_size=tp, max_num_tokens=max_num_tokens,
                                       return_hidden=bool(mtp_layers), parallel=group,
                                       progress=_bar(f"weights rank {rank}/{world}", unit="tensor"), **net_options)
                except (PackageLinkError, WeightsFileError) as e:
                    raise BuildError(str(e)) from e
            if compiler == "tensorrt" or emit_onnx:
                # the ONNX is always the TensorRT graph: bf16 activations, weights inside the graph
                onnx_net = build_network(ckpt, cache_mode, torch.bfloat16, kv_scales, device=device, tp_rank=rank,
                                         tp_size=tp, progress=_bar(f"load rank {rank}/{tp} (onnx)", unit="tensor"),
                                         **net_options)
                onnx_net.return_hidden = bool(mtp_layers)  # the draft program's input
                onnx_ep = export_program(onnx_net, max_num_tokens=max_num_tokens, device=device)
                del onnx_net
                compile_onnx_program(onnx_ep, out, name, compiler, profile, plugin_lib)
                del onnx_ep
        stats.update(peak_rss=rss.peak, start_rss=rss.start)
        rank_stats.append(stats)
        _log(f"rank {rank}: peak RSS {rss.peak / 2**30:.2f} GiB (from {rss.start / 2**30:.2f} GiB)", t0)
        if mtp_layers:
            stats["draft"] = compile_draft_program(ckpt, cfg_out, out, rank, device, torch_dtype, emit_onnx, profile,
                                                   plugin_lib, expert_op)
    for f in TOKENIZER_FILES:
        src = Path(checkpoint) / f
        if src.is_file():
            shutil.copy(src, out / f)
    cfg_out.save(out)
    write_manifest(out, cfg_out)  # last: the sha256 of every file and the config the programs were built from
    _log(f"engine -> {out}", t0)
    print(build_summary(out, cfg_out, rank_stats, dequantised), flush=True)
    return cfg_out


def resolve_weights(ckpt: Checkpoint, cache_mode: str, dtype: torch.dtype, tp: int, expert_op: bool | None,
                    weight_format: str, with_mtp: bool) -> tuple[str, list[str]]:
    """(the engine's weight format, the e4m3 Linears it dequantises: tensor-parallel slices off the
    128-block grid), from rank 0's skeletons (every rank's slices have the same widths). A weight
    format the checkpoint, dtype or tp cannot take is a BuildError naming the fix."""
    try:
        net = network_skeleton(ckpt, cache_mode, dtype, 0, tp, expert_op, weight_format)
        names = list(net.dequantised_linears)
        if with_mtp:
            from dsa_trt.export.mtp import MTPDraft

            with torch.device("meta"):
                names += MTPDraft(ckpt.config, cache_mode, dtype, 0, tp, expert_op, weight_format).dequantised_linears
    except ValueError as e:
        raise BuildError(str(e)) from None
    return net.weight_format, names


def _layer_patterns(names: list[str]) -> str:
    """model.layers.1.mlp.x, model.layers.2.mlp.x -> model.layers.{1,2}.mlp.x (the summary's short form)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        if n.startswith("model.layers.") and len(parts) > 3:
            groups.setdefault(".".join(["model.layers.*"] + parts[3:]), []).append(parts[2])
        else:
            groups.setdefault(n, [])
    return ", ".join(k.replace("*", "{" + ",".join(v) + "}") if v else k for k, v in groups.items())


def weights_summary(cfg: EngineConfig, dequantised: list[str] | None = None) -> list[str]:
    if cfg.weight_format == "fp8":
        what = "fp8: the checkpoint's e4m3 Linears (but kv_b) and routed experts kept with their 128x128 scales (W8A8)"
    elif cfg.model.fp8_weight_block is not None:
        what = f"dequant: the checkpoint's e4m3 weights dequantised to {cfg.dtype}"
    else:
        what = f"dequant: a bf16 checkpoint, {cfg.dtype} weights"
    lines = [f"  weights     {what}"]
    if dequantised:
        lines.append(f"  dequantised {len(dequantised)} e4m3 linear(s) whose tp={cfg.tp_size} slice is off the "
                     f"128-block grid: {_layer_patterns(dequantised)}")
    return lines


def build_summary(out: Path, cfg: EngineConfig, rank_stats: list[dict] | None = None,
                  dequantised: list[str] | None = None) -> str:
    """The closing table: ranks with their program and weight sizes and the build's peak host
    memory, the weight format, cache bytes per token, tokens per GiB."""
    bpt = cfg.cache_bytes_per_token
    lines = [f"  engine      {out}  ({cfg.model.model_type}, {cfg.compiler} on {cfg.device}, {cfg.dtype}, "
             f"cache {cfg.cache_mode}, weights {cfg.weight_format}, {cfg.layout})"]
    for rank in range(cfg.world_size):
        name = cfg.rank_file(rank)
        line = f"  rank {rank:<6} {name} {(out / name).stat().st_size / 2**20:.1f} MiB"
        if (w := cfg.rank_weights_file(rank)) is not None:
            line += f" + {w} {(out / w).stat().st_size / 2**20:.1f} MiB"
        if rank_stats and "peak_rss" in rank_stats[rank]:
            st = rank_stats[rank]
            line += f"; peak RSS {st['peak_rss'] / 2**20:,.0f} MiB (start {st['start_rss'] / 2**20:,.0f} MiB"
            if "largest_layer_bytes" in st:
                line += f", largest layer {st['largest_layer_bytes'] / 2**20:,.0f} MiB"
            line += ")"
        lines.append(line)
        if cfg.mtp_layers:
            d = cfg.draft_file(rank)
            line = f"  rank {rank:<6} {d} {(out / d).stat().st_size / 2**20:.1f} MiB"
            if (w := cfg.draft_weights_file(rank)) is not None:
                line += f" + {w} {(out / w).stat().st_size / 2**20:.1f} MiB"
            shared = (rank_stats[rank].get("draft") or {}).get("shared") if rank_stats else None
            line += " (MTP draft" + (f"; {', '.join(shared)} shared with the main program" if shared else "") + ")"
            lines.append(line)
    lines += weights_summary(cfg, dequantised)
    lines.append(f"  cache       {bpt:,} B/token on every rank ({cfg.model.num_hidden_layers} layers x "
                 f"{bpt // cfg.model.num_hidden_layers} B: MLA latent + indexer key, replicated across ranks)")
    lines.append(f"  capacity    {2**30 // bpt:,} tokens per GiB of cache memory per rank")
    if cfg.quant_recipe:
        lines.append(f"  quant       quant/{cfg.quant_recipe}.json (scales {', '.join(f'{s:.3g}' for s in cfg.kv_scales)})")
    return "build summary\n" + "\n".join(lines)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each flag's default (unless its help states it, or it has none) and keeps the
    description's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "default" in text:
            return text
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsa-trt build", description=__doc__, formatter_class=_HelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="Hugging Face checkpoint directory (DeepSeek-V3.2 / GLM-5 layout), e.g. checkpoints/tiny-v32")
    ap.add_argument("--out", required=True, help="engine directory to write (created; rank<N>.* files, engine.json)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: one engine per rank")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel ranks: routed experts split over P ranks and exchanged (needs --cp P too)")
    ap.add_argument("--cp", type=int, default=1,
                    help="context-parallel ranks: each step's tokens interleaved over P ranks, caches whole on each")
    ap.add_argument("--ep-capacity", type=int, default=None,
                    help="with --ep: (token, expert) pairs one rank may send to one rank per step, a static bound "
                         "(default: the step's worst case, which never overflows)")
    ap.add_argument("--cache", choices=("fp8", "bf16", "fp32"), default="fp8",
                    help="KV cache format: fp8 (deployed, calibrated), bf16, or fp32 (the exact oracle mode)")
    ap.add_argument("--compiler", choices=("auto", "aoti", "tensorrt"), default="auto",
                    help="auto: tensorrt when `import tensorrt` works, else aoti (AOTInductor); aoti for --ep/--cp")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="device the engine runs on (default: cuda when a GPU is visible, else cpu)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="activation dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--weight-format", choices=("auto", "fp8", "dequant"), default="auto",
                    help="how an fp8-block checkpoint's e4m3 weights live in the engine: fp8 (kept with their "
                         "scales, W8A8 linears; bf16 only), dequant (dequantised to --dtype), or auto (default: "
                         "fp8 for an fp8 checkpoint at bfloat16, dequant for float32 and for bf16 checkpoints)")
    ap.add_argument("--calib-file", default=None, help="text to calibrate the fp8 caches on (default: export/data/corpus.txt)")
    ap.add_argument("--kv-calibration", default=None,
                    help="reuse quant/fp8-kv-per-layer.json of an earlier fp8 build instead of calibrating (no ModelOpt needed)")
    ap.add_argument("--max-num-tokens", type=int, default=8192,
                    help="most tokens one step may hold (the exported programs' dynamic-shape bound)")
    ap.add_argument("--emit-onnx", action="store_true",
                    help="also write onnx/rank<N>.onnx: the TensorRT graphs with plugin nodes (any machine)")
    ap.add_argument("--no-mtp", action="store_true",
                    help="do not compile the checkpoint's MTP layer as the draft program (no speculative decoding)")
    ap.add_argument("--gpu-memory-gb", type=float, default=None,
                    help="refuse a --tp whose ranks cannot hold their weights and one step of cache (dsa-trt plan)")
    a = ap.parse_args(argv)
    try:
        build_engine(a.checkpoint, a.out, a.tp, a.cache, a.compiler, a.device, a.dtype, a.calib_file, a.max_num_tokens,
                     emit_onnx=a.emit_onnx, kv_calibration=a.kv_calibration, gpu_memory_gb=a.gpu_memory_gb,
                     weight_format=a.weight_format, mtp=not a.no_mtp, ep=a.ep, cp=a.cp,
                     ep_capacity=a.ep_capacity)
    except (BuildError, CalibrationError, CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
