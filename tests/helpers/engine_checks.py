"""Checks shared by the CPU and GPU engine tests."""

from __future__ import annotations

import contextlib
import math

import torch

STEPS = 32
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog because", "Once upon a time, in a small village "
           "by the sea, there lived an old fisherman who every morning walked down to the harbour and"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def teacher_forced_steps(engine_dir, tiny_ckpt, device: str, dtype: torch.dtype, steps_per_prompt: int = STEPS):
    """Teacher-forced greedy decoding of PROMPTS: each prompt's prefill, then decode steps fed the
    eager network's own greedy tokens, through the compiled engine and the eager network with the
    same operators (on the GPU our CUDA kernels), each on its own paged caches. Below fp32 the eager
    network's fp32 twin (its own caches; its ops run the plain-torch reference,
    cuda_ops.reference_ops(); for an fp8 engine the same W8A8 recipe, w8a8_fp32_reference) runs
    beside them as the precision reference. Yields one dict per step: prompt, pos, compiled /
    eager / ref logits (fp32, last position)."""
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.plugins import cuda_ops
    from dsa_trt.export.program import build_network
    from dsa_trt.plugins.pools import allocate_pools
    from dsa_trt.runtime.engine import Engine
    from dsa_trt.runtime.step_inputs import StepInputs
    from dsa_trt.runtime.tokenizer import Tokenizer

    engine = Engine.load(engine_dir)
    cfg = engine.config
    ckpt = Checkpoint(tiny_ckpt)
    dtypes = [dtype] + ([torch.float32] if dtype != torch.float32 else [])
    nets = {dtype: build_network(ckpt, cfg.cache_mode, dtype, cfg.kv_scales, device=device,
                                 weight_format=cfg.weight_format)}
    if dtype != torch.float32:
        # the fp32 twin of the eager network: the same W8A8 linears in fp32 for an fp8 engine (the
        # e4m3 rounding of activations is the model's, not noise), the dequantised weights otherwise
        nets[torch.float32] = (
            w8a8_fp32_reference(build_network(ckpt, cfg.cache_mode, dtype, cfg.kv_scales, device=device,
                                              weight_format="fp8"))
            if cfg.weight_format == "fp8" else
            build_network(ckpt, cfg.cache_mode, torch.float32, cfg.kv_scales, device=device, weight_format="dequant"))
    tok = Tokenizer(ckpt.tokenizer_path, cfg.model.bos_token_id, cfg.model.eos_token_id)
    pools = {k: allocate_pools(cfg.model, cfg.cache_mode, 16, device=device) for k in ["compiled"] + dtypes}
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        pages = [2 * i, 2 * i + 1]  # 64-token pages, scattered per prompt; prompt + 32 steps < 128
        feed, pos = ids, 0
        for _ in range(steps_per_prompt + 1):
            step = StepInputs.build([(feed, pos, pages)], device=device)
            rec = {"prompt": i, "pos": pos, "compiled": engine.forward(step, *pools["compiled"])[-1].float()}
            with torch.no_grad():
                for dt in dtypes:
                    # no CUDA kernel takes fp32 activations: the precision reference asks for the references
                    plain = dt != dtype and device != "cpu"
                    with cuda_ops.reference_ops() if plain else contextlib.nullcontext():
                        out = nets[dt](*step.as_tuple(), *pools[dt])[-1].float()
                    rec["eager" if dt == dtype else "ref"] = out
            token = rec["eager"].argmax().item()
            yield rec
            pos += len(feed)
            feed = [token]  # teacher forcing: the eager network's greedy token


