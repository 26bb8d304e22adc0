"""ImageProcessor: a checkpoint's image preprocessing, built once per tokenizer process.

`for_checkpoint(path)` reads config.json (the family, from `architectures` or `model_type`, and
the image token id) and the image processor's settings (processor_config.json's "image_processor",
else preprocessor_config.json: transformers' precedence); None for a text-only model.
`process(ImageData)` decodes (decode.py), refuses an image whose sides differ by more than 200x
(Qwen2-VL's own bound; for CLIP it keeps a 1 x 20000 image from being resized to 336 x 6.7M
before the crop), and runs the family's steps. `to_wire` gives the ImageInput sent on.

Invariant: `hash` is a function of what the vision tower sees, so the same picture in any
encoding that decodes to the same pixels gets the same hash, and different pixels a different
one. It digests the preprocessor settings, the pixels' shape, the grid and the uint8 image the
float32 pixels are a fixed function of (scaling.py's lookup, then a fixed layout): all that
decides the float32 bytes, in a quarter of their size (an eighth for Qwen2-VL, whose pixels repeat
each frame); hashing the float32 bytes took 30% of a Qwen2-VL image's time. The grid is in it because
Qwen2-VL's patches of a 28x56 and a 56x28 plain image are the same bytes in the same shape, while
the tower's 2D positions make different embeddings; the settings because a changed mean or std
changes the pixels of the same uint8 image (a persistent cache tier outlives a restart).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
from PIL import Image

from conveyor.stages.tokenizer.images.clip import ClipImages
from conveyor.stages.tokenizer.images.decode import decode_image
from conveyor.stages.tokenizer.images.gemma3 import Gemma3Images
from conveyor.stages.tokenizer.images.qwen2_vl import Qwen2VLImages
from conveyor.stages.tokenizer.images.scaling import Prepared
from conveyor.stages.tokenizer.rejected import Rejected
from conveyor.wire.images import ImageData, ImageInput

# Below Pillow's decompression-bomb warning (89.5M pixels), so our limit always speaks first;
# an RGBA image this large is 256 MiB decoded.
DEFAULT_MAX_PIXELS = 8192 * 8192
MAX_ASPECT_RATIO = 200


class Family(Protocol):
    bidirectional: ClassVar[bool]  # its images' placeholders attend to each other (wire/images.py)

    def preprocess(self, rgb: Image.Image) -> Prepared: ...

    def frame(self, token_text: Mapping[int, str], image_token_id: int) -> tuple[str, str] | None:
        """(the chat template's image marker text, the text that replaces it before the prompt is
        tokenized, holding one image token), given the special tokens' texts by id; None where
        the marker is the image token itself (encoder.py)."""
        ...


# architectures[0] or model_type -> the family's preprocessing
FAMILIES: dict[str, type[ClipImages] | type[Qwen2VLImages] | type[Gemma3Images]] = {
    "LlavaForConditionalGeneration": ClipImages,
    "llava": ClipImages,
    "Qwen2VLForConditionalGeneration": Qwen2VLImages,
    "qwen2_vl": Qwen2VLImages,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLImages,
    "qwen2_5_vl": Qwen2VLImages,
    "Gemma3ForConditionalGeneration": Gemma3Images,
    "gemma3": Gemma3Images,
}


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    pixels: np.ndarray  # float32, C order: [3, H, W] (CLIP) or [patches, 3 * T * P * P] (Qwen2-VL)
    grid: tuple[int, ...]  # Qwen2-VL: (t, h, w) in patches; () for CLIP
    num_tokens: int  # placeholder tokens: the embeddings the vision tower and projector make
    hash: int  # signed 64-bit

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.pixels.shape)


@dataclass(frozen=True, eq=False)
class ImageProcessor:
    family: Family
    image_token_id: int
    max_pixels: int = DEFAULT_MAX_PIXELS  # of a decoded image, before any resize
    settings: bytes = b""  # a digest of the preprocessor's settings, the first thing hashed

    def process(self, image: ImageData) -> ProcessedImage:
        """Raises Rejected (param = image.part) for an image that cannot or may not be used."""
        rgb = decode_image(image, max_pixels=self.max_pixels)
        if max(rgb.size) > MAX_ASPECT_RATIO * min(rgb.size):
            raise Rejected(
                f"{image.part}: the image is {rgb.width}x{rgb.height}; its longer side may be at most "
                f"{MAX_ASPECT_RATIO} times its shorter side",
                param=image.part,
            )
        prepared = self.family.preprocess(rgb)
        digest = image_hash(self.settings, prepared.pixels.shape, prepared.grid, prepared.source)
        return ProcessedImage(prepared.pixels, prepared.grid, prepared.num_tokens, digest)


def for_checkpoint(path: str | Path, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageProcessor | None:
    """The checkpoint's image processor; None where config.json names no vision family."""
    root = Path(path)
    config = _read_json(root / "config.json") or {}
    names = [*(config.get("architectures") or []), str(config.get("model_type", ""))]
    family = next((FAMILIES[name] for name in names if name in FAMILIES), None)
    if family is None:
        return None
    pre = (_read_json(root / "processor_config.json") or {}).get("image_processor")
    pre = pre if pre is not None else _read_json(root / "preprocessor_config.json")
    if pre is None:
        raise ValueError(f"{root} is a vision model ({names[0]}) without processor_config.json or preprocessor_config.json")
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if token_id is None:
        raise ValueError(f"{root / 'config.json'} names no image_token_index or image_token_id")
    settings = hashlib.blake2b(json.dumps([family.__name__, pre], sort_keys=True).encode(), digest_size=16)
    return ImageProcessor(family.from_configs(pre, config), int(token_id), max_pixels, settings.digest())


def image_hash(settings: bytes, shape: tuple[int, ...], grid: tuple[int, ...], source: np.ndarray) -> int:
    """blake2b-64 of (settings, shape, grid, the uint8 source image), as a signed 64-bit int
    (msgspec's int range)."""
    digest = hashlib.blake2b(settings, digest_size=8)
    sizes = [len(shape), *shape, len(grid), *grid, *source.shape]
    digest.update(np.array(sizes, dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(source, dtype=np.uint8).data)
    return int.from_bytes(digest.digest(), "little", signed=True)


def to_wire(processed: ProcessedImage, offset: int, *, bidirectional: bool = False) -> ImageInput:
    """The ImageInput for an image whose placeholder tokens start at `offset` in the prompt
    (`bidirectional`: its family's, ImageProcessor.family.bidirectional)."""
    return ImageInput(
        hash=processed.hash,
        offset=offset,
        length=processed.num_tokens,
        pixels=np.ascontiguousarray(processed.pixels, dtype="<f4").tobytes(),
        shape=list(processed.shape),
        grid=list(processed.grid),
        bidirectional=bidirectional,
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None
