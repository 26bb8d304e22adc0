"""Synthetic pictures and their encoded files for the image preprocessing tests: gradients plus
noise, so a resize filter or a channel order that differs shows in the pixels."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x * 7 + y * 3) % 256], axis=-1)
    rgb = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(rgb, "RGB")
    if mode in ("RGBA", "LA"):
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        image = image.convert(mode[:-1])
        image.putalpha(alpha)
        return image
    if mode == "P":  # a palette image whose entry 0 is transparent
        image = image.quantize(16)
        image.info["transparency"] = 0
        return image
    return image if mode == "RGB" else image.convert(mode)


def encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    if fmt == "JPEG" and image.mode not in ("RGB", "L", "CMYK"):
        image = image.convert("RGB")
    image.save(out, fmt, **options)
    return out.getvalue()
