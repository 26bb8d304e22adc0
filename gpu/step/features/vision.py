"""VisionStep: images in a pass (issue 51). A prompt's images arrive with its NewSeq as pixels and
the placeholder tokens that stand for them (wire/images.py ImageInput); a pass that computes any
of those tokens gets, as its first layer's input, the model's embeddings of its ids with each
placeholder row replaced by its image's embedding from the vision tower (PassInputs.input_embeds).

The encoder cache: an image's embeddings [length, H] are kept under its hash (least recently used
first out, within ENCODER_CACHE_TOKENS rows), so a prompt chunked through an image encodes it
once, and the same picture in another request is encoded once. The images a pass needs and the
cache lacks are encoded together, before the pass.

Invariants: a pass's token rows are its rows' new tokens in order, row i's being its sequence's
tokens [num_computed, num_computed + num_new[i]) (gpu/step/pass_work.py); the tower is replicated
on every tensor-parallel rank, so each computes the same embeddings and no collective is added.
A pass through no image token costs a dict lookup per row; a sequence's pixels are dropped once a
pass computes past its last image (a preempted one is sent again in full, images included).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from conveyor.gpu.models.multimodal import VisionModel
from conveyor.gpu.step.features.base import StepFeature
from conveyor.gpu.step.passes import PassWork, WorkerSeq
from conveyor.wire.images import ImageInput
from conveyor.wire.step import NewSeq

# Rows of embeddings the cache keeps: a few large images (a 336 px LLaVA-1.5 image is 576 rows).
ENCODER_CACHE_TOKENS = 16384


class EncoderCache:
    """Image hash -> its embeddings [length, H], least recently used first out past `budget` rows
    (one entry is kept whatever its size: the pass that asked for it uses it)."""

    def __init__(self, budget: int = ENCODER_CACHE_TOKENS) -> None:
        self.budget = budget
        self._rows = 0
        self._embeds: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: int) -> torch.Tensor | None:
        found = self._embeds.get(key)
        if found is not None:
            self._embeds.move_to_end(key)
        return found

    def put(self, key: int, embeds: torch.Tensor) -> None:
        self._embeds[key] = embeds
        self._rows += embeds.shape[0]
        while self._rows > self.budget and len(self._embeds) > 1:
            _, old = self._embeds.popitem(last=False)
            self._rows -= old.shape[0]


class VisionStep(StepFeature):
    def __init__(self, model: VisionModel, device: torch.device) -> None:
        self.model, self.device = model, device
        self.images: dict[int, list[ImageInput]] = {}  # seq_id -> its prompt's images
        self.cache = EncoderCache()

    def register(self, seq: WorkerSeq, new: NewSeq | None) -> None:
        if new is not None and new.images:  # a fork copies a finished prompt: no image left to compute
            self.images[seq.seq_id] = new.images

    def drop(self, seq_id: int) -> None:
        self.images.pop(seq_id, None)

    def begin_pass(self, work: PassWork) -> None:
        # (row in the pass, image, its first and last + 1 placeholder the pass computes)
        pieces: list[tuple[int, ImageInput, int, int]] = []
        at = 0
        for seq, n in zip(work.rows, work.num_new):
            start, images = seq.num_computed, self.images.get(seq.seq_id)
            if images is not None:
                for image in images:
                    lo, hi = max(start, image.offset), min(start + n, image.offset + image.length)
                    if lo < hi:
                        pieces.append((at + lo - start, image, lo - image.offset, hi - image.offset))
                if start + n >= max(image.offset + image.length for image in images):
                    del self.images[seq.seq_id]  # past its last image: its pixels go (a recomputation resends them)
            at += n
        if not pieces:
            return
        embeds = self._embeddings([image for _, image, _, _ in pieces])
        x = self.model.embed(work.inputs.input_ids)  # [T, H]
        for row, image, lo, hi in pieces:
            x[row : row + hi - lo] = embeds[image.hash][lo:hi].to(x.dtype)
        work.inputs.input_embeds = x

    def _embeddings(self, images: list[ImageInput]) -> dict[int, torch.Tensor]:
        """Each image's embeddings by hash: from the cache, the missing ones encoded together."""
        found: dict[int, torch.Tensor] = {}
        missing: dict[int, ImageInput] = {}
        for image in images:
            if image.hash in found or image.hash in missing:
                continue
            cached = self.cache.get(image.hash)
            if cached is None:
                missing[image.hash] = image
            else:
                found[image.hash] = cached
        self.cache.hits += len(found)
        if missing:
            self.cache.misses += len(missing)
            todo = list(missing.values())
            pixels = [pixel_tensor(image).to(self.device, non_blocking=True) for image in todo]
            encoded = self.model.encode_images(pixels, [image.grid for image in todo])
            for image, out in zip(todo, encoded, strict=True):
                if out.shape[0] != image.length:
                    raise ValueError(
                        f"image {image.hash:#x}: the vision tower made {out.shape[0]} embeddings for {image.length} placeholders"
                    )
                self.cache.put(image.hash, out)
                found[image.hash] = out
        return found


def pixel_tensor(image: ImageInput) -> torch.Tensor:
    """An image's pixels as a float32 tensor of its shape (a copy: the wire's bytes are read-only)."""
    return torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(image.shape)
