"""One rank's AOTInductor program with its weights outside it, built as a stream (docs/architecture.md §2).

    skeleton (meta) -> rank<r>.weights.safetensors, a tensor at a time -> the net on views of that
    file's mapping -> torch.export -> AOTInductor without constants -> check the program's table

Host memory: the checkpoint is read one tensor at a time (one layer's stacked experts at a time)
and each is written out before the next is read, so at most the largest layer's tensors (plus
their dequantised fp32 form) are in memory; the network then holds views of a private mapping of
the file, and neither torch.export (fake tensors) nor AOTInductor with
``package_constants_in_so=False`` reads the weights' data, so those pages stay on disk. What is
left is a fixed overhead: the interpreter with torch and Inductor loaded, and the traced graph.
:class:`PeakRSS` measures it all, and the build summary prints it.
"""

from __future__ import annotations

import functools
import os
import resource
import threading
import time
from pathlib import Path

import torch

from dsa_trt.checkpoint_layout import mtp_shared_copies
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.network import DSAForCausalLM
from dsa_trt.export.parallel import ParallelConfig, ParallelDSAForCausalLM, export_parallel_program
from dsa_trt.export.program import (Progress, checkpoint_tensors, derived_buffers, export_program, network_skeleton,
                                    set_tensor)
from dsa_trt.weights_file import (ConstantSpec, WeightsFileError, WeightsWriter, check_against_table, constant_table,
                                  map_weights, weights_file_name)

from .aoti import compile_package

