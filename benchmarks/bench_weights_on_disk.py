"""AOTInductor with the weights outside the compiled program (issue 25 item 3; a prototype).

    python benchmarks/bench_weights_on_disk.py [--checkpoint DIR] [--work DIR]

Builds the tiny CPU network, exports its sparse program once and compiles it three ways:

* ``in-so``        the builder's package today: every constant inside the wrapper .so;
* ``binary-blob``  ``package_constants_in_so=False`` + ``package_constants_on_disk_format=
                   "binary_blob"``: the weights ride in the .pt2 as one blob beside the .so;
* ``external``     ``package_constants_in_so=False`` alone: the package holds no weights; the
                   rank's weights go to ``rank0.weights.safetensors`` and are handed to the loaded
                   program with ``load_constants(..., check_full_update=True, user_managed=True)``
                   as tensors that view a private (copy-on-write) mmap of that file: no copy.

Each is loaded, run on the same step with fresh pools, and its logits compared bitwise with the
``in-so`` package. Printed: compile seconds, package size, weight-file size, whether the external
tensors really alias the file mapping, and the bitwise verdict.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import struct
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsa_trt.builder.aoti import LIBSTDCXX, _library_path, check_package, loaded_libstdcxx
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network, example_step, export_program
from dsa_trt.plugins.pools import allocate_pools

VARIANTS = {
    "in-so": {},
    "binary-blob": {"aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": "binary_blob"},
    "external": {"aot_inductor.package_constants_in_so": False},
}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def compile_variant(ep, path: Path, configs: dict) -> float:
    configs = dict(configs)
    lib = loaded_libstdcxx()
    if lib is not None:  # as builder/aoti.py: link the shared C++ runtime the process uses
        configs["aot_inductor.custom_op_libs"] = [":" + LIBSTDCXX]
    t0 = time.perf_counter()
    with _library_path(lib.parent if lib is not None else None):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)
    seconds = time.perf_counter() - t0
    check_package(path)
    return seconds


def program_constants(ep) -> dict[str, torch.Tensor]:
    """Everything the compiled program may ask for by FQN: parameters, buffers, lifted constants."""
    out = {k: v.detach() for k, v in ep.state_dict.items()}
    out.update({k: v.detach() for k, v in ep.constants.items() if isinstance(v, torch.Tensor)})
    return out


class WeightFileError(ValueError):
    pass


def map_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """The file's tensors as views of one private mmap (MAP_PRIVATE: pages are read from the file
    on first touch and never copied unless written). Keep the mmap alive as long as the tensors."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        (n,) = struct.unpack_from("<Q", mm, 0)
        header = json.loads(mm[8:8 + n])
    except (struct.error, ValueError) as e:
        raise WeightFileError(f"{path}: not a safetensors file ({e}); rebuild the engine") from e
    header.pop("__metadata__", None)
    base = 8 + n
    end_of_data = base + max((m["data_offsets"][1] for m in header.values()), default=0)
    if end_of_data != len(mm):
        raise WeightFileError(f"{path}: {len(mm)} bytes but its header describes {end_of_data}: "
                              "truncated or corrupted; rebuild the engine")
    tensors = {}
    for name, meta in header.items():
        dtype = SAFETENSORS_DTYPES[meta["dtype"]]
        begin, end = meta["data_offsets"]
        count = (end - begin) // dtype.itemsize
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + begin) if count else torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(meta["shape"])
    return tensors, mm


