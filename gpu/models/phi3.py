"""Phi3ForCausalLM: Llama's decoder with fused projections.

Phi-3 checkpoints store q, k and v as one `qkv_proj` ([Hq * D + 2 * Hkv * D, H]: q rows, then k,
then v) and the MLP's gate and up as one `gate_up_proj` ([2 * I, H]: gate rows, then up). The
layers here keep them fused, under the checkpoint's names, so loading stays a name lookup and
each is one GEMM; the outputs are split by columns. With tensor parallelism each part of a fused
projection is cut on its own (gpu/parallel/shard.py), so a rank's qkv_proj is its q heads, then
its KV heads, and the split by columns below is the same with local widths. Everything else is llama.py's: RMSNorm,
rotary (LongRoPE's tables are gpu/models/rope.py's), a sliding window on every layer where config.json
sets one. Older Phi-3 files spell LongRoPE "su" or "yarn" (`phi3_config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from conveyor.config.model import ModelConfig
from conveyor.config.rope_fields import original_max_position, rope_items
from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.models.base import CausalLM
from conveyor.gpu.models.layers import ColumnParallelLinear, RowParallelLinear
from conveyor.gpu.models.llama import Attention, DecoderLayer
from conveyor.gpu.parallel.group import SINGLE, TensorParallel


class Phi3Attention(Attention):
    def make_projections(self, config: ModelConfig, ops: Ops, tp: TensorParallel) -> None:
        """Each part of the fused qkv_proj cut on its own: this rank's q heads, then its KV heads."""
        h, d, heads, kv_heads = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
        self.qkv_proj = ColumnParallelLinear(h, ((heads, d), (kv_heads, d), (kv_heads, d)), config.qkv_bias, ops, tp)
        self.o_proj = RowParallelLinear(((heads, d),), h, config.o_bias, ops, tp)

    def sibling_projections(self) -> tuple[tuple[ColumnParallelLinear, ...], ...]:
        return ()  # qkv_proj is one layer already

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split((q_width, kv_width, kv_width), dim=-1)  # views of [T, (Hq + 2 Hkv) D]
        return q, k, v


class Phi3MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(h, ((i, 1), (i, 1)), config.mlp_bias, ops, tp)  # this rank's gate rows, then up rows
        self.down_proj = RowParallelLinear(((i, 1),), h, config.mlp_bias, ops, tp)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I / tp] views each
        return self.down_proj(self.ops.silu_mul(gate, up))


class Phi3DecoderLayer(DecoderLayer):
    attention_class = Phi3Attention
    mlp_class = Phi3MLP


class Phi3ForCausalLM(CausalLM):
    layer_class = Phi3DecoderLayer


def phi3_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Phi-3's older rope spellings, "su" and "yarn", mean longrope (as transformers reads them)."""
    scaling = dict(cfg.rope_scaling)
    if scaling["rope_type"] not in ("su", "yarn"):
        return cfg
    scaling["rope_type"] = "longrope"
    scaling["original_max_position_embeddings"] = original_max_position(hf, scaling, cfg.max_position_embeddings)
    return dataclasses.replace(cfg, rope_scaling=rope_items(scaling))
