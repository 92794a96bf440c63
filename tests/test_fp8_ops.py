"""dsa::fp8_block_linear and dsa::moe_experts (plugins/fp8_ops.py, reference plugins/fp8_reference.py)
against the independent float64 emulation of the official W8A8 recipe (tests/helpers/ref_fp8.py), on CPU.

Two tiers (STYLE.md), tolerances next to each check:
- tight: the same recipe in float64 (same quantisation, same bf16 roundings). What remains is the
  fp32 summation order of the reference, which can move a bf16 output by one unit in the last place.
- loose: the unquantised product (activations not quantised; the dequantised weights), i.e. the
  e4m3 activation quantisation error of the recipe itself.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import dsa_trt.plugins.fp8_ops  # noqa: F401  (registers torch.ops.dsa.fp8_block_linear / moe_experts)
from dsa_trt.plugins.fp8_ops import Fp8OpError
from tests.helpers import ref_fp8 as R

# e4m3 keeps 3 mantissa bits: relative rounding error up to 2^-4, RMS ~2^-4/sqrt(3) per element,
# and a dot product of such errors averages them down to ~0.026 (measured 0.025-0.027 on these
# inputs); 0.04 leaves room for the seeds while catching a wrong scale (errors >= 0.1) at once.
LINEAR_LOOSE_REL_L2 = 0.04
# The MoE quantises twice (x before gate/up, SiLU(gate)*up before down): ~0.045 measured.
MOE_LOOSE_REL_L2 = 0.08
# Tight MoE: the float64 combine vs the fp32 one (~3e-8), plus an occasional one-ulp bf16 flip of a
# linear output feeding the next linear, worth ~2^-8 / sqrt(I) of the output scale.
MOE_TIGHT_REL_L2 = 1e-4
MOE_TIGHT_MAX_REL = 2e-3
# Tight linear: at most this fraction of outputs may differ at all (measured <= 1.2e-4).
LINEAR_TIGHT_DIFFERING = 2e-3


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 at |v| (8 significant bits), for normal values."""
    a = v.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def assert_linear_tight(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w_deq: torch.Tensor, case: str):
    """Each output within one bf16 ulp of the float64 recipe, plus the fp32 accumulation bound
    (K terms of |x||w|, 2^-22 relative) for outputs that cancel to near zero; few outputs differ."""
    got, want = got.double(), want.double()
    bound = bf16_ulp(want) + 2.0**-22 * (x.double().abs() @ w_deq.abs().T)
    diff = (got - want).abs()
    bad = diff > bound
    if bad.any():
        t, n = (int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"{case}: {int(bad.sum())} outputs off, e.g. [{t}, {n}] got {got[t, n].item()} "
                             f"want {want[t, n].item()} (bound {bound[t, n].item():.3g})")
    differing = (diff > 0).double().mean().item()
    assert differing <= LINEAR_TIGHT_DIFFERING, f"{case}: {differing:.2%} of outputs differ from the recipe"


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_x(tokens: int, k: int, g: torch.Generator) -> torch.Tensor:
    # Per-token magnitudes over 3 decades, so the per-token scales differ; a few exact zeros.
    x = torch.randn(tokens, k, generator=g) * torch.exp2(torch.randint(-6, 4, (tokens, 1), generator=g).float())
    x[:, ::37] = 0.0
    return x.bfloat16()


# ------------------------------------------------------------------------------ the linear
LINEAR_CASES = [  # (T, N, K, pow2 activations, pow2 weight scales)
    (1, 576, 200, True, True),  # kv_a-like: 5 scale rows, the last half full; K 1.56 blocks
    (3, 576, 200, False, False),
    (64, 300, 384, True, False),
    (129, 576, 200, False, True),
    (129, 128, 128, True, True),  # whole blocks only
    (4096, 192, 200, True, True),  # prefill-sized T, small N and K
    (4096, 192, 200, False, False),
    (7, 64, 1000, True, True),  # N smaller than one block, 8 K blocks with a 104-wide tail
]


