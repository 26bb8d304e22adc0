"""MoeConfig: a mixture-of-experts model's routing and expert fields, as data.

Part of ModelConfig (its `moe` field, None for a dense model), so it is read once, with the rest of
config.json, and travels to every stage in the JSON config. The family's config adapter fills it
(gpu/models/mixtral.py, qwen3_moe.py: each family's field names and transformers' defaults); the
layers that use it are gpu/models/moe.py's. No torch here: the launcher checks a tensor-parallel
split against it (`moe_intermediate_size`) before any worker starts.

`check_moe` holds the refusals every family shares, so a family adapter ends with it.
"""

from __future__ import annotations

import dataclasses

from conveyor.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    num_experts: int  # E
    top_k: int  # K experts per token
    moe_intermediate_size: int  # I of each routed expert
    norm_topk_prob: bool  # renormalise the K chosen probabilities to sum 1
    float32_weights: bool  # the routing weights scale the experts in float32 (Mixtral), else in the model dtype
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[int, ...]  # the layers with an MoE block; the others have a dense MLP
    block_name: str  # the block's module name in the checkpoint: "block_sparse_moe" (Mixtral) or "mlp"
    expert_projections: tuple[str, str, str]  # the checkpoint's names of each expert's gate, up and down


def check_moe(moe: MoeConfig, architecture: str) -> MoeConfig:
    """`moe`, or a ConfigError naming the field that no router could use."""
    if moe.sparse_layers and not 0 < moe.top_k <= moe.num_experts:
        raise ConfigError(f"{architecture}: num_experts_per_tok {moe.top_k} must be in 1..num_experts ({moe.num_experts})")
    if moe.sparse_layers and moe.moe_intermediate_size <= 0:
        raise ConfigError(f"{architecture}: the experts' intermediate size must be positive, not {moe.moe_intermediate_size}")
    return moe
