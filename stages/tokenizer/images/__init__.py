"""Image preprocessing in the tokenizer stage (issue 51): ImageData in, ImageInput out.

decode.py turns the client's file into an upright RGB image or a 400 naming its part; clip.py
(LLaVA-1.5) and qwen2_vl.py (Qwen2-VL, Qwen2.5-VL) make the vision tower's pixels exactly as
transformers' PIL-backend processors do; scaling.py is their shared rescale-and-normalize;
processor.py picks the family from the checkpoint and hashes the result; placeholders.py expands
each image marker of the prompt into the image's placeholder tokens. Pillow and numpy only: no
torch, no transformers, so a tokenizer process still starts in a fraction of a second.
"""

from conveyor.stages.tokenizer.images.decode import decode_image
from conveyor.stages.tokenizer.images.placeholders import expand_placeholders
from conveyor.stages.tokenizer.images.processor import (
    DEFAULT_MAX_PIXELS,
    ImageProcessor,
    ProcessedImage,
    for_checkpoint,
    image_hash,
    to_wire,
)

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "ImageProcessor",
    "ProcessedImage",
    "decode_image",
    "expand_placeholders",
    "for_checkpoint",
    "image_hash",
    "to_wire",
]
