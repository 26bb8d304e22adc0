"""Qwen3MoeForCausalLM and Qwen2MoeForCausalLM on the MoE decoder (gpu/models/mixtral.py).

- Qwen3-MoE: Qwen3's attention (an RMSNorm over head_dim on each query and key head, before
  rotary; q/k/v/o biases where attention_bias) and routed experts without a shared one, the top K
  renormalised only where norm_topk_prob. Sparse layers by decoder_sparse_step / mlp_only_layers.
- Qwen2-MoE: Qwen2's attention (biases on q/k/v) and a shared expert beside the routed ones.

Both use the dense family's Attention (gpu/models/llama.py): ModelConfig turns on its per-head q/k
norms for Qwen3-MoE and the q/k/v biases for Qwen2-MoE.
"""

from __future__ import annotations

from conveyor.gpu.models.llama import Attention
from conveyor.gpu.models.mixtral import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention = Attention  # with q/k norms: ModelConfig.qk_norm is set for this architecture


class Qwen2MoeForCausalLM(MoeForCausalLM):
    attention = Attention
