"""The parallel plan: does a model fit on N GPUs, and how many tokens does its cache then hold?

Pure arithmetic over a :class:`ModelConfig`; nothing is loaded or built. The builder refuses a
plan that cannot fit (:func:`check_fits`) and ``dsa-trt plan`` prints it (:func:`format_plan`).

The layout (issue 25; export/sharding.py is today's TP-only network):

* ``world = max(tp, ep)`` ranks; both tp and ep divide it; or, with ``cp`` > 1 (context-parallel
  attention, what ``dsa-trt build --cp P [--ep P]`` builds: export/parallel.py), ``world = cp``
  ranks with tp = 1 and ep in {1, cp}.
* Attention: heads split over ``tp`` ranks (rows of q_b / kv_b, columns of o_proj); q_a / kv_a,
  their norms and the whole indexer are replicated, since the 576-byte latent and the indexer key
  are per token. When ``world > tp`` the ``dp = world / tp`` attention groups are data-parallel:
  each group serves its own sequences, so a token's cache lives in one group only (the builder
  does not build this: ``Plan.build_flags`` is None). With ``cp`` the attention is replicated as
  well, but the ranks form one group: each step's tokens are interleaved over them and every rank
  caches every token (dp = 1).
* Dense MLPs and the shared experts: intermediate dim split over the ``tp`` ranks of a group.
* Routed experts: ``n_routed_experts / ep`` whole experts per rank (rank r holds those of
  expert-parallel rank ``r % ep``); the router is replicated.
* Embedding and lm_head: replicated (what the network does today) or, with ``vocab_split``,
  rows split over the tp ranks of a group (an all-gather of the logits then).
* Weights as the engine holds them (``weights="stored"``): the checkpoint's fp8 e4m3 Linears with
  their fp32 128x128 block scales, bf16 embeddings / router / ``weights_proj``, fp32 norms, except
  ``kv_b_proj``, which the engine keeps dequantised to bf16 without its scale (the absorbed decode
  reads it as W_uk / W_uv: export/network.py); a bf16 checkpoint stays bf16. ``weights="bf16"``
  counts every fp8 Linear dequantised to bf16, as the network of before issue 24 held them. A split fp8 weight must be split on a 128-block boundary, so that
  each rank's slice keeps whole blocks and its own rows of the scale.
* The MTP layer (``model.layers.{num_hidden_layers}``) only with ``include_mtp``: one more decoder
  layer, its cache, and its norms and eh_proj; it shares the main embedding and lm_head (the engine
  holds them once: builder/weights.py build_draft_rank), so the copies the checkpoint stores are
  not counted.
* Derived buffers (part "derived"): the indexer's Hadamard rotation per layer and RoPE's inverse
  frequencies, which the engine's weights files hold beside the checkpoint's tensors.

Memory per rank = weights + ``reserve`` (activations of a ``max_num_tokens`` step, the compiled
programs' workspace, CUDA graphs, the NCCL buffers, the allocator's slack) + the cache pool. The
pool holds whole pages of ``PAGE_SIZE`` tokens; a plan fits when every rank has room for at
least ``min_cache_tokens`` (one full step) after weights and reserve.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsa_trt.config import PAGE_SIZE, ConfigError, ModelConfig

GB = 10**9  # --gpu-memory-gb is decimal GB (an H200 reports 143,771 MiB = 150.8 GB; sold as "141 GB")
DEFAULT_RESERVE_GB = 8.0  # activations + workspace + graphs + NCCL + allocator slack, per rank
DEFAULT_MIN_CACHE_TOKENS = 8192  # one full step of the builder's default max_num_tokens
WEIGHT_MODES = ("stored", "bf16")
CACHE_MODES = ("fp8", "bf16", "fp32")
SEQUENCE_LENGTHS = (4096, 32768, 131072)  # how many sequences of these lengths the caches hold
MAX_WORLD = 256  # the largest world size suggest_plan tries

# (pattern on the checkpoint name, part, split): split is "col" (rows over tp), "row" (columns
# over tp), "expert" (whole experts over ep), "vocab" (rows over tp when vocab_split) or None.
_RULES: tuple[tuple[str, str, str | None], ...] = (
    (r"^model\.embed_tokens\.", "embed", "vocab"),
    (r"^lm_head\.", "lm_head", "vocab"),
    (r"^model\.norm\.", "norms", None),
    (r"\.self_attn\.indexer\.", "indexer", None),
    (r"\.self_attn\.(q_b_proj|kv_b_proj)\.", "attention", "col"),
    (r"\.self_attn\.o_proj\.", "attention", "row"),
    (r"\.self_attn\.", "attention", None),
    (r"(input|post_attention)_layernorm\.", "norms", None),
    (r"\.mlp\.experts\.\d+\.", "routed_experts", "expert"),
    (r"\.mlp\.gate\.", "router", None),
    (r"\.mlp\.shared_experts\.(gate|up)_proj\.", "shared_experts", "col"),
    (r"\.mlp\.shared_experts\.down_proj\.", "shared_experts", "row"),
    (r"\.mlp\.(gate|up)_proj\.", "dense_mlp", "col"),
    (r"\.mlp\.down_proj\.", "dense_mlp", "row"),
    (r"\.(enorm|hnorm|eh_proj|shared_head\.norm)\.", "mtp", None),
)
_COMPILED = tuple((re.compile(p), part, split) for p, part, split in _RULES)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_ENGINE_BF16 = re.compile(r"\.self_attn\.kv_b_proj\.")  # dequantised in every engine (module docstring)


class PlanError(ConfigError):
    """A parallel layout the model cannot take, or a plan that does not fit; the message names
    the numbers and a layout that would work."""


@dataclass
class RankPlan:
    rank: int
    tp_rank: int
    ep_rank: int
    dp_group: int
    weight_bytes: int
    weight_bytes_by_part: dict[str, int]
    free_bytes: int  # after weights and the reserve (negative: does not fit)
    cache_bytes_per_token: int  # all cache layers, both pools, of one token on this rank
    cache_tokens: int  # whole pages the rank's pool holds
    cache_bytes: int
    fits: bool


@dataclass
class Plan:
    model_type: str
    num_layers: int  # cache layers: decoder layers (+ the MTP layer with include_mtp)
    tp: int
    ep: int
    cp: int  # context-parallel ranks (1: none)
    world_size: int
    dp: int  # data-parallel attention groups (1: tensor- or context-parallel attention only)
    attention: str  # "tp", "dp" or "cp"
    build_flags: str | None  # the `dsa-trt build` flags of this layout; None: the builder does not build it
    weights: str  # "fp8-block" | "bf16-dequantised" | "bf16"
    cache_mode: str
    vocab_split: bool
    include_mtp: bool
    gpu_memory_bytes: int
    reserve_bytes: int
    min_cache_tokens: int
    batch: int
    ranks: list[RankPlan]
    tokens_per_group: int  # cache tokens one attention group holds (min over its ranks)
    total_tokens: int  # over the dp groups: distinct tokens in flight
    longest_context: int  # of each of `batch` equal sequences, whole pages, <= max_position_embeddings
    sequences: dict[str, int] = field(default_factory=dict)  # str(length) -> how many fit
    fits: bool = False
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------ the layout
def check_layout(cfg: ModelConfig, tp: int, ep: int, weights: str = "stored", vocab_split: bool = False) -> None:
    """Every split must divide evenly and, for fp8 weights, on the 128-block grid."""
    problems = []
    if tp < 1 or ep < 1:
        raise PlanError(f"tp={tp}, ep={ep}: both must be >= 1")
    world = max(tp, ep)
    if world % tp or world % ep:
        problems.append(f"tp={tp} and ep={ep} must divide each other (the world is max(tp, ep) = {world} ranks)")
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    splits = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size}
    if shared:
        splits["moe_intermediate_size * n_shared_experts"] = shared
    if vocab_split:
        splits["vocab_size"] = cfg.vocab_size
    problems += [f"tp={tp} does not divide {k} = {v}" for k, v in splits.items() if v % tp]
    if cfg.n_routed_experts % ep:
        problems.append(f"ep={ep} does not divide n_routed_experts = {cfg.n_routed_experts}")
    block = cfg.fp8_weight_block
    if block is not None and weights == "stored" and not problems:
        h = cfg.num_attention_heads // tp
        local = {
            "q_b_proj rows (heads/tp * qk_head_dim)": h * cfg.qk_head_dim,
            "kv_b_proj rows (heads/tp * (qk_nope + v))": h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            "o_proj columns (heads/tp * v_head_dim)": h * cfg.v_head_dim,
            "dense MLP width / tp": cfg.intermediate_size // tp,
        }
        if shared:
            local["shared expert width / tp"] = shared // tp
        problems += [
            f"tp={tp}: {k} = {v} is not a multiple of the {block[0]}-wide fp8 block, so a rank's slice "
            "would cut a scale block"
            for k, v in local.items() if tp > 1 and v % block[0]
        ]
    if problems:
        raise PlanError(f"{cfg.model_type}: " + "; ".join(problems) + "; choose a tp/ep that divides them")


@functools.lru_cache(maxsize=16)
def _weight_totals(cfg: ModelConfig, include_mtp: bool, weights: str) -> tuple[dict, dict]:
    """Bytes an engine holds, summed from the checkpoint layout (``expected_tensors``):
    ({(part, split): bytes} of everything but the routed experts, {expert id: bytes over all layers})."""
    import torch

    from dsa_trt.checkpoint_layout import FP8, SCALE_SUFFIX, expected_tensors, is_mtp_tensor, mtp_shared_copies

    shared = mtp_shared_copies(cfg)
    fixed: dict[tuple[str, str | None], int] = {}
    experts: dict[int, int] = {}
    for name, spec in expected_tensors(cfg).items():
        if is_mtp_tensor(cfg, name) and (not include_mtp or name in shared):
            continue
        base = name.removesuffix(SCALE_SUFFIX)
        part, split = next(((p, s) for pattern, p, s in _COMPILED if pattern.search(base)), (None, None))
        if part is None:
            raise PlanError(f"{name}: no rule of dsa_trt/plan.py says how ranks hold it; add one to _RULES")
        dtype = spec.dtypes[0]
        if weights == "bf16" or _ENGINE_BF16.search(base):
            if name.endswith(SCALE_SUFFIX):
                continue  # dequantised: the scale is folded into the bf16 weight
            if dtype == FP8:
                dtype = torch.bfloat16
        nbytes = math.prod(spec.shape) * dtype.itemsize
        if split == "expert":
            e = int(_EXPERT.search(name)[1])
            experts[e] = experts.get(e, 0) + nbytes
        else:
            fixed[part, split] = fixed.get((part, split), 0) + nbytes
    fixed["derived", None] = derived_bytes(cfg, include_mtp)
    return fixed, experts


def derived_bytes(cfg: ModelConfig, include_mtp: bool) -> int:
    """The buffers an engine computes from the config (export/program.py derived_buffers): per
    decoder layer the indexer's rotation, fp32 and its exact signs in bf16 (export/layers.py
    hadamard_buffers), and RoPE's fp32 inverse frequencies once per program."""
    layers = cfg.num_hidden_layers + (min(1, cfg.num_nextn_predict_layers) if include_mtp else 0)
    programs = 2 if include_mtp and cfg.num_nextn_predict_layers else 1
    return layers * cfg.index_head_dim ** 2 * (4 + 2) + programs * cfg.qk_rope_head_dim // 2 * 4


