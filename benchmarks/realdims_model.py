"""The modelled 61-layer V3.2 decode on 8 H200s, from the per-layer numbers benchmarks/bench_realdims.py
measures on one GPU (issue 25 item 7): pure arithmetic and printing, no GPU (tests/test_bench_realdims_model.py).

The model of the 61-layer V3.2 on 8 H200s (the plan that fits, TP8 attention + EP8 experts, README
"Fitting a model"): per GPU and layer, at the whole node's batch B, the single-GPU layer measured
here at B (the CUDA-graph rows where the shape has them, labelled "graph"; else the eager rows,
labelled "eager", whose "rest" holds eager launch gaps) with the sparse MLA (heads split 8 ways)
and the routed MoE (1/8 of the pairs on each GPU) divided by 8; the indexer (replicated), the
linears and the rest undivided (conservative: q_b / o_proj / kv_b are head-split under TP8); plus
the EP dispatch and combine of every routed (token, expert) pair, 2 x B x 8 x 7168 x 2 B (bf16),
and the TP all-reduce of the attention output, 2 x B x 7168 x 2 B, 7/8 of each leaving the GPU
over NVLink at 450 GB/s, not overlapped with compute. Step = 3 dense + 58 MoE such layers
(embedding, final norm and lm_head not counted); output tok/s per GPU = B / step / 8.

The second model, attention data-parallel + EP8 (dsa_trt/plan.py with tp=1, ep=8: what TRT-LLM
serves R1 with): each GPU runs the whole attention for its own B sequences, which is exactly the
single-GPU layer measured here at B, so the attention, linears (the shared expert's included) and
rest are taken as measured; the routed experts of a GPU are 32 of the 256, fed the pairs the whole
node routes to them: ~1/8 of the node's 8B tokens' pairs, so its MoE = the row's MoE (router + the
experts for B tokens on all 256) - the experts alone at B tokens + the experts alone at 8B tokens
/ 8, the experts alone measured here on the first MoE layer (its router's picks on random hidden
states, one CUDA graph, median of the replays); plus the dispatch and combine of the GPU's own
pairs, 2 x B x 8 x 7168 x 2 B, 7/8 of it over NVLink at 450 GB/s. A row is kept only where the
plan's cache holds B sequences of the context on a GPU (else it says how many it holds: 170 of 4K,
21 of 32K for V3.2 on 141 GB; measure that batch too, e.g. ``--batches 1 21 32 128``). Output tok/s
per GPU = B / step.

``--mtp N [N ...]`` adds each decode shape as the verify step of N MTP drafts (N + 1 query tokens per
sequence, "verify B=..x(N+1)" rows) and a third model: the attention-DP + EP8 decode with N drafts per
sequence, whose step is the main model at the verify shape (the 61 layers, the experts alone at (N+1)B
and 8(N+1)B tokens, as above, and what runs outside the layers) plus the MTP passes: the first over the
step's (N+1)B rows (the fused step's: the verify shape), then N - 1 recurrent passes of one token per
sequence (the decode shape), each an MoE layer with its own experts plus the shared head (the
"outside" of its shape). It yields tau = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_N tokens per sequence,
a_k the conditional acceptance of draft k (``--mtp-acceptance``, the last value repeating; assumed,
default 0.85 then 0.63: DeepSeek reports 85-90% for the first draft; the second is the value that,
after 0.85, gives nebius/MTP-DeepSeek-V3-0324's published mean acceptance length 3.20 for
DeepSeek-V3-0324's own MTP layer reused recurrently over 7 drafts at temperature 0; the tiny embedded
model's is measured by dsa-trt bench). Not counted: the MTP layer's eh_proj and norms (103 MB of e4m3,
~25 µs a pass at HBM speed). Its plan holds the MTP layer's weights and caches too (19 sequences of
32K per GPU, 157 of 4K). Each row also says which tau would give 1,000 output tok/s per GPU.

The DP models count the measured "outside the layers" of a graph row (embedding, final norm and the
bf16 lm_head over 129,280 entries on every GPU: ~0.42-0.49 ms at these shapes); an eager row has none
measured, and its rows say so.
"""

from __future__ import annotations

from pathlib import Path

from dsa_trt.config import ModelConfig

REAL_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepseek_v32_config.json"
NVLINK_BPS = 450e9
FULL_LAYERS, FULL_DENSE, WORLD = 61, 3, 8
PEERS = ("peers, 8xH200 (research/realsize_anchors.md §1): best published V3.2 ~300 output tok/s per GPU "
         "(vLLM TP8 2,075 output tok/s / 8 = 259 at 1K/2K, 100 in flight); R1 stacks ~1,436 per GPU (TRT-LLM, "
         "attention-DP + EP8)")


def tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def dp_layers_us(per_kind: dict, tokens: int, experts_us: dict[int, float], cfg: ModelConfig) -> dict:
    """One GPU's dense and MoE layer under attention-DP + EP8 (module docstring) from a measured
    single-GPU split at ``tokens`` query tokens: {"dense", "moe_layer", "moe", "comm"} in µs."""
    layer_us = {kind: sum(cats.values()) for kind, cats in per_kind.items()}
    # the region's non-expert part (router, casts) cannot be negative: the graph's region split
    # charges some launch gaps elsewhere, so its MoE may come out below the experts timed alone
    moe = max(per_kind["MoE"]["MoE"] - experts_us[tokens], 0.0) + experts_us[WORLD * tokens] / WORLD
    comm = 2 * tokens * cfg.num_experts_per_tok * cfg.hidden_size * 2 * (WORLD - 1) / WORLD / NVLINK_BPS * 1e6
    moe_layer = layer_us["MoE"] - per_kind["MoE"]["MoE"] + moe + comm
    return {"dense": layer_us.get("dense", moe_layer), "moe_layer": moe_layer, "moe": moe, "comm": comm}


def _per_kind(graph_rows: dict, key, eager_kinds: dict) -> tuple[dict, str, float | None]:
    """(per layer kind and category µs, "graph" | "eager", µs outside the layers or None)."""
    g = graph_rows.get(key, {})
    return (g["per_kind"], "graph", g.get("outside")) if "per_kind" in g else (eager_kinds, "eager", None)


def dp_ep_rows(decode: dict, graph_rows: dict, experts_us: dict[int, float], cfg: ModelConfig,
               seqs_held) -> list[dict]:
    """The attention-DP + EP8 model's rows (module docstring): per measured (B, context) with the
    experts alone at B and 8B tokens; ``seqs_held(context)``: sequences of that length a GPU's
    cache holds. Pure arithmetic over the measured numbers (tests/test_bench_realdims_model.py)."""
    rows = []
    for (b, ctx), (eager_kinds, _, _) in sorted(decode.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        per_kind, source, outside = _per_kind(graph_rows, (b, ctx), eager_kinds)
        if "MoE" not in per_kind or b not in experts_us or WORLD * b not in experts_us:
            continue
        held = seqs_held(ctx)
        row = {"b": b, "ctx": ctx, "source": source, "held": held}
        if b > held:
            rows.append(row)
            continue
        lay = dp_layers_us(per_kind, b, experts_us, cfg)
        step = FULL_DENSE * lay["dense"] + (FULL_LAYERS - FULL_DENSE) * lay["moe_layer"] + (outside or 0.0)
        row.update(step_us=step, comm_us=(FULL_LAYERS - FULL_DENSE) * lay["comm"], moe_us=lay["moe"],
                   outside_us=outside, tok_s_per_gpu=b / (step / 1e6), per_user=1e6 / step)
        rows.append(row)
    return rows


def tokens_per_step(acceptance, num_draft: int) -> float:
    """tau = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_N: the mean tokens a sequence gains per verify step of
    N drafts, a_k the conditional acceptance of draft k (``acceptance``: one value or a list whose
    last value repeats)."""
    rates = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)
    tau, run = 1.0, 1.0
    for k in range(num_draft):
        run *= rates[min(k, len(rates) - 1)]
        tau += run
    return tau


