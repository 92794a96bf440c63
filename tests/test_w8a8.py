"""fp8-block checkpoints stay e4m3 in the engine (weight format "fp8", issue 25 item 1).

* Numerics: the bf16 fp8 network (W8A8 linears, e4m3 experts in dsa::moe_experts) against a
  plain-torch emulation of the official W8A8 recipe (spec/MODEL.md §6): the HF model with each
  e4m3 Linear and its experts run through tests/helpers/ref_fp8.py (which imports no production
  code). Teacher-forced over one sequence, the emulation's indexer top-k and routing replayed in
  our network (Indexer.replay_positions, Router.replay_ids), so a near-tied selection cannot make
  the two attend or route differently.
* The builder: its default for an fp8 checkpoint at bfloat16 is "fp8" (engine_config.json, e4m3
  tensors + scales in the weights file, an engine that generates like its eager network); float32
  is "dequant"; an explicit fp8 the checkpoint or dtype cannot take is a clear error.
* Tensor parallel: e4m3 weights sliced with their scales; TP=2 ranks (CPU processes) give the
  one-rank logits; the tiny shared expert (64-wide slices at tp 2) is dequantised under auto,
  an error under fp8; every linear of the real V3.2 at tp 8 stays e4m3, and dsa-trt plan counts
  exactly the bytes the rank-0 network holds.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from tests.helpers import ref_fp8
from tests.helpers.ranks import join_group, spawn

REAL_CONFIG = Path(__file__).parent / "data" / "deepseek_v32_config.json"
SEQ_LEN = 48  # > index_topk (16): the indexer really selects
# Our bf16 network against the float64 W8A8 emulation on fp32 activations (HF): what is left is the
# bf16 rounding of our activations and the e4m3 roundings it flips downstream. Trained tiny
# checkpoint, corpus text: measured 0.013 (trained under activation noise, 2026-12-08; the 600-step
# weights before them 0.016-0.019, 0.021 on random token ids).
EMULATION_REL_L2 = 0.03
RANDOM_WEIGHTS_REL_L2 = 0.05  # the random-weight checkpoint: see its test
TP = 2
# TP=2 vs one rank (trained tiny checkpoint, same selections): the row-parallel partial outputs are
# rounded to bf16 before they are summed, and those roundings flip e4m3 roundings downstream:
# measured 0.026 / 0.011 (prefill / decode) in fp8, 0.004 / 0.003 dequantised. Each sliced linear
# is checked exactly in test_fp8_shards_keep_whole_blocks.
TP_REL_L2 = 0.04


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------ the W8A8 emulation (HF + ref_fp8)
def stored_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as stored (e4m3 weights, fp32 scales), read with safetensors."""
    out = {}
    for shard in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


class EmulatedW8A8Linear(nn.Module):
    """The official fp8 linear on a stored e4m3 weight: act_quant of the bf16 input per 128 group,
    e4m3 products summed per K block and scaled, bf16 output (ref_fp8.fp8_linear64)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, pow2: bool):
        super().__init__()
        self.weight, self.scale, self.pow2 = weight, scale, pow2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = ref_fp8.fp8_linear64(rows, self.weight, self.scale, self.pow2)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


class EmulatedW8A8Experts(nn.Module):
    """HF's routed experts (same call signature) as ref_fp8.moe64 on the stored e4m3 experts."""

    def __init__(self, stored: dict, layer: int, num_experts: int, pow2: bool):
        super().__init__()
        p = f"model.layers.{layer}.mlp.experts."

        def stack(projs, what):
            return torch.stack([torch.cat([stored[f"{p}{e}.{j}_proj.{what}"] for j in projs]) for e in range(num_experts)])

        self.w13, self.w13_scale = stack(("gate", "up"), "weight"), stack(("gate", "up"), "weight_scale_inv")
        self.w2, self.w2_scale = stack(("down",), "weight"), stack(("down",), "weight_scale_inv")
        self.pow2 = pow2

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states.to(torch.bfloat16)
        out = ref_fp8.moe64(x, top_k_index, top_k_weights, self.w13, self.w13_scale, self.w2, self.w2_scale, 0,
                            self.pow2)
        return out.to(hidden_states.dtype)


def w8a8_emulation(hf_model, ckpt_dir: Path):
    """A copy of the HF model whose e4m3-stored Linears (but kv_b, dequantised in [R]'s decode and in
    our absorbed attention) and routed experts run the official W8A8 recipe."""
    emu = copy.deepcopy(hf_model)
    stored = stored_tensors(ckpt_dir)
    hf_cfg = emu.config
    quant = json.loads((Path(ckpt_dir) / "config.json").read_text())["quantization_config"]
    pow2 = quant.get("scale_fmt") == "ue8m0"
    for name, t in stored.items():
        if t.dtype != torch.float8_e4m3fn or ".experts." in name or "kv_b_proj" in name:
            continue
        module = name.removesuffix(".weight")
        if int(module.split(".")[2]) >= hf_cfg.num_hidden_layers:
            continue  # the MTP layer: HF has none
        owner, _, leaf = module.rpartition(".")
        assert isinstance(emu.get_submodule(module), nn.Linear), module
        setattr(emu.get_submodule(owner), leaf, EmulatedW8A8Linear(t, stored[module + ".weight_scale_inv"], pow2))
    for layer in range(hf_cfg.first_k_dense_replace, hf_cfg.num_hidden_layers):
        emu.model.layers[layer].mlp.experts = EmulatedW8A8Experts(stored, layer, hf_cfg.n_routed_experts, pow2)
    return emu


def record_selections(model) -> tuple[dict, dict, list]:
    """Forward hooks that keep each layer's indexer top-k [S, k] and routed expert ids [T, k]."""
    topk, experts, handles = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.indexer.register_forward_hook(
            lambda m, a, out, i=i: topk.__setitem__(i, out[0].clone())))
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(
                lambda m, a, out, i=i: experts.__setitem__(i, out[2].clone())))
    return topk, experts, handles


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, object]:
    """The trained tiny fp8 checkpoint (the demo's, export/train_tiny.py) and its HF copy, fp32."""
    from transformers import DeepseekV32ForCausalLM

    from dsa_trt.export.tiny_checkpoint import write_dequantized_hf_copy, write_trained_checkpoint

    root = tmp_path_factory.mktemp("trained")
    ckpt = write_trained_checkpoint(root / "tiny-v32-trained")
    hf = DeepseekV32ForCausalLM.from_pretrained(write_dequantized_hf_copy(ckpt, root / "hf"), dtype=torch.float32)
    return ckpt, hf.eval()


def _corpus_ids(ckpt_dir: Path) -> torch.Tensor:
    from dsa_trt.export.tiny_checkpoint import CORPUS_PATH
    from dsa_trt.tokenizer import Tokenizer

    tok = Tokenizer(Path(ckpt_dir) / "tokenizer.json", None, ())
    return torch.tensor(tok.encode(CORPUS_PATH.read_text(encoding="utf-8")[5000:5600], add_bos=False)[:SEQ_LEN])


def _random_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(7))


def _fp8_vs_emulation(ckpt_dir: Path, hf_model, ids: torch.Tensor) -> tuple[float, float]:
    """(rel L2 of the fp8 network's logits vs the W8A8 emulation, vs the unquantised HF model),
    every position of one sequence, the emulation's selections replayed."""
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network
    from dsa_trt.plugins.pools import allocate_pools
    from dsa_trt.step import StepInputs

    ckpt = Checkpoint(ckpt_dir)
    net = build_network(ckpt, "bf16", torch.bfloat16)  # the defaults: weight format auto, expert op on
    assert net.weight_format == "fp8" and net.expert_op
    assert type(net.model.layers[0].self_attn.x_proj).__name__ == "FusedFp8Linear"  # [q_a | wk | kv_a]
    assert type(net.model.layers[0].self_attn.o_proj).__name__ == "Fp8Linear"

    emu = w8a8_emulation(hf_model, ckpt_dir)
    topk, experts, handles = record_selections(emu)
    with torch.no_grad():
        want = emu(ids[None]).logits[0]  # [S, V] fp32, every position (teacher-forced)
        plain = hf_model(ids[None]).logits[0]  # no quantisation: how far W8A8 moves the logits
    for h in handles:
        h.remove()
    assert len(topk) == ckpt.config.num_hidden_layers
    assert len(experts) == ckpt.config.num_hidden_layers - ckpt.config.first_k_dense_replace

    for i, layer in enumerate(net.model.layers):
        layer.self_attn.indexer.replay_positions = topk[i]
        if i in experts:
            layer.mlp.gate.replay_ids = experts[i].long()
    step = StepInputs.build([(ids.tolist(), 0, [3, 1])], logits_for="all")
    mla, idx = allocate_pools(ckpt.config, "bf16", 4)
    with torch.no_grad():
        got = net(*step.as_tuple(), mla, idx).float()
    assert torch.isfinite(got).all()
    return rel_l2(got, want), rel_l2(got, plain)


def test_fp8_network_matches_the_official_w8a8_recipe(trained):
    ckpt_dir, hf = trained
    err, err_plain = _fp8_vs_emulation(ckpt_dir, hf, _corpus_ids(ckpt_dir))
    print(f"[w8a8] trained tiny: fp8 network vs the W8A8 emulation rel L2 {err:.4f}; vs unquantised HF {err_plain:.4f}")
    assert err <= EMULATION_REL_L2, f"fp8 network vs the official W8A8 recipe: rel L2 {err:.4f} > {EMULATION_REL_L2}"
    assert err < err_plain / 2, "the emulation must be closer than the unquantised model (is W8A8 emulated?)"


def test_fp8_network_matches_the_recipe_on_random_weights(tiny_ckpt, hf_oracle):
    """The seed-0 random checkpoint (the exact-mode oracle's) amplifies every perturbation: the
    emulation against itself with 2^-9 relative noise on its embeddings moves by rel L2 0.12, and
    the bf16 roundings our network adds (0.006 without W8A8) flip e4m3 roundings downstream:
    measured 0.034, hence the looser bound here (the trained model above is the 0.03 one)."""
    from dsa_trt.config import ModelConfig

    ids = _random_ids(ModelConfig.from_json(tiny_ckpt).vocab_size)
    err, err_plain = _fp8_vs_emulation(tiny_ckpt, hf_oracle, ids)
    print(f"[w8a8] random tiny: fp8 network vs the W8A8 emulation rel L2 {err:.4f}; vs unquantised HF {err_plain:.4f}")
    assert err <= RANDOM_WEIGHTS_REL_L2 and err < err_plain / 2


# ------------------------------------------------------------------ the builder
def _build(argv: list[str]) -> tuple[int, str, str]:
    from dsa_trt.builder.build import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def bf16_engine(trained, tmp_path_factory) -> tuple[Path, str]:
    """The builder's defaults on the trained tiny fp8 checkpoint (`make engine`'s) at --dtype
    bfloat16 (CPU, AOTInductor)."""
    out = tmp_path_factory.mktemp("engines") / "tiny-bf16"
    rc, log, err = _build(["--checkpoint", str(trained[0]), "--out", str(out), "--cache", "bf16",
                           "--compiler", "aoti", "--device", "cpu", "--dtype", "bfloat16"])
    assert rc == 0, err
    return out, log


