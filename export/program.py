"""Checkpoint -> our network -> torch.export program (docs/architecture.md §2).

``build_network`` loads the checkpoint weights (e4m3 kept or dequantised: its weight_format) into DSAForCausalLM under their HF
names; ``export_program`` traces one step with dynamic token count, batch, pages and pool size.
The same ExportedProgram feeds AOTInductor (here) and the ONNX/TensorRT path (builder).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
from torch.export import ExportedProgram, export

from dsa_trt.config import ModelConfig
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import StepInputs, dynamic_shapes, export_dims

from .checkpoint import Checkpoint
from .layers import FusedFp8Linear, StackedExperts, hadamard_buffers
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
    expert_op: bool | None = None,
    weight_format: str = "auto",
    network_cls: Callable[..., DSAForCausalLM] = DSAForCausalLM,
) -> DSAForCausalLM:
    """Rank ``tp_rank``'s network with the checkpoint's weights (sliced by export/sharding.py), in
    eval mode. ``progress`` wraps the loop over the tensors.

    ``weight_format`` (export/layers.py resolve_weight_format): "fp8" keeps the fp8-block
    checkpoint's e4m3 Linears (but kv_b) e4m3 with their ``weight_scale_inv`` (W8A8) and its
    routed experts stacked as stored; "dequant" dequantises them; "auto" (the default): "fp8" for
    an fp8-block checkpoint in a bf16 network, else "dequant". ``expert_op``: each MoE layer's
    routed experts are one dsa::moe_experts call on this rank's experts (Checkpoint.stacked_experts);
    None: on for bf16 networks. ``network_cls``: a DSAForCausalLM subclass taking the same
    arguments (export/parallel.py's expert- and context-parallel network)."""
    net = network_skeleton(ckpt, cache_mode, dtype, tp_rank, tp_size, expert_op, weight_format, network_cls)
    state = {name: t.to(device) for name, t in checkpoint_tensors(ckpt, net, tp_rank, tp_size, progress)}
    net.load_state_dict(state, strict=True, assign=True)
    # non-persistent buffers were created on meta: rebuild them on the target device
    for name, t in derived_buffers(net).items():
        set_tensor(net, name, t.to(device))
    if kv_scales is not None:
        net.set_kv_scales(kv_scales)
    return net.eval()


def network_skeleton(ckpt: Checkpoint, cache_mode: str, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                     expert_op: bool | None = None, weight_format: str = "auto",
                     network_cls: Callable[..., DSAForCausalLM] = DSAForCausalLM) -> DSAForCausalLM:
    """Rank ``tp_rank``'s network on the meta device: every tensor's name, dtype and shape, no data."""
    with torch.device("meta"):
        return network_cls(ckpt.config, cache_mode=cache_mode, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
                           expert_op=expert_op, weight_format=weight_format)


def derived_buffers(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The non-persistent buffers (computed from the config, not stored in the checkpoint), on the
    CPU: of a DSAForCausalLM or an MTP draft network (export/mtp.py; its one layer keyed by its index)."""
    out = {"inv_freq": net.cfg.rope_inv_freq()}
    for i, _ in net.model.layers.named_children():
        for name, t in hadamard_buffers(net.cfg.index_head_dim).items():
            out[f"model.layers.{i}.self_attn.indexer.{name}"] = t
    return out


def set_tensor(net: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """Replace the buffer ``name`` (dotted) of ``net`` by ``t``."""
    owner, _, leaf = name.rpartition(".")
    net.get_submodule(owner)._buffers[leaf] = t


def checkpoint_tensors(ckpt: Checkpoint, net: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1,
                       progress: Progress | None = None, skip=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every persistent tensor of ``net`` (a skeleton: DSAForCausalLM or the
    MTP draft), in module order (a layer at a time), each as the network holds it and sliced by
    export/sharding.py: fp8 blocks dequantised, or kept e4m3 with their scales (Fp8Linear, stacked
    experts; a FusedFp8Linear's weight and scales its parts' stacked, each part sliced by its own
    name). Only one tensor (one layer's stacked experts) is alive at a time unless the caller keeps
    them. Names in ``skip`` are neither read nor yielded."""
    stacked = {}  # layer -> its StackedExperts buffers by name (the current layer only)
    items = [(n, p) for n, p in net.state_dict().items() if n not in skip]
    for name, param in progress(items) if progress else items:
        parts = name.split(".")
        if ".mlp.stacked_experts." in name:  # model.layers.L.mlp.stacked_experts.<buffer>
            layer = int(parts[2])
            if layer not in stacked:
                stacked.clear()
                moe = net.get_submodule(f"model.layers.{layer}.mlp")
                experts = ckpt.stacked_experts(layer, moe.expert_lo, moe.expert_hi,
                                               dequantise=not moe.stacked_experts.fp8)
                stacked[layer] = dict(zip(StackedExperts.BUFFERS, experts, strict=True))
            t = stacked[layer][parts[-1]]
            if t is None or t.dtype != param.dtype:
                raise ValueError(f"{name}: the checkpoint's stacked experts are {None if t is None else t.dtype}, "
                                 f"the network expects {param.dtype}")
            if t.shape != param.shape:
                raise ValueError(f"{name}: stacked experts {tuple(t.shape)}, the network expects {tuple(param.shape)}")
            yield name, t
            continue
        owner, _, leaf = name.rpartition(".")
        fused = net.get_submodule(owner) if owner else None
        if isinstance(fused, FusedFp8Linear):  # model.layers.L.self_attn.x_proj.weight: its parts' rows
            parent = owner.rpartition(".")[0]
            t = torch.cat([_stored_fp8(ckpt, f"{parent}.{part}.{leaf}", param.dtype, tp_rank, tp_size)
                           for part, _ in fused.parts])
        elif param.dtype == torch.float8_e4m3fn or name.endswith(".weight_scale_inv"):  # Fp8Linear, as stored
            t = _stored_fp8(ckpt, name, param.dtype, tp_rank, tp_size)
        else:
            t = shard_tensor(name, ckpt.get(name, dtype=param.dtype), tp_rank, tp_size)
        if t.shape != param.shape:
            raise ValueError(f"{name}: rank {tp_rank}/{tp_size} shard has shape {tuple(t.shape)}, "
                             f"the network expects {tuple(param.shape)}")
        yield name, t


def _stored_fp8(ckpt: Checkpoint, name: str, dtype: torch.dtype, tp_rank: int, tp_size: int) -> torch.Tensor:
    """An Fp8Linear's e4m3 weight or its scales as stored, this rank's whole 128 x 128 blocks."""
    t = ckpt.raw(name)
    if t.dtype != dtype:
        raise ValueError(f"{name}: the checkpoint stores {t.dtype}, the fp8 network expects {dtype}")
    return shard_tensor(name, t, tp_rank, tp_size)


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
        ep = export(net, step.as_tuple() + (mla, idx), dynamic_shapes=dynamic_shapes(dims, cfg.num_hidden_layers))
    drop_noop_nodes(ep)
    return ep


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(map(str, a.shape)) == tuple(map(str, b.shape))  # symbolic sizes by name: no guard added


def drop_noop_nodes(ep: ExportedProgram) -> int:
    """Remove what export leaves that computes nothing: the ``_assert_tensor_metadata`` check it adds
    after every ``.to()`` (a dtype assertion of a value the graph already types), a ``view`` /
    ``reshape`` to the shape its input has, and a ``to`` to the dtype its input has (both return
    their input). Inductor drops them too, but only after every consumer (the node count, the
    ONNX exporter) has walked them: ~60 of a V3.2 MoE layer's ~280 nodes. Then repeated pure
    calls are merged (_merge_common_nodes). Returns the nodes removed."""
    aten = torch.ops.aten
    graph, dropped = ep.graph_module.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
            dropped += 1
            continue
        if node.target not in (aten.view.default, aten.reshape.default, aten.to.dtype):
            continue
        src, out = node.args[0], node.meta.get("val")
        before = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(before, torch.Tensor) or not isinstance(out, torch.Tensor):
            continue
        if node.target is aten.to.dtype:
            if node.kwargs.get("copy") or any(a is True for a in node.args[2:]) or before.dtype != out.dtype:
                continue
        elif not _same_shape(before, out) or before.dtype != out.dtype:
            continue
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        dropped += 1
    dropped += _merge_common_nodes(graph)
    ep.graph_module.recompile()
    return dropped


def _merge_common_nodes(graph: torch.fx.Graph) -> int:
    """One node for each pure aten call repeated on the same inputs: every layer reshapes the same
    RoPE cos/sin, for instance. Only functional aten ops with a tensor input (no factory, no
    mutation, no custom op: the dsa:: cache writes mutate their pools)."""
    seen, merged = {}, 0
    for node in list(graph.nodes):
        schema = getattr(node.target, "_schema", None)
        if (node.op != "call_function" or schema is None or schema.is_mutable or node.is_impure()
                or not str(node.target).startswith("aten.")
                or not any(isinstance(a, torch.fx.Node) for a in node.args)):
            continue
        key = (node.target, repr(node.args), repr(sorted(node.kwargs.items())))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return merged
