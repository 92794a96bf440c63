"""ONNX with TensorRT plugin nodes (builder/onnx_export.py) and the TensorRT adapters.

CPU, every machine:
* the graphs `build_engine --emit-onnx` writes: exactly the expected Dsa* nodes per layer, their
  attributes (types and values: kv_scale is the engine's calibrated per-layer scale, k = index_topk,
  head counts), the wiring the plugins' aliasing relies on, onnx.checker, `polygraphy inspect model`,
  the TensorRT plugin contract (tensorrt_problems) and the optimisation profile;
* the emitted graph run by ONNX Runtime against torch: the plugin inputs of the program up to layer
  0's plugins (incl. the explicit FP8 QuantizeLinear of the indexer query), and the whole program
  with every plugin node resolved to an ONNX reference function of the same name
  (REFERENCE_FUNCTIONS below, written from plugins/reference.py's semantics), which checks the
  plugin nodes' input order, attributes and the pool threading, over three steps.
These use float32 networks with bf16 or fp8 caches: ONNX Runtime's CPU provider has no bf16 MatMul.

TensorRT (skipped unless `import tensorrt` works, a GPU is present and the plugin library is built):
a plan built by the real builder against the AOTInductor engine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest
import torch
from onnx import TensorProto
from onnx import helper as oh
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_trt.builder.build import BuildError, build_engine, check_onnx_options
from dsa_trt.builder.onnx_export import export_onnx, functionalize, tensorrt_problems
from dsa_trt.builder.tensorrt_build import MAX_TENSOR_VOLUME, Profile, TensorRTBuildError, build_plan, profile_shapes
from dsa_trt.engine_config import EngineConfig
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network, export_program
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime import tensorrt_engine
from dsa_trt.runtime.step_inputs import StepInputs
from tests.helpers.tensorrt import import_tensorrt, plugin_library_path

PLUGINS = ("DsaMlaCacheWrite", "DsaIndexerKCacheWrite", "DsaIndexerLogits", "DsaTopkTranslate", "DsaSparseMla")
PER_LAYER = Counter(PLUGINS)  # plugin nodes per decoder layer
FIELDS = {  # PLUGINS.md: field -> ONNX attribute type
    "DsaMlaCacheWrite": {"kv_scale": "FLOAT", "cache_format": "INT"},
    "DsaIndexerKCacheWrite": {"cache_format": "INT"},
    "DsaIndexerLogits": {"num_heads": "INT", "cache_format": "INT"},
    "DsaTopkTranslate": {"k": "INT"},
    "DsaSparseMla": {"num_heads": "INT", "topk": "INT", "kv_scale": "FLOAT", "sm_scale": "FLOAT",
                     "cache_format": "INT"},
}
STRINGS = {"plugin_namespace": "dsa", "plugin_version": "1"}
F32_KV_SCALES = [0.011, 0.0125, 0.0097]  # fp8 graphs of float32 networks: any per-layer scales


# ================================================================ fixtures
@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return Checkpoint(tiny_ckpt)


@pytest.fixture(scope="module")
def emitted(tiny_ckpt, tmp_path_factory):
    """`build_engine --emit-onnx` (fp8 cache, bf16): the TensorRT-ready graphs + the engine config."""
    out = tmp_path_factory.mktemp("emit") / "tiny-fp8"
    cfg = build_engine(tiny_ckpt, out, cache_mode="fp8", compiler="aoti", device="cpu", dtype="bfloat16",
                       emit_onnx=True)
    path = out / "onnx" / "rank0.onnx"
    return cfg, path, onnx.load(str(path))


@pytest.fixture(scope="module")
def f32_graphs(ckpt, tmp_path_factory):
    """float32 networks exported to ONNX for ONNX Runtime: cache_mode -> (net, ep, model)."""
    out = tmp_path_factory.mktemp("f32")
    graphs = {}
    for mode in ("bf16", "fp8"):
        net = build_network(ckpt, mode, torch.float32, F32_KV_SCALES)
        ep = export_program(net)
        path = export_onnx(ep, out / f"{mode}.onnx")
        graphs[mode] = net, ep, onnx.load(str(path))
    return graphs


# ================================================================ graph helpers
def dsa_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "dsa"]


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def layer_of(node: onnx.NodeProto, made_by: dict[str, onnx.NodeProto]) -> int:
    """The layer of a plugin node: the index of the graph-input pool it (transitively) reads."""
    if node.op_type == "DsaTopkTranslate":
        return layer_of(made_by[node.input[0]], made_by)
    pool = node.input[{"DsaMlaCacheWrite": 3, "DsaIndexerKCacheWrite": 2, "DsaIndexerLogits": 2,
                       "DsaSparseMla": 1}[node.op_type]]
    if pool in made_by:
        return layer_of(made_by[pool], made_by)
    return int(pool.rsplit("_", 1)[1])


def prune(model: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """The subgraph computing ``outputs`` (fp8 ones cast to float for numpy), all else removed."""
    made_by = producers(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info,
                                                             *model.graph.output]}
    keep, todo = set(), list(outputs)
    while todo:
        name = todo.pop()
        node = made_by.get(name)
        if node is not None and id(node) not in keep:
            keep.add(id(node))
            todo.extend(i for i in node.input if i)
    nodes = [n for n in model.graph.node if id(n) in keep]
    graph_outputs = []
    for name in outputs:
        dtype = types[name]
        if dtype == TensorProto.FLOAT8E4M3FN:
            nodes.append(oh.make_node("Cast", [name], [name + "_f32"], to=TensorProto.FLOAT))
            name, dtype = name + "_f32", TensorProto.FLOAT
        graph_outputs.append(oh.make_tensor_value_info(name, dtype, None))
    used = {i for n in nodes for i in n.input}
    graph = oh.make_graph(nodes, "pruned", [v for v in model.graph.input if v.name in used], graph_outputs,
                          initializer=[t for t in model.graph.initializer if t.name in used])
    return oh.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)


def ort_session(model: onnx.ModelProto):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3  # errors only
    # ORT 1.32's Clip->QuantizeLinear fusion cannot read an FP8 zero point ("Unexpected data type for
    # QuantizeLinear input y_zero_point of 17"): run the graph as written (it is what we check anyway).
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def feeds(session, step: StepInputs, mla: list[torch.Tensor], idx: list[torch.Tensor]) -> dict[str, np.ndarray]:
    """The step + pools by graph-input name; bf16 pools travel as float (cast in the graph, see with_reference)."""
    values = dict(zip(tensorrt_engine.STEP_INPUTS, step.as_tuple()))
    values.update({f"mla_pools_{i}": p for i, p in enumerate(mla)})
    values.update({f"index_pools_{i}": p for i, p in enumerate(idx)})
    out = {}
    for i in session.get_inputs():
        name = i.name.removesuffix("_f32")
        t = values[name]
        out[i.name] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return out


def steps(cfg) -> tuple[StepInputs, StepInputs, StepInputs]:
    """A ragged prefill over scattered pages (longer than index_topk: the top-k selects), a decode
    step over those caches, and a short fresh prefill; logits for every token of the prefills."""
    prefill = StepInputs.build([(list(range(2, 92)), 0, [7, 3]), (list(range(5, 35)), 0, [11])],
                               logits_for="all")
    decode = StepInputs.build([([17], 90, [7, 3]), ([9], 30, [11])])
    short = StepInputs.build([(list(range(40, 52)), 0, [5]), (list(range(60, 65)), 0, [9])],
                             logits_for="all")
    return prefill, decode, short


def random_pools(cfg, mode: str, num_pages: int = 16):
    """Pools full of random (finite) entries: a wrong slot reads garbage, never a lucky zero."""
    mla, idx = allocate_pools(cfg, mode, num_pages)
    g = torch.Generator().manual_seed(7)
    for p in mla + idx:
        p.copy_(torch.randn(p.shape, generator=g))
    return mla, idx


# ================================================================ inventory, attributes, wiring
def test_plugin_node_inventory(emitted, ckpt):
    cfg, _, model = emitted
    made_by = producers(model)
    attention = [n for n in dsa_nodes(model) if n.op_type in PLUGINS]
    per_layer = Counter((layer_of(n, made_by), n.op_type) for n in attention)
    for layer in range(cfg.model.num_hidden_layers):
        got = Counter({op: c for (lay, op), c in per_layer.items() if lay == layer})
        assert got == PER_LAYER, f"layer {layer}: {dict(got)} != {dict(PER_LAYER)}"
    assert len(attention) == cfg.model.num_hidden_layers * sum(PER_LAYER.values())
    # bf16 + an fp8 checkpoint: weight format fp8, so the e4m3 Linears (but kv_b) and the routed experts
    # are plugin nodes too (one expert node per MoE layer)
    m = cfg.model
    assert cfg.weight_format == "fp8"
    e4m3 = [n for n in ckpt.names() if ckpt.is_fp8(n) and ".experts." not in n and "kv_b_proj" not in n]
    linears = Counter(n.op_type for n in dsa_nodes(model) if n.op_type not in PLUGINS)
    # the linears of one input are one node (export/layers.py FusedFp8Linear: [q_a | wk | kv_a],
    # [q_b | wq_b], an MLP's [gate | up])
    from dsa_trt.export.layers import FusedFp8Linear
    from dsa_trt.export.program import network_skeleton

    skeleton = network_skeleton(ckpt, "fp8", torch.bfloat16, weight_format="fp8")
    fused = [mod for mod in skeleton.modules() if isinstance(mod, FusedFp8Linear)]
    assert len(fused) == 3 * m.num_hidden_layers
    assert linears == {"DsaFp8BlockLinear": len(e4m3) - sum(len(f.parts) - 1 for f in fused),
                       "DsaMoeExperts": m.num_hidden_layers - m.first_k_dense_replace}, dict(linears)
    assert {n.domain for n in model.graph.node} == {"", "dsa"}
    assert {o.domain: o.version for o in model.opset_import} == {"": 21, "dsa": 1}
    assert not [n for n in model.graph.node if n.op_type == "Einsum"], "Einsum has no bf16 in ONNX"


def test_plugin_attributes(emitted):
    """Every field of PLUGINS.md, with its ONNX type, and nothing else; values from the engine config."""
    cfg, _, model = emitted
    m = cfg.model
    made_by = producers(model)
    for node in dsa_nodes(model):
        if node.op_type == "DsaFp8BlockLinear":  # the tiny checkpoint's scales are ue8m0 (powers of two)
            assert attrs(node)["pow2_scales"] == 1, node.name
        if node.op_type not in PLUGINS:  # the linear operators' fields: plugins/fp8_ops.py
            continue
        layer = layer_of(node, made_by)
        types = {a.name: onnx.AttributeProto.AttributeType.Name(a.type) for a in node.attribute}
        assert types == {**FIELDS[node.op_type], **{k: "STRING" for k in STRINGS}}, f"{node.name}: {types}"
        a = attrs(node)
        assert {k: a[k].decode() for k in STRINGS} == STRINGS
        expect = {"cache_format": 0, "k": m.index_topk, "topk": m.index_topk,
                  "kv_scale": np.float32(cfg.kv_scales[layer]), "sm_scale": np.float32(m.softmax_scale),
                  "num_heads": m.index_n_heads if node.op_type == "DsaIndexerLogits" else m.num_attention_heads}
        for field in FIELDS[node.op_type]:
            assert a[field] == expect[field], f"{node.name} (layer {layer}): {field} {a[field]} != {expect[field]}"
    assert all(0 < s < 1 for s in cfg.kv_scales), "calibrated scales expected for the tiny model"


def test_wiring(emitted):
    """The data edges TensorRT orders by: readers take the cache writes' outputs (the aliased pools)."""
    _, _, model = emitted
    made_by = producers(model)
    for node in (n for n in dsa_nodes(model) if n.op_type in PLUGINS):
        src = {i: made_by.get(x) for i, x in enumerate(node.input)}
        layer = layer_of(node, made_by)
        if node.op_type == "DsaSparseMla":
            assert src[1].op_type == "DsaMlaCacheWrite" and src[2].op_type == "DsaTopkTranslate"
            assert layer_of(src[2], made_by) == layer, f"{node.name}: slots from another layer's top-k"
        if node.op_type == "DsaIndexerLogits":
            assert src[2].op_type == "DsaIndexerKCacheWrite"
            q = src[0]  # the explicit FP8 quantisation (TensorRT 11: strongly typed)
            assert q.op_type == "QuantizeLinear" and attrs(q)["saturate"] == 1
            inits = {t.name: t for t in model.graph.initializer}
            assert inits[q.input[2]].data_type == TensorProto.FLOAT8E4M3FN
            assert onnx.numpy_helper.to_array(inits[q.input[1]]) == 1.0
        if node.op_type == "DsaTopkTranslate":
            assert src[0].op_type == "DsaIndexerLogits"
    for v in model.graph.input:  # byte pools are read by plugin nodes only (their carrier is not data)
        if "_pools_" in v.name:
            assert {n.domain for n in model.graph.node if v.name in n.input} == {"dsa"}


