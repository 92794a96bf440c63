"""The MTP (next-n) layer as the engine's draft program (MODEL.md §5, docs/architecture.md §2).

One step of the draft program drafts, for each packed token at position i, the token at i + 2:

    e = enorm(Embed(t_{i+1}))        (zero at position 0, as the engines and export/train_tiny.py do)
    g = hnorm(h_i)                   h_i: the main model's final-norm output at i (its lm_head input)
    z = DecoderLayer(eh_proj([e ; g]))   one full DSA layer: its own indexer, its own MLA and indexer
                                          cache pools on the same page ids and slot mapping
    logits = shared_head.head(shared_head.norm(z)) in fp32

So the step's ``input_ids`` are the NEXT tokens (t_{i+1} at position i) while positions, page table
and slots are those of position i. ``hidden_states`` [tokens, D] is the main program's ``hidden``
output for those tokens, or this program's own ``hidden`` (z) for a further draft token (n > 1
reuses the layer recurrently). Outputs: ``logits`` at ``logits_indices`` and ``hidden`` = z of
every token (dsa_trt/step.py). Pools: lists of one layer (``mla_pools_0``, ``index_pools_0``).

Parameter names are the checkpoint's (``model.layers.{num_hidden_layers}.enorm.weight`` ...), so the
checkpoint's MTP tensors load unchanged; the layer's ``embed_tokens`` and ``shared_head.head`` are
its stored copies of the main embedding and lm_head.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.export import ExportedProgram, export

from dsa_trt.config import ModelConfig
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import dynamic_shapes, export_dims

from .checkpoint import Checkpoint
from .layers import RMSNorm, fp32_linear, linear, resolve_weight_format
from .network import CACHE_MODES, DecoderLayer, check_dequantised, step_meta
from .program import Progress, checkpoint_tensors, derived_buffers, example_step, set_tensor
from .sharding import check_tp

MTP_POOL_LAYERS = 1  # the draft program's pool lists hold one layer


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = linear(cfg.hidden_size, cfg.vocab_size, dtype)


class MTPBlock(DecoderLayer):
    """DecoderLayer ``num_hidden_layers`` (MoE FFN, own indexer) plus the §5 extras."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp_rank: int, tp_size: int, expert_op: bool,
                 weight_format: str):
        super().__init__(cfg, cfg.num_hidden_layers, dtype, tp_rank, tp_size, expert_op, weight_format)
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = linear(2 * d, d, dtype)  # [D, 2D]: embedding first, hidden second (§5)
        self.shared_head = SharedHead(cfg, dtype)


class MTPDraft(nn.Module):
    """The draft program's module. ``tp_rank``/``tp_size``, ``expert_op`` and ``weight_format`` as
    DSAForCausalLM: the block's heads and experts are this rank's shard, its e4m3 Linears kept or
    dequantised alike; eh_proj, the norms, embedding and head (bf16 in the checkpoint) are replicated."""

    def __init__(self, cfg: ModelConfig, cache_mode: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                 tp_rank: int = 0, tp_size: int = 1, expert_op: bool | None = None, weight_format: str = "auto"):
        super().__init__()
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("the checkpoint has no MTP layer (num_nextn_predict_layers = 0): no draft program")
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode {cache_mode!r} not in {CACHE_MODES}")
        check_tp(cfg, tp_size)
        self.cfg, self.cache_mode, self.dtype = cfg, cache_mode, dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight_format = resolve_weight_format(cfg, dtype, weight_format)
        self.expert_op = dtype == torch.bfloat16 if expert_op is None else expert_op
        self.model = nn.Module()
        # a ModuleDict keyed by the layer index gives the checkpoint's names: model.layers.<L>.*
        self.model.layers = nn.ModuleDict(
            {str(cfg.num_hidden_layers): MTPBlock(cfg, dtype, tp_rank, tp_size, self.expert_op, self.weight_format)})
        self.dequantised_linears = check_dequantised(self, weight_format, tp_size)
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)

    @property
    def block(self) -> MTPBlock:
        return self.model.layers[str(self.cfg.num_hidden_layers)]

    def set_kv_scale(self, kv_scale: float) -> None:
        self.block.self_attn.kv_scale = float(kv_scale)

    def forward(self, input_ids, positions, req_idx, page_table, slot_mapping, logits_indices, hidden_states,
                mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.block
        cos, sin, meta = step_meta(self.cfg, self.inv_freq, positions, req_idx, page_table, slot_mapping)
        e = b.embed_tokens(input_ids)
        e = e.masked_fill((positions == 0)[:, None], 0.0)  # [T, D]; position 0 has no previous token
        z = b.eh_proj(torch.cat([b.enorm(e), b.hnorm(hidden_states.to(e.dtype))], dim=-1))
        z = b(z, cos, sin, meta, mla_pools[0], index_pools[0], self.cache_mode)  # [T, D]
        h = b.shared_head.norm(z[logits_indices])
        return fp32_linear(h, b.shared_head.head.weight), z


def build_mtp_network(ckpt: Checkpoint, cache_mode: str, dtype: torch.dtype, kv_scale: float = 1.0,
                      device: str | torch.device = "cpu", tp_rank: int = 0, tp_size: int = 1,
                      progress: Progress | None = None, expert_op: bool | None = None,
                      weight_format: str = "auto") -> MTPDraft:
    """Rank ``tp_rank``'s draft network with the checkpoint's MTP tensors (``Checkpoint(...,
    include_mtp=True)``), loaded as export/program.py's build_network loads the main layers."""
    if not ckpt.include_mtp:
        raise ValueError(f"{ckpt.path}: open the checkpoint with Checkpoint(path, include_mtp=True) to build the "
                         "MTP draft program")
    cfg = ckpt.config
    with torch.device("meta"):
        net = MTPDraft(cfg, cache_mode, dtype, tp_rank, tp_size, expert_op, weight_format)
    state = {name: t.to(device) for name, t in checkpoint_tensors(ckpt, net, tp_rank, tp_size, progress)}
    net.load_state_dict(state, strict=True, assign=True)
    for name, t in derived_buffers(net).items():
        set_tensor(net, name, t.to(device))
    net.set_kv_scale(kv_scale)
    return net.eval()


def example_hidden(cfg: ModelConfig, num_tokens: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(num_tokens, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)


def export_mtp_program(net: MTPDraft, max_num_tokens: int = 8192, max_batch: int = 256,
                       max_pages_per_seq: int = 4096, device="cpu") -> ExportedProgram:
    """``draft(*step.as_tuple(), hidden_states, mla_pools, index_pools) -> (logits, hidden)``, with
    the main program's dynamic dims (dsa_trt/step.py)."""
    cfg = net.cfg
    step = example_step(cfg, device)
    hidden = example_hidden(cfg, step.input_ids.shape[0], net.dtype, device)
    mla, idx = allocate_pools(cfg, net.cache_mode, 4, device=device, num_layers=MTP_POOL_LAYERS)
    dims = export_dims(max_num_tokens=max_num_tokens, max_batch=max_batch, max_pages_per_seq=max_pages_per_seq)
    with torch.no_grad():
        return export(net, step.as_tuple() + (hidden, mla, idx),
                      dynamic_shapes=dynamic_shapes(dims, MTP_POOL_LAYERS, draft=True))