@pytest.mark.parametrize("tokens,n,k,pow2_act,pow2_w", LINEAR_CASES)
def test_fp8_block_linear_matches_recipe(tokens, n, k, pow2_act, pow2_w, one_thread):
    case = f"T={tokens} N={n} K={k} pow2_act={pow2_act} pow2_w={pow2_w}"
    g = torch.Generator().manual_seed(tokens * 1009 + n * 7 + k)
    x = make_x(tokens, k, g)
    w, w_scale = R.quantize_weight64(torch.randn(n, k, generator=g) * 0.05, pow2_w)
    assert w_scale.shape == (math.ceil(n / 128), math.ceil(k / 128))
    got = torch.ops.dsa.fp8_block_linear(x, w, w_scale, pow2_act)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n)
    w_deq = R.dequantize64(w, w_scale)
    assert_linear_tight(got, R.fp8_linear64(x, w, w_scale, pow2_act), x, w_deq, case)
    loose = rel_l2(got, R.linear64_unquantised(x, w, w_scale))
    assert loose <= LINEAR_LOOSE_REL_L2, f"{case}: rel L2 {loose:.4f} against the unquantised product"


def test_fp8_block_linear_strided_x_and_zero_tokens(one_thread):
    """x with a row stride (a column slice) reads like its contiguous copy; T = 0 gives [0, N]."""
    g = torch.Generator().manual_seed(5)
    wide = make_x(9, 512, g)
    w, s = R.quantize_weight64(torch.randn(256, 300, generator=g) * 0.05, True)
    x = wide[:, 100:400]
    assert not x.is_contiguous()
    got = torch.ops.dsa.fp8_block_linear(x, w, s, True)
    assert torch.equal(got, torch.ops.dsa.fp8_block_linear(x.contiguous(), w, s, True))
    empty = torch.ops.dsa.fp8_block_linear(x[:0], w, s, True)
    assert empty.shape == (0, 256)


def test_act_quant_scales_follow_the_recipe():
    """Power-of-two scales are exact powers and the smallest with amax / s <= 448, also where
    amax / 448 lies one fp32 ulp above a power of two (fp32 log2 would round it down)."""
    from dsa_trt.plugins.fp8_reference import act_quant

    amax = torch.tensor([448.0 * 2.0**-10 * (1 + 2.0**-7), 1.0, 0.0, 448.0 * 2.0**-3])  # bf16-exact values
    x = torch.zeros(4, 130)
    x[:, 5] = amax
    x[:, 129] = -amax
    x = x.bfloat16()
    for pow2 in (True, False):
        q, s = act_quant(x, pow2)
        q64, s64 = R.act_quant64(x, pow2)
        assert torch.equal(s.double(), s64), (pow2, s, s64)
        assert torch.equal(q.double(), q64)
        if pow2:
            assert torch.equal(torch.exp2(torch.log2(s64).round()), s64)
    assert s.shape == (4, 2) and s[2, 0] == torch.tensor(1e-4, dtype=torch.float32) * (1 / 448)


# ------------------------------------------------------------------------------ the MoE
def make_experts(num_local, hidden, inter, pow2_w, g, bf16=False):
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) * 0.05
    w2 = torch.randn(num_local, hidden, inter, generator=g) * 0.05
    if bf16:
        return w13.bfloat16(), None, w2.bfloat16(), None
    q13, s13 = zip(*(R.quantize_weight64(w, pow2_w) for w in w13))
    q2, s2 = zip(*(R.quantize_weight64(w, pow2_w) for w in w2))
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


def route(tokens, num_experts, top_k, g, only=None, always=None):
    """Distinct top-k ids per token, drawn from ``only`` if given, with ``always`` in every row."""
    pool = torch.arange(num_experts) if only is None else torch.tensor(only)
    rows = []
    for _ in range(tokens):
        ids = pool[torch.randperm(len(pool), generator=g)][:top_k]
        if always is not None and always not in ids:
            ids[0] = always
        rows.append(ids)
    ids = torch.stack(rows).int() if tokens else torch.zeros(0, top_k, dtype=torch.int32)
    return ids, torch.rand(tokens, top_k, generator=g)


MOE_CASES = [  # (label, T, num_experts, E_local, expert_offset, top_k, pow2, routing)
    ("all local", 3, 8, 8, 0, 2, True, {}),
    ("subset at offset 6", 1, 16, 5, 6, 4, True, {}),
    ("subset at offset 6 fp32 scales", 64, 16, 5, 6, 4, False, {}),
    ("last rank", 129, 16, 4, 12, 4, True, {}),
    ("experts with no tokens", 64, 16, 6, 4, 3, True, {"only": [0, 1, 4, 5, 9, 13, 14]}),
    ("every token on one expert", 129, 16, 6, 4, 2, False, {"always": 7}),
    ("no local pairs", 9, 16, 4, 8, 2, True, {"only": [0, 1, 2, 3, 12, 13]}),
    ("no tokens", 0, 8, 4, 0, 2, True, {}),
]


