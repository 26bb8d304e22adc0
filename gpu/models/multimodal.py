"""VisionModel: what a vision-language family adds to CausalLM, as the step sees it (issue 51).

The worker's image feature (gpu/step/features/vision.py) knows a model with images only through
this: `embed(input_ids)` (the text embeddings, [T, H]) and `encode_images(pixels, grids)`, each
image's pixels (wire/images.py ImageInput.shape, float32, on the device) to its embeddings
[length, H] after the projector, one per placeholder token, in the language model's dtype. The
feature writes those over the placeholder rows of `embed`'s output and passes the result to
`forward(..., input_embeds=...)`. `mrope`: the model's M-RoPE (gpu/models/mrope.py: Qwen2-VL's
three positions per token, which the feature derives from each sequence's images and hands the
forward as `rope_positions`), None where the language model rotates by one position (LLaVA).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from conveyor.gpu.models.mrope import MRope


@runtime_checkable
class VisionModel(Protocol):
    @property
    def mrope(self) -> MRope | None: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def encode_images(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]: ...


def renamed(tensors: Iterable[tuple[str, torch.Tensor]], prefixes: tuple[tuple[str, str], ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs with the first of `prefixes`' (old, new) that a name
    starts with put in the model's terms: a family's one table for every layout it reads."""
    for name, tensor in tensors:
        for old, new in prefixes:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor
