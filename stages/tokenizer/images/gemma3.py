"""Gemma 3's preprocessing and prompt framing: a resize to the tower's square, rescale and normalize;
each image's marker framed as Gemma 3's processor frames it.

Equal to transformers' PIL backend (`Gemma3ImageProcessorPil`) on the same RGB image, with
pan-and-scan off (its default): the image resized to `size` height x width with Pillow's filter
`resample` (bilinear by default) on the uint8 image, no crop, then rescaled and normalized (mean
and std 0.5 by default: scaling.py). One image gives `pixels` [3, H, W] float32 and
mm_tokens_per_image placeholder tokens (the projector pools the tower's patches to that many).
do_pan_and_scan (extra crops, each its own run of tokens) is refused: not implemented.

Framing (Gemma3Processor): the chat template renders `<start_of_image>` (boi) per image, and the
processor replaces each in the rendered text by "\\n\\n" + boi + image_token * n + eoi + "\\n\\n"
before tokenizing, so the newlines merge with the text beside them. `frame` gives that text with
one image token, which the tokenizer stage substitutes in the rendered prompt before encoding;
expand_placeholders then repeats the image token n times (special tokens encode alone, so the ids
are the processor's). `bidirectional`: Gemma 3's image tokens attend to their whole image
(wire/images.py ImageInput.bidirectional).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from PIL import Image

from conveyor.stages.tokenizer.images.clip import ClipImages
from conveyor.stages.tokenizer.images.scaling import PixelScale, Prepared

# transformers' IMAGENET_STANDARD_MEAN / _STD, Gemma3ImageProcessor's defaults
STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True, eq=False)
class Gemma3Images:
    resize: ClipImages  # a resize to (height, width), no crop: CLIP's steps with these settings
    num_tokens: int  # mm_tokens_per_image
    boi_token_id: int
    eoi_token_id: int
    bidirectional: ClassVar[bool] = True

    @classmethod
    def from_configs(cls, pre: Mapping[str, Any], config: Mapping[str, Any]) -> Gemma3Images:
        """From preprocessor_config.json (`pre`) and the model's config.json."""
        if pre.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's do_pan_and_scan is not implemented: set it to false in preprocessor_config.json")
        if not pre.get("do_resize", True):
            raise ValueError("Gemma 3 preprocessing needs do_resize: the tower takes one square size")
        size = pre.get("size") or {"height": 224, "width": 224}
        if isinstance(size, int):
            size = {"height": size, "width": size}
        vision = config.get("vision_config") or {}
        side = int(vision.get("image_size", 224))
        if (int(size["height"]), int(size["width"])) != (side, side):
            raise ValueError(f"the preprocessor's size {size} is not the vision tower's {side}x{side} square")
        scale_cfg = {"image_mean": STANDARD, "image_std": STANDARD, **{k: v for k, v in pre.items() if v is not None}}
        resize = ClipImages(
            shortest_edge=None,
            size=(side, side),
            crop=None,
            pad_color=None,
            resample=int(pre["resample"] if pre.get("resample") is not None else Image.Resampling.BILINEAR),
            scale=PixelScale.from_preprocessor(scale_cfg),
            patch_size=int(vision.get("patch_size", 16)),
            extra_tokens=0,
        )
        return cls(
            resize=resize,
            num_tokens=int(config.get("mm_tokens_per_image", 256)),
            boi_token_id=int(config.get("boi_token_index", 255_999)),
            eoi_token_id=int(config.get("eoi_token_index", 256_000)),
        )

    def preprocess(self, rgb: Image.Image) -> Prepared:
        """An RGB image -> pixels [3, S, S] float32, no grid, mm_tokens_per_image placeholders."""
        return self.resize.preprocess(rgb)._replace(num_tokens=self.num_tokens)

    def frame(self, token_text: Mapping[int, str], image_token_id: int) -> tuple[str, str] | None:
        """(the template's image marker text, what replaces it before tokenizing: the marker framed,
        one image token inside), from the tokenizer's special-token texts by id."""
        boi, eoi, image = token_text[self.boi_token_id], token_text[self.eoi_token_id], token_text[image_token_id]
        return boi, f"\n\n{boi}{image}{eoi}\n\n"