@pytest.mark.parametrize("label,tokens,num_experts,num_local,offset,top_k,pow2,routing", MOE_CASES,
                         ids=[c[0] for c in MOE_CASES])
def test_moe_experts_matches_recipe(label, tokens, num_experts, num_local, offset, top_k, pow2, routing, one_thread):
    hidden, inter = 256, 128
    g = torch.Generator().manual_seed(tokens * 31 + num_local * 7 + offset)
    w13, s13, w2, s2 = make_experts(num_local, hidden, inter, pow2, g)
    x = make_x(tokens, hidden, g)
    ids, weights = route(tokens, num_experts, top_k, g, **routing)
    got = torch.ops.dsa.moe_experts(x, ids, weights, w13, s13, w2, s2, num_experts, offset, pow2)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    local = (ids >= offset) & (ids < offset + num_local)
    assert torch.all(got[~local.any(dim=1)] == 0), f"{label}: tokens without a local expert must be zero"
    if tokens == 0 or not local.any():
        return
    want = R.moe64(x, ids, weights, w13, s13, w2, s2, offset, pow2)
    tight = rel_l2(got, want)
    worst = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert tight <= MOE_TIGHT_REL_L2 and worst <= MOE_TIGHT_MAX_REL, f"{label}: rel L2 {tight:.2e}, max {worst:.2e}"
    loose = rel_l2(got, R.moe64(x, ids, weights, w13, s13, w2, s2, offset, pow2, quantise_acts=False))
    assert loose <= MOE_LOOSE_REL_L2, f"{label}: rel L2 {loose:.4f} against unquantised activations"


def test_moe_experts_bf16_weights_match_a_plain_loop(one_thread):
    g = torch.Generator().manual_seed(11)
    num_experts, num_local, offset, hidden, inter = 12, 7, 3, 256, 192
    w13, _, w2, _ = make_experts(num_local, hidden, inter, True, g, bf16=True)
    x = make_x(64, hidden, g)
    ids, weights = route(64, num_experts, 3, g)
    got = torch.ops.dsa.moe_experts(x, ids, weights, w13, None, w2, None, num_experts, offset, True)
    want = R.moe64(x, ids, weights, w13, None, w2, None, offset, True)
    tight = rel_l2(got, want)
    worst = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert tight <= MOE_TIGHT_REL_L2 and worst <= MOE_TIGHT_MAX_REL, f"rel L2 {tight:.2e}, max {worst:.2e}"


def test_moe_expert_parallel_ranks_sum_to_the_whole(one_thread):
    """Four ranks of 4 experts each add up to one rank holding all 16 (fp32 summation order only)."""
    g = torch.Generator().manual_seed(3)
    num_experts, hidden, inter = 16, 256, 128
    w13, s13, w2, s2 = make_experts(num_experts, hidden, inter, True, g)
    x = make_x(40, hidden, g)
    ids, weights = route(40, num_experts, 4, g)
    whole = torch.ops.dsa.moe_experts(x, ids, weights, w13, s13, w2, s2, num_experts, 0, True)
    parts = sum(torch.ops.dsa.moe_experts(x, ids, weights, w13[lo:lo + 4], s13[lo:lo + 4], w2[lo:lo + 4],
                                          s2[lo:lo + 4], num_experts, lo, True) for lo in range(0, 16, 4))
    assert (parts - whole).abs().max() <= 1e-6 * whole.abs().max()


# ------------------------------------------------------------------------------ bad input
def _linear_args():
    g = torch.Generator().manual_seed(0)
    w, s = R.quantize_weight64(torch.randn(576, 200, generator=g), True)
    return {"x": make_x(4, 200, g), "weight": w, "weight_scale": s}