def teacher_forced_greedy(engine_dir, tiny_ckpt, device: str, dtype: torch.dtype, steps_per_prompt: int = STEPS,
                          report=None):
    """Compiled engine vs the eager network, teacher-forced (teacher_forced_steps).

    Logits: in fp32 the two must agree to 3e-2 rel. L2 per step (fp8 cache bytes may round across an
    e4m3 boundary). Below fp32 the noise floor is measured, not guessed: both are compared with the
    fp32 network, and the compiled engine's RMS rel. L2 error over all steps may be at most 1.5x the
    eager network's (fusion changes roundings, not their size); per step, compiled vs eager stays
    within 3x the eager network's worst step error.
    Tokens: the greedy token must equal the eager one, except where the eager top-2 margin is inside
    twice that step's max |logit difference| (a near tie that rounding may flip). How many such
    flips rounding explains is measured too: at most 1 in 8 steps, or twice as many as the eager
    network's greedy tokens differ from its fp32 twin's (a W8A8 network on random weights flips
    ~1 in 5 steps by bf16 rounding alone: an e4m3 step is 6% of an activation).
    Free-running token streams are not compared: one flipped near tie changes every later token.
    ``report(rec)`` sees each step's numbers. Returns a dict of the totals."""
    recs = []
    for rec in teacher_forced_steps(engine_dir, tiny_ckpt, device, dtype, steps_per_prompt):
        got, want = rec.pop("compiled"), rec.pop("eager")
        ref = rec.pop("ref", None)
        top2 = torch.topk(want, 2)
        token, got_token = top2.indices[0].item(), got.argmax().item()
        rec.update(rel=_rel(got, want), diff=(got - want).abs().max().item(),
                   margin=(top2.values[0] - top2.values[1]).item(), same=got_token == token, token=token,
                   got_token=got_token)
        if ref is not None:
            rec.update(err_compiled=_rel(got, ref), err_eager=_rel(want, ref), ref_same=ref.argmax().item() == token)
        if report:
            report(rec)
        recs.append(rec)
    where = lambda r: f"prompt {r['prompt']} pos {r['pos']}"  # noqa: E731
    out = {"steps": len(recs), "same": sum(r["same"] for r in recs), "worst_rel": max(r["rel"] for r in recs)}
    if dtype == torch.float32:
        for r in recs:
            assert r["rel"] < 3e-2, f"{where(r)}: compiled vs eager logits rel. L2 {r['rel']:.3g}"
    else:
        rms = lambda key: math.sqrt(sum(r[key] ** 2 for r in recs) / len(recs))  # noqa: E731
        out.update(rms_compiled=rms("err_compiled"), rms_eager=rms("err_eager"),
                   worst_eager=max(r["err_eager"] for r in recs))
        assert out["rms_compiled"] <= 1.5 * out["rms_eager"], (
            f"compiled engine's RMS logits error vs the fp32 network {out['rms_compiled']:.3g} > 1.5 x the eager "
            f"{dtype} network's {out['rms_eager']:.3g}")
        for r in recs:
            assert r["rel"] <= 3 * out["worst_eager"], (
                f"{where(r)}: compiled vs eager logits rel. L2 {r['rel']:.3g} > 3 x the eager network's worst "
                f"error vs fp32 ({out['worst_eager']:.3g})")
    near_ties = 0
    for r in recs:
        if not r["same"]:
            assert r["margin"] <= 2 * r["diff"], (
                f"{where(r)}: greedy token {r['got_token']} vs eager {r['token']} with a top-2 margin "
                f"{r['margin']:.3g} > 2 x |diff| {r['diff']:.3g}")
            near_ties += 1
    floor = sum(not r.get("ref_same", True) for r in recs)  # eager vs its fp32 twin: rounding's own flips
    assert near_ties <= max(len(recs) // 8, 2 * floor), (
        f"{near_ties} of {len(recs)} steps flipped near ties: more than rounding explains (the eager network "
        f"flips {floor} vs its fp32 twin)")
    out.update(near_ties=near_ties, floor_flips=floor)
    return out


