"""LlavaForConditionalGeneration (LLaVA-1.5): a CLIP vision tower, a two-layer MLP projector and a
Llama language model (issue 51), with its config adapter.

The language model is LlamaForCausalLM unchanged (its backend, ops, attention and tensor-parallel
sharding); this adds `vision_tower` (gpu/models/vision/clip.py) and `multi_modal_projector`
(linear_1 -> activation -> linear_2, from the tower's features to the language model's hidden
size) and `encode_images` (gpu/models/multimodal.py). Each image's embeddings take the place of its
placeholder tokens' embeddings, one per patch (the class token dropped), as transformers does.

Checkpoints come in two layouts, both read: transformers' save layout (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`, as the llava-hf
checkpoints ship) and its module layout (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*`), the tower's own names with or without CLIP's
`vision_model.`. The tower and projector are plain torch modules,
replicated on every tensor-parallel rank: they run once per image.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.config.vision import VisionConfig
from conveyor.gpu.backends.base import Backend
from conveyor.gpu.models.llama import LlamaForCausalLM
from conveyor.gpu.models.multimodal import renamed
from conveyor.gpu.models.vision.clip import ClipVisionTower, activation

# Checkpoint prefix -> this module's, longest first.
_PREFIXES = (
    ("vision_tower.vision_model.", "vision_tower."),  # the Hub's llava-hf files: CLIPVisionModel's own prefix
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class LlavaProjector(nn.Module):
    def __init__(self, vision: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        features = vision.hidden_size * len(vision.feature_layers)
        self.linear_1 = nn.Linear(features, text_hidden, bias=vision.projector_bias)
        self.act = activation(vision.projector_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=vision.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    mrope = None  # one rotary position per token (gpu/models/multimodal.py)

    def __init__(self, config: ModelConfig, rope_device: torch.device | str = "cpu", backend: Backend | None = None) -> None:
        super().__init__(config, rope_device, backend)
        assert config.vision is not None  # llava_config sets it
        self.vision_tower = ClipVisionTower(config.vision)
        self.multi_modal_projector = LlavaProjector(config.vision, config.hidden_size)

    def encode_images(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
        """Each image's [tokens_per_image, H] embeddings; images of one size go through the tower together."""
        dtype = self.model.embed_tokens.weight.dtype
        out: list[torch.Tensor] = [torch.empty(0)] * len(pixels)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(pixels):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        for indices in by_shape.values():
            batch = torch.stack([pixels[i] for i in indices])  # [N, C, S, S]
            embeds = self.multi_modal_projector(self.vision_tower(batch)).to(dtype)
            for i, e in zip(indices, embeds, strict=True):
                out[i] = e
        return out

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(tensors, _PREFIXES))


def llava_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """The language model's fields come from text_config (config/model.py); the tower's from
    vision_config, with the wrapper's feature and projector settings."""
    vision = hf.get("vision_config") or {}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ConfigError(f"unsupported LLaVA vision tower {vision.get('model_type')!r} in {cfg.path}: CLIP only")
    text_type = (hf.get("text_config") or {}).get("model_type", "llama")
    if text_type not in ("llama", "mistral"):
        raise ConfigError(f"unsupported LLaVA language model {text_type!r} in {cfg.path}: Llama or Mistral")
    layers = hf.get("vision_feature_layer", -2)
    token = hf.get("image_token_index", hf.get("image_token_id"))
    if token is None:
        raise ConfigError(f"{cfg.path}/config.json names no image_token_index")
    return dataclasses.replace(
        cfg,
        vision=VisionConfig(
            tower="clip",
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_layers=int(vision["num_hidden_layers"]),
            num_heads=int(vision["num_attention_heads"]),
            image_size=int(vision["image_size"]),
            patch_size=int(vision["patch_size"]),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=str(vision.get("hidden_act", "quick_gelu")),
            image_token_id=int(token),
            feature_layers=tuple(int(i) for i in layers) if isinstance(layers, list) else (int(layers),),
            feature_select=str(hf.get("vision_feature_select_strategy", "default")),
            projector_act=str(hf.get("projector_hidden_act", "gelu")),
            projector_bias=bool(hf.get("multimodal_projector_bias", True)),
            num_channels=int(vision.get("num_channels", 3)),
        ),
    )
