"""The step contract (dsa_trt/step.py): one field table, and what derives from it agrees with it.

Built steps carry the table's dtypes and shapes; the network takes the table's inputs by name; the
tensor-parallel broadcast, the CUDA-graph padding, the ONNX dim names, the export dynamic shapes
and the Triton step model are all read off the same table.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from dsa_trt import step as S
from dsa_trt.cache_layout import PAGE_SIZE
from dsa_trt.config import ModelConfig
from dsa_trt.engine_config import EngineConfig
from dsa_trt.export.network import DSAForCausalLM
from dsa_trt.export.tiny_checkpoint import tiny_config_dict
from dsa_trt.runtime import distributed
from dsa_trt.runtime.cuda_graphs import Uniform, pad_uniform, uniform_shape
from dsa_trt.runtime.triton.repository import step_model_io


def _steps(topk: int) -> dict[str, S.StepInputs]:
    return {
        "prefill": S.StepInputs.build([(list(range(2, 92)), 0, [7, 3]), (list(range(5, 35)), 0, [11])]),
        "decode": S.StepInputs.build([([17], 90, [7, 3]), ([9], 30, [11])]),
        "mixed_all_logits": S.StepInputs.build([(list(range(3, 13)), 60, [4, 2]), ([5], 7, [9])],
                                               logits_for="all"),
    }


def _check_against_table(step: S.StepInputs) -> None:
    sizes = step.dim_sizes()
    for f, t in zip(S.STEP_FIELDS, step.as_tuple()):
        assert t.dtype == f.dtype, f.name
        assert tuple(t.shape) == tuple(sizes[d] for d in f.dims), f.name  # one size per dim name


@pytest.mark.parametrize("name", ["prefill", "decode", "mixed_all_logits"])
def test_built_steps_follow_the_table(name):
    step = _steps(2048)[name]
    _check_against_table(step)
    moved = step.to("cpu")
    assert all(torch.equal(a, b) for a, b in zip(moved.as_tuple(), step.as_tuple()))


def test_build_semantics():
    step = S.StepInputs.build([(list(range(3, 13)), 60, [4, 2]), ([5], 7, [9])])
    # token i of sequence 0 sits at position 60 + i: pages [4, 2] hold positions [0, 64) and [64, 128)
    expected = [(4 if p < PAGE_SIZE else 2) * PAGE_SIZE + p % PAGE_SIZE for p in range(60, 70)] + [9 * PAGE_SIZE + 7]
    assert step.slot_mapping.tolist() == expected
    assert step.req_idx.tolist() == [0] * 10 + [1] and step.logits_indices.tolist() == [9, 10]
    with pytest.raises(ValueError, match="sequence 0: 1 pages cannot hold 65 tokens"):
        S.StepInputs.build([(list(range(65)), 0, [0])])
    with pytest.raises(ValueError, match="sequence 1 has no new tokens"):
        S.StepInputs.build([([1], 0, [0]), ([], 0, [1])])


def test_network_takes_the_table_inputs_in_order():
    """torch.export names the program inputs after forward's parameters: they are the contract."""
    params = list(inspect.signature(DSAForCausalLM.forward).parameters)[1:]
    assert tuple(params) == S.STEP_INPUT_NAMES + S.POOL_INPUTS


@pytest.mark.parametrize("name", ["prefill", "decode", "mixed_all_logits"])
def test_tensor_parallel_broadcast_round_trip(name):
    step = _steps(16)[name]
    header, payload = distributed._pack(step, 40, torch.device("cpu"))
    header = header.tolist()
    assert len(header) == distributed.HEADER_LEN and header[distributed.POOL_PAGES_AT] == 40
    assert distributed._payload_len(header) == payload.numel()
    back = distributed._unpack(header, payload)
    for f, a, b in zip(S.STEP_FIELDS, back.as_tuple(), step.as_tuple()):
        assert a.dtype == b.dtype and torch.equal(a, b), f.name


def test_padding_rows_write_nowhere_and_read_page_zero():
    sizes = {"tokens": 4, "batch": 4, "pages_per_seq": 8, "logit_rows": 4}
    pad = S.StepInputs.padding(sizes)
    _check_against_table(pad)
    assert (pad.slot_mapping == -1).all() and (pad.page_table == 0).all() and (pad.positions == 0).all()
    assert pad.req_idx.tolist() == list(range(4)) and pad.logits_indices.tolist() == list(range(4))