def _rank_bytes(cfg: ModelConfig, fixed: dict, experts: dict, tp: int, ep: int, ep_rank: int,
                vocab_split: bool) -> dict[str, int]:
    """Bytes per part on one rank. A split tensor (and its scale, whole blocks: check_layout
    guarantees the grid) puts 1/tp of its bytes on each rank of the group."""
    by_part: dict[str, int] = {}
    for (part, split), nbytes in fixed.items():
        divided = split in ("col", "row") or (split == "vocab" and vocab_split)
        by_part[part] = by_part.get(part, 0) + (nbytes // tp if divided else nbytes)
    per_rank = cfg.n_routed_experts // ep
    local = sum(n for e, n in experts.items() if e // per_rank == ep_rank)
    if experts:
        by_part["routed_experts"] = local
    return by_part


# ----------------------------------------------------------------------------- the plan
def build_flags(tp: int, ep: int, cp: int) -> str | None:
    """The `dsa-trt build` flags that build this layout, or None. --tp N splits whole experts over
    its N ranks too (ep = tp); expert parallelism otherwise runs with context parallelism."""
    if cp > 1:
        return f"--ep {ep} --cp {cp}" if ep > 1 else f"--cp {cp}"
    return f"--tp {tp}" if ep == tp else None


def make_plan(cfg: ModelConfig, tp: int = 1, ep: int | None = None, gpu_memory_gb: float = 141.0,
              batch: int = 1, cache_mode: str = "fp8", weights: str = "stored", vocab_split: bool = False,
              include_mtp: bool = False, reserve_gb: float = DEFAULT_RESERVE_GB,
              min_cache_tokens: int = DEFAULT_MIN_CACHE_TOKENS, cp: int = 1) -> Plan:
    """Per-rank weight bytes, cache bytes per token, the tokens the pool holds, the longest context.
    ``cp`` > 1: context-parallel attention over one group of cp ranks (tp 1, ep 1 or cp)."""
    ep = (tp if cp == 1 else 1) if ep is None else ep
    if cp < 1 or (cp > 1 and (tp != 1 or ep not in (1, cp))):
        raise PlanError(f"tp={tp}, ep={ep}, cp={cp}: context parallelism runs over one group with tp 1 and ep 1 "
                        f"or cp (e.g. --ep {cp} --cp {cp})")
    if weights not in WEIGHT_MODES:
        raise PlanError(f"weights={weights!r}: choose one of {WEIGHT_MODES}")
    if cache_mode not in CACHE_MODES:
        raise PlanError(f"cache_mode={cache_mode!r}: choose one of {CACHE_MODES}")
    if batch < 1 or gpu_memory_gb <= 0 or reserve_gb < 0:
        raise PlanError(f"batch={batch}, gpu_memory_gb={gpu_memory_gb}, reserve_gb={reserve_gb}: "
                        "need batch >= 1, memory > 0, reserve >= 0")
    check_layout(cfg, tp, ep, weights, vocab_split)
    world = max(tp, ep, cp)
    dp = 1 if cp > 1 else world // tp
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_mtp else 0)
    bpt = layers * (cfg.mla_cache_bytes_per_token(cache_mode) + cfg.indexer_cache_bytes_per_token(cache_mode))
    memory, reserve = int(gpu_memory_gb * GB), int(reserve_gb * GB)
    fixed, experts = _weight_totals(cfg, include_mtp, weights)

    ranks = []
    for rank in range(world):
        by_part = _rank_bytes(cfg, fixed, experts, tp, ep, rank % ep, vocab_split)
        weight_bytes = sum(by_part.values())
        free = memory - weight_bytes - reserve
        pages = max(free, 0) // (bpt * PAGE_SIZE)
        tokens = pages * PAGE_SIZE
        ranks.append(RankPlan(rank, rank % tp, rank % ep, rank // (world // dp), weight_bytes, by_part, free, bpt,
                              tokens, tokens * bpt, tokens >= min_cache_tokens))

    group_tokens = min(r.cache_tokens for r in ranks)
    per_group = math.ceil(batch / dp)  # sequences of the batch that land on one attention group
    context = min((group_tokens // PAGE_SIZE // per_group) * PAGE_SIZE, cfg.max_position_embeddings)
    quality = "bf16-dequantised" if weights == "bf16" and cfg.fp8_weight_block else (
        "fp8-block" if cfg.fp8_weight_block else "bf16")
    plan = Plan(
        model_type=cfg.model_type, num_layers=layers, tp=tp, ep=ep, cp=cp, world_size=world, dp=dp,
        attention="cp" if cp > 1 else "dp" if dp > 1 else "tp", build_flags=build_flags(tp, ep, cp), weights=quality,
        cache_mode=cache_mode, vocab_split=vocab_split,
        include_mtp=include_mtp, gpu_memory_bytes=memory, reserve_bytes=reserve, min_cache_tokens=min_cache_tokens,
        batch=batch, ranks=ranks, tokens_per_group=group_tokens, total_tokens=group_tokens * dp,
        longest_context=context,
        sequences={str(n): (group_tokens // (math.ceil(n / PAGE_SIZE) * PAGE_SIZE)) * dp for n in SEQUENCE_LENGTHS},
    )
    failing: dict[str, list[int]] = {}  # one line per distinct shortfall, naming its ranks
    for r in ranks:
        if not r.fits:
            why = (f"{_size(r.weight_bytes)} of weights + {_size(reserve)} reserve leave {_size(r.free_bytes)} "
                   f"of {_size(memory)} for the cache: {r.cache_tokens:,} tokens, fewer than the "
                   f"{min_cache_tokens:,} of one step")
            failing.setdefault(why, []).append(r.rank)
    for why, bad in failing.items():
        who = "every rank" if len(bad) == world else f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
        plan.problems.append(f"{who}: {why}")
    plan.fits = not plan.problems
    return plan


def suggest_plan(cfg: ModelConfig, gpu_memory_gb: float, **kw) -> Plan | None:
    """The smallest world size that fits, among the layouts the builder builds: tp = ep = n first,
    then context-parallel attention with expert parallelism (tp=1, ep=cp=n)."""
    for n in range(1, MAX_WORLD + 1):
        for tp, ep, cp in ((n, n, 1), (1, n, n)):
            if n == 1 and cp > 1:
                continue
            try:
                plan = make_plan(cfg, tp, ep, gpu_memory_gb, cp=cp, **kw)
            except PlanError:
                continue
            if plan.fits:
                return plan
    return None


def check_fits(cfg: ModelConfig, tp: int, ep: int | None = None, gpu_memory_gb: float = 141.0, cp: int = 1,
               **kw) -> Plan:
    """The plan, or a :class:`PlanError` naming the numbers and the smallest plan that would fit."""
    plan = make_plan(cfg, tp, ep, gpu_memory_gb, cp=cp, **kw)
    if plan.fits:
        return plan
    better = suggest_plan(cfg, gpu_memory_gb, **kw)
    hint = (f"the smallest plan that fits {gpu_memory_gb:g} GB per GPU is --tp {better.tp} --ep {better.ep}"
            f"{f' --cp {better.cp}' if better.cp > 1 else ''} "
            f"({_size(better.ranks[0].weight_bytes)} of weights per rank, {better.tokens_per_group:,} cache "
            "tokens per rank)" if better else f"no plan of up to {MAX_WORLD} ranks fits {gpu_memory_gb:g} GB")
    raise PlanError(f"--tp {plan.tp} --ep {plan.ep}{f' --cp {plan.cp}' if plan.cp > 1 else ''} on "
                    f"{gpu_memory_gb:g} GB GPUs does not fit: "
                    + "; ".join(plan.problems) + f". {hint}")


def _size(nbytes: int) -> str:
    return f"{nbytes / GB:.1f} GB" if abs(nbytes) >= GB else f"{nbytes / 1e6:.1f} MB"


def load_config(path: str | Path) -> ModelConfig:
    """A checkpoint directory or a bare config.json."""
    return ModelConfig.from_json(path)


# ------------------------------------------------------------------------------ printing
PARTS = ("attention", "indexer", "dense_mlp", "shared_experts", "routed_experts", "router", "embed", "lm_head",
         "norms", "mtp", "derived")


def format_plan(plan: Plan) -> str:
    r0 = plan.ranks[0]
    attn = {"dp": f"{plan.dp} data-parallel groups of tp={plan.tp}", "tp": f"tensor-parallel over {plan.tp}",
            "cp": f"context-parallel over {plan.cp} (steps interleaved, every rank caches every token)"}[plan.attention]
    lines = [
        f"plan: {plan.model_type}, {plan.num_layers} cache layers, {plan.world_size} ranks: attention {attn}, "
        f"experts over ep={plan.ep}; weights {plan.weights}, cache {plan.cache_mode}, "
        f"embed/lm_head {'vocab-split' if plan.vocab_split else 'replicated'}",
        f"  per GPU {plan.gpu_memory_bytes / GB:.1f} GB = weights + {plan.reserve_bytes / GB:.1f} GB reserve "
        "(activations, workspace, graphs, NCCL) + cache",
        f"  {'rank':>4} {'weights GB':>10} {'free GB':>8} {'cache B/token':>13} {'cache tokens':>13}  fits",
    ]
    for r in plan.ranks:
        lines.append(f"  {r.rank:>4} {r.weight_bytes / GB:>10.2f} {r.free_bytes / GB:>8.2f} "
                     f"{r.cache_bytes_per_token:>13,} {r.cache_tokens:>13,}  {'yes' if r.fits else 'NO'}")
    parts = ", ".join(f"{p} {r0.weight_bytes_by_part[p] / GB:.2f}" for p in PARTS if r0.weight_bytes_by_part.get(p))
    lines.append(f"  rank 0 weights by part (GB): {parts}")
    seqs = ", ".join(f"{n} x {int(k) // 1024}K" for k, n in plan.sequences.items())
    lines.append(f"  cache: {plan.tokens_per_group:,} tokens per attention group, {plan.total_tokens:,} in all; "
                 f"sequences that fit: {seqs}")
    lines.append(f"  longest context at batch {plan.batch}: {plan.longest_context:,} tokens")
    lines.append(f"  build: dsa-trt build {plan.build_flags}" if plan.build_flags else
                 "  build: not a layout dsa-trt build builds (it builds --tp N, --cp P and --ep P --cp P)")
    lines.append(f"  fits: {'yes' if plan.fits else 'NO'}" + "".join(f"\n    {p}" for p in plan.problems))
    return "\n".join(lines)
