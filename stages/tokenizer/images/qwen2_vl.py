"""Qwen2-VL's and Qwen2.5-VL's preprocessing: a resize to whole merged patches, then flat patches.

Equal to transformers' PIL backend (`Qwen2VLImageProcessorPil`, which both families use) on the
same RGB image:
- smart_resize: each side rounded to a multiple of factor = patch_size * merge_size, then the
  area scaled into [min_pixels, max_pixels] keeping the aspect ratio; Pillow's `resample` on the
  uint8 image;
- rescale and normalize (scaling.py);
- patches in the order the vision tower reads them: merge windows row by row, the merge_size^2
  patches of a window row by row, each patch flattened as (channel, temporal, row, column) with the
  one frame repeated temporal_patch_size times.
One image gives `pixels` [grid_h * grid_w, 3 * T * P * P] float32, grid (1, grid_h, grid_w) in
patches, and grid_h * grid_w / merge_size^2 placeholder tokens (the merger's outputs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from conveyor.stages.tokenizer.images.scaling import PixelScale, Prepared


@dataclass(frozen=True, eq=False)
class Qwen2VLImages:
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    resample: int  # a PIL.Image.Resampling value
    scale: PixelScale

    bidirectional: ClassVar[bool] = False  # its placeholders attend causally (wire/images.py)

    @classmethod
    def from_configs(cls, pre: Mapping[str, Any], config: Mapping[str, Any]) -> Qwen2VLImages:
        """From preprocessor_config.json (`pre`) and the model's config.json. transformers'
        precedence: top-level min_pixels/max_pixels, then size's shortest_edge/longest_edge."""
        size = pre.get("size") or {}
        min_pixels = pre.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
        max_pixels = pre.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
        if not pre.get("do_resize", True):
            raise ValueError("Qwen2-VL preprocessing needs do_resize: patches need sides that are multiples of patch * merge")
        images = cls(
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            patch_size=int(pre.get("patch_size", 14)),
            merge_size=int(pre.get("merge_size", 2)),
            temporal_patch_size=int(pre.get("temporal_patch_size", 2)),
            resample=int(pre.get("resample", Image.Resampling.BICUBIC)),
            scale=PixelScale.from_preprocessor(pre),
        )
        vision = config.get("vision_config") or {}
        tower = {
            "patch_size": (vision.get("patch_size"), images.patch_size),
            "spatial_merge_size": (vision.get("spatial_merge_size"), images.merge_size),
            "temporal_patch_size": (vision.get("temporal_patch_size"), images.temporal_patch_size),
        }
        wrong = {k: v for k, v in tower.items() if v[0] is not None and v[0] != v[1]}
        if wrong:
            raise ValueError(f"the preprocessor and the vision tower disagree (vision_config, preprocessor): {wrong}")
        return images

    def preprocess(self, rgb: Image.Image) -> Prepared:
        """An RGB image -> pixels [patches, 3 * T * P * P] float32, grid (1, h, w), its placeholder count."""
        height, width = self.resized_size(rgb.height, rgb.width)
        array = np.asarray(rgb.resize((width, height), resample=self.resample))  # [H, W, 3] uint8
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        # [H, W, C] -> [gh/m, m, P, gw/m, m, P, C] -> [gh/m, gw/m, m(h), m(w), C, P(h), P(w)], in uint8
        # (a quarter of the bytes to move), then one float32 lookup per channel into the output.
        windows = array.reshape(grid_h // m, m, p, grid_w // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        patches = windows.reshape(grid_h * grid_w, 3, p, p)
        pixels = np.empty((grid_h * grid_w, 3, t, p, p), dtype=np.float32)
        for c in range(3):
            np.take(self.scale.table[c], patches[:, c], out=pixels[:, c, 0], mode="clip")
        pixels[:, :, 1:] = pixels[:, :, :1]  # one image is T equal frames
        num_tokens = grid_h * grid_w // (m * m)
        return Prepared(pixels.reshape(grid_h * grid_w, 3 * t * p * p), (1, grid_h, grid_w), num_tokens, array)

    def frame(self, token_text: Mapping[int, str], image_token_id: int) -> tuple[str, str] | None:
        """None: the template's image marker is the placeholder token itself (processor.py Family)."""
        return None

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after smart_resize: multiples of patch * merge, area in [min, max] pixels."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio {max(height, width) / min(height, width)} is over 200")
        new_h, new_w = round(height / factor) * factor, round(width / factor) * factor
        if new_h * new_w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            new_h = max(factor, math.floor(height / beta / factor) * factor)
            new_w = max(factor, math.floor(width / beta / factor) * factor)
        elif new_h * new_w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            new_h = math.ceil(height * beta / factor) * factor
            new_w = math.ceil(width * beta / factor) * factor
        return new_h, new_w
