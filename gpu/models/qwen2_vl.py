"""Qwen2VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration: the Qwen2 language model
with M-RoPE and the Qwen2-VL / Qwen2.5-VL vision tower (issue 51), with their config adapter.

The language model is LlamaForCausalLM with Qwen2's q/k/v biases (`qwen2_config`); it rotates by
M-RoPE (gpu/models/mrope.py) where a pass brings `rope_positions` [3, T] (its image sequences'
rows: gpu/step/features/vision.py), and by the ordinary table otherwise, which is M-RoPE with three
equal positions (text-only traffic, and a decode row past its images with its positions moved by
its sequence's delta). The tower is gpu/models/vision/qwen2_vl.py, under `visual`: `encode_images`
runs all images' patches through it at once and hands back each image's [t*h*w / merge^2, H] rows.
The two families differ only in the tower, which its config picks.

Checkpoints come in two layouts, both read: the Hub's, which transformers 5's save_pretrained
writes too (`model.*`, `lm_head.*`, `visual.*`), and transformers 5's module names
(`model.language_model.*`, `model.visual.*`, `lm_head.*`). The tower is replicated on every
tensor-parallel rank (it runs once per image).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.config.rope_fields import rope_items, rope_parameters
from conveyor.gpu.backends.base import Backend
from conveyor.gpu.models.llama import LlamaForCausalLM, qwen2_config
from conveyor.gpu.models.mrope import MRope
from conveyor.gpu.models.multimodal import renamed
from conveyor.gpu.models.rope import RotaryEmbedding
from conveyor.gpu.models.vision.qwen2_vl import Qwen2VisionTower, qwen2_vl_vision_config

# transformers 5's module prefixes -> this module's (the Hub's names are this module's already).
_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "model."))


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, rope_device: torch.device | str = "cpu", backend: Backend | None = None) -> None:
        super().__init__(config, rope_device, backend)
        assert config.vision is not None  # qwen2_vl_config sets it
        self.visual = Qwen2VisionTower(config.vision)
        sections = dict(config.rope_scaling)["mrope_section"]
        assert isinstance(sections, tuple)
        self.mrope: MRope | None = MRope(tuple(int(s) for s in sections), config.vision.spatial_merge_size)
        self._columns = self.mrope.column_rows().to(rope_device)  # [D]: each table column's position row

    def pass_rotary(self, positions: torch.Tensor, rope_positions: torch.Tensor | None) -> tuple[torch.Tensor, list[RotaryEmbedding]]:
        """With rope_positions [3, T]: one table for the pass, row t token t's (every layer shares
        the model's rope: no local base), and positions arange(T) to read it."""
        if rope_positions is None:
            return positions, self.layer_ropes
        assert self.mrope is not None
        table = self.mrope.table(self.rope.cos_sin, rope_positions, self._columns)
        return torch.arange(positions.shape[0], device=positions.device), [table] * len(self.layer_ropes)

    def encode_images(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
        """Each image's [t*h*w / merge^2, H] embeddings: the images' patches [sum of t*h*w, C*T*P*P]
        through the tower together (attention stays within each frame)."""
        dtype = self.model.embed_tokens.weight.dtype
        return [e.to(dtype) for e in self.visual.encode(torch.cat(pixels), grids)]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(tensors, _PREFIXES))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """The same model: Qwen2.5-VL's tower (RMSNorm, SwiGLU, window attention) is its config's."""


def qwen2_vl_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """The language model's fields come from text_config (or the top level: the Hub's flat
    files), Qwen2's quirks from `qwen2_config`; `mrope_section` from rope_scaling /
    rope_parameters joins ModelConfig.rope_scaling (its "mrope" type is the default rope:
    transformers reads it so too); the tower's fields from vision_config."""
    text = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")} | (hf.get("text_config") or {})
    section = rope_parameters(text)[0].get("mrope_section")
    if not section:
        raise ConfigError(f"{cfg.path}/config.json names no mrope_section in rope_scaling or rope_parameters")
    if sum(int(s) for s in section) != cfg.head_dim // 2:
        raise ConfigError(f"mrope_section {list(section)} in {cfg.path} must sum to head_dim / 2 = {cfg.head_dim // 2}")
    scaling = {k: v for k, v in cfg.rope_scaling if k != "type"}  # transformers 5 keeps "type": "mrope" beside rope_type
    if scaling.get("rope_type") == "mrope":
        scaling["rope_type"] = "default"
    scaling["mrope_section"] = tuple(int(s) for s in section)
    cfg = qwen2_config(text, dataclasses.replace(cfg, rope_scaling=rope_items(scaling)))
    return dataclasses.replace(cfg, vision=qwen2_vl_vision_config(hf))
