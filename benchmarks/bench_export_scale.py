"""torch.export of the real-size network on fake weights: graph nodes per layer and export time.

    python benchmarks/bench_export_scale.py [--layers L] [--config CONFIG_JSON] [--tp N]

Builds rank 0's DSAForCausalLM for the real DeepSeek-V3.2 config (tests/data, spec/MODEL.md §1.1;
61 layers unless --layers) with every parameter a FakeTensor (shapes and dtypes, no storage: the
671B model costs no memory), exports it exactly as the builder does
(``dsa_trt.export.program.export_program``) and counts the nodes of the exported graph. The MTP
layer is counted when the network has one (a child module named ``*mtp*``). The MoE layers run
their routed experts as one dsa::moe_experts node and an fp8-block config keeps its Linears e4m3
(the builder's defaults for a bf16 network: expert op on, weight format auto). Issue 25's targets on the 2-core
machine: <= 200 nodes per layer and <= 180 s for 61 layers (export_program drops the no-op nodes
export leaves and merges repeated pure calls: export/program.py drop_noop_nodes).

The last line is the result:
    export: L layers, N graph nodes, N/L nodes per layer, S s
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dsa_trt.config import ModelConfig
from dsa_trt.export.network import DSAForCausalLM
from dsa_trt.export.program import export_program

REAL_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepseek_v32_config.json"
TOP_OPS = 8  # the most frequent ops, printed to see what a layer is made of


def fake_network(cfg: ModelConfig, cache_mode: str, tp: int) -> DSAForCausalLM:
    """Rank 0's network with FakeTensor parameters and buffers (meta-like, but on the CPU device
    the example inputs live on, so fake-tensor device propagation accepts the mix). The MoE layers'
    routed experts are one dsa::moe_experts node each; an fp8-block config keeps its Linears e4m3
    (W8A8, sliced on the 128-block grid under tp), as the builder does for such a checkpoint."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        net = DSAForCausalLM(cfg, cache_mode=cache_mode, dtype=torch.bfloat16,
                             tp_rank=0, tp_size=tp, expert_op=True, weight_format="auto")
    return net.eval()


def count_layers(net: DSAForCausalLM) -> tuple[int, int]:
    """(decoder layers, MTP layers) the network holds."""
    mtp = sum(len(m) if isinstance(m, torch.nn.ModuleList) else 1
              for name, m in net.named_children() if "mtp" in name.lower())
    return len(net.model.layers), mtp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REAL_CONFIG, help="a config.json (default: the real V3.2)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (first_k_dense_replace stays)")
    ap.add_argument("--tp", type=int, default=1, help="export rank 0 of a tensor-parallel engine")
    ap.add_argument("--cache", choices=("fp8", "bf16"), default="fp8")
    a = ap.parse_args(argv)
    d = ModelConfig.from_json(a.config).to_dict()
    if a.layers is not None:
        if a.layers < 1:
            ap.error(f"--layers {a.layers} must be >= 1")
        d["num_hidden_layers"] = a.layers
    cfg = ModelConfig.from_dict(d)
    moe = sum(cfg.is_moe_layer)
    print(f"config {a.config.name}: {cfg.num_hidden_layers} layers ({cfg.num_hidden_layers - moe} dense, {moe} MoE), "
          f"{cfg.n_routed_experts} experts, hidden {cfg.hidden_size}; tp={a.tp}, cache {a.cache}; "
          f"torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)

    t0 = time.perf_counter()
    net = fake_network(cfg, a.cache, a.tp)
    layers, mtp = count_layers(net)
    print(f"network on fake weights: {layers} decoder layers, "
          f"{f'{mtp} MTP layers' if mtp else 'no MTP layer (the network does not export one)'}, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    t1, c1 = time.perf_counter(), time.process_time()
    ep = export_program(net)
    seconds, cpu_seconds = time.perf_counter() - t1, time.process_time() - c1
    nodes = list(ep.graph.nodes)
    ops = collections.Counter(str(n.target) for n in nodes if n.op == "call_function")
    print(f"top ops: {', '.join(f'{op} {k}' for op, k in ops.most_common(TOP_OPS))}")
    # on a shared machine the wall time measures the neighbours too; the CPU time is the export's own
    print(f"export CPU time {cpu_seconds:.1f} s ({cpu_seconds / seconds:.0%} of the wall time; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    total_layers = layers + mtp
    print(f"export: {total_layers} layers, {len(nodes)} graph nodes, {len(nodes) / total_layers:.0f} nodes per layer, "
          f"{seconds:.1f} s")


if __name__ == "__main__":
    main()
