"""The mixture-of-experts decoder, and MixtralForCausalLM on it.

A decoder layer is Llama's (gpu/models/llama.py: pre-norm attention, then pre-norm feed-forward,
the residual add folded into the next norm) whose feed-forward is a SparseMoeBlock
(gpu/models/moe.py) on its sparse layers and a dense MLP elsewhere. Families differ in their
attention class (Qwen3-MoE's normalises q and k per head: gpu/models/qwen3_moe.py) and in
MoeConfig (routing, shared experts, which layers are sparse, the block's name).

Mixtral is Mistral's attention (GQA, an optional sliding window, no biases) with a
`block_sparse_moe` block in every layer: 8 experts, top 2, renormalised.

The model takes the dense fields from ModelConfig and the MoE fields as a MoeConfig; without
one it reads them from the checkpoint's config.json (`ModelConfig.path`), so the model registry
can build it with the same (config, rope_device, backend) call as every other family. Tensor
parallelism splits it as the dense families (attention, embedding, LM head) plus each expert's
intermediate dim (gpu/models/moe.py). Its
parameter names are not all the checkpoint's (the experts are stacked), so it loads through
`load_checkpoint_tensors` rather than a name lookup.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import AttentionMetadata, Backend
from conveyor.gpu.models.layers import ParallelLMHead, VocabParallelEmbedding
from conveyor.gpu.models.llama import MLP, Attention, DecoderLayer, RMSNorm
from conveyor.gpu.models.moe import MoeConfig, SparseMoeBlock, load_moe_weights, moe_fields
from conveyor.gpu.rope import RotaryEmbedding


class MoeDecoderLayer(DecoderLayer):
    """DecoderLayer's pre-norm layout (its forward) with a sparse MoE block as the feed-forward
    (a plain MLP in a Qwen layer that mlp_only_layers / decoder_sparse_step keep dense)."""

    def __init__(self, config: ModelConfig, moe: MoeConfig, index: int, backend: Backend, attention: type[Attention]) -> None:
        nn.Module.__init__(self)  # its own sublayers, not DecoderLayer's
        self.self_attn = attention(config, backend.ops, backend.attn, index, backend.tp)  # its window: config.window_of(index)
        # The checkpoint's module name: Mixtral's block is `block_sparse_moe`, a Qwen dense layer's `mlp`.
        self.feed_forward_name = moe.block_name if index in moe.sparse_layers else "mlp"
        sparse = index in moe.sparse_layers
        block = SparseMoeBlock(config, moe, backend.ops, backend.tp) if sparse else MLP(config, backend.ops, backend.tp)
        self.add_module(self.feed_forward_name, block)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.feed_forward_name)(h)


class MoeDecoderModel(nn.Module):
    """The `model.` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, moe: MoeConfig, backend: Backend, attention: type[Attention]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, backend.tp)
        self.layers = nn.ModuleList(MoeDecoderLayer(config, moe, i, backend, attention) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)


class MoeForCausalLM(nn.Module):
    """The interface of llama.LlamaForCausalLM (forward, compute_logits; model, lm_head, rope,
    backend, config) over MoE layers. Subclasses name their attention class."""

    attention: type[Attention] = Attention

    def __init__(
        self,
        config: ModelConfig,
        rope_device: torch.device | str = "cpu",
        backend: Backend | None = None,
        moe: MoeConfig | None = None,
    ) -> None:
        super().__init__()
        if backend is None:
            from conveyor.gpu.backends import torch_backend

            backend = torch_backend(config, rope_device)
        self.config, self.backend = config, backend
        self.moe = moe or read_moe_config(config)
        self.model = MoeDecoderModel(config, self.moe, backend, self.attention)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, backend.ops, backend.tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding.from_config(config, rope_device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """input_ids, positions [T] int64; kv_caches one per layer -> [T, H]."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rope, meta, kv_cache)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (the matmul runs in the model dtype, as HF)."""
        return self.lm_head(hidden).float()

    def load_checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every parameter from the checkpoint's (name, tensor) pairs, which may stream: the
        experts' one tensor each into their stacked rows, the rest by name (moe.load_moe_weights)."""
        load_moe_weights(self, tensors, self.moe, self.backend.tp)


class MixtralForCausalLM(MoeForCausalLM):
    attention = Attention


def read_moe_config(config: ModelConfig) -> MoeConfig:
    """The MoeConfig of the checkpoint at config.path (its config.json)."""
    path = Path(config.path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return moe_fields(hf)
