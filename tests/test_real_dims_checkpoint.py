"""The checkpoint generator's presets: the tiny default unchanged, the real-dims one streamed.

The tiny checkpoint is what every other test builds on, so its tensors are pinned by hash to the
output of the generator before the real-dims preset existed (commit 4100e29 of main). The
real-dims preset is written in a child process (its own peak-RSS high-water mark) and read back
through the real checkpoint reader, which validates every tensor against the V3.2 layout.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsa_trt.config import ModelConfig
from dsa_trt.export.checkpoint import Checkpoint, scale_name
from dsa_trt.export.real_dims import LINEAR_STD, V32_DIMS, router_groups
from dsa_trt.export.tiny_checkpoint import main as generator_main
from dsa_trt.export.tiny_checkpoint import write_tiny_checkpoint
from dsa_trt.plan import derived_bytes, make_plan

# sha256 over (name, dtype, shape, bytes) of every tensor, in name order, as written at 4100e29
TINY_TENSORS_SHA256 = {
    "deepseek_v32": "37be3de2d2bd78525a57a0f0f6b01d07188b4dae74da4ca98620e04fde6b1f5e",
    "glm_moe_dsa": "189d14ddaa70e6c2069b38d5f21471e5b3571d4366c6516e969e30cedb9add9d",
}
CI_PRESET = dict(layers=2, experts=8, vocab_size=1024)  # ~1.2 GB: fits the 24 GB, 2-core machine
# The streamed writer holds one 64 MB fp32 row slice and its quantised copy; a layer is ~600 MB.
MAX_RSS_GROWTH = 400 * 10**6


def tensors_sha256(ckpt_dir: Path) -> str:
    tensors = {}
    for shard in sorted(ckpt_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("model_type", sorted(TINY_TENSORS_SHA256))
def test_tiny_default_writes_the_same_tensors(model_type: str, tmp_path: Path) -> None:
    out = write_tiny_checkpoint(tmp_path / model_type, seed=0, model_type=model_type)
    assert tensors_sha256(out) == TINY_TENSORS_SHA256[model_type], (
        f"the tiny {model_type} checkpoint changed: every test's reference data moves with it")


@pytest.mark.parametrize(("experts", "groups"), [(256, (8, 4)), (8, (4, 4)), (16, (8, 4)), (32, (8, 4)),
                                                 (12, (6, 4)), (2, (1, 1))])
def test_router_groups_divide_and_offer_top_k(experts: int, groups: tuple[int, int]) -> None:
    top_k = min(8, experts)
    n_group, topk_group = router_groups(experts, top_k)
    assert (n_group, topk_group) == groups
    assert experts % n_group == 0 and experts // n_group >= min(2, experts)
    assert topk_group * (experts // n_group) >= top_k  # the kept groups hold enough experts


def test_preset_options_are_checked(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        generator_main([str(tmp_path / "a"), "--layers", "2"])  # tiny takes no real-dims options
    assert "only with --preset v32-real-dims" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generator_main([str(tmp_path / "b"), "--preset", "v32-real-dims", "--layers", "2", "--dense-layers", "3"])
    assert "--dense-layers 3 must be in [0, --layers 2]" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_real_dims_preset_streams_the_real_format(tmp_path: Path) -> None:
    out = tmp_path / "v32-real-dims"
    code = ("import json, sys; from dsa_trt.export.real_dims import write_real_dims_checkpoint as w; "
            f"s = w(sys.argv[1], **{CI_PRESET!r}); "
            "print(json.dumps(dict(bytes=s.bytes_written, peak=s.peak_rss_bytes, start=s.start_rss_bytes)))")
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout.splitlines()[-1])
    assert stats["peak"] - stats["start"] < MAX_RSS_GROWTH < stats["bytes"], stats

    with Checkpoint(out) as ckpt:  # validates every tensor's shape and dtype against the layout
        cfg = ckpt.config
        for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "intermediate_size",
                    "moe_intermediate_size", "index_topk", "index_n_heads"):
            assert getattr(cfg, key) == V32_DIMS[key], key
        assert (cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.n_routed_experts) == (2, 1, 8)
        assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (4, 4, 8)
        assert cfg.fp8_weight_block == (128, 128) and cfg.fp8_scale_fmt == "ue8m0"
        kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 576 rows: a partial scale block
        assert ckpt.is_fp8(kv_a) and tuple(ckpt.raw(scale_name(kv_a)).shape) == (5, 56)
        for name in (kv_a, "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
            scale = ckpt.raw(scale_name(name))
            assert torch.equal(torch.exp2(torch.log2(scale).round()), scale), f"{name}: ue8m0 scales are 2^n"
            w = ckpt.get(name)
            assert abs(w.std().item() / LINEAR_STD - 1) < 0.05, f"{name}: std {w.std().item():.4f}"
        assert ckpt.raw("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
        assert ckpt.raw("model.layers.0.self_attn.indexer.weights_proj.weight").dtype == torch.bfloat16

    # the plan counts exactly what the generator stored, as the engine holds it: kv_b in bf16 without its
    # scale, plus the derived buffers (dsa_trt/plan.py)
    cfg = ModelConfig.from_json(out)
    rows, cols = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank
    kv_b = rows * cols * (2 - 1) - math.ceil(rows / 128) * math.ceil(cols / 128) * 4
    engine_bytes = stats["bytes"] + cfg.num_hidden_layers * kv_b + derived_bytes(cfg, include_mtp=False)
    assert make_plan(cfg, 1, 1, 141.0).ranks[0].weight_bytes == engine_bytes
    assert math.isclose(stats["bytes"], sum(p.stat().st_size for p in out.glob("*.safetensors")), rel_tol=1e-4)
