"""The mixture-of-experts decoder, MixtralForCausalLM on it, and Mixtral's config adapter.

A decoder layer is Llama's (gpu/models/llama.py: pre-norm attention, then pre-norm feed-forward,
the residual add folded into the next norm) whose feed-forward is a SparseMoeBlock
(gpu/models/moe.py) on its sparse layers and a dense MLP elsewhere; the model is CausalLM over
such layers, so it runs the one forward every family shares (per-layer rope tables and the
`embed` hook included). Families differ in their config adapter, which fills ModelConfig.moe
(routing, shared experts, which layers are sparse, the block's name) from their own fields and
transformers' defaults, and, where a family needs it, in the attention class the layer names.

Mixtral is Mistral's attention (GQA, an optional sliding window, no biases) with a
`block_sparse_moe` block in every layer: 8 experts, top 2, renormalised.

Tensor parallelism splits it as the dense families (attention, embedding, LM head) plus each
expert's intermediate dim (gpu/models/moe.py). Its parameter names are not all the checkpoint's
(the experts are stacked), so `load_weights` maps the experts' tensors (moe.load_moe_weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.config.moe import MoeConfig, check_moe
from conveyor.gpu.backends.base import Backend
from conveyor.gpu.models.base import CausalLM
from conveyor.gpu.models.layers import RMSNorm
from conveyor.gpu.models.llama import MLP, DecoderLayer
from conveyor.gpu.models.moe import SparseMoeBlock, load_moe_weights


class MoeDecoderLayer(DecoderLayer):
    """DecoderLayer's pre-norm layout (its forward) with a sparse MoE block as the feed-forward
    (a plain MLP in a Qwen layer that mlp_only_layers / decoder_sparse_step keep dense)."""

    def __init__(self, config: ModelConfig, backend: Backend, layer_index: int = 0) -> None:
        nn.Module.__init__(self)  # its own sublayers, not DecoderLayer's
        moe = config.moe
        assert moe is not None, "a mixture-of-experts model's config has its moe fields (its family's config adapter)"
        self.self_attn = self.attention_class(config, backend.ops, backend.attn, layer_index, backend.tp)
        # The checkpoint's module name: Mixtral's block is `block_sparse_moe`, a Qwen dense layer's `mlp`.
        sparse = layer_index in moe.sparse_layers
        self.feed_forward_name = moe.block_name if sparse else "mlp"
        block = SparseMoeBlock(config, moe, backend.ops, backend.tp) if sparse else MLP(config, backend.ops, backend.tp)
        self.add_module(self.feed_forward_name, block)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.feed_forward_name)(h)


class MoeForCausalLM(CausalLM):
    """CausalLM over MoE layers; a family with its own attention names a layer class whose
    attention_class is it."""

    layer_class: type[nn.Module] = MoeDecoderLayer

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As CausalLM's, each expert's one tensor per projection into its stacked rows."""
        load_moe_weights(self, tensors)


class MixtralForCausalLM(MoeForCausalLM):
    pass


def mixtral_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Mixtral: every layer sparse, its experts intermediate_size wide, top K renormalised and
    applied in float32; transformers' defaults (8 experts, top 2) where config.json says nothing."""
    return with_moe(
        cfg,
        lambda: MoeConfig(
            num_experts=num_experts(hf, 8),
            top_k=int(hf.get("num_experts_per_tok", 2)),
            moe_intermediate_size=cfg.intermediate_size,
            norm_topk_prob=True,
            float32_weights=True,
            shared_expert_intermediate_size=0,
            sparse_layers=tuple(range(cfg.num_layers)),
            block_name="block_sparse_moe",
            expert_projections=("w1", "w3", "w2"),
        ),
    )


def with_moe(cfg: ModelConfig, read: Callable[[], MoeConfig]) -> ModelConfig:
    """cfg with the MoE fields `read()` finds, or one ConfigError line: the experts are SiLU-gated
    only, and a field that does not parse is named as the family's."""
    if cfg.hidden_act != "silu":
        raise ConfigError(f"{cfg.architecture} with hidden_act {cfg.hidden_act!r} is not supported: only silu")
    try:
        moe = read()
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"malformed mixture-of-experts fields in config.json ({cfg.architecture}): {e!r}") from None
    return dataclasses.replace(cfg, moe=check_moe(moe, cfg.architecture))


def num_experts(hf: dict[str, Any], default: int) -> int:
    # transformers 5 writes Mixtral's and Qwen3-MoE's count as num_local_experts, older files
    # Qwen's as num_experts.
    return int(hf.get("num_local_experts", hf.get("num_experts", default)))
