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
from .layers import hadamard_matrix
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
) -> DSAForCausalLM:
    """Rank ``tp_rank``'s network with the checkpoint's weights (fp8 blocks dequantised, then sliced
    by export/sharding.py), in eval mode. ``progress`` wraps the loop over the tensors."""
    cfg = ckpt.config
    with torch.device("meta"):
        net = DSAForCausalLM(cfg, cache_mode=cache_mode, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)
    state = {}
    items = list(net.state_dict().items())
    for name, param in progress(items) if progress else items:
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