RSS_SAMPLE_S = 0.02  # the sampler's period: a peak shorter than this can be missed (ru_maxrss cannot)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident set size of this process while the ``with`` block runs, sampled by a thread.

    ``ru_maxrss`` is the lifetime peak (an earlier phase would hide this one), so a thread reads
    /proc/self/statm every RSS_SAMPLE_S; ``lifetime`` is ru_maxrss at exit, for reference."""

    def __init__(self) -> None:
        self.peak = self.start = self.lifetime = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def network_specs(net: torch.nn.Module) -> dict[str, ConstantSpec]:
    """Every tensor the network holds (parameters, persistent and derived buffers) by FQN."""
    tensors = dict(net.named_parameters())
    tensors.update(net.named_buffers())
    return {n: ConstantSpec(t.dtype, tuple(t.shape)) for n, t in tensors.items()}


def _group(name: str) -> str:
    """model.layers.3.mlp.gate.weight -> model.layers.3; the tensors outside the layers: themselves."""
    return ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name


def _buffers_as_parameters(net: torch.nn.Module) -> None:
    """Persistent buffers (Fp8Linear's e4m3 weight and scales, the stacked experts) become frozen
    Parameters, same names: AOTInductor clones every buffer the program takes (in case the program
    mutates it) but not parameters, and a clone of each would put the rank's weights in memory."""
    for mod in net.modules():
        for key in [k for k in mod._buffers if k not in mod._non_persistent_buffers_set]:
            mod._parameters[key] = torch.nn.Parameter(mod._buffers.pop(key), requires_grad=False)


def largest_layer_bytes(specs: dict[str, ConstantSpec]) -> int:
    """Bytes of the largest group the stream holds at once: one decoder layer's tensors, or one of
    the tensors outside the layers (the embedding, the head)."""
    groups: dict[str, int] = {}
    for name, s in specs.items():
        groups[_group(name)] = groups.get(_group(name), 0) + s.nbytes()
    return max(groups.values(), default=0)


def build_rank(ckpt: Checkpoint, out: Path, rank: int, package_name: str, *, cache_mode: str, dtype: torch.dtype,
               kv_scales: list[float], device: str, tp_size: int, max_num_tokens: int,
               expert_op: bool | None = None, weight_format: str = "auto", return_hidden: bool = False,
               progress: Progress | None = None, parallel: ParallelConfig | None = None) -> dict:
    """Write ``out/rank<r>.weights.safetensors`` and ``out/<package_name>`` (no constants inside).
    Returns the numbers the build summary prints. ``expert_op`` / ``weight_format``: build_network's.

    ``parallel``: rank ``parallel.rank`` of an expert / context-parallel group (export/parallel.py;
    ``tp_size`` 1). It streams like a TP rank: its skeleton holds only its own routed experts, so
    the stream reads and writes only those, and every other tensor whole."""
    tp_rank, export, cls = rank, export_program, DSAForCausalLM
    if parallel is not None:
        if parallel.rank != rank or tp_size != 1:
            raise ValueError(f"build_rank: rank {rank} / tp_size {tp_size} with {parallel}")
        tp_rank, export = 0, export_parallel_program  # nothing is sliced by tp
        cls = functools.partial(ParallelDSAForCausalLM, parallel=parallel)
    net = network_skeleton(ckpt, cache_mode, dtype, tp_rank, tp_size, expert_op, weight_format, network_cls=cls)
    net.return_hidden = return_hidden  # the MTP draft program's input (export/mtp.py)
    return _stream_and_compile(ckpt, net, out / weights_file_name(rank), out / package_name, tp_rank, tp_size,
                               lambda n: n.set_kv_scales(kv_scales),
                               lambda n: export(n, max_num_tokens=max_num_tokens, device=device), device, progress)


def build_draft_rank(ckpt: Checkpoint, out: Path, rank: int, package_name: str, *, cache_mode: str,
                     dtype: torch.dtype, kv_scale: float, device: str, tp_size: int, max_num_tokens: int,
                     expert_op: bool | None = None, weight_format: str = "auto",
                     progress: Progress | None = None) -> dict:
    """The MTP draft program of rank ``rank`` as build_rank builds the main one: its weights streamed
    into ``out/rank<r>.mtp.weights.safetensors``, ``out/<package_name>`` without constants. The MTP
    layer's embedding and head are the checkpoint's copies of the main ones (spec §5): when they are
    equal to the main tensors they are not written again, and the runtime hands the draft program
    the main program's (rank<r>.weights.safetensors, written first). Returns build_rank's numbers
    and ``shared`` (the draft's tensor names taken from the main program's weights)."""
    from dsa_trt.export.mtp import MTPDraft, export_mtp_program

    with torch.device("meta"):
        net = MTPDraft(ckpt.config, cache_mode, dtype, rank, tp_size, expert_op, weight_format)
    main = map_weights(out / weights_file_name(rank))
    skeleton, shared = net.state_dict(), {}
    for name, main_name in mtp_shared_copies(ckpt.config).items():
        mine, theirs = skeleton.get(name), main.tensors.get(main_name)
        if mine is None or theirs is None or (mine.dtype, mine.shape) != (theirs.dtype, theirs.shape):
            continue
        if torch.equal(ckpt.raw(name), ckpt.raw(main_name)):  # the stored copies, bit for bit
            shared[name] = theirs
        ckpt.close()  # two stored tensors at a time in memory at most
    stats = _stream_and_compile(ckpt, net, out / weights_file_name(rank, draft=True), out / package_name, rank,
                                tp_size, lambda n: n.set_kv_scale(kv_scale),
                                lambda n: export_mtp_program(n, max_num_tokens=max_num_tokens, device=device),
                                device, progress, shared)
    return {**stats, "shared": sorted(shared)}


def _stream_and_compile(ckpt: Checkpoint, net: torch.nn.Module, wpath: Path, package: Path, tp_rank: int,
                        tp_size: int, set_scales, export, device: str, progress: Progress | None,
                        shared: dict[str, torch.Tensor] | None = None) -> dict:
    """The stream of build_rank for a skeleton ``net``: its checkpoint tensors (rank ``tp_rank``'s
    slices) and derived buffers into ``wpath`` a tensor at a time, then ``net`` on views of that
    file's mapping (and on ``shared``: tensors of another file, not written here), ``set_scales(net)``,
    ``export(net)``, AOTInductor without constants at ``package``, checked against the file."""
    t0 = time.perf_counter()
    shared = shared or {}
    specs = {n: s for n, s in network_specs(net).items() if n not in shared}
    derived = derived_buffers(net)
    with WeightsWriter(wpath, specs) as writer:
        group = None
        for name, t in checkpoint_tensors(ckpt, net, tp_rank, tp_size, progress, skip=shared.keys()):
            if group is not None and _group(name) != group:
                ckpt.close()  # unmap the shards: their pages would stay resident for the whole build
            group = _group(name)
            writer.put(name, t)
            del t
        ckpt.close()
        for name, t in derived.items():
            writer.put(name, t)
    t_write = time.perf_counter() - t0
    mapped = map_weights(wpath)
    tensors = {**mapped.tensors, **shared}
    if device != "cpu":  # the export traces on the target device: one H2D copy per tensor
        tensors = {n: t.to(device) for n, t in tensors.items()}
    net.load_state_dict({n: tensors[n] for n in net.state_dict()}, strict=True, assign=True)
    for name in derived:
        set_tensor(net, name, tensors[name])
    _buffers_as_parameters(net)
    set_scales(net)
    net.eval()
    ep = export(net)
    t_export = time.perf_counter() - t0 - t_write
    compile_package(ep, package, external_weights=True)
    del ep, net
    table = constant_table(package)
    try:
        check_against_table(wpath, {**mapped.tensors, **shared}, table)
    except WeightsFileError as e:  # the export lifted a tensor the network does not hold, or Inductor changed one
        raise WeightsFileError(f"the compiled program does not take the weights written for it: {e}") from None
    return {"weights_bytes": wpath.stat().st_size, "constants": len(table), "tensors": len(specs) + len(shared),
            "largest_layer_bytes": largest_layer_bytes(specs), "write_s": t_write, "export_s": t_export,
            "compile_s": time.perf_counter() - t0 - t_write - t_export}
