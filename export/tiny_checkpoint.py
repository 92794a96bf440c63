"""The embedded default checkpoint: a tiny random DeepSeek-V3.2 (or GLM-5) in the real format.

``write_tiny_checkpoint`` builds TINY_CONFIG (below) with transformers, random-inits it
from a seed, and writes it the way the real V3.2 release is stored: fp8 e4m3 Linears with
power-of-two (ue8m0) fp32 block scales, bf16/fp32 for the rest, per-expert names, the MTP layer
as ``model.layers.3``, several shards plus an index, and a byte-level BPE tokenizer trained on
``data/corpus.txt``. Same seed, same bytes.

``write_dequantized_hf_copy`` turns such a checkpoint into a bf16 one that
``DeepseekV32ForCausalLM.from_pretrained`` reads on CPU (it cannot read the fp8 block format
there, §7.3): the HF oracle for the tests, with exactly the same weights.

    python -m dsa_trt.export.tiny_checkpoint OUT_DIR [--seed N] [--model-type glm_moe_dsa]

The ``v32-real-dims`` preset (export/real_dims.py) writes V3.2's real per-layer dims with random
weights instead, streamed one tensor at a time:

    python -m dsa_trt.export.tiny_checkpoint OUT_DIR --preset v32-real-dims --layers 2 --experts 8

``write_trained_checkpoint`` (``--trained``) writes the same format with the weights trained on
the corpus by ``export/train_tiny.py`` (committed as ``data/tiny_trained.safetensors``) instead.
That is the demo's default (``make engine`` writes ``checkpoints/tiny-v32-trained`` with it); the
plain command stays the random seed-0 checkpoint, the tests' oracle checkpoint (conftest's
``tiny_ckpt``), whose fidelity margins were tuned on random weights (LM_HEAD_STD).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dsa_trt.config import ModelConfig
from dsa_trt.export.checkpoint import (
    FP8,
    INDEX_FILE,
    SCALE_SUFFIX,
    TOKENIZER_FILE,
    Checkpoint,
    expected_tensors,
    quantize_fp8_blockwise,
    scale_name,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
TRAINED_WEIGHTS_PATH = Path(__file__).parent / "data" / "tiny_trained.safetensors"  # by export/train_tiny.py
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
ARCHITECTURE = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}

# DeepSeek-V3.2's own config (spec/MODEL.md section 1.1; HF's DeepseekV32Config defaults are the
# same values) but for the layer counts: the base of the tiny model and of the v32-real-dims preset
V32_DIMS = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    hidden_act="silu",
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
# The tiny model: the real one's widths, head and expert counts scaled down; its DSA structure (MLA,
# indexer, MoE, MTP), head dims, latent and index dims, RoPE and routing kept
TINY_CONFIG = dict(
    V32_DIMS,
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    index_topk=16,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    num_nextn_predict_layers=1,
)
# GLM-5's differences from V3.2 at the tiny size; every layer keeps its own indexer (no shared layers)
GLM_OVERRIDES = dict(
    index_n_heads=32,
    n_group=1,
    topk_group=1,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
)
QUANTIZATION_CONFIG = dict(
    quant_method="fp8",
    fmt="e4m3",
    activation_scheme="dynamic",
    weight_block_size=[128, 128],
    scale_fmt="ue8m0",
)

# Perturbations of the parameters HF initializes to trivial values, so that they matter (§7.2).
NORM_WEIGHT_STD = 0.1  # RMSNorm / LayerNorm weights: 1 + N(0, 0.1)
K_NORM_BIAS_STD = 0.1
E_SCORE_BIAS_STD = 0.05
# HF's 0.02 init gives nearly flat next-token logits (median top-2 gap 0.05), so
# greedy tests would flip on bf16 rounding. With a 0.3 lm_head the logits have std ~5 and the
# median top-2 gap 1.2 (seed 0, random prompts; tests/test_checkpoint.py asserts > 0.5).
LM_HEAD_STD = 0.3
EH_PROJ_STD = 0.02
MAX_SHARD_BYTES = 4 << 20  # ~12 MB in all -> 4 shards


# --------------------------------------------------------------------------- the model
def tiny_hf_config(model_type: str = "deepseek_v32", num_hidden_layers: int | None = None) -> PretrainedConfig:
    """The transformers config object of the tiny model (``num_hidden_layers`` overrides 3)."""
    # transformers is a build/test dependency, not a runtime one: imported only where needed.
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} not supported; choose one of {MODEL_TYPES}")
    kwargs = dict(TINY_CONFIG)
    if model_type == "glm_moe_dsa":
        kwargs.update(GLM_OVERRIDES)
    if num_hidden_layers is not None:
        kwargs["num_hidden_layers"] = num_hidden_layers
    config_class = DeepseekV32Config if model_type == "deepseek_v32" else GlmMoeDsaConfig
    config = config_class(**kwargs)
    config.architectures = [ARCHITECTURE[model_type]]
    return config


def tiny_config_dict(model_type: str = "deepseek_v32", quantized: bool = True) -> dict:
    """The config.json contents of the tiny checkpoint."""
    return hf_config_dict(tiny_hf_config(model_type), quantized)


def hf_config_dict(config: PretrainedConfig, quantized: bool = True) -> dict:
    """config.json contents for a transformers config: bf16, only what differs from the class
    defaults, no bookkeeping keys, and the release's fp8 quantization_config when quantized."""
    config.dtype = torch.bfloat16
    d = json.loads(config.to_json_string(use_diff=True))
    for key in ("transformers_version", "_name_or_path", "id2label", "label2id"):
        d.pop(key, None)
    if quantized:
        d["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return d


def build_tiny_master(seed: int = 0, model_type: str = "deepseek_v32") -> dict[str, torch.Tensor]:
    """The bf16 master weights, MTP layer included, under the checkpoint's names.

    Linears, embeddings and the router are bf16; norms and biases fp32 (the unquantized layout
    of ``expected_tensors``). The fp8 checkpoint is this, block-quantized."""
    cfg = ModelConfig.from_hf_dict(tiny_config_dict(model_type, quantized=False))
    # The MTP layer's attention + MoE block is one more decoder layer of the same model.
    hf_state = _hf_random_state(seed, model_type, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    generator = torch.Generator().manual_seed(seed)
    d, v = cfg.hidden_size, cfg.vocab_size
    for layer in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{layer}."
        hf_state[p + "enorm.weight"] = torch.ones(d)
        hf_state[p + "hnorm.weight"] = torch.ones(d)
        hf_state[p + "shared_head.norm.weight"] = torch.ones(d)
        hf_state[p + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=generator) * EH_PROJ_STD
        # DeepSeek's MTP module shares the main embedding and output head; the checkpoint stores copies.
        hf_state[p + "embed_tokens.weight"] = hf_state["model.embed_tokens.weight"]
        hf_state[p + "shared_head.head.weight"] = hf_state["lm_head.weight"]

    specs = expected_tensors(cfg)
    if set(hf_state) != set(specs):
        raise RuntimeError(
            "transformers' tensor names no longer match the checkpoint layout: "
            f"only in HF {sorted(set(hf_state) - set(specs))}, only in layout {sorted(set(specs) - set(hf_state))}"
        )
    master = {}
    for name in sorted(specs):
        w = hf_state[name].float()
        if name.endswith("norm.weight"):
            w = w + NORM_WEIGHT_STD * torch.randn(w.shape, generator=generator)
        elif name.endswith("k_norm.bias"):
            w = w + K_NORM_BIAS_STD * torch.randn(w.shape, generator=generator)
        elif name.endswith("e_score_correction_bias"):
            w = w + E_SCORE_BIAS_STD * torch.randn(w.shape, generator=generator)
        master[name] = w.to(specs[name].dtypes[0]).contiguous()
    return master


def _hf_random_state(seed: int, model_type: str, num_layers: int) -> dict[str, torch.Tensor]:
    """HF's random init under ``seed`` (global RNG forked, so callers' RNG is untouched), with the
    experts un-fused to per-expert names and lm_head rescaled."""
    from transformers import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM

    model_class = DeepseekV32ForCausalLM if model_type == "deepseek_v32" else GlmMoeDsaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(tiny_hf_config(model_type, num_hidden_layers=num_layers))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state["lm_head.weight"] = torch.randn(state["lm_head.weight"].shape) * LM_HEAD_STD
    for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gate_up = state.pop(name)  # [E, 2I, D]: gate rows first, then up
        down = state.pop(prefix + "down_proj")  # [E, D, I]
        gate, up = gate_up.chunk(2, dim=1)
        for e in range(gate_up.shape[0]):
            state[f"{prefix}{e}.gate_proj.weight"] = gate[e]
            state[f"{prefix}{e}.up_proj.weight"] = up[e]
            state[f"{prefix}{e}.down_proj.weight"] = down[e]
    return state


# ---------------------------------------------------------------------------- writing
def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0, model_type: str = "deepseek_v32") -> Path:
    """Write the tiny fp8 checkpoint (config, shards, index, tokenizer) to ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config_dict(model_type, quantized=True)
    cfg = ModelConfig.from_hf_dict(config)
    master = build_tiny_master(seed, model_type)
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in expected_tensors(cfg).items():
        if name.endswith(SCALE_SUFFIX):
            continue  # written with its weight
        if spec.dtypes[0] == FP8:
            tensors[name], tensors[scale_name(name)] = quantize_fp8_blockwise(master[name], cfg.fp8_weight_block)
        else:
            tensors[name] = master[name].to(spec.dtypes[0])
    _write_json(out_dir / "config.json", config)
    write_shards(tensors, out_dir)
    write_tokenizer(out_dir)
    return out_dir


def write_trained_checkpoint(out_dir: str | Path, weights: str | Path = TRAINED_WEIGHTS_PATH) -> Path:
    """Write the trained tiny V3.2 checkpoint (``export/train_tiny.py``'s weights) to ``out_dir``.

    ``weights`` holds the checkpoint's own tensors (fp8 + block scales, bf16/fp32 for the rest)
    without the MTP layer's copies of the embedding and head, which are restored here."""
    out_dir, weights = Path(out_dir), Path(weights)
    if not weights.is_file():
        raise FileNotFoundError(
            f"trained weights {weights} not found: run `python -m dsa_trt.export.train_tiny --out {weights}`"
        )
    config = tiny_config_dict("deepseek_v32", quantized=True)
    cfg = ModelConfig.from_hf_dict(config)
    tensors = load_file(str(weights))
    tensors.update({n: t.clone() for n, t in mtp_shared_copies(tensors, cfg.num_hidden_layers).items()})
    specs = expected_tensors(cfg)
    problems = [f"missing {n}" for n in sorted(set(specs) - set(tensors))]
    problems += [f"unexpected {n}" for n in sorted(set(tensors) - set(specs))]
    problems += [
        f"{n}: {tuple(t.shape)} {t.dtype}, expected {specs[n].shape} {specs[n].dtypes[0]}"
        for n, t in sorted(tensors.items())
        if n in specs and (tuple(t.shape) != specs[n].shape or t.dtype != specs[n].dtypes[0])
    ]
    if problems:
        raise ValueError(
            f"{weights} does not fit the tiny V3.2 layout ({'; '.join(problems[:5])}"
            f"{'; ...' if len(problems) > 5 else ''}): regenerate it with `python -m dsa_trt.export.train_tiny`"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    write_shards(tensors, out_dir)
    write_tokenizer(out_dir)
    return out_dir


def mtp_shared_copies(tensors: dict[str, torch.Tensor], num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """The MTP layer's embed_tokens / shared_head.head: the main embedding and lm_head (§5)."""
    p = f"model.layers.{num_hidden_layers}."
    return {
        p + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        p + "shared_head.head.weight": tensors["lm_head.weight"],
    }


def write_dequantized_hf_copy(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """A bf16 copy of an fp8 checkpoint for ``from_pretrained`` on CPU (the HF oracle).

    fp8 weights become W_fp8 * scale in bf16, which is exact (e4m3 times a power of two); other
    tensors keep their dtype. The MTP layer is dropped (HF never loads it) and
    ``num_nextn_predict_layers`` set to 0 so that the copy is itself a valid checkpoint."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    with Checkpoint(src_dir, include_mtp=False) as ckpt:
        tensors = {n: ckpt.get(n, torch.bfloat16) if ckpt.is_fp8(n) else ckpt.raw(n) for n in ckpt.names()}
    config = json.loads((src_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config["num_nextn_predict_layers"] = 0
    _write_json(dst_dir / "config.json", config)
    write_shards(tensors, dst_dir)
    for file in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        if (src_dir / file).is_file():
            shutil.copyfile(src_dir / file, dst_dir / file)
    return dst_dir


def write_shards(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """HF-style ``model-0000i-of-0000n.safetensors`` shards in name order, plus the index."""
    names = sorted(tensors, key=_layer_order)
    groups = shard_groups(names, [tensors[n].numel() * tensors[n].element_size() for n in names], max_shard_bytes)
    weight_map = {}
    for i, group in enumerate(groups):
        file = shard_file_name(i, len(groups))
        save_file({n: tensors[n] for n in group}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update((n, file) for n in group)
    write_index(out_dir, sum(t.numel() * t.element_size() for t in tensors.values()), weight_map)


def shard_groups(items: list, sizes: list[int], max_shard_bytes: int) -> list[list]:
    """The items in order, cut into shards of at most max_shard_bytes (an item larger than that
    gets a shard of its own); sizes[i] is the byte size of items[i]."""
    groups: list[list] = [[]]
    size = 0
    for item, nbytes in zip(items, sizes, strict=True):
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_index(out_dir: Path, total_size: int, weight_map: dict[str, str]) -> None:
    """The shard index (model.safetensors.index.json): total byte size and tensor -> shard file."""
    _write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def _layer_order(name: str) -> tuple[int, str]:
    """Globals first, then by layer number (not string order: layer 10 after layer 9)."""
    parts = name.split(".")
    layer = int(parts[2]) if name.startswith("model.layers.") else -1
    return layer, name


def train_tokenizer(corpus: Path = CORPUS_PATH, vocab_size: int = TINY_CONFIG["vocab_size"]) -> Tokenizer:
    """Byte-level BPE with BOS id 0 and EOS id 1; encode() prepends BOS like DeepSeek's tokenizer.

    Training gives the same tokenizer.json bytes in every process (tests/test_checkpoint.py
    checks this through the whole checkpoint)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.read_text(encoding="utf-8").splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    return tokenizer


def write_tokenizer(out_dir: Path) -> None:
    tokenizer = train_tokenizer()
    if (tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)) != (0, 1):
        raise RuntimeError("tokenizer training put BOS/EOS at unexpected ids")
    (out_dir / TOKENIZER_FILE).write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(
        out_dir / TOKENIZER_CONFIG_FILE,
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "clean_up_tokenization_spaces": False,
            "model_max_length": TINY_CONFIG["max_position_embeddings"],
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


PRESETS = ("tiny", "v32-real-dims")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="deepseek_v32")
    parser.add_argument("--preset", choices=PRESETS, default="tiny",
                        help="tiny: MODEL.md 7.1 (the tests' checkpoint); v32-real-dims: V3.2's real layer dims")
    real = parser.add_argument_group("v32-real-dims options")
    real.add_argument("--layers", type=int, default=None, help="decoder layers (default 2)")
    real.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default 256)")
    real.add_argument("--dense-layers", type=int, default=None, help="leading dense-MLP layers (default 1)")
    real.add_argument("--vocab-size", type=int, default=None, help="default 129280")
    real.add_argument("--mtp-layers", type=int, default=None, help="MTP layers stored after the last (default 0)")
    parser.add_argument(
        "--trained", action="store_true",
        help=f"the weights trained on the corpus ({TRAINED_WEIGHTS_PATH.name}; what `make engine` writes)"
    )
    args = parser.parse_args(argv)
    overrides = {k: v for k in ("layers", "experts", "dense_layers", "vocab_size", "mtp_layers")
                 if (v := getattr(args, k)) is not None}
    if args.trained:
        if args.model_type != "deepseek_v32" or args.seed != 0 or args.preset != "tiny":
            parser.error("--trained writes the committed deepseek_v32 weights: drop --seed / --model-type / --preset")
        print(write_trained_checkpoint(args.out_dir))
        return
    if args.preset == "tiny":
        if overrides:
            parser.error(f"--{', --'.join(k.replace('_', '-') for k in overrides)}: only with --preset v32-real-dims")
        print(write_tiny_checkpoint(args.out_dir, seed=args.seed, model_type=args.model_type))
        return
    if args.model_type != "deepseek_v32":
        parser.error("--preset v32-real-dims writes a deepseek_v32 checkpoint; drop --model-type")
    from .real_dims import write_real_dims_checkpoint

    try:
        stats = write_real_dims_checkpoint(args.out_dir, seed=args.seed, **overrides)
    except ValueError as e:
        parser.error(str(e))
    print(stats.summary())


if __name__ == "__main__":
    main()
