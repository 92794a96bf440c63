"""The tiny default checkpoint (writer) and the checkpoint reader, on real files on disk.

Format checks read the safetensors headers directly (not through the reader); dequantization is
checked against an index-arithmetic reference and against the bf16 master; every validation
error is triggered by a checkpoint corrupted on disk.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsa_trt.config import ModelConfig
from dsa_trt.export.checkpoint import Checkpoint, CheckpointError, expected_tensors
from dsa_trt.export.tiny_checkpoint import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_tiny_master,
    write_dequantized_hf_copy,
    write_tiny_checkpoint,
)

INDEX = "model.safetensors.index.json"
BLOCK = 128
E4M3_MANTISSA_BITS = 3
E4M3_MIN_SUBNORMAL_EXP = -9  # smallest e4m3 subnormal is 2^-9 (in units of the block scale)
FP8_LINEAR_SUFFIXES = (
    "q_a_proj.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
    "indexer.wq_b.weight",
    "indexer.wk.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def hf_copy_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dequantized_hf_copy(tiny_dir, tmp_path_factory.mktemp("tiny_bf16"))


def _headers(ckpt_dir: Path) -> dict[str, tuple[str, list[int], str]]:
    """name -> (shard file, shape, safetensors dtype), read straight from the shards."""
    out = {}
    for shard in sorted(ckpt_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                out[name] = (shard.name, view.get_shape(), view.get_dtype())
    return out


# ------------------------------------------------------------------------------ the writer
def test_generator_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_checkpoint(tmp_path / "again", seed=0)
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for file in files:
        assert (tiny_dir / file).read_bytes() == (again / file).read_bytes(), f"{file} differs between runs"


def test_other_seed_gives_other_weights(tiny_dir: Path) -> None:
    a, b = build_tiny_master(seed=0), build_tiny_master(seed=1)
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(a[bias], b[bias])


def test_real_fp8_format(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32"
    assert config["architectures"] == ["DeepseekV32ForCausalLM"]
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "scale_fmt": "ue8m0",
    }
    headers = _headers(tiny_dir)
    weight_map = json.loads((tiny_dir / INDEX).read_text())["weight_map"]
    assert len({file for file, _, _ in headers.values()}) >= 2
    assert weight_map == {name: file for name, (file, _, _) in headers.items()}

    fp8 = [n for n in headers if n.endswith(FP8_LINEAR_SUFFIXES)]
    assert len(fp8) == 4 * 7 + 3 + 3 * (3 * 9)  # 4 layers' attention, 1 dense MLP, 3 MoE (8 + 1 shared)
    for name in fp8:
        _, shape, dtype = headers[name]
        assert dtype == "F8_E4M3", name
        _, scale_shape, scale_dtype = headers[name + "_scale_inv"]
        assert scale_dtype == "F32", name
        assert scale_shape == [math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)], name
    assert headers["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][1] == [576, 256]
    assert headers["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"][1] == [5, 2]

    bf16 = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.3.eh_proj.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"]
    bf16 += [n for n in headers if n.endswith(("mlp.gate.weight", "indexer.weights_proj.weight"))]
    for name in bf16:
        assert headers[name][2] == "BF16", name
    assert headers["model.layers.3.eh_proj.weight"][1] == [256, 512]
    fp32 = [n for n in headers if n.endswith(("norm.weight", "k_norm.bias", "e_score_correction_bias"))]
    assert len(fp32) == 1 + 4 * 6 + 3 + 3  # final norm; per layer 4 norms + k_norm; MoE biases; MTP norms
    for name in fp32:
        assert headers[name][2] == "F32", name
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.3.mlp.experts.{e}.{proj}.weight" in headers  # MTP layer is MoE too


def test_scales_are_powers_of_two(tiny_dir: Path) -> None:
    for shard in sorted(tiny_dir.glob("*.safetensors")):
        for name, scale in load_file(shard).items():
            if name.endswith("_scale_inv"):
                log2 = torch.log2(scale)
                assert torch.equal(log2, log2.round()), f"{name}: scale not a power of two"


def _reference_dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(weight.shape[0]) // BLOCK
    cols = torch.arange(weight.shape[1]) // BLOCK
    return weight.float() * scale[rows][:, cols]


def test_dequantization_within_fp8_rounding_of_master(tiny_dir: Path) -> None:
    master = build_tiny_master(seed=0)
    ckpt = Checkpoint(tiny_dir, include_mtp=True)
    fp8_names = [n for n in ckpt.names() if ckpt.is_fp8(n)]
    assert len(fp8_names) == 4 * 7 + 3 + 3 * 27
    for name in fp8_names:
        scale = ckpt.raw(name + "_scale_inv")
        got = ckpt.get(name)
        assert torch.equal(got, _reference_dequant(ckpt.raw(name), scale)), name
        # Round-to-nearest e4m3 in units of the block scale s: relative error <= 2^-4 for normal
        # values, absolute error <= s * 2^-10 (half the smallest subnormal) near zero.
        want = master[name].float()
        s = scale[torch.arange(want.shape[0]) // BLOCK][:, torch.arange(want.shape[1]) // BLOCK]
        bound = want.abs() * 2.0 ** -(E4M3_MANTISSA_BITS + 1) + s * 2.0 ** (E4M3_MIN_SUBNORMAL_EXP - 1)
        excess = (got - want).abs() - bound
        worst = excess.argmax()
        assert excess.max() <= 0, f"{name}: error exceeds fp8 rounding by {excess.max():.3g} at flat index {worst}"
    for name in ckpt.names():  # unquantized tensors are stored exactly
        if not ckpt.is_fp8(name):
            assert torch.equal(ckpt.get(name), master[name].float()), name


def test_tokenizer(tiny_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    assert (tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)) == (0, 1)
    text = "The keeper wrote down the weather twice a day, 42 times."
    ids = tokenizer.encode(text).ids
    assert ids[0] == 0 and max(ids) < 512 and len(ids) < len(text)
    assert tokenizer.decode(ids) == text
    tokenizer_config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == (BOS_TOKEN, EOS_TOKEN)


# ------------------------------------------------------------------------------ the HF oracle
def test_hf_loads_dequantized_copy(tiny_dir: Path, hf_copy_dir: Path) -> None:
    from transformers import DeepseekV32ForCausalLM

    model, info = DeepseekV32ForCausalLM.from_pretrained(hf_copy_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ckpt = Checkpoint(tiny_dir)
    layer = model.model.layers[1]
    i = ckpt.config.moe_intermediate_size
    assert torch.equal(layer.mlp.experts.gate_up_proj[5, :i], ckpt.get("model.layers.1.mlp.experts.5.gate_proj.weight"))
    assert torch.equal(layer.mlp.experts.gate_up_proj[5, i:], ckpt.get("model.layers.1.mlp.experts.5.up_proj.weight"))
    assert torch.equal(
        layer.self_attn.kv_a_proj_with_mqa.weight, ckpt.get("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    )
    bias = ckpt.get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert torch.equal(layer.mlp.gate.e_score_correction_bias, bias)

    ids = torch.randint(2, 512, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits  # [4, 24, 512]
    assert torch.isfinite(logits).all()
    # Later tests compare greedy tokens across bf16/fp8 paths: the random model must not be flat.
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).median() > 0.5


def test_dequantized_copy_is_a_valid_unquantized_checkpoint(tiny_dir: Path, hf_copy_dir: Path) -> None:
    copy = Checkpoint(hf_copy_dir)
    assert copy.config.fp8_weight_block is None and copy.config.num_nextn_predict_layers == 0
    fp8 = Checkpoint(tiny_dir)
    assert copy.names() == fp8.names()
    for name in ("model.layers.2.self_attn.o_proj.weight", "model.layers.0.self_attn.q_a_layernorm.weight"):
        assert torch.equal(copy.get(name), fp8.get(name))
    assert copy.raw("model.layers.2.self_attn.o_proj.weight").dtype == torch.bfloat16


def test_single_file_checkpoint_without_index(hf_copy_dir: Path, tmp_path: Path) -> None:
    single = tmp_path / "single"
    single.mkdir()
    tensors = {}
    for shard in sorted(hf_copy_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    save_file(tensors, str(single / "model.safetensors"))
    for file in ("config.json", "tokenizer.json"):
        shutil.copyfile(hf_copy_dir / file, single / file)
    assert Checkpoint(single).names() == Checkpoint(hf_copy_dir).names()


def test_glm_variant(tmp_path: Path) -> None:
    from transformers import GlmMoeDsaForCausalLM

    src = write_tiny_checkpoint(tmp_path / "glm", model_type="glm_moe_dsa")
    ckpt = Checkpoint(src, include_mtp=True)
    assert ckpt.config.model_type == "glm_moe_dsa" and ckpt.config.index_n_heads == 32
    assert ckpt.raw("model.layers.0.self_attn.indexer.weights_proj.weight").shape == (32, 256)
    copy = write_dequantized_hf_copy(src, tmp_path / "glm_bf16")
    _, info = GlmMoeDsaForCausalLM.from_pretrained(copy, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


# ------------------------------------------------------------------------------ the reader
def test_layout_table_matches_real_v32_tensor_count() -> None:
    """The real DeepSeek-V3.2 release holds 92,425 tensors."""
    cfg = ModelConfig.from_hf_dict(
        dict(
            model_type="deepseek_v32", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
            num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
            first_k_dense_replace=3, intermediate_size=18432, moe_intermediate_size=2048,
            n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
            routed_scaling_factor=2.5, max_position_embeddings=163840, num_nextn_predict_layers=1,
            rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096),
            quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128], scale_fmt="ue8m0"),
        )
    )
    specs = expected_tensors(cfg)
    assert len(specs) == 92_425
    assert specs["model.layers.61.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 56)
    assert specs["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].shape == (256, 4)
    assert specs["model.layers.3.mlp.experts.255.down_proj.weight_scale_inv"].shape == (56, 16)
    assert specs["model.layers.61.eh_proj.weight"].shape == (7168, 14336)
    assert specs["model.layers.60.self_attn.indexer.weights_proj.weight"].dtypes[0] == torch.bfloat16


def test_reader_scope(tiny_dir: Path) -> None:
    main = Checkpoint(tiny_dir)
    assert not any(n.startswith("model.layers.3.") for n in main.names())
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" in main.names(include_scales=True)
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" not in main.names()
    with pytest.raises(KeyError, match="include_mtp"):
        main.get("model.layers.3.eh_proj.weight")
    with_mtp = Checkpoint(tiny_dir, include_mtp=True)
    assert with_mtp.get("model.layers.3.eh_proj.weight", torch.bfloat16).shape == (256, 512)
    assert main.tokenizer_path == tiny_dir / "tokenizer.json"
    assert main.config.num_hidden_layers == 3 and main.config.fp8_weight_block == (128, 128)


# ------------------------------------------------------------------- corrupted checkpoints
def _copy(tiny_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


def _edit_shard(
    ckpt_dir: Path, near: str, edit: Callable[[dict[str, torch.Tensor]], None], sync_index: bool = True
) -> None:
    """Rewrite the shard holding ``near`` after ``edit`` changes its tensors; keep the index in step."""
    index_path = ckpt_dir / INDEX
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][near]
    tensors = load_file(ckpt_dir / shard)
    before = set(tensors)
    edit(tensors)
    save_file(tensors, str(ckpt_dir / shard), metadata={"format": "pt"})
    if sync_index:
        for name in before - set(tensors):
            del index["weight_map"][name]
        index["weight_map"].update((name, shard) for name in set(tensors) - before)
        index_path.write_text(json.dumps(index))


def _edit_config(ckpt_dir: Path, **changes: object) -> None:
    config = json.loads((ckpt_dir / "config.json").read_text())
    config.update(changes)
    (ckpt_dir / "config.json").write_text(json.dumps(config))


def _drop_config_key(ckpt_dir: Path, key: str) -> None:
    config = json.loads((ckpt_dir / "config.json").read_text())
    config.pop(key)
    (ckpt_dir / "config.json").write_text(json.dumps(config))


def _problems(ckpt_dir: Path, include_mtp: bool = False) -> list[str]:
    with pytest.raises(CheckpointError) as info:
        Checkpoint(ckpt_dir, include_mtp=include_mtp)
    assert str(ckpt_dir) in str(info.value)
    return info.value.problems


def _drop(ckpt_dir: Path, name: str, sync_index: bool = True) -> None:
    _edit_shard(ckpt_dir, name, lambda t: t.pop(name), sync_index)


def _replace(ckpt_dir: Path, name: str, new: Callable[[torch.Tensor], torch.Tensor]) -> None:
    _edit_shard(ckpt_dir, name, lambda t: t.update({name: new(t[name])}))


def _add_copy(ckpt_dir: Path, name: str, new_name: str) -> None:
    _edit_shard(ckpt_dir, name, lambda t: t.update({new_name: t[name].clone()}))


EXPERT_UP = "model.layers.1.mlp.experts.3.up_proj.weight"
NO_SUCH_EXPERT = "model.layers.1.mlp.experts.8.up_proj.weight"  # n_routed_experts is 8
Q_A_NORM = "model.layers.0.self_attn.q_a_layernorm.weight"
O_PROJ = "model.layers.2.self_attn.o_proj.weight"
KV_A_SCALE = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
# case -> (corrupt the copied checkpoint, texts the one reported problem must contain)
CORRUPTIONS: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "missing tensor": (
        lambda d: _drop(d, EXPERT_UP),
        ["missing tensor", EXPERT_UP],
    ),
    "missing tensor still in index": (
        lambda d: _drop(d, EXPERT_UP, sync_index=False),
        ["missing tensor", EXPERT_UP, "does not hold it"],
    ),
    "unexpected tensor": (
        lambda d: _add_copy(d, EXPERT_UP, NO_SUCH_EXPERT),
        ["unexpected tensor", NO_SUCH_EXPERT, "n_routed_experts=8"],
    ),
    "wrong shape": (
        lambda d: _replace(d, Q_A_NORM, lambda t: t[:64].clone()),
        ["wrong shape", Q_A_NORM, "[64]", "[128]"],
    ),
    "wrong dtype": (
        lambda d: _replace(d, O_PROJ, lambda t: t.bfloat16()),
        ["wrong dtype", O_PROJ, "BF16", "F8_E4M3"],
    ),
    "wrong dtype of a norm": (
        lambda d: _replace(d, "model.norm.weight", lambda t: t.half()),
        ["wrong dtype", "model.norm.weight", "F16"],
    ),
    "missing weight_scale_inv": (
        lambda d: _drop(d, KV_A_SCALE),
        ["missing weight_scale_inv", KV_A_SCALE, "[5, 2]"],
    ),
    "unsupported model_type": (
        lambda d: _edit_config(d, model_type="llama"),
        ["model_type", "llama"],
    ),
    "missing config field": (
        lambda d: _drop_config_key(d, "index_topk"),
        ["index_topk"],
    ),
    "no config.json": (
        lambda d: (d / "config.json").unlink(),
        ["config.json"],
    ),
    "missing shard file": (
        lambda d: (d / "model-00002-of-00004.safetensors").unlink(),
        ["model-00002-of-00004.safetensors", "missing"],
    ),
    "no tokenizer.json": (
        lambda d: (d / "tokenizer.json").unlink(),
        ["tokenizer.json"],
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_checkpoint_is_reported(case: str, tiny_dir: Path, tmp_path: Path) -> None:
    corrupt, must_mention = CORRUPTIONS[case]
    ckpt_dir = _copy(tiny_dir, tmp_path)
    corrupt(ckpt_dir)
    problems = _problems(ckpt_dir)
    assert len(problems) == 1, f"{case}: expected exactly one problem, got {problems}"
    for text in must_mention:
        assert text in problems[0], f"{case}: {text!r} not in {problems[0]!r}"


def test_every_problem_is_reported_at_once(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt_dir = _copy(tiny_dir, tmp_path)
    for case in ("missing tensor", "wrong shape", "wrong dtype", "missing weight_scale_inv", "no tokenizer.json"):
        CORRUPTIONS[case][0](ckpt_dir)
    problems = _problems(ckpt_dir)
    assert len(problems) == 5, problems


def test_config_error_still_reports_files(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt_dir = _copy(tiny_dir, tmp_path)
    _edit_config(ckpt_dir, model_type="llama")
    (ckpt_dir / "tokenizer.json").unlink()
    (ckpt_dir / "model-00003-of-00004.safetensors").unlink()
    problems = _problems(ckpt_dir)
    assert len(problems) == 3, problems


def test_missing_mtp_tensor_matters_only_with_include_mtp(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt_dir = _copy(tiny_dir, tmp_path)
    name = "model.layers.3.hnorm.weight"
    _drop(ckpt_dir, name)
    Checkpoint(ckpt_dir)  # the engine does not need the MTP layer
    problems = _problems(ckpt_dir, include_mtp=True)
    assert len(problems) == 1 and name in problems[0]
    # present MTP tensors are validated even when not needed
    _replace(ckpt_dir, "model.layers.3.enorm.weight", lambda t: t[:3].clone())
    assert "model.layers.3.enorm.weight" in _problems(ckpt_dir)[0]
