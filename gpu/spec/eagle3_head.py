"""Eagle3Head: an EAGLE-3 draft head for Llama targets, in the published checkpoint layout, and
its loading (conveyor/draft_config.py reads and checks its config.json).

The checkpoint's names, which are the module's (H its width, the target's too; V the target's
vocabulary, Vd the head's own; heads * D its attention width):

    fc.weight                          [H, 3H]  the inputs of three target layers, concatenated -> H
    midlayer.input_layernorm.weight    [H]      the token's embedding, normed
    midlayer.hidden_norm.weight        [H]      the features, normed
    midlayer.self_attn.{q,k,v}_proj.weight [heads * D, 2H]  attention reads [embedding ; features]
    midlayer.self_attn.o_proj.weight   [H, heads * D]
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight [H], lm_head.weight [Vd, H]
    d2t [Vd] int64    draft id d is target id d + d2t[d] (absent: Vd = V, the identity)
    t2d [V] bool      which target ids it can draft (not needed to draft: skipped)
    embed_tokens.weight [V, H]   optional: without it the head embeds with the target's table

One step at position i reads the token at i + 1 and features of position i (the target's,
through fc, or its own last step's pre-norm output) and writes its one layer's KV at i; its
argmax is its guess for the token at i + 2. Greedy (argmax) only, so each draft is one token
with probability 1 and verification stays exact (gpu/spec/verify.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.config.speculative import Eagle3Layout
from conveyor.gpu.backends.base import AttentionMetadata, Backend
from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.loading.loader import checkpoint_tensors
from conveyor.gpu.models.base import check_loaded, copy_weight
from conveyor.gpu.models.layers import ColumnParallelLinear, Linear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from conveyor.gpu.models.llama import Attention, DecoderLayer
from conveyor.gpu.models.rope import RotaryEmbedding
from conveyor.gpu.parallel.group import TensorParallel

# The published heads ship pytorch_model.bin (later ones model.safetensors): both load.
TORCH_FILE = "pytorch_model.bin"


class Eagle3Attention(Attention):
    """Llama attention whose q/k/v read the [embedding ; features] concatenation, [T, 2H]."""

    def make_projections(self, config: ModelConfig, ops: Ops, tp: TensorParallel) -> None:
        h, d, heads, kv_heads = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
        self.q_proj = ColumnParallelLinear(2 * h, ((heads, d),), config.qkv_bias, ops, tp)
        self.k_proj = ColumnParallelLinear(2 * h, ((kv_heads, d),), config.qkv_bias, ops, tp)
        self.v_proj = ColumnParallelLinear(2 * h, ((kv_heads, d),), config.qkv_bias, ops, tp)
        self.o_proj = RowParallelLinear(((heads, d),), h, config.o_bias, ops, tp)


class Eagle3Layer(DecoderLayer):
    """The head's one decoder layer (`midlayer`): a Llama layer over [norm(embedding) ;
    hidden_norm(features)], its residual stream the features (normed, with norm_before_residual)."""

    attention_class = Eagle3Attention

    def __init__(self, config: ModelConfig, backend: Backend, norm_before_residual: bool) -> None:
        super().__init__(config, backend, 0)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, features, positions, rope, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, features [T, H] -> (the MLP's output, the stream before it), as DecoderLayer."""
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features.clone()  # the norm below may add into it
        h = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), positions, rope, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.feed_forward(h), residual


class Eagle3Head(nn.Module):
    d2t: torch.Tensor  # [Vd] int64, a buffer

    def __init__(self, config: ModelConfig, layout: Eagle3Layout, rope_device: torch.device, backend: Backend, embeds: bool) -> None:
        super().__init__()
        h, ops = config.hidden_size, backend.ops
        self.config = config
        self.fc = Linear(3 * h, h, False, ops)
        self.midlayer = Eagle3Layer(config, backend, layout.norm_before_residual)
        self.norm = RMSNorm(h, config.rms_norm_eps, ops)
        self.lm_head = Linear(h, layout.draft_vocab_size, False, ops)
        self.register_buffer("d2t", torch.zeros(layout.draft_vocab_size, dtype=torch.int64))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, ops) if embeds else None
        self.rope = RotaryEmbedding.from_config(config, rope_device)

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, H] of the tokens at positions + 1, features [T, H] of `positions` ->
        (normed [T, H], for `draft`; pre-norm [T, H], the next step's features)."""
        x, residual = self.midlayer(embeds, features, positions, self.rope, meta, kv_cache)
        return self.norm(x, residual)

    def draft(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [T, H] -> the greedy guesses [T] int64, as target ids."""
        best = self.lm_head(normed).argmax(dim=-1)
        return best + self.d2t[best]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every parameter and d2t from the checkpoint's tensors, shapes checked."""
        wanted = dict(self.named_parameters()) | {"d2t": self.d2t}
        missing = set(wanted)
        if "d2t" not in tensors and self.d2t.numel() == self.config.vocab_size:
            self.d2t.zero_()  # a full vocabulary maps to itself
            missing.discard("d2t")
        for name, tensor in tensors.items():
            if name in wanted:
                copy_weight(name, tensor, wanted[name])
                missing.discard(name)
        check_loaded(missing, self.config.path)
        targets = torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t
        if bool(((targets < 0) | (targets >= self.config.vocab_size)).any()):
            raise ConfigError(
                f"EAGLE-3 head {self.config.path}: d2t maps draft ids outside the model's {self.config.vocab_size} tokens"
            )


def load_eagle3_head(config: ModelConfig, layout: Eagle3Layout, device: torch.device, backend: Backend) -> Eagle3Head:
    """The head on `device` in config.dtype, its weights loaded and prepared for the backend's ops."""
    tensors = dict(head_tensors(Path(config.path)))
    with torch.device("meta"):
        head = Eagle3Head(config, layout, device, backend, embeds="embed_tokens.weight" in tensors)
    head = head.to(dtype=getattr(torch, config.dtype)).to_empty(device=device)
    head.load_weights(tensors)
    head = head.eval().requires_grad_(False)
    backend.ops.prepare(head)
    return head


def head_tensors(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The head's (name, tensor) pairs: its safetensors files, else its pytorch_model.bin."""
    if (root / TORCH_FILE).is_file() and not any(root.glob("*.safetensors")):
        try:
            yield from torch.load(root / TORCH_FILE, map_location="cpu", weights_only=True).items()
        except Exception as e:  # a truncated or foreign file: one line
            raise ConfigError(f"cannot read {root / TORCH_FILE}: {e}") from None
        return
    yield from checkpoint_tensors(root)