def test_builder_default_keeps_fp8_at_bf16(bf16_engine, trained):
    from dsa_trt.engine_config import EngineConfig
    from tests.helpers.engine_checks import teacher_forced_greedy

    out, log = bf16_engine
    assert json.loads((out / "engine_config.json").read_text())["weight_format"] == "fp8"
    cfg = EngineConfig.load(out)
    assert cfg.weight_format == "fp8" and cfg.mtp_layers == 1
    assert "weights fp8, one rank)" in log and "weights     fp8: " in log, log
    with safe_open(str(out / cfg.rank_weights_file(0)), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    e4m3 = [n for n, d in dtypes.items() if d == "F8_E4M3"]
    for name in ("model.layers.0.self_attn.x_proj.weight", "model.layers.1.mlp.stacked_experts.w13",
                 "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
        assert name in e4m3, f"{name} is {dtypes.get(name)} in the weights file, not e4m3"
    assert all(n.replace(".weight", ".weight_scale_inv") in dtypes for n in e4m3 if n.endswith(".weight"))
    assert dtypes["model.layers.1.mlp.stacked_experts.w13_scale"] == "F32"
    assert dtypes["model.layers.0.self_attn.kv_b_proj.weight"] == "BF16"  # read as a matrix: dequantised
    # it generates like its eager fp8 network (compiled vs eager, teacher-forced greedy)
    totals = teacher_forced_greedy(out, trained[0], "cpu", torch.bfloat16, steps_per_prompt=8)
    print(f"[w8a8] bf16 fp8 engine vs eager: {totals}")
    assert totals["same"] >= totals["steps"] * 7 // 8


def test_plan_bytes_equal_the_engine_files(bf16_engine):
    """`dsa-trt plan` counts what the engine holds: the tensors of rank 0's weights file and of its
    MTP draft's, byte for byte (kv_b in bf16, the derived buffers, the draft's embedding and head
    held once)."""
    import math

    from dsa_trt.engine_config import EngineConfig
    from dsa_trt.plan import make_plan

    out, log = bf16_engine
    cfg = EngineConfig.load(out)
    held = 0
    for name in (cfg.rank_weights_file(0), cfg.draft_weights_file(0)):
        with safe_open(str(out / name), framework="pt") as f:
            for t in map(f.get_slice, f.keys()):
                held += math.prod(t.get_shape()) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[t.get_dtype()]
    assert make_plan(cfg.model, 1, 1, 1.0, include_mtp=True).ranks[0].weight_bytes == held


def test_draft_weights_outside_its_program(bf16_engine):
    """The MTP draft program holds no weights: its file has every constant of its table but the
    embedding and head, which it takes from the main program's (the same tensors once loaded)."""
    from dsa_trt.checkpoint_layout import mtp_shared_copies
    from dsa_trt.engine_config import EngineConfig
    from dsa_trt.runtime.engine import Engine
    from dsa_trt.weights_file import constant_table

    out, log = bf16_engine
    cfg = EngineConfig.load(out)
    shared = mtp_shared_copies(cfg.model)
    table = constant_table(out / cfg.draft_file(0))
    with safe_open(str(out / cfg.draft_weights_file(0)), framework="pt") as f:
        in_file = set(f.keys())
    # (the file may hold more: the CPU program does not read the indexer's bf16 Hadamard signs)
    assert set(shared) <= set(table) and in_file >= set(table) - set(shared) and not in_file & set(shared)
    assert "shared with the main program" in log
    engine = Engine.load(out, device="cpu")
    for name, main in shared.items():
        assert engine.draft_program.weights[name] is engine.program.weights[main]


def test_float32_build_is_dequant(exact_engine):
    from dsa_trt.engine_config import EngineConfig

    assert EngineConfig.load(exact_engine).weight_format == "dequant"


def test_engine_config_weight_format_on_load(bf16_engine, tmp_path):
    import shutil

    from dsa_trt.engine_config import ENGINE_CONFIG_NAME, EngineConfig, EngineDirError

    src, _ = bf16_engine
    d = json.loads((src / ENGINE_CONFIG_NAME).read_text())
    for name in (ENGINE_CONFIG_NAME, "tokenizer.json"):
        shutil.copy(src / name, tmp_path / name)
    old = {k: v for k, v in d.items() if k != "weight_format"} | {"dtype": "float32"}
    (tmp_path / ENGINE_CONFIG_NAME).write_text(json.dumps(old))
    assert EngineConfig.load(tmp_path, check_files=False).weight_format == "dequant"  # engines before the field
    for bad, match in (({"weight_format": "int4"}, "weight_format 'int4' not in"),
                       ({"dtype": "float32"}, "weight_format 'fp8' needs dtype bfloat16")):
        (tmp_path / ENGINE_CONFIG_NAME).write_text(json.dumps(d | bad))
        with pytest.raises(EngineDirError, match=match):
            EngineConfig.load(tmp_path, check_files=False)


def test_explicit_fp8_it_cannot_take_is_an_error(tiny_ckpt, tmp_path):
    from dsa_trt.export.tiny_checkpoint import write_dequantized_hf_copy

    base = ["--compiler", "aoti", "--device", "cpu", "--cache", "bf16", "--weight-format", "fp8"]
    rc, _, err = _build(["--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "a"), "--dtype", "float32", *base])
    assert rc == 2 and "weight format fp8 runs W8A8 linears on bf16 activations" in err and "--dtype bfloat16" in err
    bf16_ckpt = write_dequantized_hf_copy(tiny_ckpt, tmp_path / "bf16-ckpt")
    rc, _, err = _build(["--checkpoint", str(bf16_ckpt), "--out", str(tmp_path / "b"), "--dtype", "bfloat16", *base])
    assert rc == 2 and "nothing to keep in e4m3" in err and "--weight-format auto or dequant" in err
    rc, _, err = _build(["--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "c"), "--dtype", "bfloat16",
                         "--tp", "2", *base])
    assert rc == 2 and "128-wide scale block" in err and "shared_experts" in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c" / "rank0.pt2").exists()


# ------------------------------------------------------------------ tensor parallel
def test_fp8_shards_keep_whole_blocks(tiny_ckpt):
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network

    ckpt = Checkpoint(tiny_ckpt)
    ranks = [build_network(ckpt, "bf16", torch.bfloat16, tp_rank=r, tp_size=TP) for r in range(TP)]
    cq, q_rows = "model.layers.0.self_attn.cq_proj", ranks[0].model.layers[0].self_attn.cq_proj.parts[0][1]
    for name, dim in (("model.layers.0.self_attn.q_b_proj", 0), ("model.layers.0.self_attn.o_proj", 1),
                      ("model.layers.0.mlp.down_proj", 1)):
        for suffix in ("weight", "weight_scale_inv"):
            if name.endswith("q_b_proj"):  # fused with the indexer's wq_b (whole on every rank): the rank's rows first
                rows = q_rows if suffix == "weight" else q_rows // 128
                parts = [net.get_submodule(cq).get_buffer(suffix)[:rows] for net in ranks]
                wq_b = ckpt.raw(f"model.layers.0.self_attn.indexer.wq_b.{suffix}")
                assert all(torch.equal(net.get_submodule(cq).get_buffer(suffix)[rows:].view(torch.uint8),
                                       wq_b.view(torch.uint8)) for net in ranks)
            else:
                parts = [net.get_submodule(name).get_buffer(suffix) for net in ranks]
            full = ckpt.raw(f"{name}.{suffix}")
            assert parts[0].dtype == full.dtype
            bits = (lambda t: t.view(torch.uint8)) if suffix == "weight" else (lambda t: t)  # noqa: E731
            assert torch.equal(torch.cat([bits(t) for t in parts], dim), bits(full)), f"{name}.{suffix}"
    # the slices compute the whole linear: a column split exactly (the same rows, the same act_quant),
    # a row split up to the bf16 rounding of each rank's partial output (its 128-groups are the whole one's)
    full = build_network(ckpt, "bf16", torch.bfloat16)
    x = torch.randn(5, ckpt.config.q_lora_rank, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():  # q_b, fused: each rank's q rows against the whole network's
        q_of = lambda net: net.get_submodule(cq).split(net.get_submodule(cq)(x))[0]  # noqa: E731
        assert torch.equal(torch.cat([q_of(net) for net in ranks], 1), q_of(full))
        for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
            width = full.get_submodule(name).weight.shape[1]
            x = torch.randn(5, width, generator=torch.Generator().manual_seed(2)).bfloat16()
            parts = [net.get_submodule(name)(xr).float() for net, xr in zip(ranks, x.chunk(TP, 1))]
            want = full.get_submodule(name)(x).float()
            err = ((parts[0] + parts[1]) - want).abs().max().item()
            bound = 2**-8 * max(p.abs().max().item() for p in parts + [want])  # 3 bf16 roundings of these sizes
            assert err <= bound, f"{name}: the ranks' partial sums miss the whole output by {err:.3g} > {bound:.3g}"
    # the tiny shared expert is 128 wide: 64-wide slices at tp 2 cut its scale blocks, so auto dequantises it
    moe_layers = range(ckpt.config.first_k_dense_replace, ckpt.config.num_hidden_layers)
    assert ranks[0].dequantised_linears == [f"model.layers.{i}.mlp.shared_experts.{p}_proj" for i in moe_layers
                                            for p in ("gate", "up", "down")]
    with pytest.raises(ValueError, match="128-wide scale block grid, e.g. model.layers.1.mlp.shared_experts"):
        build_network(ckpt, "bf16", torch.bfloat16, tp_rank=0, tp_size=TP, weight_format="fp8")


def _steps():
    """A prefill and a decode step whose sequences see at most index_topk (16) keys: the indexer
    selects every key, so no near-tied top-k choice can flip between the rank counts."""
    from dsa_trt.step import StepInputs

    prefill = StepInputs.build([(list(range(2, 14)), 0, [7, 3]), (list(range(5, 10)), 0, [11])])
    decode = StepInputs.build([([17], 12, [7, 3]), ([9], 5, [11])])
    return [prefill, decode]


def _recording(gate, chosen: dict, layer: int):
    """gate.select that also keeps its expert ids in chosen[layer]."""
    def select(x):
        ids, weights = type(gate).select(gate, x)
        chosen[layer] = ids
        return ids, weights
    return select


@torch.no_grad()
def _run(net, cfg, replay: list[dict] | None = None) -> tuple[list[torch.Tensor], list[dict]]:
    """Logits of each step, and each step's routing {layer: expert ids}; ``replay``: routing to use
    (Router.replay_ids), so bf16 near ties in the router cannot route the rank counts apart."""
    from dsa_trt.plugins.pools import allocate_pools

    pools = allocate_pools(cfg, "bf16", 16)
    logits, routing = [], []
    for i, step in enumerate(_steps()):
        chosen = {}
        for layer_idx, layer in enumerate(net.model.layers):
            if layer.dense_mlp:
                continue
            gate = layer.mlp.gate
            gate.replay_ids = replay[i][layer_idx] if replay else None
            gate.select = _recording(gate, chosen, layer_idx)
        logits.append(net(*step.as_tuple(), *pools).float())
        routing.append(chosen)
    return logits, routing


def _tp_worker(rank, world, port, out_dir, ckpt_dir, routing):
    import torch.distributed as dist

    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network

    join_group(rank, world, port)
    ckpt = Checkpoint(ckpt_dir)
    out = {}
    for fmt in ("auto", "dequant"):
        net = build_network(ckpt, "bf16", torch.bfloat16, tp_rank=rank, tp_size=world, weight_format=fmt)
        out[fmt] = {"logits": _run(net, ckpt.config, routing[fmt])[0], "weight_format": net.weight_format}
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_fp8_tp2_equals_one_rank(trained, tmp_path):
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network

    ckpt_dir, _ = trained
    ckpt = Checkpoint(ckpt_dir)
    # one rank with the same numerics: fp8, but the shared experts dequantised as at tp 2
    ref = build_network(ckpt, "bf16", torch.bfloat16)
    dequant = build_network(ckpt, "bf16", torch.bfloat16, weight_format="dequant")
    for name in [n for n, _ in dequant.named_modules() if ".shared_experts." in n and n.endswith("_proj")]:
        owner, _, leaf = name.rpartition(".")
        setattr(ref.get_submodule(owner), leaf, dequant.get_submodule(name))
    for name, mod in ref.named_modules():  # and their gate/up apart, as tp 2 keeps them (not fused)
        if name.endswith(".shared_experts"):
            mod.gate_up_proj = None
    want, routing = {}, {}
    want["auto"], routing["auto"] = _run(ref, ckpt.config)
    want["dequant"], routing["dequant"] = _run(dequant, ckpt.config)
    results = spawn(_tp_worker, TP, tmp_path, str(ckpt_dir), routing)
    errs = {}
    for fmt in ("auto", "dequant"):
        for rank, res in enumerate(results):
            assert res[fmt]["weight_format"] == ("fp8" if fmt == "auto" else "dequant")
            errs[fmt, rank] = [rel_l2(g, w) for g, w in zip(res[fmt]["logits"], want[fmt])]
            print(f"[w8a8 TP={TP}] {fmt} rank {rank}: rel L2 vs one rank per step {errs[fmt, rank]}")
        for a, b in zip(results[0][fmt]["logits"], results[1][fmt]["logits"]):
            assert torch.equal(a, b), "every rank returns the same logits"
    assert max(errs["auto", 0]) <= TP_REL_L2 and max(errs["dequant", 0]) <= TP_REL_L2 / 4


def test_real_v32_tp8_keeps_every_linear_fp8_and_plan_counts_it():
    """Every tp-split slice of the real V3.2 at tp 8 is on the 128 grid, so nothing is dequantised;
    the network holds the checkpoint's stored bytes but for kv_b, dequantised to bf16 (the absorbed
    attention reads it as a matrix; no scale), and dsa-trt plan counts exactly that plus the derived
    buffers (not in the state dict). The router and the indexer's weights_proj stay bf16 as stored
    (layers.stored_dtype), applied in fp32."""
    from dsa_trt.config import ModelConfig
    from dsa_trt.export.network import DSAForCausalLM
    from dsa_trt.plan import derived_bytes, make_plan

    cfg = ModelConfig.from_json(REAL_CONFIG)
    tp = 8
    with torch.device("meta"):
        net = DSAForCausalLM(cfg, "fp8", torch.bfloat16, tp_rank=0, tp_size=tp, weight_format="fp8")
    assert net.dequantised_linears == []
    held = sum(t.numel() * t.element_size() for t in net.state_dict().values())
    planned = make_plan(cfg, tp=tp, ep=tp, gpu_memory_gb=141).ranks[0].weight_bytes
    derived = derived_bytes(cfg, include_mtp=False)
    print(f"[w8a8] real V3.2 rank 0 of tp 8, fp8: the network holds {held / 1e9:.2f} GB (+{derived / 1e6:.1f} MB of "
          f"derived buffers), dsa-trt plan says {planned / 1e9:.2f} GB")
    assert held + derived == planned