def check_weights(mapped: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """AOTI's load_constants checks neither shape nor dtype (a short tensor is taken as is) and only
    warns about a missing buffer: the runtime has to check the file against the program itself."""
    problems = [f"{k}: missing" for k in expected if k not in mapped]
    problems += [f"{k}: {tuple(t.shape)} {t.dtype} in the file, the program wants "
                 f"{tuple(expected[k].shape)} {expected[k].dtype}"
                 for k, t in mapped.items() if k in expected and (t.shape != expected[k].shape
                                                                  or t.dtype != expected[k].dtype)]
    if problems:
        raise WeightFileError(f"weights do not match the program: {'; '.join(problems[:3])}")


def aliases_mapping(tensors: dict[str, torch.Tensor], mm: mmap.mmap) -> bool:
    lo = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    hi = lo + len(mm)
    return all(lo <= t.data_ptr() < hi for t in tensors.values() if t.numel())


def run(program, cfg, step) -> torch.Tensor:
    mla, idx = allocate_pools(cfg, "fp32", 8)  # fresh zero pools: the cache writes mutate them
    with torch.no_grad():
        return program(*step.as_tuple(), mla, idx)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: write the tiny one into --work")
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="weights-on-disk-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt_dir = a.checkpoint
    if ckpt_dir is None:
        from dsa_trt.export.tiny_checkpoint import write_tiny_checkpoint

        ckpt_dir = write_tiny_checkpoint(work / "tiny-v32")
    net = build_network(Checkpoint(ckpt_dir), cache_mode="fp32", dtype=torch.float32)
    cfg = net.cfg
    ep = export_program(net)
    step = example_step(cfg)
    reference = None
    print(f"torch {torch.__version__}; {cfg.num_hidden_layers}-layer network, "
          f"{sum(t.numel() * t.element_size() for t in program_constants(ep).values()) / 2**20:.1f} MiB of constants")
    print(f"{'variant':<12} {'compile s':>9} {'package MiB':>11} {'weights MiB':>11}  loaded how / logits vs in-so")
    for name, configs in VARIANTS.items():
        pkg = work / f"rank0.{name}.pt2"
        try:
            seconds = compile_variant(ep, pkg, configs)
            program = torch._inductor.aoti_load_package(str(pkg))
        except Exception as e:  # noqa: BLE001 - a variant torch cannot do is a result, not a crash
            print(f"{name:<12} UNSUPPORTED: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        how, weights_mib, keep = "constants from the package", 0.0, None
        if name == "external":
            fqns = program.get_constant_fqns()
            constants = program_constants(ep)
            missing = [f for f in fqns if f not in constants]
            if missing:
                print(f"{name:<12} {seconds:>9.1f}  FQNs the program asks for that the export lacks: {missing[:4]}")
                continue
            wfile = work / "rank0.weights.safetensors"
            save_file({f: constants[f].contiguous() for f in fqns}, str(wfile))
            weights_mib = wfile.stat().st_size / 2**20
            mapped, mm = map_safetensors(wfile)
            check_weights(mapped, {f: constants[f] for f in fqns})
            program.load_constants(mapped, check_full_update=True, user_managed=True)
            keep = (mapped, mm)  # user_managed: the program holds raw pointers into the mapping
            how = (f"{len(fqns)} constants from {wfile.name}, "
                   f"{'zero-copy (they alias the mmap)' if aliases_mapping(mapped, mm) else 'COPIED'}")
        logits = run(program, cfg, step)
        if reference is None:
            reference, verdict = logits, "reference"
        else:
            diff = (logits - reference).abs().max().item()
            verdict = "bitwise equal" if torch.equal(logits, reference) else f"DIFFERS (max |d| {diff:.3g})"
        print(f"{name:<12} {seconds:>9.1f} {pkg.stat().st_size / 2**20:>11.2f} {weights_mib:>11.2f}  {how}; {verdict}")
        del keep
    print(f"work dir {work}")
    show_bad_files(work / "rank0.weights.safetensors", program_constants(ep))


def show_bad_files(wfile: Path, constants: dict[str, torch.Tensor]) -> None:
    """A truncated file and a file of another program must fail with a message, before AOTI sees them."""
    if not wfile.is_file():
        return
    data = wfile.read_bytes()
    cut = wfile.with_name("truncated.safetensors")
    cut.write_bytes(data[: len(data) - 1000])
    try:
        map_safetensors(cut)
        print("truncated file: NOT detected")
    except WeightFileError as e:
        print(f"truncated file: {e}")
    mapped, _mm = map_safetensors(wfile)
    constants = {k: constants[k] for k in mapped}  # what the program asked for (get_constant_fqns)
    name = next(k for k, t in mapped.items() if t.dim() == 2)
    mapped[name] = mapped[name][:-1]
    try:
        check_weights(mapped, constants)
        print("wrong shape: NOT detected")
    except WeightFileError as e:
        print(f"wrong shape: {e}")


if __name__ == "__main__":
    main()
