"""CausalLM: the interface every model family implements, over the decoder they all share.

The loader and the runner know a model only through it: built as `cls(config, rope_device,
backend)` (on the meta device when loading), filled by `load_weights(tensors)` from the
checkpoint's (name, tensor) stream, adjusted once by `after_load()`, then run as
`forward(input_ids, positions, meta, kv_caches[, input_embeds, rope_positions])` -> hidden [T, H] and `compute_logits(hidden)` (or,
for greedy draws that want nothing else, `compute_greedy(hidden)`: the ids alone, where it can).

Invariants: there is one forward for every family, mixture-of-experts included; a family names
its `layer_class` (built as (config, backend, layer_index), called as (x, residual, positions,
rope, meta, kv_cache) -> (x, residual)) and overrides only the hooks `embed`, `pass_rotary`, `compute_logits`
(with `compute_greedy`), `load_weights`, `after_load`. `positions` reach the layers only as the rotary's
(a KV slot and a token's causal extent are the attention metadata's), so a wrapper may move them (M-RoPE's
delta inside a decode graph: gpu/step/features/vision.py). The skeleton and the parameter names are the checkpoint's
(`model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`, the embedding's weight where
tied), so the default `load_weights` is a name lookup; every parameter is required, and an
error is one ConfigError line naming the weight.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import AttentionMetadata, Backend
from conveyor.gpu.models.layers import ParallelLMHead, RMSNorm, VocabParallelEmbedding
from conveyor.gpu.models.rope import RotaryEmbedding, layer_tables
from conveyor.gpu.parallel.shard import cut, splits_of


class DecoderModel(nn.Module):
    """The `model.` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, backend: Backend, layer_class: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, backend.ops, backend.tp)
        self.layers = nn.ModuleList(layer_class(config, backend, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)


class CausalLM(nn.Module):
    """`backend` (gpu/backends) does the layers' ops and attention; None: the torch backend on
    `rope_device`. `rope_device` is explicit so the model can be built on the meta device (no
    init cost) while the rope tables, which are computed rather than loaded, land on the real one:
    one table per layer (gpu/models/rope.py `layer_tables`: Gemma 3's windowed layers have their own)."""

    layer_class: type[nn.Module]  # each family names its own
    # An EAGLE-3 head's (gpu/spec/eagle3.py): the layers whose inputs (the residual stream, x +
    # residual) each forward keeps, concatenated in that order as `aux_hidden` [T, len * H].
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    def __init__(self, config: ModelConfig, rope_device: torch.device | str = "cpu", backend: Backend | None = None) -> None:
        super().__init__()
        if backend is None:
            from conveyor.gpu.backends import torch_backend

            backend = torch_backend(config, rope_device)
        self.config = config
        self.backend = backend
        self.model = DecoderModel(config, backend, self.layer_class)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, backend.ops, backend.tp)
        if config.tie_word_embeddings:  # the same vocabulary shard on each rank
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding.from_config(config, rope_device)
        self.layer_ropes = layer_tables(config, self.rope, rope_device)  # one per layer, shared

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        input_embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64; kv_caches one per layer, [2, N, ...] in the attention
        backend's layout -> [T, H]. `input_embeds` [T, H]: the first layer's input where the caller
        made it (images' rows replaced: gpu/step/features/vision.py); None: embed(input_ids).
        `rope_positions` [3, T] int64: M-RoPE's positions (pass_rotary), where the pass has any."""
        x, residual = (self.embed(input_ids) if input_embeds is None else input_embeds), None
        positions, ropes = self.pass_rotary(positions, rope_positions)
        kept: dict[int, torch.Tensor] = {}
        for i, (layer, rope, kv_cache) in enumerate(zip(self.model.layers, ropes, kv_caches, strict=True)):
            if i in self.aux_layers:
                kept[i] = x.clone() if residual is None else x + residual  # the ops may add into residual in place
            x, residual = layer(x, residual, positions, rope, meta, kv_cache)
        if self.aux_layers:
            self.aux_hidden = torch.cat([kept[i] for i in self.aux_layers], dim=-1)
        return self.model.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, H]."""
        return self.model.embed_tokens(input_ids)

    def pass_rotary(self, positions: torch.Tensor, rope_positions: torch.Tensor | None) -> tuple[torch.Tensor, list[RotaryEmbedding]]:
        """The positions the layers rotate by and each layer's table: `positions` through the
        model's tables. A family with multi-dimensional positions (gpu/models/qwen2_vl.py) builds
        a table for the pass from `rope_positions`; the others have none."""
        if rope_positions is not None:
            raise ValueError(f"{type(self).__name__} has no multi-dimensional rotary positions")
        return positions, self.layer_ropes

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (the matmul runs in the model dtype, as HF; upcast
        False: left in it, for the sampler, which upcasts only what its math needs); with several
        tensor-parallel ranks, [N, 0] on all but rank 0, which samples."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    def compute_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden [N, H] -> (ids [N] int64, valid [N] bool): the argmax of compute_logits' rows, for
        greedy draws that want nothing else (ParallelLMHead.argmax: without the logits where the
        backend can, else from the head's product in the model dtype, never a float32 copy or a
        softmax); None: compute the logits. A family whose logits are not the head's product
        overrides it."""
        return self.lm_head.argmax(hidden)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from the checkpoint's (name, tensor) pairs, which may stream, casting
        dtype; each cut to this rank's slice by the split its layer declares (gpu/parallel/shard.py),
        its shape checked."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        splits, tp = splits_of(self), self.backend.tp
        missing = set(params)
        pooling = self.config.pooling is not None
        for name, tensor in tensors:
            if pooling and name not in params and f"model.{name}" in params:
                name = f"model.{name}"  # an embedding checkpoint saved from the base model: no prefix
            if name not in params:
                continue  # extras (a tied lm_head shipped anyway) are ignored
            try:
                tensor = cut(tensor, splits.get(name), tp.rank, tp.size)
            except ValueError as e:
                raise ConfigError(f"weight {name}: {e}: checkpoint and config.json disagree") from None
            copy_weight(name, tensor, params[name])
            missing.discard(name)
        if pooling and "lm_head.weight" in missing:  # an embedding model without one: its draws are discarded
            params["lm_head.weight"].data.zero_()
            missing.discard("lm_head.weight")
        check_loaded(missing, self.config.path)

    def after_load(self) -> None:
        """Once, after the checkpoint's weights are copied in (gpu/loading/loader.py): a family's one-time
        transform of them (Gemma's norm offset). By default the weights serve as loaded."""


def copy_weight(name: str, tensor: torch.Tensor, dest: torch.Tensor) -> None:
    """dest <- tensor (cast to dest's dtype), or a ConfigError naming the weight whose shape disagrees."""
    if tensor.shape != dest.shape:
        raise ConfigError(
            f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}: checkpoint and config.json disagree"
        )
    with torch.no_grad():
        dest.copy_(tensor)


def check_loaded(missing: set[str], path: str) -> None:
    """A ConfigError naming the first few parameters that no checkpoint tensor filled."""
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (" ..." if len(missing) > 3 else "")
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} weight(s): {shown}")