def test_graph_io(emitted):
    cfg, _, model = emitted
    layers = cfg.model.num_hidden_layers

    def sig(values):
        return [(v.name, TensorProto.DataType.Name(v.type.tensor_type.elem_type),
                 [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in values]

    pools = [(f"mla_pools_{i}", "INT32", ["pool_pages", 64, 144]) for i in range(layers)] + \
            [(f"index_pools_{i}", "INT32", ["pool_pages", 2112]) for i in range(layers)]
    assert sig(model.graph.input) == [
        ("input_ids", "INT64", ["tokens"]), ("positions", "INT64", ["tokens"]), ("req_idx", "INT32", ["tokens"]),
        ("page_table", "INT32", ["batch", "pages_per_seq"]), ("slot_mapping", "INT64", ["tokens"]),
        ("logits_indices", "INT64", ["logit_rows"]), *pools]
    # an MTP-enabled engine (the tiny checkpoint has one MTP layer) also returns the final-norm hidden states
    assert cfg.mtp_layers > 0
    assert sig(model.graph.output) == [("logits", "FLOAT", ["logit_rows", cfg.model.vocab_size]),
                                      ("hidden", "BFLOAT16", ["tokens", cfg.model.hidden_size]),
                                      *[(n + "_out", t, s) for n, t, s in pools]]
    assert tuple(v.name for v in model.graph.input[:6]) == tensorrt_engine.STEP_INPUTS


def test_checker_and_polygraphy(emitted):
    _, path, model = emitted
    polygraphy = Path(sys.executable).with_name("polygraphy")  # the console script of the build extra
    if not polygraphy.is_file():
        polygraphy = shutil.which("polygraphy")
    assert polygraphy, "polygraphy is not installed (pip install -e '.[build]')"
    onnx.checker.check_model(model, full_check=True)
    r = subprocess.run([str(polygraphy), "inspect", "model", str(path), "--show", "layers"],
                       capture_output=True, text=True, timeout=120)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "Other Opsets: {'dsa': 1}" in log
    for op in PER_LAYER:
        assert f"Op: {op}" in log, f"polygraphy does not list {op}"


def test_tensorrt_contract_and_profile(emitted, f32_graphs, tmp_path):
    cfg, _, model = emitted
    assert tensorrt_problems(model) == []
    shapes = profile_shapes(model, Profile.from_limits(cfg.max_num_tokens, cfg.max_batch, cfg.max_pages_per_seq))
    assert set(shapes) == {v.name for v in model.graph.input}
    assert shapes["input_ids"] == ((1,), (256,), (cfg.max_num_tokens,))
    assert shapes["page_table"][2] == (cfg.max_batch, cfg.max_pages_per_seq)
    assert all(np.prod(s[2]) <= MAX_TENSOR_VOLUME for s in shapes.values())
    # a float32 network's graph: the plugins take bf16 activations; the builder says so before TensorRT
    _, _, f32 = f32_graphs["bf16"]
    problems = tensorrt_problems(f32)
    assert any("DsaMlaCacheWrite" in p and "is FLOAT; TensorRT needs BFLOAT16" in p for p in problems), problems
    path = tmp_path / "f32.onnx"
    onnx.save(f32, str(path))
    with pytest.raises(TensorRTBuildError, match="does not meet the plugin contract"):
        build_plan(path, tmp_path / "x.plan", "unused.so", Profile())


def test_build_options():
    with pytest.raises(BuildError, match="fp8 or bf16 caches"):
        check_onnx_options("aoti", True, "fp32", "cpu", "float32", 1)
    with pytest.raises(BuildError, match="bfloat16 plans for CUDA"):
        check_onnx_options("tensorrt", False, "fp8", "cpu", "float32", 1)
    with pytest.raises(BuildError, match="all-reduce"):
        check_onnx_options("tensorrt", False, "fp8", "cuda", "bfloat16", 2)
    check_onnx_options("aoti", True, "bf16", "cpu", "float32", 2)  # TP graphs can be emitted


# ================================================================ ONNX Runtime against torch
def test_functional_program_equals_network(f32_graphs, ckpt):
    """The rewrite ONNX export starts from (in-place cache writes -> functional ops + pool outputs)
    computes what the network computes, pools included."""
    net, ep, _ = f32_graphs["bf16"]
    fn, pools = functionalize(ep)
    assert pools == [f"mla_pools_{i}" for i in range(3)] + [f"index_pools_{i}" for i in range(3)]
    step = steps(ckpt.config)[0]
    mla, idx = random_pools(ckpt.config, "bf16")
    got = fn.module()(*step.as_tuple(), [p.clone() for p in mla], [p.clone() for p in idx])
    with torch.no_grad():
        want = net(*step.as_tuple(), mla, idx)
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)
    for g, w in zip(got[1:], mla + idx):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class CaptureDsaOps(TorchDispatchMode):
    """Records the arguments of every torch.ops.dsa.* call (eager), in call order."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dsa":
            self.calls.append((func._opname, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)))
        return func(*args, **(kwargs or {}))


def test_fp8_plugin_inputs_match_torch(f32_graphs, ckpt):
    """Sparse fp8 program: what layer 0's plugins receive (the FP8 query from QuantizeLinear, its folded
    weights, the latent, the indexer key, the absorbed query) is plugin-free upstream; ONNX Runtime
    computes it as torch does. fp8: an fp32 reassociation can move an input across an e4m3 rounding
    boundary (one step = 2^-3 relative) -> a handful of entries may differ by one step."""
    net, _, model = f32_graphs["fp8"]
    made_by = producers(model)
    layer0 = {n.op_type: n for n in dsa_nodes(model) if layer_of(n, made_by) == 0}
    wanted = {("mla_cache_write", 0): layer0["DsaMlaCacheWrite"].input[0],
              ("mla_cache_write", 1): layer0["DsaMlaCacheWrite"].input[1],
              ("indexer_k_cache_write", 0): layer0["DsaIndexerKCacheWrite"].input[0],
              ("indexer_logits", 0): layer0["DsaIndexerLogits"].input[0],
              ("indexer_logits", 1): layer0["DsaIndexerLogits"].input[1],
              ("sparse_mla", 0): layer0["DsaSparseMla"].input[0]}
    sub = prune(model, list(wanted.values()))
    assert not dsa_nodes(sub)
    step = steps(ckpt.config)[0]
    mla, idx = allocate_pools(ckpt.config, "fp8", 16)
    sess = ort_session(sub)
    got = dict(zip(wanted, sess.run(None, feeds(sess, step, mla, idx))))
    with CaptureDsaOps() as cap, torch.no_grad():
        net(*step.as_tuple(), mla, idx)
    first = {}
    for op, args in cap.calls:
        first.setdefault(op, args)
    for (op, i), value in got.items():
        want = first[op][i].float()
        have = torch.from_numpy(value)
        if op == "indexer_logits" and i == 0:
            assert first[op][i].dtype == torch.float8_e4m3fn
            off = (have != want).float().mean().item()
            step_rel = ((have - want).abs() / want.abs().clamp(min=2**-9)).max().item()
            assert off < 1e-3 and step_rel <= 0.13, f"fp8 q: {off:.2%} differ, worst {step_rel:.3f} relative"
        else:
            torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5, msg=f"{op} input {i}")


# plugins/reference.py's semantics for bf16 caches as ONNX functions named like the plugin nodes:
# ONNX Runtime resolves each dsa node to the model-local function of that name and domain.
_HEADER = '<domain: "dsa", opset_import: ["" : 21, "dsa_ref" : 1]>\n'
REFERENCE_FUNCTIONS = [r'''<domain: "dsa_ref", opset_import: ["" : 21]>
ScatterRows (rows, slot_mapping, pool) => (pool_out) {
    minus1 = Constant <value_ints = [-1]> ()
    width = Shape <start = -1> (pool)
    row_shape = Concat <axis = 0> (minus1, width)
    flat = Reshape (pool, row_shape)
    flat_f = Cast <to = 1> (flat)
    pads = Constant <value_ints = [0, 0, 1, 0]> ()
    padded = Pad (flat_f, pads)
    n = Shape <start = 0, end = 1> (flat)
    zero = Constant <value_int = 0> ()
    valid = GreaterOrEqual (slot_mapping, zero)
    idx = Where (valid, slot_mapping, n)
    idx2 = Unsqueeze (idx, minus1)
    rows_f = Cast <to = 1> (rows)
    written = ScatterND (padded, idx2, rows_f)
    starts = Constant <value_ints = [0]> ()
    kept = Slice (written, starts, n, starts)
    kept_t = CastLike (kept, pool)
    shape = Shape (pool)
    pool_out = Reshape (kept_t, shape)
}''', _HEADER + r'''DsaMlaCacheWrite <kv_scale, cache_format, plugin_namespace, plugin_version>
    (kv_latent, k_pe, slot_mapping, pool) => (pool_out) {
    rows = Concat <axis = -1> (kv_latent, k_pe)
    pool_out = dsa_ref.ScatterRows (rows, slot_mapping, pool)
}''', _HEADER + r'''DsaIndexerKCacheWrite <cache_format, plugin_namespace, plugin_version>
    (index_k, slot_mapping, pool) => (pool_out) {
    pool_out = dsa_ref.ScatterRows (index_k, slot_mapping, pool)
}''', _HEADER + r'''DsaIndexerLogits <num_heads, cache_format, plugin_namespace, plugin_version>
    (q, weights, pool, page_table, req_idx, seq_lens) => (logits) {
    pages = Gather <axis = 0> (pool, page_table)
    kshape = Constant <value_ints = [0, -1, 128]> ()
    k = Reshape (pages, kshape)
    kf = Cast <to = 1> (k)
    kt = Gather <axis = 0> (kf, req_idx)
    ktt = Transpose <perm = [0, 2, 1]> (kt)
    qf = Cast <to = 1> (q)
    qk = MatMul (qf, ktt)
    s = Relu (qk)
    one = Constant <value_ints = [1]> ()
    w1 = Unsqueeze (weights, one)
    l3 = MatMul (w1, s)
    l = Squeeze (l3, one)
    width = Shape <start = 1, end = 2> (l)
    width0 = Squeeze (width)
    zero = Constant <value_int = 0> ()
    step = Constant <value_int = 1> ()
    cols = Range (zero, width0, step)
    lens = Cast <to = 7> (seq_lens)
    lens2 = Unsqueeze (lens, one)
    beyond = GreaterOrEqual (cols, lens2)
    ninf = Constant <value_float = -inf> ()
    logits = Where (beyond, ninf, l)
}''', _HEADER + r'''DsaTopkTranslate <k, plugin_namespace, plugin_version>
    (logits, lengths, page_table, req_idx) => (slots) {
    zeros = Constant <value_ints = [0]> ()
    one = Constant <value_ints = [1]> ()
    k0 = Constant <value_int: int = @k> ()
    k1 = Unsqueeze (k0, zeros)
    width = Shape <start = 1, end = 2> (logits)
    kk = Min (k1, width)
    width0 = Squeeze (width)
    zero = Constant <value_int = 0> ()
    step = Constant <value_int = 1> ()
    cols = Range (zero, width0, step)
    lens = Cast <to = 7> (lengths)
    lens2 = Unsqueeze (lens, one)
    beyond = GreaterOrEqual (cols, lens2)
    ninf = Constant <value_float = -inf> ()
    masked = Where (beyond, ninf, logits)
    vals, idx = TopK <axis = -1, largest = 1, sorted = 1> (masked, kk)
    valid = Less (idx, lens2)
    rows = Gather <axis = 0> (page_table, req_idx)
    page_size = Constant <value_int = 64> ()
    pg = Div (idx, page_size)
    off = Mod (idx, page_size)
    pages = GatherElements <axis = 1> (rows, pg)
    pages64 = Cast <to = 7> (pages)
    base = Mul (pages64, page_size)
    slot = Add (base, off)
    minus1 = Constant <value_int = -1> ()
    slot_v = Where (valid, slot, minus1)
    tail = Sub (k1, kk)
    pads = Concat <axis = 0> (zeros, zeros, zeros, tail)
    padded = Pad (slot_v, pads, minus1)
    slots = Cast <to = 6> (padded)
}''', _HEADER + r'''DsaSparseMla <num_heads, topk, kv_scale, sm_scale, cache_format, plugin_namespace, plugin_version>
    (q, pool, slots) => (out, lse) {
    minus1 = Constant <value_ints = [-1]> ()
    width = Shape <start = -1> (pool)
    row_shape = Concat <axis = 0> (minus1, width)
    flat = Reshape (pool, row_shape)
    flat_f = Cast <to = 1> (flat)
    zero = Constant <value_int = 0> ()
    zero32 = Cast <to = 6> (zero)
    clamped = Max (slots, zero32)
    kv = Gather <axis = 0> (flat_f, clamped)
    kvt = Transpose <perm = [0, 2, 1]> (kv)
    qf = Cast <to = 1> (q)
    qk = MatMul (qf, kvt)
    sm = Constant <value_float: float = @sm_scale> ()
    scores = Mul (qk, sm)
    valid = GreaterOrEqual (slots, zero32)
    one = Constant <value_ints = [1]> ()
    valid3 = Unsqueeze (valid, one)
    ninf = Constant <value_float = -inf> ()
    masked = Where (valid3, scores, ninf)
    probs = Softmax <axis = -1> (masked)
    lse = ReduceLogSumExp <keepdims = 0> (masked, minus1)
    starts = Constant <value_ints = [0]> ()
    ends = Constant <value_ints = [512]> ()
    axes = Constant <value_ints = [2]> ()
    v = Slice (kv, starts, ends, axes)
    o = MatMul (probs, v)
    out = CastLike (o, q)
}''']


def with_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """The emitted graph, unchanged, plus REFERENCE_FUNCTIONS; bf16 pool I/O cast to float at the
    boundary (numpy has no bf16): inputs ``<pool>_f32``, outputs ``<pool>_out_f32``."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.functions.extend(onnx.parser.parse_function(f) for f in REFERENCE_FUNCTIONS)
    m.opset_import.append(oh.make_opsetid("dsa_ref", 1))
    casts = []
    for v in m.graph.input:
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            casts.append(oh.make_node("Cast", [v.name + "_f32"], [v.name], to=TensorProto.BFLOAT16))
            v.name += "_f32"
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    for v in m.graph.output:
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            m.graph.node.append(oh.make_node("Cast", [v.name], [v.name + "_f32"], to=TensorProto.FLOAT))
            v.name += "_f32"
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in reversed(casts):
        m.graph.node.insert(0, node)
    onnx.checker.check_model(m)
    return m


