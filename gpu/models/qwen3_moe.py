"""Qwen3MoeForCausalLM and Qwen2MoeForCausalLM on the MoE decoder (gpu/models/mixtral.py), and their
config adapters.

- Qwen3-MoE: Qwen3's attention (an RMSNorm over head_dim on each query and key head, before
  rotary; q/k/v/o biases where attention_bias) and routed experts without a shared one, the top K
  renormalised only where norm_topk_prob. Sparse layers by decoder_sparse_step / mlp_only_layers.
- Qwen2-MoE: Qwen2's attention (biases on q/k/v) and a shared expert beside the routed ones.

Both use the dense family's Attention (gpu/models/llama.py): their adapters start from the dense
Qwen adapters (q/k norms, q/k/v biases, max_window_layers), then read the MoE fields with
transformers' defaults for what config.json leaves out.
"""

from __future__ import annotations

from typing import Any

from conveyor.config.model import ModelConfig
from conveyor.config.moe import MoeConfig
from conveyor.gpu.models.llama import qwen2_config, qwen3_config
from conveyor.gpu.models.mixtral import MoeForCausalLM, num_experts, with_moe


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass  # q/k norms: qwen3_moe_config sets ModelConfig.qk_norm


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass


def qwen3_moe_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Qwen3's dense quirks, then 128 experts of 768, top 8, no shared expert by default."""
    return _qwen_moe(hf, qwen3_config(hf, cfg), experts=128, top_k=8, size=768, shared=None)


def qwen2_moe_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Qwen2's dense quirks, then 60 experts of 1408, top 4, and a shared expert (5632) by default."""
    return _qwen_moe(hf, qwen2_config(hf, cfg), experts=60, top_k=4, size=1408, shared=5632)


def _qwen_moe(hf: dict[str, Any], cfg: ModelConfig, *, experts: int, top_k: int, size: int, shared: int | None) -> ModelConfig:
    """The Qwen MoE fields, transformers' defaults (the keyword arguments; shared None: the family
    has no shared expert) where absent: layer i is sparse where (i + 1) % decoder_sparse_step == 0
    and i is not in mlp_only_layers."""

    def read() -> MoeConfig:
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
        count = num_experts(hf, experts)
        return MoeConfig(
            num_experts=count,
            top_k=int(hf.get("num_experts_per_tok", top_k)),
            moe_intermediate_size=int(hf.get("moe_intermediate_size", size)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            float32_weights=False,
            shared_expert_intermediate_size=0 if shared is None else int(hf.get("shared_expert_intermediate_size", shared)),
            sparse_layers=tuple(i for i in range(cfg.num_layers) if count > 0 and (i + 1) % step == 0 and i not in dense),
            block_name="mlp",
            expert_projections=("gate_proj", "up_proj", "down_proj"),
        )

    return with_moe(cfg, read)
