"""One decode step of a CUDA AOTInductor engine through build/dsa_step (no Python) vs Engine.forward.

    python benchmarks/step_runner_check.py ENGINE_DIR [--runner build/dsa_step] [--batch 4] [--context 200]

Builds nothing (`make kernels torch-ops step-runner` first). Prefills `batch` random prompts of
`context` tokens with the runtime (so the caches are not zero), makes the next decode step
(StepInputs.build), saves its inputs and the pools, runs the C++ runner on them, runs
Engine.forward on the same inputs and pools, and prints the largest logits difference. Both run
the same compiled program and kernels on the same device, so it must be 0 (or bf16 noise); exit
status 1 otherwise. GPU only.
"""

from __future__ import annotations

import argparse
import random
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.engine import Engine
from dsa_trt.runtime.step_inputs import StepInputs

ROOT = Path(__file__).resolve().parents[1]
MAGIC = b"DSATENS1"
# c10::ScalarType codes of the dtypes a step uses (runtime/cpp/dsa_step.cpp reads them)
DTYPE_CODES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
               torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15, torch.float8_e4m3fn: 24}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def write_dsat(path: Path, tensors: list[torch.Tensor]) -> None:
    """The .dsat format of runtime/cpp/dsa_step.cpp: magic, count, then (dtype, ndim, dims, nbytes, bytes)."""
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<q", len(tensors)))
        for t in tensors:
            c = t.detach().cpu().contiguous()
            raw = c.reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(struct.pack(f"<qq{c.dim()}qq", DTYPE_CODES[c.dtype], c.dim(), *c.shape, len(raw)))
            f.write(raw)


def read_dsat(path: Path) -> list[torch.Tensor]:
    data = path.read_bytes()
    if data[:8] != MAGIC:
        raise ValueError(f"{path}: not a .dsat file")
    (count,), off, out = struct.unpack_from("<q", data, 8), 16, []
    for _ in range(count):
        code, ndim = struct.unpack_from("<qq", data, off)
        dims = struct.unpack_from(f"<{ndim}q", data, off + 16)
        (nbytes,) = struct.unpack_from("<q", data, off + 16 + 8 * ndim)
        off += 24 + 8 * ndim
        buf = (torch.frombuffer(bytearray(data[off:off + nbytes]), dtype=torch.uint8) if nbytes
               else torch.empty(0, dtype=torch.uint8))
        out.append(buf.view(CODE_DTYPES[code]).reshape(dims))
        off += nbytes
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", type=Path, help="a CUDA AOTInductor engine directory (tp 1)")
    ap.add_argument("--runner", type=Path, default=ROOT / "build" / "dsa_step", help="the C++ runner (make step-runner)")
    ap.add_argument("--batch", type=int, default=4, help="decode sequences (default 4)")
    ap.add_argument("--context", type=int, default=200, help="prefilled tokens per sequence (default 200)")
    ap.add_argument("--iters", type=int, default=20, help="timed runner iterations (default 20)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_runner_check: needs a CUDA GPU")
    if not a.runner.is_file():
        sys.exit(f"step_runner_check: {a.runner} missing: build it with `make kernels torch-ops step-runner`")
    engine = Engine.load(a.engine)
    cfg = engine.config
    if cfg.compiler != "aoti" or cfg.device != "cuda" or cfg.tp_size != 1:
        sys.exit(f"step_runner_check: {a.engine} is {cfg.compiler}/{cfg.device}/tp{cfg.tp_size}; needs aoti/cuda/tp1")
    rng = random.Random(0)
    pages_per_seq = -(-(a.context + 1) // 64)
    num_pages = a.batch * pages_per_seq + 4
    pools = allocate_pools(cfg.model, cfg.cache_mode, num_pages, device="cuda")
    pages = rng.sample(range(num_pages), a.batch * pages_per_seq)
    seq_pages = [pages[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(a.batch)]
    prompts = [[rng.randrange(2, cfg.model.vocab_size) for _ in range(a.context)] for _ in range(a.batch)]
    prefill = StepInputs.build([(p, 0, pg) for p, pg in zip(prompts, seq_pages)], device="cuda")
    first = engine.forward(prefill, *pools).argmax(-1).tolist()
    step = StepInputs.build([([t], a.context, pg) for t, pg in zip(first, seq_pages)],
                            device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        inputs, logits_path = Path(tmp) / "inputs.dsat", Path(tmp) / "logits.dsat"
        write_dsat(inputs, [*step.as_tuple(), *pools[0], *pools[1]])  # the caches before the step
        want = engine.forward(step, *pools).float().cpu()
        package = a.engine / cfg.rank_file(0)
        run = subprocess.run([str(a.runner), str(package), str(inputs), str(logits_path), "--iters", str(a.iters)],
                             capture_output=True, text=True, timeout=600)
        print(run.stdout.strip())
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
            return 1
        (got,) = read_dsat(logits_path)
    if got.shape != want.shape:
        print(f"step_runner_check: runner logits {tuple(got.shape)} != Engine.forward's {tuple(want.shape)}")
        return 1
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    ok = diff <= 2.0**-8 * scale  # 0 expected (same program, kernels, device); bf16 rounding at most
    print(f"step_runner_check: batch {a.batch}, context {a.context}: logits {tuple(want.shape)}, max |C++ - Python| "
          f"{diff:.3g} (max |logit| {scale:.3g}): {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