def test_whole_graph_with_reference_plugins(f32_graphs, ckpt):
    """Every plugin node resolved to its reference function: the full emitted graph in ONNX Runtime
    against the network over three steps (a prefill, a decode reading the pools the prefill wrote,
    a short fresh prefill), logits and every pool after each step.
    Tolerances: fp32 math on both sides, but the bf16 caches round what they store: when fp32
    reassociation moves a value across a bf16 rounding boundary, that entry differs by one bf16 step
    (2^-8..2^-7 relative) and the logits downstream move by ~1e-4 of their scale; a top-k near-tie
    flipping a selection would show as a far larger error."""
    net, _, model = f32_graphs["bf16"]
    sess = ort_session(with_reference(model))
    run = steps(ckpt.config)
    mla, idx = random_pools(ckpt.config, "bf16")
    o_mla, o_idx = [p.clone() for p in mla], [p.clone() for p in idx]
    for i, step in enumerate(run):
        out = sess.run(None, feeds(sess, step, o_mla, o_idx))
        got, pools = torch.from_numpy(out[0]), [torch.from_numpy(x).to(torch.bfloat16) for x in out[1:]]
        o_mla, o_idx = pools[: len(mla)], pools[len(mla):]
        with torch.no_grad():
            want = net(*step.as_tuple(), mla, idx)
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-3, f"step {i}: logits max |diff| {err:.2e} of max |logit|"
        for layer, (a, b) in enumerate(zip(o_mla + o_idx, mla + idx)):
            diff, mag = (a.float() - b.float()).abs(), b.float().abs()
            off = (diff > 0).float().mean().item()
            # at most one bf16 step of the entry (or of 1% of the pool's scale for entries near zero, whose
            # own step is finer than the fp32 noise they are rounded from), in a small fraction of entries
            # that grows with depth as the flips of earlier layers propagate; a systematic error (wrong
            # rounding, wrong slot) would touch most entries or be far larger than a step
            steps_off = (diff / (mag + 1e-2 * mag.max())).max().item()
            assert off < 1e-2 and steps_off <= 2**-7, \
                f"step {i} pool {layer}: {off:.3%} entries differ, worst {steps_off:.2e} relative"


