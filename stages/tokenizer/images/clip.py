"""LLaVA-1.5's CLIP preprocessing: shortest edge resized, center crop, rescale and normalize.

Equal to transformers' PIL backend (`CLIPImageProcessorPil`, and `LlavaImageProcessorPil` with
its `do_pad` that pads to a square first) on the same RGB image:
- pad (LLaVA do_pad): the image centred on a square of int(mean * 255), before the resize;
- resize: the shorter edge to `size.shortest_edge`, the other to int(S * long / short) (truncated,
  as transformers and torchvision do), with Pillow's filter `resample` on the uint8 image;
  or to `size.height` x `size.width`;
- center crop: top = (H - crop_h) // 2, left likewise, zero-padded where the image is smaller;
- rescale and normalize (scaling.py).
One image gives `pixels` [3, crop_h, crop_w] float32 and (crop_h / patch) * (crop_w / patch)
placeholder tokens, one per patch embedding: LLaVA's "default" feature strategy drops the CLS
token, "full" keeps it (one more).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import ceil
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from conveyor.stages.tokenizer.images.scaling import PixelScale, Prepared


@dataclass(frozen=True, eq=False)
class ClipImages:
    shortest_edge: int | None  # resize the shorter edge to this; None: to `size`
    size: tuple[int, int] | None  # (height, width) when shortest_edge is None
    crop: tuple[int, int] | None  # (height, width); None: no center crop
    pad_color: tuple[int, int, int] | None  # pad to a square of this colour first (LLaVA do_pad)
    resample: int  # a PIL.Image.Resampling value
    scale: PixelScale
    patch_size: int
    extra_tokens: int  # 1 with vision_feature_select_strategy "full" (the CLS token), else 0

    bidirectional: ClassVar[bool] = False  # its placeholders attend causally (wire/images.py)

    @classmethod
    def from_configs(cls, pre: Mapping[str, Any], config: Mapping[str, Any]) -> ClipImages:
        """From preprocessor_config.json (`pre`) and the model's config.json."""
        size = _size_dict(pre.get("size", {"shortest_edge": 224}), square=False)
        crop = _size_dict(pre.get("crop_size", {"height": 224, "width": 224}), square=True)
        shortest = size.get("shortest_edge") if pre.get("do_resize", True) else None
        if pre.get("do_resize", True) and shortest is None and not {"height", "width"} <= size.keys():
            raise ValueError(f"preprocessor size {size} has neither shortest_edge nor height and width")
        mean = pre.get("image_mean", [0.48145466, 0.4578275, 0.40821073])
        # LlavaImageProcessor pads to a square before resizing; CLIPImageProcessor's do_pad pads a
        # batch to its largest image, nothing for one image.
        is_llava = str(pre.get("image_processor_type", "")).startswith("LlavaImageProcessor")
        vision = config.get("vision_config") or {}
        if "patch_size" not in vision:
            raise ValueError("config.json's vision_config has no patch_size")
        return cls(
            shortest_edge=shortest,
            size=(size["height"], size["width"]) if pre.get("do_resize", True) and shortest is None else None,
            crop=(crop["height"], crop["width"]) if pre.get("do_center_crop", True) else None,
            pad_color=tuple(int(x * 255) for x in mean) if is_llava and pre.get("do_pad") else None,  # type: ignore[arg-type]
            resample=int(pre.get("resample", Image.Resampling.BICUBIC)),
            scale=PixelScale.from_preprocessor(pre),
            patch_size=int(vision["patch_size"]),
            extra_tokens=1 if config.get("vision_feature_select_strategy", "default") == "full" else 0,
        )

    def preprocess(self, rgb: Image.Image) -> Prepared:
        """An RGB image -> pixels [3, H, W] float32, no grid, its placeholder count."""
        if self.pad_color is not None and rgb.width != rgb.height:
            side = max(rgb.size)
            square = Image.new("RGB", (side, side), self.pad_color)
            square.paste(rgb, ((side - rgb.width) // 2, (side - rgb.height) // 2))
            rgb = square
        if self.shortest_edge is not None or self.size is not None:
            height, width = self.resized_size(rgb.height, rgb.width)
            rgb = rgb.resize((width, height), resample=self.resample)
        array = np.asarray(rgb)  # [H, W, 3] uint8
        if self.crop is not None:
            array = center_crop(array, *self.crop)
        pixels = self.scale(array)
        num_tokens = (pixels.shape[1] // self.patch_size) * (pixels.shape[2] // self.patch_size) + self.extra_tokens
        return Prepared(pixels, (), num_tokens, array)

    def frame(self, token_text: Mapping[int, str], image_token_id: int) -> tuple[str, str] | None:
        """None: the template's image marker is the placeholder token itself (processor.py Family)."""
        return None

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize: transformers' get_resize_output_image_size."""
        if self.shortest_edge is None:
            return self.size if self.size is not None else (height, width)
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        return (new_long, self.shortest_edge) if width <= height else (self.shortest_edge, new_long)


def center_crop(image: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """[H, W, C] -> [crop_h, crop_w, C], zero-padded where the image is smaller (transformers'
    image_transforms.center_crop, channels last)."""
    height, width = image.shape[:2]
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return image[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    pad_top, pad_left = ceil((new_h - height) / 2), ceil((new_w - width) / 2)
    padded = np.zeros((new_h, new_w, image.shape[2]), dtype=image.dtype)
    padded[pad_top : pad_top + height, pad_left : pad_left + width] = image
    top, left = top + pad_top, left + pad_left
    return padded[max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]


def _size_dict(value: int | Mapping[str, int], *, square: bool) -> dict[str, int]:
    """transformers' get_size_dict for the forms configs use: an int is the shortest edge of
    `size` and the side of a square `crop_size`."""
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    return {k: int(v) for k, v in value.items() if v is not None}
