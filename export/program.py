"""Checkpoint -> our network -> torch.export program (docs/architecture.md §2).

``build_network`` loads the (dequantised) checkpoint weights into DSAForCausalLM under their HF
names; ``export_program`` traces one step with dynamic token count, batch, pages and pool size.
The same ExportedProgram feeds AOTInductor (here) and the ONNX/TensorRT path (builder).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.export import ExportedProgram, export

from dsa_trt.config import ModelConfig
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import StepInputs, dynamic_shapes, export_dims

from .checkpoint import Checkpoint
from .layers import StackedExperts, hadamard_matrix
from .network import DSAForCausalLM
from .sharding import shard_tensor

Progress = Callable[[Iterable], Iterable]  # e.g. functools.partial(tqdm, desc="load")


def build_network(
    ckpt: Checkpoint,
    cache_mode: str,
    dtype: torch.dtype,
    kv_scales: list[float] | None = None,
    device: str | torch.device = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    progress: Progress | None = None,
    expert_op: bool = False,
    fp8_linears: bool = False,
    network_cls: Callable[..., DSAForCausalLM] = DSAForCausalLM,
) -> DSAForCausalLM:
    """Rank ``tp_rank``'s network with the checkpoint's weights (fp8 blocks dequantised, then sliced
    by export/sharding.py), in eval mode. ``progress`` wraps the loop over the tensors.

    ``expert_op``: each MoE layer's routed experts are one dsa::moe_experts call on this rank's
    experts stacked as stored (Checkpoint.stacked_experts: e4m3 + scales for fp8 checkpoints, never
    dequantised; bf16 otherwise); bf16 networks only. ``fp8_linears``: the fp8-block checkpoint's
    e4m3 Linears (but kv_b) stay e4m3 with their ``weight_scale_inv`` (W8A8); tp_size 1.
    ``network_cls``: a DSAForCausalLM subclass taking the same arguments (export/parallel.py's
    expert- and context-parallel network)."""
    cfg = ckpt.config
    with torch.device("meta"):
        net = network_cls(cfg, cache_mode=cache_mode, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
                          expert_op=expert_op, fp8_linears=fp8_linears)
    state = {}
    stacked = {}  # layer -> its StackedExperts buffers by name
    items = list(net.state_dict().items())
    for name, param in progress(items) if progress else items:
        parts = name.split(".")
        if expert_op and ".mlp.stacked_experts." in name:  # model.layers.L.mlp.stacked_experts.<buffer>
            layer = int(parts[2])
            if layer not in stacked:
                moe = net.model.layers[layer].mlp
                stacked[layer] = dict(zip(StackedExperts.BUFFERS,
                                          ckpt.stacked_experts(layer, moe.expert_lo, moe.expert_hi), strict=True))
            t = stacked[layer][parts[-1]]
            if t is None or t.dtype != param.dtype:
                raise ValueError(f"{name}: the checkpoint's stacked experts are {None if t is None else t.dtype}, "
                                 f"the network expects {param.dtype}")
            if t.shape != param.shape:
                raise ValueError(f"{name}: stacked experts {tuple(t.shape)}, the network expects {tuple(param.shape)}")
            state[name] = t.to(device)
            continue
        if param.dtype == torch.float8_e4m3fn or name.endswith(".weight_scale_inv"):  # Fp8Linear, as stored
            t = ckpt.raw(name)
            if t.dtype != param.dtype:
                raise ValueError(f"{name}: the checkpoint stores {t.dtype}, the fp8 network expects {param.dtype}")
        else:
            t = shard_tensor(name, ckpt.get(name, dtype=param.dtype), tp_rank, tp_size)
        if t.shape != param.shape:
            raise ValueError(f"{name}: rank {tp_rank}/{tp_size} shard has shape {tuple(t.shape)}, "
                             f"the network expects {tuple(param.shape)}")
        state[name] = t.to(device)
    net.load_state_dict(state, strict=True, assign=True)
    # non-persistent buffers were created on meta: rebuild them on the target device
    net.inv_freq = cfg.rope_inv_freq().to(device)
    for layer in net.model.layers:
        layer.self_attn.indexer.hadamard = hadamard_matrix(cfg.index_head_dim).to(device)
    if kv_scales is not None:
        net.set_kv_scales(kv_scales)
    return net.eval()


def example_step(cfg: ModelConfig, device="cpu") -> StepInputs:
    """A small two-sequence step that exercises every branch while tracing."""
    n = 24
    # two pages per sequence so the page-table width is not specialised to 1 while tracing
    seqs = [(list(range(2, 2 + n)), 0, [1, 3]), (list(range(3, 3 + n // 2 + 1)), 0, [2, 0])]
    return StepInputs.build(seqs, device=device)


def export_program(net: DSAForCausalLM, max_num_tokens: int = 8192, max_batch: int = 256,
                   max_pages_per_seq: int = 4096, device="cpu") -> ExportedProgram:
    cfg = net.cfg
    step = example_step(cfg, device)
    mla, idx = allocate_pools(cfg, net.cache_mode, 4, device=device)
    # dims and their bounds come from the step contract (dsa_trt/step.py): one symbol per name
    dims = export_dims(max_num_tokens=max_num_tokens, max_batch=max_batch, max_pages_per_seq=max_pages_per_seq)
    with torch.no_grad():
        return export(net, step.as_tuple() + (mla, idx),
                      dynamic_shapes=dynamic_shapes(dims, cfg.num_hidden_layers))
