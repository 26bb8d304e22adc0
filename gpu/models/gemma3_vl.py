"""Gemma3ForConditionalGeneration (Gemma 3 with images): the Gemma 3 language model, a SigLIP vision
tower and Gemma 3's pooling projector (issue 51), with its config adapter.

The language model is GemmaForCausalLM as Gemma3ForCausalLM runs it (`gemma3_config` on the
text_config: q/k norms, sliding and global layers with their own rope bases); this adds
`vision_tower` (gpu/models/vision/siglip.py) and `multi_modal_projector` (Gemma3Projector) and
`encode_images` (gpu/models/multimodal.py). An image's embeddings replace its placeholders' rows
unscaled: only the text embeddings are multiplied by sqrt(hidden_size) (`embed`), as in
transformers, where the scaled embedding table's output is overwritten by the image features.

Gemma 3's image tokens attend to every token of their own image, not only the earlier ones
(transformers' token_type_ids mask, on sliding and global layers alike, the window still
applying): the tokenizer stage marks each image `bidirectional` (wire/images.py), the scheduler
never ends a prompt chunk inside one, and the worker's VisionStep gives such a pass its rows'
extents (gpu/backends/extents.py). The model itself is unchanged by it.

Checkpoints come in two layouts, both read: transformers' save layout (`language_model.model.*`,
`vision_tower.[vision_model.]*`, `multi_modal_projector.*`; the lm_head tied) and its module
layout (`model.language_model.*`, `model.vision_tower.[vision_model.]*`,
`model.multi_modal_projector.*`, `lm_head.*`). Tower and projector are replicated on every
tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.config.vision import VisionConfig
from conveyor.gpu.backends.base import Backend
from conveyor.gpu.models.gemma import GemmaForCausalLM, gemma3_config
from conveyor.gpu.models.multimodal import renamed
from conveyor.gpu.models.vision.siglip import SiglipVisionTower

# Checkpoint prefix -> this module's, first match wins (the longer of two that nest comes first).
_PREFIXES = (
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class Gemma3Projector(nn.Module):
    """Patches [N, P*P, D] -> a P x P grid, average-pooled to `pooled_tokens` (a square: k x k
    windows of P / sqrt(pooled) patches), Gemma's RMSNorm (scale 1 + w, in float32), then
    `mm_input_projection_weight` [D, H] -> [N, pooled_tokens, H]."""

    def __init__(self, vision: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        d = vision.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.empty(d, text_hidden))
        self.mm_soft_emb_norm = _GemmaRMSNorm(d, vision.layer_norm_eps)
        self.side = vision.image_size // vision.patch_size  # patches a side
        per_side = math.isqrt(vision.pooled_tokens)
        self.pool = nn.AvgPool2d(self.side // per_side, stride=self.side // per_side)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, d = patches.shape
        grid = patches.transpose(1, 2).reshape(n, d, self.side, self.side)  # [N, D, P, P]
        pooled = self.pool(grid).flatten(2).transpose(1, 2)  # [N, k * k, D], row by row
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


class _GemmaRMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm: float32 normalisation scaled by (1 + w), cast back. Not the
    ops' RMSNorm, whose weight GemmaForCausalLM.after_load offsets by 1 (this one keeps its own)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    mrope = None  # one rotary position per token (gpu/models/multimodal.py)

    def __init__(self, config: ModelConfig, rope_device: torch.device | str = "cpu", backend: Backend | None = None) -> None:
        super().__init__(config, rope_device, backend)
        assert config.vision is not None  # gemma3_vl_config sets it
        self.vision_tower = SiglipVisionTower(config.vision)
        self.multi_modal_projector = Gemma3Projector(config.vision, config.hidden_size)
        # transformers embeds an image token past the vocabulary as id 0 (its row is replaced anyway).
        self._image_token_outside = config.vision.image_token_id >= config.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._image_token_outside:
            input_ids = torch.where(input_ids < self.config.vocab_size, input_ids, 0)
        return super().embed(input_ids)

    def encode_images(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
        """Each image's [pooled_tokens, H] embeddings, all images (one size: the processor's) at once."""
        dtype = self.model.embed_tokens.weight.dtype
        embeds = self.multi_modal_projector(self.vision_tower(torch.stack(pixels)))  # [N, tokens, H]
        return list(embeds.to(dtype).unbind(0))

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(tensors, _PREFIXES))


def gemma3_vl_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """The language model is Gemma 3's (`gemma3_config` on text_config, which the generic reading
    already merged); the tower's fields from vision_config (SigLIP's defaults where left out), the
    pooling from mm_tokens_per_image, the placeholder from image_token_index."""
    vision = hf.get("vision_config") or {}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ConfigError(f"unsupported Gemma 3 vision tower {vision.get('model_type')!r} in {cfg.path}: SigLIP only")
    text = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")} | (hf.get("text_config") or {})
    cfg = gemma3_config(text, cfg)
    image_size, patch_size = int(vision.get("image_size", 224)), int(vision.get("patch_size", 16))
    tokens = int(hf.get("mm_tokens_per_image", 256))
    side, per_side = image_size // patch_size, math.isqrt(tokens)
    if per_side * per_side != tokens or side % per_side:
        raise ConfigError(f"mm_tokens_per_image {tokens} in {cfg.path} must be a square whose side divides the {side} patches a side")
    token = hf.get("image_token_index", hf.get("image_token_id", 262_144))
    return dataclasses.replace(
        cfg,
        vision=VisionConfig(
            tower="siglip",
            hidden_size=int(vision.get("hidden_size", 768)),
            intermediate_size=int(vision.get("intermediate_size", 3072)),
            num_layers=int(vision.get("num_hidden_layers", 12)),
            num_heads=int(vision.get("num_attention_heads", 12)),
            image_size=image_size,
            patch_size=patch_size,
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            image_token_id=int(token),
            num_channels=int(vision.get("num_channels", 3)),
            pooled_tokens=tokens,
        ),
    )
