"""Qwen3MoeForCausalLM and Qwen2MoeForCausalLM on the MoE decoder (gpu/models/mixtral.py).

- Qwen3-MoE: Qwen3's attention (an RMSNorm over head_dim on each query and key head, before
  rotary; q/k/v/o biases where attention_bias) and routed experts without a shared one, the top K
  renormalised only where norm_topk_prob. Sparse layers by decoder_sparse_step / mlp_only_layers.
- Qwen2-MoE: Qwen2's attention (biases on q/k/v) and a shared expert beside the routed ones.

Note for whoever merges this with the dense Qwen3 model: QKNormAttention is the Qwen3 attention
of the dense family too; once gpu/models has one, this file should use it instead.
"""

from __future__ import annotations

import torch

from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata, Ops
from conveyor.gpu.models.llama import Attention, RMSNorm
from conveyor.gpu.models.mixtral import MoeForCausalLM
from conveyor.gpu.rope import RotaryEmbedding


class QKNormAttention(Attention):
    """Llama's attention with `q_norm` and `k_norm` (weights [D]) applied per head before rotary."""

    def __init__(self, config: ModelConfig, ops: Ops, attn: AttentionBackend) -> None:
        super().__init__(config, ops, attn)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, d = x.shape[0], self.head_dim
        # Each head's [D] is one row of the norm: [T, Hq * D] -> [T * Hq, D] -> [T, Hq, D].
        q = self.q_norm(self.q_proj(x).view(-1, d)).view(num_tokens, self.num_heads, d)
        k = self.k_norm(self.k_proj(x).view(-1, d)).view(num_tokens, self.num_kv_heads, d)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, d)
        q, k = self.ops.rotary(positions, q, k, rope.cos_sin)
        out = self.attn.forward(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * d))


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention = QKNormAttention


class Qwen2MoeForCausalLM(MoeForCausalLM):
    attention = Attention
