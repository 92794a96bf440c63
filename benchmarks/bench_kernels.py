"""All kernel benchmarks of issue 3 in one run: the indexer logits + top-k tables, the sparse-MLA
table, then the whole DSA decode layer. Each prints its markdown table (µs, TFLOP/s, TB/s, % of
the H200 roofline, the peer anchor); see benchmarks/RESULTS.md for the method.

    python benchmarks/bench_kernels.py [--iters 15]
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ("bench_indexer_topk.py", "bench_sparse_mla.py", "bench_dsa_decode.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=15)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA GPU (Hopper, sm_90a) and `make kernels`; none is visible here")
    sys.path.insert(0, str(HERE))  # the scripts import timing.py beside them
    for script in SCRIPTS:
        print(f"\n## {script}\n", flush=True)
        sys.argv = [script] + (["--iters", str(a.iters)] if script != "bench_dsa_decode.py" else [])
        runpy.run_path(str(HERE / script), run_name="__main__")


if __name__ == "__main__":
    main()
