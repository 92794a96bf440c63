"""ExportedProgram -> ONNX in which every ``torch.ops.dsa.*`` call is one TensorRT plugin node.

The contract with the plugin library is plugins/tensorrt/PLUGINS.md; the node inventory and the
attribute table are docs/onnx_plugin_nodes.md. How the graph is made:

1. ``functionalize`` rewrites the program (training IR, where the cache writes mutate their pool
   in place) so that each write is a functional stand-in (``dsa_onnx::*``, below) returning the
   updated pool; later readers take that value (the data edge that orders write before read) and
   each pool's last value becomes an extra program output.
2. ``torch.onnx.export(dynamo=True)`` with a custom translation table: each DSA op becomes ONE node
   ``domain="dsa", op_type=<plugin name>``, attributes = the plugin fields + ``plugin_namespace="dsa"``,
   ``plugin_version="1"`` (onnx-tensorrt's FallbackPluginImporter turns them into PluginFields).
   One aten op gets our own translation: einsum (ONNX Einsum has no bf16).
3. Post-processing on the ONNX IR: outputs named ``logits`` and ``<pool input>_out`` (TensorRT aliases
   the latter to the pool inputs through the plugins' getAliasedInput; the runtime binds both to one
   buffer); dynamic dims named as in the step contract, dsa_trt/step.py (tokens, batch, pages_per_seq,
   pool_pages, logit_rows); fp8-mode byte pools declared in the INT32 carrier (PLUGINS.md "Byte pools"); the
   indexer's fp8 query made explicit as ``QuantizeLinear(x, scale=1, zero_point=FLOAT8E4M3FN)`` (the
   network already divided by its per-(token, head) power-of-two scale): TensorRT 11 networks are
   strongly typed, and that Q node *is* the FP8 tensor the DsaIndexerLogits plugin takes as input 0.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import defs
from onnxscript import opset18 as op  # the opset torchlib traces in; export converts to OPSET
from onnxscript import values as osv
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument
from torch.utils import _pytree as pytree

import dsa_trt.plugins.collectives  # noqa: F401  (registers torch.ops.dsa.all_reduce)
from dsa_trt.cache_layout import CACHE_FORMATS  # the plugins' cache_format field
from dsa_trt.plugins.fp8_ops import PLUGIN_NAMES as FP8_PLUGIN_NAMES
from dsa_trt.plugins.ops import PLUGIN_NAMES
from dsa_trt.step import POOL_OUTPUT_SUFFIX, STEP_OUTPUTS, onnx_dim_names

PLUGIN_DOMAIN = "dsa"
PLUGIN_NAMESPACE = "dsa"
PLUGIN_VERSION = "1"
OPSET = 21  # FLOAT8E4M3FN QuantizeLinear with `saturate` needs >= 19; TensorRT 10/11 parse 21
POOL_CARRIERS = ("int32", "int8", "uint8")  # fp8-mode byte pools at the engine boundary (PLUGINS.md)
CARRIER_TYPES = {"int32": ir.DataType.INT32, "int8": ir.DataType.INT8, "uint8": ir.DataType.UINT8}
# (program input, dim) -> the dim name of the step contract (dsa_trt/step.py); one symbol per name
DIM_NAMES = onnx_dim_names()


class OnnxExportError(RuntimeError):
    pass


# ---------------------------------------------------------------- 1. functional cache writes
@torch.library.custom_op("dsa_onnx::mla_cache_write", mutates_args=())
def mla_cache_write_functional(kv_latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
                               pool: torch.Tensor, kv_scale: float) -> torch.Tensor:
    out = pool.clone()
    torch.ops.dsa.mla_cache_write(kv_latent, k_pe, slot_mapping, out, kv_scale)
    return out


@mla_cache_write_functional.register_fake
def _(kv_latent, k_pe, slot_mapping, pool, kv_scale):
    return torch.empty_like(pool)


@torch.library.custom_op("dsa_onnx::indexer_k_cache_write", mutates_args=())
def indexer_k_cache_write_functional(index_k: torch.Tensor, slot_mapping: torch.Tensor,
                                     pool: torch.Tensor) -> torch.Tensor:
    out = pool.clone()
    torch.ops.dsa.indexer_k_cache_write(index_k, slot_mapping, out)
    return out


@indexer_k_cache_write_functional.register_fake
def _(index_k, slot_mapping, pool):
    return torch.empty_like(pool)


FUNCTIONAL = {
    torch.ops.dsa.mla_cache_write.default: torch.ops.dsa_onnx.mla_cache_write.default,
    torch.ops.dsa.indexer_k_cache_write.default: torch.ops.dsa_onnx.indexer_k_cache_write.default,
}


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes an op mutates (per its schema's alias annotations)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    args = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
    return [args[a.name] for a in schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and isinstance(args.get(a.name), torch.fx.Node)]


def functionalize(ep: ExportedProgram) -> tuple[ExportedProgram, list[str]]:
    """A copy of the program in which every in-place cache write is its functional stand-in.

    ``write(..., pool)`` becomes ``pool' = write_functional(..., pool)``, later uses of ``pool``
    read ``pool'``, and each pool's last value becomes an extra program output (after the logits,
    in pool-input order). The program then mutates nothing: the pools are ordinary graph outputs,
    which no exporter pass can drop (mutation outputs would be dead code to ONNX: the last layer's
    writes are read by nothing in the step). Rewriting the (non-functional)
    training IR directly also spares a ``run_decompositions``.
    """
    gm = torch.fx.GraphModule(ep.graph_module, copy.deepcopy(ep.graph))  # parameters shared, not copied
    graph = gm.graph
    latest: dict[torch.fx.Node, torch.fx.Node] = {}  # pool placeholder -> its value after the last write
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        for old, new in latest.items():
            if old in node.all_input_nodes:
                node.replace_input_with(old, new)
        if node.target not in FUNCTIONAL:
            if any(n.op == "placeholder" for n in _written(node)):
                raise OnnxExportError(f"{node.format_node()} writes a program input; only the DSA cache writes may")
            continue
        args = torch.fx.operator_schemas.normalize_function(
            node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        root = next((k for k, v in latest.items() if v is args["pool"]), args["pool"])
        if root.op != "placeholder":
            raise OnnxExportError(f"{node.format_node()}: the pool must be a program input, not {root.format_node()}")
        with graph.inserting_after(node):
            new = graph.call_function(FUNCTIONAL[node.target], kwargs=args)
        new.meta = dict(node.meta, val=root.meta["val"])
        latest[root] = new
        graph.erase_node(node)
    sig = copy.deepcopy(ep.graph_signature)
    num_user = len(sig.output_specs)
    if not 1 <= num_user <= len(STEP_OUTPUTS) or any(s.kind != OutputKind.USER_OUTPUT for s in sig.output_specs):
        raise OnnxExportError(f"expected the outputs {STEP_OUTPUTS} (hidden optional), got {sig.output_specs}")
    order = [n for n in graph.nodes if n.op == "placeholder" and n in latest]  # pool-input order
    output = graph.output_node()
    output.args = ((*output.args[0], *(latest[p] for p in order)),)
    sig.output_specs.extend(OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(latest[p].name), None) for p in order)
    graph.lint()
    gm.recompile()
    new_ep = ep._update(gm, sig)
    new_ep._module_call_graph[0].signature.out_spec = pytree.tree_flatten(tuple(range(num_user + len(order))))[1]
    return new_ep, [p.name for p in order]


# ---------------------------------------------------------------- 2. plugin node schemas + translations
@dataclass(frozen=True)
class PluginNode:
    """One plugin node: inputs in PLUGINS.md order (= the torch op schema's), outputs, fields.

    Tensor kinds: ``act`` a bf16 activation (float32 allowed by the schema only so that graphs
    of float32 networks can be checked with ONNX Runtime; TensorRT needs bf16), ``pool`` a cache
    pool (byte carrier in fp8 mode, bf16 in bf16 mode), ``q`` the indexer query (FP8 in fp8 mode,
    bf16 in bf16 mode), else a fixed ONNX type.
    """

    inputs: tuple[tuple[str, str], ...]  # (name, kind)
    outputs: tuple[tuple[str, str], ...]
    fields: tuple[tuple[str, str], ...]  # (PluginField name, "int" | "float"), as ONNX attributes


PLUGINS: dict[str, PluginNode] = {
    "DsaMlaCacheWrite": PluginNode(
        (("kv_latent", "act"), ("k_pe", "act"), ("slot_mapping", "int64"), ("pool", "pool")),
        (("pool_out", "pool"),), (("kv_scale", "float"), ("cache_format", "int"))),
    "DsaIndexerKCacheWrite": PluginNode(
        (("index_k", "act"), ("slot_mapping", "int64"), ("pool", "pool")),
        (("pool_out", "pool"),), (("cache_format", "int"),)),
    "DsaIndexerLogits": PluginNode(
        (("q", "q"), ("weights", "float"), ("pool", "pool"), ("page_table", "int32"), ("req_idx", "int32"),
         ("seq_lens", "int32")),
        (("logits", "float"),), (("num_heads", "int"), ("cache_format", "int"))),
    "DsaTopkTranslate": PluginNode(
        (("logits", "float"), ("lengths", "int32"), ("page_table", "int32"), ("req_idx", "int32")),
        (("slots", "int32"),), (("k", "int"),)),
    "DsaSparseMla": PluginNode(
        (("q", "act"), ("pool", "pool"), ("slots", "int32")),
        (("out", "act"), ("lse", "float")),
        (("num_heads", "int"), ("topk", "int"), ("kv_scale", "float"), ("sm_scale", "float"),
         ("cache_format", "int"))),
    # The real-size linear operators (plugins/fp8_ops.py). Their weights are graph initializers: e4m3
    # (FLOAT8E4M3FN) with FLOAT block scales, or bf16 for the MoE's weight_format=1, where the two
    # scale inputs are FLOAT [1] placeholders (onnx-tensorrt's plugin importer has no optional inputs).
    "DsaFp8BlockLinear": PluginNode(
        (("x", "act"), ("weight", "weight"), ("weight_scale", "float")),
        (("out", "act"),), (("pow2_scales", "int"),)),
    "DsaMoeExperts": PluginNode(
        (("x", "act"), ("topk_ids", "int32"), ("topk_weights", "float"), ("w13", "weight"), ("w13_scale", "float"),
         ("w2", "weight"), ("w2_scale", "float")),
        (("out", "float"),),
        (("num_experts", "int"), ("expert_offset", "int"), ("weight_format", "int"), ("pow2_scales", "int"))),
}
MOE_WEIGHT_FORMATS = {"fp8_block": 0, "bf16": 1}  # DsaMoeExperts weight_format (DsaMoeWeightFormat)
# dsa::all_reduce of tensor-parallel programs (plugins/collectives.py): emitted, but the plugin
# library has no such plugin yet, so tensorrt_problems() reports it (TP>1 engines: --compiler aoti).
COLLECTIVES: dict[str, PluginNode] = {
    "DsaAllReduce": PluginNode((("x", "act"),), (("y", "act"),), (("group_size", "int"),)),
}
ALIASED = {"DsaMlaCacheWrite": 3, "DsaIndexerKCacheWrite": 2}  # plugin -> the input its output 0 aliases
_SCHEMA_TYPES = {
    "act": ("TA", ["tensor(bfloat16)", "tensor(float)"]),
    "pool": ("TP", ["tensor(int32)", "tensor(int8)", "tensor(uint8)", "tensor(bfloat16)"]),
    "q": ("TQ", ["tensor(float8e4m3fn)", "tensor(bfloat16)", "tensor(float)"]),
    "weight": ("TW", ["tensor(float8e4m3fn)", "tensor(bfloat16)"]),
    "float": ("tensor(float)", None), "int32": ("tensor(int32)", None), "int64": ("tensor(int64)", None),
}
# What TensorRT accepts at the plugin boundary (PLUGINS.md), by kind and cache_format
_TRT_TYPES = {
    "act": {0: {ir.DataType.BFLOAT16}, 1: {ir.DataType.BFLOAT16}},
    "pool": {0: set(CARRIER_TYPES.values()), 1: {ir.DataType.BFLOAT16}},
    "q": {0: {ir.DataType.FLOAT8E4M3FN}, 1: {ir.DataType.BFLOAT16}},
    "weight": {f: {ir.DataType.FLOAT8E4M3FN, ir.DataType.BFLOAT16} for f in (0, 1)},
    "float": {f: {ir.DataType.FLOAT} for f in (0, 1)},
    "int32": {f: {ir.DataType.INT32} for f in (0, 1)},
    "int64": {f: {ir.DataType.INT64} for f in (0, 1)},
}
PLUGIN_STRINGS = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}


def op_schema(name: str) -> defs.OpSchema:
    """The ONNX OpSchema of a plugin node (domain dsa, version 1): the emitter builds nodes through it."""
    p = {**PLUGINS, **COLLECTIVES}[name]
    attr_type = {"int": defs.OpSchema.AttrType.INT, "float": defs.OpSchema.AttrType.FLOAT}
    kinds = [k for _, k in p.inputs + p.outputs]
    return defs.OpSchema(
        name, PLUGIN_DOMAIN, 1, f"TensorRT plugin {name} (namespace {PLUGIN_NAMESPACE}, version {PLUGIN_VERSION})",
        inputs=[defs.OpSchema.FormalParameter(n, _SCHEMA_TYPES[k][0]) for n, k in p.inputs],
        outputs=[defs.OpSchema.FormalParameter(n, _SCHEMA_TYPES[k][0]) for n, k in p.outputs],
        type_constraints=[(_SCHEMA_TYPES[k][0], _SCHEMA_TYPES[k][1], "") for k in dict.fromkeys(kinds)
                          if _SCHEMA_TYPES[k][1] is not None],
        attributes=[defs.OpSchema.Attribute(f, attr_type[t], "") for f, t in p.fields]
        + [defs.OpSchema.Attribute(a, defs.OpSchema.AttrType.STRING, "") for a in PLUGIN_STRINGS],
    )


_OPSET = osv.Opset(PLUGIN_DOMAIN, 1)
_OPS = {name: osv.Op(_OPSET, name, op_schema(name)) for name in {**PLUGINS, **COLLECTIVES}}


def _cache_format(pool) -> int:
    """uint8 pools are the fp8 byte layouts, bf16 pools the exact bf16 mode; nothing else has a plugin."""
    fmt = {ir.DataType.UINT8: CACHE_FORMATS["fp8"], ir.DataType.BFLOAT16: CACHE_FORMATS["bf16"]}.get(pool.dtype)
    if fmt is None:
        raise OnnxExportError(f"pool {pool.name} is {pool.dtype}: the TensorRT plugins hold fp8 (uint8 bytes) or "
                              "bf16 caches; build with --cache fp8 or bf16")
    return fmt


def _mla_cache_write(kv_latent, k_pe, slot_mapping, pool, kv_scale: float):
    return _OPS["DsaMlaCacheWrite"](kv_latent, k_pe, slot_mapping, pool, kv_scale=float(kv_scale),
                                    cache_format=_cache_format(pool), **PLUGIN_STRINGS)


def _indexer_k_cache_write(index_k, slot_mapping, pool):
    return _OPS["DsaIndexerKCacheWrite"](index_k, slot_mapping, pool, cache_format=_cache_format(pool),
                                         **PLUGIN_STRINGS)


def _indexer_logits(q, weights, pool, page_table, req_idx, seq_lens):
    return _OPS["DsaIndexerLogits"](q, weights, pool, page_table, req_idx, seq_lens, num_heads=int(q.shape[1]),
                                    cache_format=_cache_format(pool), **PLUGIN_STRINGS)


def _topk_translate(logits, lengths, page_table, req_idx, k: int):
    return _OPS["DsaTopkTranslate"](logits, lengths, page_table, req_idx, k=int(k), **PLUGIN_STRINGS)


def _sparse_mla(q, pool, slots, kv_scale: float, sm_scale: float):
    return _OPS["DsaSparseMla"](q, pool, slots, num_heads=int(q.shape[1]), topk=int(slots.shape[1]),
                                kv_scale=float(kv_scale), sm_scale=float(sm_scale), cache_format=_cache_format(pool),
                                **PLUGIN_STRINGS)


def _fp8_block_linear(x, weight, weight_scale, pow2_scales: bool):
    return _OPS["DsaFp8BlockLinear"](x, weight, weight_scale, pow2_scales=int(pow2_scales), **PLUGIN_STRINGS)


def _moe_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, num_experts: int, expert_offset: int,
                 pow2_scales: bool):
    fmt = MOE_WEIGHT_FORMATS["bf16" if w13_scale is None else "fp8_block"]
    if w13_scale is None:  # bf16 experts: the plugin ignores these FLOAT [1] placeholders
        w13_scale = w2_scale = op.Constant(value_floats=[0.0])
    return _OPS["DsaMoeExperts"](x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                                 num_experts=int(num_experts), expert_offset=int(expert_offset), weight_format=fmt,
                                 pow2_scales=int(pow2_scales), **PLUGIN_STRINGS)


def _all_reduce(x, group_size: int):
    return _OPS["DsaAllReduce"](x, group_size=int(group_size), **PLUGIN_STRINGS)


def _einsum(equation: str, tensors, path=None):
    """Two-operand einsum as Transpose + broadcast MatMul (+ ReduceSum): ONNX Einsum has no bf16 and
    TensorRT's Einsum layer is narrower than MatMul. Covers products with at most one contracted
    index (the MLA absorption products); anything else fails naming the equation."""
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or len(tensors) != 2 or any(len(set(t)) != len(t) for t in terms):
        raise OnnxExportError(f"einsum {equation!r}: only two operands without repeated indices are translated")
    (a_idx, b_idx), (a, b) = terms, list(tensors)
    only_a = [i for i in a_idx if i not in b_idx and i not in out]  # summed away before the product
    only_b = [i for i in b_idx if i not in a_idx and i not in out]
    if only_a:
        a = op.ReduceSum(a, op.Constant(value_ints=[a_idx.index(i) for i in only_a]), keepdims=0)
        a_idx = "".join(i for i in a_idx if i not in only_a)
    if only_b:
        b = op.ReduceSum(b, op.Constant(value_ints=[b_idx.index(i) for i in only_b]), keepdims=0)
        b_idx = "".join(i for i in b_idx if i not in only_b)
    contracted = [i for i in a_idx if i in b_idx and i not in out]
    if len(contracted) != 1:
        raise OnnxExportError(f"einsum {equation!r}: {len(contracted)} contracted indices; one is translated")
    batch = [i for i in out if i in a_idx and i in b_idx]
    left = [i for i in out if i in a_idx and i not in b_idx]
    right = [i for i in out if i in b_idx and i not in a_idx]
    m, n, k = left[-1:] or ["1"], right[-1:] or ["1"], contracted  # "1": a unit axis made by Unsqueeze
    extra = left[:-1] + right[:-1]  # broadcast axes: present in one operand, size 1 in the other
    a_order = batch + extra + m + k
    b_order = batch + extra + k + n

    def arrange(x, idx, order):
        present = [i for i in order if i in idx]
        x = op.Transpose(x, perm=[idx.index(i) for i in present])
        units = [p for p, i in enumerate(order) if i not in idx]
        return op.Unsqueeze(x, op.Constant(value_ints=units)) if units else x

    prod = op.MatMul(arrange(a, a_idx, a_order), arrange(b, b_idx, b_order))  # [batch, extra, m, n]
    prod_idx = batch + extra + m + n
    units = [p for p, i in enumerate(prod_idx) if i == "1"]
    if units:
        prod = op.Squeeze(prod, op.Constant(value_ints=units))
        prod_idx = [i for i in prod_idx if i != "1"]
    return op.Transpose(prod, perm=[prod_idx.index(i) for i in out])


def _mm_fp32_out(a, b, out_dtype):
    """aten::mm.dtype (export/layers.py fp32_linear: a bf16 GEMM with fp32 output) as the fp32 GEMM of
    the cast operands: the same products (bf16 x bf16 is exact in fp32), fp32 accumulation; the
    weight's Cast folds into an fp32 initializer when TensorRT builds the plan."""
    if out_dtype not in (torch.float32, ir.DataType.FLOAT):  # the exporter passes ONNX's data type
        raise OnnxExportError(f"mm with out_dtype={out_dtype}: only float32 output (the lm_head) is translated")
    return op.MatMul(op.Cast(a, to=onnx.TensorProto.FLOAT), op.Cast(b, to=onnx.TensorProto.FLOAT))


def _f32_linear(x, weight):
    """dsa::f32_linear (export/layers.py fp32_linear on CUDA): x @ weight^T as _mm_fp32_out. The
    deterministic mode's row chunks are a CUDA-runtime choice of the op; one MatMul has no chunks."""
    return op.MatMul(op.Cast(x, to=onnx.TensorProto.FLOAT),
                     op.Transpose(op.Cast(weight, to=onnx.TensorProto.FLOAT), perm=[1, 0]))


TRANSLATIONS = {
    torch.ops.aten.einsum.default: _einsum,
    torch.ops.aten.mm.dtype: _mm_fp32_out,
    torch.ops.dsa.f32_linear.default: _f32_linear,
    torch.ops.dsa_onnx.mla_cache_write.default: _mla_cache_write,
    torch.ops.dsa_onnx.indexer_k_cache_write.default: _indexer_k_cache_write,
    torch.ops.dsa.indexer_logits.default: _indexer_logits,
    torch.ops.dsa.topk_translate.default: _topk_translate,
    torch.ops.dsa.sparse_mla.default: _sparse_mla,
    torch.ops.dsa.all_reduce.default: _all_reduce,
    torch.ops.dsa.fp8_block_linear.default: _fp8_block_linear,
    torch.ops.dsa.moe_experts.default: _moe_experts,
}
assert sorted(PLUGINS) == sorted({**PLUGIN_NAMES, **FP8_PLUGIN_NAMES}.values())


# ---------------------------------------------------------------- 3. the exported graph, finished
def export_onnx(ep: ExportedProgram, path: str | Path, pool_carrier: str = "int32") -> Path:
    """Write the ONNX of one exported step program to ``path``.

    Graph inputs: the program's (input_ids, positions, req_idx, page_table, slot_mapping,
    logits_indices, [hidden_states: draft programs], mla_pools_<l>, index_pools_<l>). Outputs: ``logits``
    [logit_rows, vocab] fp32, ``hidden`` [tokens, D] (MTP-enabled engines), then ``mla_pools_<l>_out``, ``index_pools_<l>_out`` (the pools after this step's writes).
    Weights past protobuf's 2 GiB go to an external-data file beside it (the parser finds it).
    """
    if pool_carrier not in POOL_CARRIERS:
        raise OnnxExportError(f"pool_carrier {pool_carrier!r} not in {POOL_CARRIERS}")
    ep, pools = functionalize(ep)
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")  # "torchvision is not installed"
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        program = torch.onnx.export(ep, dynamo=True, custom_translation_table=TRANSLATIONS, opset_version=OPSET,
                                    optimize=False, verbose=False)
    finally:
        quiet.setLevel(level)
    model = program.model
    _name_outputs(model, pools)
    _name_dims(model)
    _explicit_fp8(model)
    _pool_carrier(model, pool_carrier)
    program.optimize()  # constant folding + dead-code removal; the pool outputs keep the writes alive
    program.model.producer_name = "dsa_trt"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(path)
    return path


def _name_outputs(model: ir.Model, pools: list[str]) -> None:
    """``logits`` (and ``hidden``), then ``<pool>_out`` for every pool the step writes (functionalize's
    output order; the step contract's STEP_OUTPUTS, dsa_trt/step.py)."""
    outputs = model.graph.outputs
    num_user = len(outputs) - len(pools)
    if not 1 <= num_user <= len(STEP_OUTPUTS):
        raise OnnxExportError(f"expected {STEP_OUTPUTS} + {len(pools)} pools as outputs, got {[v.name for v in outputs]}")
    for value, name in zip(outputs[:num_user], STEP_OUTPUTS):
        value.name = name
    for value, pool in zip(outputs[num_user:], pools):
        producer = value.producer()
        if producer is None or producer.domain != PLUGIN_DOMAIN or producer.op_type not in ALIASED:
            raise OnnxExportError(f"output for {pool} is not made by a DSA cache write: {producer}")
        value.name = pool + POOL_OUTPUT_SUFFIX


def _name_dims(model: ir.Model) -> None:
    """The exporter's symbols (s0, s42, ...) -> the step contract's dim names, also inside expressions
    such as ``64*s2`` (the indexer logits width): TensorRT profiles and readers see our names."""
    inputs = {v.name: v for v in model.graph.inputs}
    rename = {}
    for (name, axis), dim_name in DIM_NAMES.items():
        dim = inputs[name].shape[axis] if name in inputs else None
        if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            rename[dim.value] = dim_name
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")

    def renamed(d):
        return pattern.sub(lambda m: rename[m.group(1)], d.value) if isinstance(d, ir.SymbolicDim) and d.value else d

    for v in [*model.graph.inputs, *(o for n in model.graph for o in n.outputs)]:
        if v.shape is not None:
            v.shape = ir.Shape([renamed(d) for d in v.shape])


def _explicit_fp8(model: ir.Model) -> None:
    """Cast(to=FLOAT8E4M3FN) -> QuantizeLinear(x, 1.0, FLOAT8E4M3FN zero, saturate=1): the same rounding
    (to nearest even, saturating; the network already divided by its scale and clamped) in the form
    TensorRT imports as an FP8 IQuantizeLayer and ONNX Runtime runs."""
    graph = model.graph
    for node in list(graph):
        if node.domain != "" or node.op_type != "Cast" or node.attributes["to"].as_int() != ir.DataType.FLOAT8E4M3FN:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if x.dtype != ir.DataType.FLOAT:
            raise OnnxExportError(f"{node.name}: fp8 quantisation of a {x.dtype} tensor; expected FLOAT")
        scale = ir.Value(name=f"{node.name}_scale", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT),
                         const_value=ir.tensor(np.array(1.0, dtype=np.float32)))
        fp8_zero = np.zeros((), dtype=ir.DataType.FLOAT8E4M3FN.numpy())
        zero = ir.Value(name=f"{node.name}_zero", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT8E4M3FN),
                        const_value=ir.Tensor(fp8_zero, dtype=ir.DataType.FLOAT8E4M3FN))
        graph.register_initializer(scale)
        graph.register_initializer(zero)
        q = ir.node("QuantizeLinear", [x, scale, zero], attributes={"saturate": 1}, name=f"{node.name}_fp8_q")
        graph.insert_before(node, q)
        q.outputs[0].dtype, q.outputs[0].shape = y.dtype, y.shape
        y.replace_all_uses_with(q.outputs[0])
        graph.remove(node, safe=True)
        q.outputs[0].name = y.name


