"""Phi3ForCausalLM: Llama's decoder with fused projections.

Phi-3 checkpoints store q, k and v as one `qkv_proj` ([Hq * D + 2 * Hkv * D, H]: q rows, then k,
then v) and the MLP's gate and up as one `gate_up_proj` ([2 * I, H]: gate rows, then up). The
layers here keep them fused, under the checkpoint's names, so loading stays a name lookup and
each is one GEMM; the outputs are split by columns. Everything else is llama.py's: RMSNorm,
rotary (LongRoPE's tables are gpu/rope.py's), a sliding window on every layer where config.json
sets one.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import Ops
from conveyor.gpu.models.llama import Attention, DecoderLayer, Linear, LlamaForCausalLM


class Phi3Attention(Attention):
    def make_projections(self, config: ModelConfig, ops: Ops) -> None:
        h, d = config.hidden_size, config.head_dim
        self.qkv_proj = Linear(h, (self.num_heads + 2 * self.num_kv_heads) * d, config.qkv_bias, ops)
        self.o_proj = Linear(self.num_heads * d, h, config.o_bias, ops)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split((q_width, kv_width, kv_width), dim=-1)  # views of [T, (Hq + 2 Hkv) D]
        return q, k, v


class Phi3MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(h, 2 * i, config.mlp_bias, ops)
        self.down_proj = Linear(i, h, config.mlp_bias, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] views each
        return self.down_proj(self.ops.silu_mul(gate, up))


class Phi3DecoderLayer(DecoderLayer):
    attention_class = Phi3Attention
    mlp_class = Phi3MLP


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_class = Phi3DecoderLayer