LINEAR_BAD = [
    ("x float32", lambda a: a.update(x=a["x"].float()), "x must be torch.bfloat16"),
    ("x 3-D", lambda a: a.update(x=a["x"][None]), "x must be 2-D"),
    ("x columns", lambda a: a.update(x=a["x"][:, :199]), "x has K=199 columns"),
    ("x inner stride", lambda a: a.update(x=a["x"].T.contiguous().T), "x must have unit inner stride"),
    ("weight bf16", lambda a: a.update(weight=a["weight"].bfloat16()), "weight must be torch.float8_e4m3fn"),
    ("weight 3-D", lambda a: a.update(weight=a["weight"][None]), "weight must be 2-D"),
    ("weight strided", lambda a: a.update(weight=a["weight"].view(torch.uint8)[::2].view(torch.float8_e4m3fn)),
     "weight must be contiguous"),
    ("scale rows", lambda a: a.update(weight_scale=a["weight_scale"][:4]), "weight_scale must be [ceil(N/128)"),
    ("scale dtype", lambda a: a.update(weight_scale=a["weight_scale"].double()), "weight_scale must be torch.float32"),
    ("scale strided", lambda a: a.update(weight_scale=a["weight_scale"].T.contiguous().T),
     "weight_scale must be contiguous"),
]


@pytest.mark.parametrize("label,mutate,message", LINEAR_BAD, ids=[c[0] for c in LINEAR_BAD])
def test_fp8_block_linear_bad_input(label, mutate, message):
    args = _linear_args()
    mutate(args)
    with pytest.raises(Fp8OpError, match="dsa::fp8_block_linear: .*" + _re(message)):
        torch.ops.dsa.fp8_block_linear(args["x"], args["weight"], args["weight_scale"], True)


def _re(s: str) -> str:
    import re

    return re.escape(s)


def _moe_args():
    g = torch.Generator().manual_seed(1)
    w13, s13, w2, s2 = make_experts(4, 256, 128, True, g)
    ids, weights = route(6, 16, 3, g)
    return {"x": make_x(6, 256, g), "topk_ids": ids, "topk_weights": weights, "w13": w13, "w13_scale": s13,
            "w2": w2, "w2_scale": s2, "num_experts": 16, "expert_offset": 4}


def _set_id(a, value):
    ids = a["topk_ids"].clone()
    ids[2, 1] = value
    a["topk_ids"] = ids


def _repeat_id(a):
    ids = a["topk_ids"].clone()
    ids[3, 2] = ids[3, 0]
    a["topk_ids"] = ids


MOE_BAD = [
    ("x float32", lambda a: a.update(x=a["x"].float()), "x must be torch.bfloat16"),
    ("x strided", lambda a: a.update(x=a["x"].T.contiguous().T), "x must be contiguous"),
    ("ids int64", lambda a: a.update(topk_ids=a["topk_ids"].long()), "topk_ids must be torch.int32"),
    ("ids rows", lambda a: a.update(topk_ids=a["topk_ids"][:5]), "topk_ids has 5 rows, x has 6 tokens"),
    ("weights shape", lambda a: a.update(topk_weights=a["topk_weights"][:, :2].contiguous()), "topk_weights [6, 2] must have"),
    ("weights bf16", lambda a: a.update(topk_weights=a["topk_weights"].bfloat16()), "topk_weights must be torch.float32"),
    ("w13 2-D", lambda a: a.update(w13=a["w13"][0]), "w13 must be 3-D"),
    ("w13 strided", lambda a: a.update(w13=a["w13"].transpose(1, 2).contiguous().transpose(1, 2)),
     "w13 must be contiguous"),
    ("w13 odd rows", lambda a: a.update(w13=a["w13"][:, :255].contiguous()), "even, non-zero row count"),
    ("w13 hidden", lambda a: a.update(w13=a["w13"][:, :, :128].contiguous()), "with D=256"),
    ("w2 dtype", lambda a: a.update(w2=a["w2"].float()), "w2 must be torch.float8_e4m3fn"),
    ("w2 shape", lambda a: a.update(w2=a["w2"][:3]), "w2 must be [E_local, D, I] = [4, 256, 128]"),
    ("w2 strided", lambda a: a.update(w2=a["w2"].transpose(1, 2).contiguous().transpose(1, 2)),
     "w2 must be contiguous"),
    ("w13_scale missing", lambda a: a.update(w13_scale=None), "w13_scale is required for e4m3 weights"),
    ("w2_scale shape", lambda a: a.update(w2_scale=a["w2_scale"][:, :1].contiguous()), "w2_scale must be [4, 2, 1]"),
    ("w13_scale dtype", lambda a: a.update(w13_scale=a["w13_scale"].bfloat16()), "w13_scale must be torch.float32"),
    ("bf16 with scales", lambda a: a.update(w13=a["w13"].bfloat16(), w2=a["w2"].bfloat16()),
     "w13_scale must be None for bf16 weights"),
    ("offset past the end", lambda a: a.update(expert_offset=13), "expert_offset=13 with E_local=4"),
    ("negative offset", lambda a: a.update(expert_offset=-1), "expert_offset=-1"),
    ("id out of range", lambda a: _set_id(a, 16), "topk_ids[2, 1] = 16 is out of [0, num_experts=16)"),
    ("negative id", lambda a: _set_id(a, -1), "topk_ids[2, 1] = -1 is out of"),
    ("repeated id", _repeat_id, "topk_ids row 3 names expert"),
]