def _pool_carrier(model: ir.Model, carrier: str) -> None:
    """fp8-mode pools are bytes TensorRT must not interpret: declare them in the chosen carrier
    (INT32: innermost extent / 4) on the graph inputs and on the cache writes' outputs."""
    if carrier == "uint8":
        return
    dtype = CARRIER_TYPES[carrier]
    width = 4 if carrier == "int32" else 1
    pools = [v for v in model.graph.inputs if "pools_" in v.name and v.dtype == ir.DataType.UINT8]
    for v in pools:
        users = {u.op_type for u, _ in v.uses()}
        if not users <= set(PLUGINS) or any(u.domain != PLUGIN_DOMAIN for u, _ in v.uses()):
            raise OnnxExportError(f"{v.name} is read by non-plugin nodes {users}: its bytes cannot change carrier")
        *lead, inner = v.shape
        if isinstance(inner, int) and inner % width:
            raise OnnxExportError(f"{v.name}: innermost extent {inner} is not a multiple of {width}")
        v.dtype, v.shape = dtype, ir.Shape([*lead, inner // width])
    for node in model.graph:
        if node.domain == PLUGIN_DOMAIN and node.op_type in ALIASED:
            src, out = node.inputs[ALIASED[node.op_type]], node.outputs[0]
            if out.dtype == ir.DataType.UINT8:
                out.dtype, out.shape = src.dtype, src.shape


# ---------------------------------------------------------------- 4. the TensorRT contract, checked here
def tensorrt_problems(model: onnx.ModelProto) -> list[str]:
    """What keeps this graph from building with libdsa_trt_plugins.so (empty: nothing): DSA nodes the
    library lacks, plugin inputs/outputs whose dtype is not the one PLUGINS.md fixes for the node's
    cache_format (e.g. float32 activations of a float32 network), missing plugin attributes."""
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*model.graph.input, *model.graph.output, *model.graph.value_info]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    problems = []
    for node in model.graph.node:
        if node.domain != PLUGIN_DOMAIN:
            continue
        where = f"{node.name} ({node.op_type})"
        spec = PLUGINS.get(node.op_type)
        if spec is None:
            problems.append(f"{where}: no such plugin in the library (tensor-parallel engines need --compiler aoti)")
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        missing = [f for f, _ in spec.fields if f not in attrs] + [a for a in PLUGIN_STRINGS if a not in attrs]
        if missing:
            problems.append(f"{where}: missing attributes {missing}")
        fmt = attrs.get("cache_format", CACHE_FORMATS["fp8"])
        for names, formals in ((node.input, spec.inputs), (node.output, spec.outputs)):
            for name, (formal, kind) in zip(names, formals):
                have = types.get(name)
                allowed = _TRT_TYPES[kind][fmt]
                if have is not None and ir.DataType(have) not in allowed:
                    want = " or ".join(sorted(d.name for d in allowed))
                    problems.append(f"{where}: {formal} ({name}) is {ir.DataType(have).name}; TensorRT needs {want}")
    return problems