def test_graph_bucket_holds_the_step_then_padding():
    """What a CUDA-graph replay reads (runtime/cuda_graphs.py): each real sequence's tokens last in
    its q rows, the contract's padding everywhere else (slot -1, page 0), padding rows of a real
    sequence at its first new position, the bucket's fixed row fields."""
    step = S.StepInputs.build([([17, 4, 5], 90, [7, 3]), ([9], 30, [11])])  # an MTP draft pass: last rows
    shape = uniform_shape(step)
    assert shape == Uniform(3, all_logits=False)
    padded, dst = pad_uniform(step, shape, 4, 16)
    _check_against_table(padded)
    assert dst.tolist() == [0, 1, 2, 5]
    assert padded.input_ids[dst].tolist() == [17, 4, 5, 9] and padded.slot_mapping[dst].tolist() == step.slot_mapping.tolist()
    assert padded.positions.tolist() == [90, 91, 92, 30, 30, 30] + [0] * 6
    rest = torch.ones(12, dtype=torch.bool)
    rest[dst] = False
    assert (padded.slot_mapping[rest] == -1).all()
    assert padded.req_idx.tolist() == [r // 3 for r in range(12)] and padded.logits_indices.tolist() == [2, 5, 8, 11]
    assert padded.page_table[:2, :2].tolist() == [[7, 3], [11, 0]] and (padded.page_table[2:] == 0).all()
    verify = S.StepInputs.build([([1, 2, 3], 10, [1]), ([4, 5, 6], 70, [2, 3])], logits_for="all")
    assert uniform_shape(verify) == Uniform(3, all_logits=True)
    assert uniform_shape(_steps(16)["decode"]) == Uniform(1, all_logits=True)
    assert uniform_shape(_steps(16)["mixed_all_logits"]) is None  # 10 + 1 tokens, every row a logits row


def test_export_dims_and_dynamic_shapes():
    dims = S.export_dims(max_num_tokens=512, max_batch=8, max_pages_per_seq=16)
    assert set(dims) == {d.name for d in S.STEP_DIMS} | {S.POOL_PAGES.name}
    shapes = S.dynamic_shapes(dims, num_layers=3)
    assert len(shapes) == len(S.STEP_FIELDS) + len(S.POOL_INPUTS)
    for f, spec in zip(S.STEP_FIELDS, shapes):
        assert [spec[axis] for axis in range(len(f.dims))] == [dims[d] for d in f.dims]
    for pools in shapes[len(S.STEP_FIELDS):]:
        assert pools == [{0: dims["pool_pages"]}] * 3
    bounds = S.dim_bounds(512, 8, 16)
    assert bounds["tokens"] == (1, 512) and bounds["logit_rows"] == (1, 512) and bounds["batch"] == (1, 8)
    with pytest.raises(ValueError, match="dim batch: max 0 .from max_batch. is below its min 1"):
        S.dim_bounds(512, 0, 16)


def test_onnx_dim_names_name_every_dim_once():
    names = S.onnx_dim_names()
    assert sorted(names.values()) == sorted({d.name for d in S.STEP_DIMS} | {S.POOL_PAGES.name})
    fields = {f.name: f for f in S.STEP_FIELDS}
    for (inp, axis), dim in names.items():
        if inp in fields:
            assert fields[inp].dims[axis] == dim
        else:
            assert inp == S.pool_input_name("mla_pools", 0) and dim == S.POOL_PAGES.name


@pytest.mark.parametrize("mode", ["fp8", "bf16"])
def test_triton_step_model_inputs_follow_the_table(mode):
    model = ModelConfig.from_hf_dict(tiny_config_dict())
    cfg = EngineConfig(model, mode, "bfloat16", "cuda", "tensorrt", kv_scales=[1.0] * model.num_hidden_layers)
    ins, outs = step_model_io(cfg)
    step_ins = ins[: len(S.STEP_FIELDS)]
    assert [i.name for i in step_ins] == list(S.STEP_INPUT_NAMES)
    dtypes = {torch.int64: "TYPE_INT64", torch.int32: "TYPE_INT32"}
    assert [(i.data_type, len(i.dims)) for i in step_ins] == [(dtypes[f.dtype], len(f.dims)) for f in S.STEP_FIELDS]
    pools = ins[len(S.STEP_FIELDS):]
    assert [p.name for p in pools[:2]] == ["mla_pools_0", "index_pools_0"]
    assert len(pools) == len(S.POOL_INPUTS) * model.num_hidden_layers
    assert [o.name for o in outs] == [S.LOGITS] + [p.name + S.POOL_OUTPUT_SUFFIX for p in pools]


def test_pool_input_name_rejects_unknown_kinds():
    assert S.pool_input_name("index_pools", 3) == "index_pools_3"
    with pytest.raises(ValueError, match="pool kind 'kv_pools' not in"):
        S.pool_input_name("kv_pools", 0)
