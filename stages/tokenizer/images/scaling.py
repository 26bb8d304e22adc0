"""Rescale and normalize as one lookup: uint8 RGB pixels to the float32 values a vision tower reads.

transformers' PIL path rescales a uint8 image in float64 (`x * rescale_factor`), casts to float32,
then normalizes in float32 (`(x - mean) / std`, mean and std cast to float32). Each output value
depends only on its channel and its uint8 input, so `PixelScale` evaluates exactly those
operations once for the 3 x 256 possible inputs at start-up and indexes the table per image: the
same float32 bits, without per-pixel arithmetic. `Prepared` is what a family makes of an image.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

# transformers' defaults (image_utils.OPENAI_CLIP_MEAN / _STD), for configs that leave them out.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class Prepared(NamedTuple):
    """What a family's preprocess makes of one RGB image."""

    pixels: np.ndarray  # float32, C order, the vision tower's input
    grid: tuple[int, ...]  # (t, h, w) in patches where the family has a grid, else ()
    num_tokens: int  # placeholder tokens: the embeddings the tower and projector make
    source: np.ndarray  # [H, W, 3] uint8 that `pixels` is a fixed function of (what is hashed)


@dataclass(frozen=True, eq=False)
class PixelScale:
    table: np.ndarray  # [3, 256] float32: table[c, v] is channel c's value for input byte v

    @classmethod
    def from_preprocessor(cls, cfg: Mapping[str, Any]) -> PixelScale:
        """From preprocessor_config.json's do_rescale, rescale_factor, do_normalize, image_mean, image_std."""
        values: np.ndarray = np.arange(256, dtype=np.uint8)
        if cfg.get("do_rescale", True):
            values = (values.astype(np.float64) * float(cfg.get("rescale_factor", 1 / 255))).astype(np.float32)
        values = np.broadcast_to(values.astype(np.float32), (3, 256))
        if cfg.get("do_normalize", True):
            mean = _per_channel(cfg.get("image_mean", CLIP_MEAN))
            std = _per_channel(cfg.get("image_std", CLIP_STD))
            values = (values - mean[:, None]) / std[:, None]
        return cls(np.ascontiguousarray(values, dtype=np.float32))

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 -> [3, H, W] float32."""
        out = np.empty((3, *rgb.shape[:2]), dtype=np.float32)
        for c in range(3):
            np.take(self.table[c], rgb[:, :, c], out=out[c], mode="clip")  # uint8 indices: always in range
        return out


def _per_channel(value: float | Sequence[float]) -> np.ndarray:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"image_mean and image_std need 3 values (RGB), got {values}")
    return np.array(values, dtype=np.float32)