def mtp_dp_rows(decode: dict, verify: dict, graph_rows: dict, experts_us: dict[int, float], cfg: ModelConfig,
                seqs_held, acceptance, num_draft: int = 1) -> list[dict]:
    """The attention-DP + EP8 model with N = ``num_draft`` MTP drafts per sequence (module
    docstring): per (B, context) measured both as a decode step and as a verify step of N + 1 query
    tokens per sequence (``verify`` keyed (N + 1, B, context), its graph rows ("verify", N + 1, B,
    context)). A step = the main model at the verify shape (61 layers + outside) + the MTP passes
    (the first at the verify shape, N - 1 at the decode shape, each an MoE layer + outside); it
    yields tokens_per_step(acceptance, N) tokens per sequence. Pure arithmetic
    (tests/test_bench_realdims_model.py)."""
    q = num_draft + 1
    tau = tokens_per_step(acceptance, num_draft)
    rows = []
    for (b, ctx), (eager_kinds, _, _) in sorted(decode.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if (q, b, ctx) not in verify:
            continue
        per_kind, source, out_d = _per_kind(graph_rows, (b, ctx), eager_kinds)
        v_kind, v_source, out_v = _per_kind(graph_rows, ("verify", q, b, ctx), verify[(q, b, ctx)][0])
        if "MoE" not in per_kind or "MoE" not in v_kind or any(
                t not in experts_us for t in (b, WORLD * b, q * b, q * WORLD * b)):
            continue
        held = seqs_held(ctx)
        row = {"b": b, "ctx": ctx, "drafts": num_draft, "held": held,
               "source": source if source == v_source else f"{v_source} / {source}"}
        if b > held:
            rows.append(row)
            continue
        ver, dec = dp_layers_us(v_kind, q * b, experts_us, cfg), dp_layers_us(per_kind, b, experts_us, cfg)
        out_v, out_d = out_v or 0.0, out_d or 0.0
        main = FULL_DENSE * ver["dense"] + (FULL_LAYERS - FULL_DENSE) * ver["moe_layer"] + out_v
        draft = ver["moe_layer"] + out_v + (num_draft - 1) * (dec["moe_layer"] + out_d)
        step = main + draft
        row.update(step_us=step, draft_us=draft, tau=tau, tok_s_per_gpu=b * tau / (step / 1e6),
                   per_user=tau * 1e6 / step, tau_for_1000=1000 * step / 1e6 / b)
        rows.append(row)
    return rows


def model_8gpu_dp(decode: dict, graph_rows: dict, experts_us: dict[int, float], cfg: ModelConfig,
                  verify: dict | None = None, acceptance=(0.85,), drafts=(1,), card: str = "this GPU") -> None:
    from dsa_trt.plan import load_config, make_plan

    full = load_config(REAL_CONFIG)
    plan = make_plan(full, tp=1, ep=WORLD, gpu_memory_gb=141.0)
    print(f"\nmodelled V3.2 decode on 8 H200s, attention data-parallel + EP8 (dsa_trt/plan.py tp=1 ep=8: "
          f"{plan.ranks[0].weight_bytes / 1e9:.1f} GB of weights and {plan.tokens_per_group:,} cache tokens per GPU, "
          f"fits {plan.fits}; the timings measured on {card}): per GPU B sequences, its attention as measured at B, "
          f"its 32 experts fed 1/8 of the "
          f"node's 8B tokens' pairs (experts alone, µs: "
          + ", ".join(f"T={t} {us:.1f}" for t, us in sorted(experts_us.items())) + "); dispatch + combine over "
          "NVLink at 450 GB/s, not overlapped; embedding, final norm and lm_head as measured 'outside the layers' "
          "of the graph rows (eager rows: not counted)")
    print("| context | batch per GPU | layers from | step ms | of it comms ms | routed MoE per layer µs | "
          "output tok/s per GPU | per user tok/s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in dp_ep_rows(decode, graph_rows, experts_us, cfg, lambda ctx: plan.tokens_per_group // ctx):
        if "step_us" not in r:
            print(f"| {tokens_label(r['ctx'])} | {r['b']} | {r['source']} | does not fit: a GPU's cache holds "
                  f"{r['held']} sequences of {tokens_label(r['ctx'])} | | | | |")
            continue
        print(f"| {tokens_label(r['ctx'])} | {r['b']} | {r['source']} | {r['step_us'] / 1e3:.2f} | "
              f"{r['comm_us'] / 1e3:.2f} | {r['moe_us']:.1f} | {r['tok_s_per_gpu']:,.0f} | {r['per_user']:.1f} |")
    print(PEERS)
    if not verify:
        return
    mplan = make_plan(full, tp=1, ep=WORLD, gpu_memory_gb=141.0, include_mtp=True)
    rates = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)
    print(f"\nthe same model with MTP, N drafts per sequence (plan.py tp=1 ep=8 with the MTP layer: "
          f"{mplan.ranks[0].weight_bytes / 1e9:.1f} GB of weights and {mplan.tokens_per_group:,} cache tokens per GPU, "
          f"fits {mplan.fits}): a step = the main model measured as a verify step of N + 1 query tokens per sequence "
          f"(61 layers + outside; experts alone at (N+1)B and 8(N+1)B tokens) + the MTP passes (the first at the "
          f"verify shape, N - 1 at the decode shape, each an MoE layer + outside); it yields tau = 1 + a_1 + a_1 a_2 "
          f"+ ... tokens per sequence, a_k the conditional acceptance of draft k assumed "
          f"({', '.join(f'{x:.2f}' for x in rates)}, the last repeating; not measured here: DeepSeek reports 85-90% "
          "for the first draft, research/realsize_anchors.md §5; the module docstring says where the later ones come "
          "from); 'tau for 1,000': the tokens per step that would give 1,000 output tok/s per GPU")
    print("| context | batch per GPU | drafts N | layers from | step ms | of it the MTP passes µs | tau | "
          "output tok/s per GPU | per user tok/s | tau for 1,000 |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in drafts:
        for r in mtp_dp_rows(decode, verify, graph_rows, experts_us, cfg, lambda ctx: mplan.tokens_per_group // ctx,
                             rates, n):
            if "step_us" not in r:
                print(f"| {tokens_label(r['ctx'])} | {r['b']} | {n} | {r['source']} | does not fit: a GPU's cache "
                      f"holds {r['held']} sequences of {tokens_label(r['ctx'])} | | | | | |")
                continue
            need = r["tau_for_1000"]
            need_s = f"{need:.2f}" + (f" (over {n + 1}: out of reach)" if need > n + 1 else "")
            print(f"| {tokens_label(r['ctx'])} | {r['b']} | {n} | {r['source']} | {r['step_us'] / 1e3:.2f} | "
                  f"{r['draft_us']:.1f} | {r['tau']:.2f} | {r['tok_s_per_gpu']:,.0f} | {r['per_user']:.1f} | "
                  f"{need_s} |")


def model_8gpu(decode: dict, graph_rows: dict, cfg: ModelConfig, card: str = "this GPU") -> None:
    """The modelled 61-layer decode on 8 H200s (the assumptions are in the module docstring); per
    shape from its CUDA-graph rows where they exist, else from its eager rows (labelled)."""
    print("\nmodelled V3.2 (61 layers: 3 dense + 58 MoE) decode on 8 H200s, TP8 attention + EP8 (dsa_trt/plan.py's "
          f"fitting plan), from the per-layer numbers above, measured on {card} (the CUDA-graph rows where measured, "
          "else the eager ones: "
          "'layers from'); EP dispatch + combine and TP all-reduce over NVLink at 450 GB/s, not overlapped; "
          "embedding, final norm and lm_head not counted")
    print("| context | batch (whole node) | layers from | step ms | of it comms ms | output tok/s per GPU | "
          "per user tok/s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    wanted = {4096, 32768} & {ctx for _, ctx in decode} or {ctx for _, ctx in decode}  # else what was measured
    eager_used = False
    for (b, ctx), (eager_kinds, _, _) in sorted(decode.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        g = graph_rows.get((b, ctx), {})
        per_kind, source = (g["per_kind"], "graph") if "per_kind" in g else \
            (eager_kinds, "eager" + (f" (graph: {g['error']})" if "error" in g else ""))
        if ctx not in wanted or "MoE" not in per_kind:
            continue
        eager_used |= source != "graph"
        layer_us = {}
        for kind, cats in per_kind.items():
            # TP8: each GPU runs every sequence with 1/8 of the heads; EP8: 1/8 of the routed pairs
            layer_us[kind] = (cats["DSA indexer + top-k"] + cats["DSA sparse MLA"] / WORLD + cats["MoE"] / WORLD
                              + cats["linears"] + cats["rest"])
        comm = (2 * b * cfg.num_experts_per_tok * cfg.hidden_size * 2 + 2 * b * cfg.hidden_size * 2) * \
            (WORLD - 1) / WORLD / NVLINK_BPS * 1e6
        dense_us = layer_us.get("dense", layer_us["MoE"])
        step = FULL_DENSE * (dense_us + comm) + (FULL_LAYERS - FULL_DENSE) * (layer_us["MoE"] + comm)
        print(f"| {tokens_label(ctx)} | {b} | {source} | {step / 1e3:.2f} | {FULL_LAYERS * comm / 1e3:.2f} | "
              f"{b / (step / 1e6) / WORLD:,.0f} | {1e6 / step:.1f} |")
    print(PEERS)
    print("caveat: the linears and the rest are taken undivided at the single-GPU shapes" +
          ("; rows from eager layers carry the eager stream's launch gaps in 'rest' (a CUDA-graph step has none)"
           if eager_used else ""))