# ---------------------------------------------------------------- the fp32 W8A8 precision reference
def w8a8_linear_fp32(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, pow2: bool) -> torch.Tensor:
    """The official W8A8 linear (activations e4m3 per 1x128 group, weights e4m3 per 128x128
    block) with fp32 activations in and fp32 out: no bf16 rounding anywhere. The same function as
    plugins/fp8_reference.fp8_gemm, summed as one product of the dequantised operands (fp32
    summation order only: ~1e-6, far below bf16's 4e-3)."""
    from dsa_trt.plugins.fp8_reference import FP8_BLOCK, act_quant, num_blocks

    q, s_x = act_quant(x, pow2)
    k, n = x.shape[1], weight.shape[0]
    xd, wd = q.float(), weight.float()
    s_w = weight_scale.float().repeat_interleave(FP8_BLOCK, dim=0)[:n]  # [N, KB]: each row's block scales
    for b in range(num_blocks(k)):  # in place, a K block at a time: no second copy of the weight
        cols = slice(b * FP8_BLOCK, min(k, (b + 1) * FP8_BLOCK))
        xd[:, cols] *= s_x[:, b : b + 1]
        wd[:, cols] *= s_w[:, b : b + 1]
    return xd @ wd.T


class Fp32W8A8Linear(torch.nn.Module):
    """An Fp8Linear's weights, run by w8a8_linear_fp32 on fp32 activations (a FusedFp8Linear's
    with its ``split``)."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin
        if hasattr(lin, "split"):
            self.split = lin.split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.lin
        y = w8a8_linear_fp32(x.reshape(-1, x.shape[-1]).float(), lin.weight, lin.weight_scale_inv, lin.pow2_scales)
        return y.view(*x.shape[:-1], y.shape[-1])


class Fp32W8A8Experts(torch.nn.Module):
    """A StackedExperts' e4m3 experts in fp32: per local expert, its tokens' gate/up W8A8 linear,
    SiLU(gate) * up, the down W8A8 linear, weighted and summed in fp32 (dsa::moe_experts' recipe
    without its bf16 roundings)."""

    def __init__(self, experts):
        super().__init__()
        if not experts.fp8:
            raise ValueError("Fp32W8A8Experts needs e4m3 stacked experts (an fp8-block checkpoint)")
        self.experts = experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        inter, pow2 = ex.w2.shape[2], ex.pow2_scales
        for e in range(ex.w13.shape[0]):
            tok, j = torch.nonzero(ids == e + ex.expert_offset, as_tuple=True)
            if tok.numel() == 0:
                continue
            gate_up = w8a8_linear_fp32(x[tok].float(), ex.w13[e], ex.w13_scale[e], pow2)
            h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out.index_add_(0, tok, w8a8_linear_fp32(h, ex.w2[e], ex.w2_scale[e], pow2) * weights[tok, j, None].float())
        return out


def w8a8_fp32_reference(net: torch.nn.Module) -> torch.nn.Module:
    """A bf16 network built with ``weight_format="fp8"`` (W8A8 linears, the expert op), turned in place into the same
    W8A8 network computing in fp32: the same e4m3 weights and scales, activations quantised to
    e4m3 by the same recipe, but fp32 wherever the bf16 network rounds to bf16 (every
    activation, the bf16 weights widened exactly). It is the precision reference of the real-dims
    engine: its distance to the bf16 network is the noise floor that bf16 rounding sets."""
    from dsa_trt.export.layers import Fp8Linear, StackedExperts

    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Fp8Linear):
                setattr(parent, name, Fp32W8A8Linear(child))
            elif isinstance(child, StackedExperts):
                setattr(parent, name, Fp32W8A8Experts(child))
    for mod in net.modules():
        for key, p in mod._parameters.items():
            if p is not None and p.dtype == torch.bfloat16:
                mod._parameters[key] = torch.nn.Parameter(p.float(), requires_grad=False)
        for key, b in mod._buffers.items():
            if b is not None and b.dtype == torch.bfloat16:
                mod._buffers[key] = b.float()
    return net