@pytest.mark.parametrize("label,mutate,message", MOE_BAD, ids=[c[0] for c in MOE_BAD])
def test_moe_experts_bad_input(label, mutate, message):
    args = _moe_args()
    mutate(args)
    with pytest.raises(Fp8OpError, match="dsa::moe_experts: .*" + _re(message)):
        torch.ops.dsa.moe_experts(*args.values(), True)


def test_fake_kernels_check_shapes_under_export():
    """torch.export traces both ops with a dynamic token count; the fake kernels' checks run there."""
    lin, moe = _linear_args(), _moe_args()

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k in ("weight", "weight_scale"):
                self.register_buffer(k, lin[k])
            for k in ("w13", "w13_scale", "w2", "w2_scale"):
                self.register_buffer(k, moe[k])

        def forward(self, x, ids, weights):
            h = torch.ops.dsa.fp8_block_linear(x[:, :200], self.weight, self.weight_scale, True)
            return torch.ops.dsa.moe_experts(x, ids, weights, self.w13, self.w13_scale, self.w2, self.w2_scale,
                                             16, 4, True), h

    tokens = torch.export.Dim("tokens", min=1, max=4096)
    args = (moe["x"], moe["topk_ids"], moe["topk_weights"])
    ep = torch.export.export(Both(), args, dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.dsa.fp8_block_linear.default in targets and torch.ops.dsa.moe_experts.default in targets
    out, h = ep.module()(*args)
    assert out.shape == (6, 256) and h.shape == (6, 576)
    bad = Both()
    bad.w13_scale = bad.w13_scale[:, :1].contiguous()
    with pytest.raises(Fp8OpError, match="w13_scale must be"):
        torch.export.export(bad, args)


# ------------------------------------------------------------------------------ checkpoint access
class _Recording:
    """Wraps Checkpoint.raw to record which tensors a call reads (the reads stay real)."""

    def __init__(self, ckpt):
        self.names: list[str] = []
        self._raw = ckpt.raw
        ckpt.raw = self

    def __call__(self, name):
        self.names.append(name)
        return self._raw(name)


def test_checkpoint_fp8_weight_and_stacked_experts(tiny_ckpt):
    from dsa_trt.export.checkpoint import Checkpoint, dequantize_fp8_blockwise, scale_name

    with Checkpoint(tiny_ckpt) as ckpt:
        cfg = ckpt.config
        layer, lo, hi = cfg.first_k_dense_replace, 2, 5
        kv_a = f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"
        w, s = ckpt.fp8_weight(kv_a)
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
        assert torch.equal(w.view(torch.uint8), ckpt.raw(kv_a).view(torch.uint8))
        with pytest.raises(ValueError, match="not F8_E4M3: read it with get()"):
            ckpt.fp8_weight("model.embed_tokens.weight")

        reads = _Recording(ckpt)
        w13, s13, w2, s2 = ckpt.stacked_experts(layer, lo, hi)
        p = f"model.layers.{layer}.mlp.experts."
        wanted = {f"{p}{e}.{proj}_proj.weight{sfx}" for e in range(lo, hi) for proj in ("gate", "up", "down")
                  for sfx in ("", "_scale_inv")}
        assert sorted(reads.names) == sorted(wanted), "stacked_experts must read exactly its experts, once each"
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        assert w13.shape == (hi - lo, 2 * inter, hidden) and w2.shape == (hi - lo, hidden, inter)
        assert s13.shape == (hi - lo, math.ceil(2 * inter / 128), math.ceil(hidden / 128))
        assert s2.shape == (hi - lo, math.ceil(hidden / 128), math.ceil(inter / 128))
        for i, e in enumerate(range(lo, hi)):
            for name, weight, scale in ((f"{p}{e}.gate_proj.weight", w13[i, :inter], s13[i, : inter // 128]),
                                        (f"{p}{e}.up_proj.weight", w13[i, inter:], s13[i, inter // 128 :]),
                                        (f"{p}{e}.down_proj.weight", w2[i], s2[i])):
                assert torch.equal(dequantize_fp8_blockwise(weight, scale), ckpt.get(name)), name
                assert torch.equal(scale, ckpt.raw(scale_name(name)))
        with pytest.raises(ValueError, match="has no routed experts"):
            ckpt.stacked_experts(0, 0, 1)
        with pytest.raises(ValueError, match=r"experts \[3, 3\) must be a non-empty range"):
            ckpt.stacked_experts(layer, 3, 3)
        with pytest.raises(ValueError, match="n_routed_experts"):
            ckpt.stacked_experts(layer, 0, cfg.n_routed_experts + 1)


def test_checkpoint_stacked_experts_bf16(tiny_ckpt, tmp_path):
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.tiny_checkpoint import write_dequantized_hf_copy

    dst = write_dequantized_hf_copy(tiny_ckpt, tmp_path / "bf16")
    with Checkpoint(dst) as ckpt:
        layer = ckpt.config.first_k_dense_replace
        inter = ckpt.config.moe_intermediate_size
        w13, s13, w2, s2 = ckpt.stacked_experts(layer, 0, ckpt.config.n_routed_experts)
        assert s13 is None and s2 is None and w13.dtype == torch.bfloat16
        p = f"model.layers.{layer}.mlp.experts.3."
        assert torch.equal(w13[3, :inter], ckpt.get(p + "gate_proj.weight", torch.bfloat16))
        assert torch.equal(w13[3, inter:], ckpt.get(p + "up_proj.weight", torch.bfloat16))
        assert torch.equal(w2[3], ckpt.get(p + "down_proj.weight", torch.bfloat16))
        with pytest.raises(ValueError, match="not F8_E4M3"):
            ckpt.fp8_weight(p + "gate_proj.weight")


# ------------------------------------------------------------------------------ ONNX plugin nodes
def test_onnx_export_emits_plugin_nodes(tmp_path):
    """Both ops become one dsa-domain node each, attributes = the plugin fields (PLUGINS.md), the
    fp8 weights FLOAT8E4M3FN initializers; the bf16 MoE gets FLOAT [1] scale placeholders."""
    import onnx

    from dsa_trt.builder.onnx_export import PLUGINS, export_onnx, tensorrt_problems

    g = torch.Generator().manual_seed(2)
    w, s = R.quantize_weight64(torch.randn(256, 200, generator=g) * 0.05, True)
    w13, s13, w2, s2 = make_experts(4, 256, 128, True, g)
    b13, _, b2, _ = make_experts(2, 256, 128, True, g, bf16=True)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in dict(w=w, s=s, w13=w13, s13=s13, w2=w2, s2=s2, b13=b13, b2=b2).items():
                self.register_buffer(k, v)

        def forward(self, x, ids, weights):
            h = torch.ops.dsa.fp8_block_linear(x, self.w, self.s, True)  # [T, 256] bf16
            routed = torch.ops.dsa.moe_experts(h, ids, weights, self.w13, self.s13, self.w2, self.s2, 16, 4, True)
            dense = torch.ops.dsa.moe_experts(h, ids, weights, self.b13, None, self.b2, None, 16, 8, False)
            return routed + dense

    x = make_x(5, 200, g)
    ids, weights = route(5, 16, 3, g)
    tokens = torch.export.Dim("tokens", min=1, max=1024)
    ep = torch.export.export(Block(), (x, ids, weights), dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    model = onnx.load(str(export_onnx(ep, tmp_path / "fp8.onnx")))
    onnx.checker.check_model(model)
    nodes = [n for n in model.graph.node if n.domain == "dsa"]
    assert [n.op_type for n in nodes] == ["DsaFp8BlockLinear", "DsaMoeExperts", "DsaMoeExperts"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    strings = {"plugin_namespace": b"dsa", "plugin_version": b"1"}
    assert attrs[0] == {"pow2_scales": 1, **strings}
    assert attrs[1] == {"num_experts": 16, "expert_offset": 4, "weight_format": 0, "pow2_scales": 1, **strings}
    assert attrs[2] == {"num_experts": 16, "expert_offset": 8, "weight_format": 1, "pow2_scales": 0, **strings}
    for n, a in zip(nodes, attrs):
        assert set(a) == {f for f, _ in PLUGINS[n.op_type].fields} | set(strings)
        assert len(n.input) == len(PLUGINS[n.op_type].inputs)
    inits = {t.name: t for t in model.graph.initializer}
    consts = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}

    def dtype_of(name):
        if name in inits:
            return inits[name].data_type, list(inits[name].dims)
        t = onnx.helper.get_attribute_value(consts[name].attribute[0])
        return (t.data_type, list(t.dims)) if hasattr(t, "data_type") else (onnx.TensorProto.FLOAT, [len(t)])

    assert dtype_of(nodes[0].input[1]) == (onnx.TensorProto.FLOAT8E4M3FN, [256, 200])
    assert dtype_of(nodes[0].input[2]) == (onnx.TensorProto.FLOAT, [2, 2])
    assert dtype_of(nodes[1].input[3]) == (onnx.TensorProto.FLOAT8E4M3FN, [4, 256, 256])
    assert dtype_of(nodes[1].input[4]) == (onnx.TensorProto.FLOAT, [4, 2, 2])
    assert dtype_of(nodes[2].input[3]) == (onnx.TensorProto.BFLOAT16, [2, 256, 256])
    assert dtype_of(nodes[2].input[4]) == (onnx.TensorProto.FLOAT, [1])
    assert nodes[1].input[0] == nodes[0].output[0] and nodes[2].input[0] == nodes[0].output[0]
    assert tensorrt_problems(model) == []


# ------------------------------------------------------------------------------ the network on the op
# W8A8 MoE (e4m3 experts, activations quantised) against the same network with dequantised experts:
# the logits move by the recipe's quantisation error (~0.017 measured on the tiny model).
NETWORK_FP8_MOE_REL_L2 = 0.05


@contextlib.contextmanager
def native_cpu_gemms():
    """torch's own CPU GEMM kernels instead of oneDNN's while the block runs (restored after)."""
    old = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = old


def _logits(net, cfg):
    from dsa_trt.export.program import example_step
    from dsa_trt.plugins.pools import allocate_pools

    step = example_step(cfg)
    mla, idx = allocate_pools(cfg, "bf16", 4)
    with torch.no_grad():
        return net(*step.as_tuple(), mla, idx).double()


def test_network_moe_on_the_expert_op(tiny_ckpt, tmp_path):
    """build_network(expert_op=True): one dsa::moe_experts node per MoE layer; on a bf16 checkpoint the
    logits equal the per-expert loop's exactly, on the fp8 checkpoint they are W8A8 (experts e4m3),
    and with weight_format="dequant" the stacked experts are the dequantised bf16 ones."""
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network, export_program
    from dsa_trt.export.tiny_checkpoint import write_dequantized_hf_copy

    bf16 = Checkpoint(write_dequantized_hf_copy(tiny_ckpt, tmp_path / "bf16"))
    cfg = bf16.config
    # exact needs GEMMs whose rows do not depend on M: the loop runs each expert on all T tokens, the
    # op on its routed ones, and oneDNN's AMX bf16 GEMM blocks by M (on such CPUs the two differed by
    # rel L2 1.5e-3); torch's own CPU kernels sum every row the same way at any M
    with native_cpu_gemms():
        loop = _logits(build_network(bf16, "bf16", torch.bfloat16, expert_op=False), cfg)
    net = build_network(bf16, "bf16", torch.bfloat16)  # the expert op is on by default in bf16
    with native_cpu_gemms():
        assert torch.equal(_logits(net, cfg), loop)
    moe = net.model.layers[cfg.first_k_dense_replace].mlp
    assert moe.stacked_experts.w13.dtype == torch.bfloat16 and moe.stacked_experts.w13_scale is None

    fp8 = Checkpoint(tiny_ckpt)
    fp8_net = build_network(fp8, "bf16", torch.bfloat16, expert_op=True)
    stacked = fp8_net.model.layers[cfg.first_k_dense_replace].mlp.stacked_experts
    assert stacked.w13.dtype == torch.float8_e4m3fn and stacked.w13_scale.dtype == torch.float32
    dequant = build_network(fp8, "bf16", torch.bfloat16, weight_format="dequant")
    with native_cpu_gemms():
        assert torch.equal(_logits(dequant, cfg), loop), "dequantised stacked experts = the bf16 checkpoint's"
    # only the experts W8A8: the fp8 network's Fp8Linears swapped for the dequantised network's Linears
    for name, m in list(fp8_net.named_modules()):
        owner, _, leaf = name.rpartition(".")
        if type(m).__name__ == "Fp8Linear":
            setattr(fp8_net.get_submodule(owner), leaf, dequant.get_submodule(name))
        elif type(m).__name__ == "FusedFp8Linear":  # its parts' dequantised Linears, stacked as it stacks them
            lin = torch.nn.Linear(m.weight.shape[1], m.weight.shape[0], bias=False, dtype=torch.bfloat16)
            lin.weight = torch.nn.Parameter(torch.cat([dequant.get_submodule(f"{owner}.{p}").weight for p, _ in m.parts]),
                                            requires_grad=False)
            lin.split = m.split
            setattr(fp8_net.get_submodule(owner), leaf, lin)
    err = rel_l2(_logits(fp8_net, cfg), loop)
    assert 0 < err <= NETWORK_FP8_MOE_REL_L2, f"W8A8 experts moved the logits by rel L2 {err:.4f}"

    ep = export_program(net)
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert sum(n.target == torch.ops.dsa.moe_experts.default for n in calls) == moe_layers
    expert_nodes = [n for n in calls if any(".experts." in p for p, _ in (n.meta.get("nn_module_stack") or {}).values())]
    assert not expert_nodes, "no per-expert nodes may remain"
    with pytest.raises(ValueError, match="take bf16 activations"):
        build_network(bf16, "bf16", torch.float32, expert_op=True)


# Every attention / dense / shared-expert Linear in W8A8 against the dequantised bf16 network: three
# layers of activation quantisation (measured rel L2 0.073 on the tiny model, top-1 all equal).
NETWORK_W8A8_REL_L2 = 0.15


def test_network_fp8_linears_stay_e4m3(tiny_ckpt):
    """build_network(weight_format="fp8"): each e4m3 Linear of the checkpoint (but kv_b, and the routed
    experts, which the expert op holds) is one dsa::fp8_block_linear on the stored weight and scale."""
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network, export_program

    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    net = build_network(ckpt, "bf16", torch.bfloat16, weight_format="fp8")
    # the MLA's and the indexer's linears of x as one GEMM: their stored e4m3 rows stacked
    x_proj = net.model.layers[0].self_attn.x_proj
    assert [p for p, _ in x_proj.parts] == ["q_a_proj", "indexer.wk", "kv_a_proj_with_mqa"]
    stored = [ckpt.raw(f"model.layers.0.self_attn.{p}.weight").view(torch.uint8) for p, _ in x_proj.parts]
    assert torch.equal(x_proj.weight.view(torch.uint8), torch.cat(stored))
    scales = [ckpt.raw(f"model.layers.0.self_attn.{p}.weight_scale_inv") for p, _ in x_proj.parts]
    assert torch.equal(x_proj.weight_scale_inv, torch.cat(scales))
    assert [p for p, _ in net.model.layers[0].self_attn.cq_proj.parts] == ["q_b_proj", "indexer.wq_b"]
    base = _logits(build_network(ckpt, "bf16", torch.bfloat16, weight_format="dequant"), cfg)
    got = _logits(net, cfg)
    err = rel_l2(got, base)
    assert 0 < err <= NETWORK_W8A8_REL_L2, f"W8A8 network: rel L2 {err:.4f} against the dequantised one"
    assert (got.argmax(-1) == base.argmax(-1)).float().mean() >= 0.9

    fp8_linears = [n for n in ckpt.names() if ckpt.is_fp8(n) and ".experts." not in n and "kv_b_proj" not in n]
    ep = export_program(net)
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    # per layer q_a, wk, kv_a (over x), q_b, wq_b (over c_q) and the MLP's gate, up are three fused calls
    fused = [m for m in net.modules() if type(m).__name__ == "FusedFp8Linear"]
    assert len(fused) == 3 * cfg.num_hidden_layers
    fused_away = sum(len(m.parts) - 1 for m in fused)
    assert sum(n.target == torch.ops.dsa.fp8_block_linear.default for n in calls) == len(fp8_linears) - fused_away