@pytest.mark.parametrize("form", ["mm.dtype", "dsa.f32_linear"])
def test_fp32_linear_translation(form):
    """The CUDA lm_head / router / weights_proj (export/layers.py fp32_linear: dsa::f32_linear, or
    aten::mm.dtype written directly, a bf16 GEMM with fp32 output) become Cast + Cast + MatMul in fp32:
    no aten or dsa node left, and in ONNX Runtime the logits of the fp32 GEMM of the bf16-rounded
    operands (exact products, fp32 sums: float32 tolerance)."""
    from dsa_trt.builder.onnx_export import OPSET, TRANSLATIONS

    class Head(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = torch.nn.Parameter(w, requires_grad=False)

        def forward(self, x):  # the exported CUDA program's call, traced on the CPU
            if form == "mm.dtype":
                return torch.mm(x.to(torch.bfloat16), self.w.t(), out_dtype=torch.float32)
            return torch.ops.dsa.f32_linear(x.to(torch.bfloat16), self.w)

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g)
    ep = torch.export.export(Head(w), (x,))
    target = torch.ops.aten.mm.dtype if form == "mm.dtype" else torch.ops.dsa.f32_linear.default
    assert any(n.target is target for n in ep.graph.nodes)
    model = torch.onnx.export(ep, dynamo=True, custom_translation_table=TRANSLATIONS, opset_version=OPSET,
                              verbose=False).model_proto
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["MatMul"] == 1 and ops["Cast"] >= 2, ops
    got = torch.from_numpy(ort_session(model).run(None, {model.graph.input[0].name: x.numpy()})[0])
    want = x.to(torch.bfloat16).double() @ w.double().t()
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-6, atol=1e-5)


# ================================================================ TensorRT (where it is installed)
def tensorrt_or_skip() -> None:
    import_tensorrt()
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200)")
    lib = plugin_library_path()
    if not lib.is_file():
        pytest.skip(f"{lib} not built: `make trt-plugins TENSORRT_ROOT=...` (plugins/tensorrt/PLUGINS.md)")


@pytest.mark.gpu
@pytest.mark.parametrize("cache_mode", ["fp8", "bf16"])
def test_tensorrt_plan_matches_aoti(tiny_ckpt, tmp_path, cache_mode):
    """The real builder's TensorRT plans against the AOTInductor engine built from the same programs:
    the same kernels behind both (plugins vs torch ops), different fusion of the bf16 dense math, so
    logits agree to bf16 accuracy; the pools are written in place (aliased) and agree byte-for-byte up
    to rare rounding flips."""
    tensorrt_or_skip()
    from dsa_trt.runtime.engine import Engine

    dirs = {}
    for compiler in ("tensorrt", "aoti"):
        dirs[compiler] = tmp_path / compiler
        build_engine(tiny_ckpt, dirs[compiler], cache_mode=cache_mode, compiler=compiler, device="cuda",
                     dtype="bfloat16")
    cfg = EngineConfig.load(dirs["tensorrt"])
    assert cfg.compiler == "tensorrt" and (dirs["tensorrt"] / cfg.plugin_library).is_file()
    engines = {c: Engine.load(d) for c, d in dirs.items()}
    plan = engines["tensorrt"].program
    assert all(src is not None for src in plan.aliased.values()), f"pools copied, not aliased: {plan.aliased}"
    pools = {c: allocate_pools(cfg.model, cache_mode, 16, device="cuda") for c in dirs}
    for i, step in enumerate(steps(cfg.model)):
        step = step.to("cuda")
        got = engines["tensorrt"].forward(step, *pools["tensorrt"])
        want = engines["aoti"].forward(step, *pools["aoti"])
        torch.cuda.synchronize()
        err = (got - want).abs().max().item() / want.abs().max().item()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        print(f"{cache_mode} step {i}: max |diff| {err:.2e} of max |logit|, argmax agreement {agree:.1%}")
        assert err < 3e-2 and agree >= 0.9, f"step {i}: TensorRT vs AOTInductor {err:.2e}, argmax {agree:.1%}"
    for a, b in zip(pools["tensorrt"][0] + pools["tensorrt"][1], pools["aoti"][0] + pools["aoti"][1]):
        frac = (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
        assert frac < 1e-2, f"{frac:.2%} of cache bytes differ between TensorRT and AOTInductor"
