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
pass computes past its last image (a preempted one is sent again in full, images included). A pass
left to a decode graph that computes a placeholder (a one-token prompt chunk) runs eagerly.

Bidirectional images (ImageInput.bidirectional, Gemma 3): a pass through one gets its rows'
extents (AttentionMetadata.extents [T]: position + 1, an image row its image's end), which the
attention backends honour (gpu/backends/extents.py); the scheduler guarantees the pass holds the
image's last row (a pass ending inside one is an error here, never a silent causal row).

M-RoPE (Qwen2-VL, the model's `mrope`): a sequence with images keeps its `RopeLayout` on its
WorkerSeq (gpu/models/mrope.py; a fork shares its parent's). An eager pass with any such row gets
`rope_positions` [3, T] for all its rows, built on the host from each row's tokens
[num_computed, num_computed + num_new) and copied once; a graphed pass (no placeholder in it: its
three positions are equal) moves each row's position by its sequence's shift through a per-row
buffer that `decode_model`'s wrapper adds inside the graph (padding rows 0). Text-only passes
change nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from conveyor.gpu.backends.base import AttentionMetadata
from conveyor.gpu.models.multimodal import VisionModel
from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.step.cuda_graphs import DecodeModel
from conveyor.gpu.step.features.base import StepFeature
from conveyor.gpu.step.passes import PassWork, WorkerSeq
from conveyor.gpu.step.step_inputs import PassInputs
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
    """`run_eagerly(inputs)` gives a pass left to a decode graph its attention metadata
    (step_inputs.py `with_metadata`); `max_rows`: the most rows a graphed pass has."""

    def __init__(self, model: VisionModel, device: torch.device, run_eagerly: Callable[[PassInputs], None], max_rows: int) -> None:
        self.model, self.device, self.run_eagerly = model, device, run_eagerly
        self.images: dict[int, list[ImageInput]] = {}  # seq_id -> its prompt's images
        self.cache = EncoderCache()
        self.mrope = model.mrope
        # [max_rows] int64: each graphed row's M-RoPE shift, 0 on padding rows; `_shift_set`: it
        # holds a nonzero shift, so the next graphed pass writes it even with no image row (to 0s).
        self.graph_shift = torch.zeros(max_rows, dtype=torch.int64, device=device) if self.mrope is not None else None
        self._shift_set = False

    def register(self, seq: WorkerSeq, new: NewSeq | None) -> None:
        if new is not None and new.images:  # a fork copies a finished prompt: no image left to compute
            self.images[seq.seq_id] = new.images
            if self.mrope is not None:
                seq.rope_layout = self.mrope.layout(new.images)

    def drop(self, seq_id: int) -> None:
        self.images.pop(seq_id, None)

    def decode_model(self, model: DecodeModel) -> DecodeModel:
        """With M-RoPE: each row's position moved by its shift inside the graph (positions reach
        only the rotary: gpu/models/base.py; the slot mapping reads the graph's own buffer)."""
        shift = self.graph_shift
        if shift is None:
            return model

        def shifted(
            ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
        ) -> torch.Tensor:
            return model(ids, positions + shift[: positions.shape[0]], meta, kv_caches)

        return shifted

    def begin_pass(self, work: PassWork) -> None:
        extents = self._embed_images(work)
        if work.inputs.input_embeds is not None and work.inputs.meta is None:
            self.run_eagerly(work.inputs)  # a graph reads token ids, not embeddings
        if extents is not None:
            assert work.inputs.meta is not None
            work.inputs.meta.extents = to_device(extents, torch.int32, self.device)
        if self.mrope is not None:
            self._rope_positions(work)

    def _rope_positions(self, work: PassWork) -> None:
        """rope_positions for an eager pass with an image sequence's row, or the graph's shifts."""
        rows = list(zip(work.rows, work.num_new))
        if work.inputs.meta is None:  # graphed: one token a row, none a placeholder
            shifts = np.zeros(len(rows), dtype=np.int64)
            for i, (seq, _) in enumerate(rows):
                if seq.rope_layout is not None:
                    shifts[i] = seq.rope_layout.positions(seq.num_computed, 1)[0, 0] - seq.num_computed
            if shifts.any() or self._shift_set:
                assert self.graph_shift is not None
                padded = np.zeros(self.graph_shift.shape[0], dtype=np.int64)
                padded[: len(rows)] = shifts
                self.graph_shift.copy_(to_device(padded, torch.int64, self.device), non_blocking=True)
                self._shift_set = bool(shifts.any())
            return
        if all(seq.rope_layout is None for seq, _ in rows):
            return
        positions = np.empty((3, sum(work.num_new)), dtype=np.int64)
        at = 0
        for seq, n in rows:
            start = seq.num_computed
            layout = seq.rope_layout
            positions[:, at : at + n] = np.arange(start, start + n) if layout is None else layout.positions(start, n)
            at += n
        work.inputs.rope_positions = to_device(positions, torch.int64, self.device)

    def _embed_images(self, work: PassWork) -> np.ndarray | None:
        """Sets the pass's input_embeds where it computes a placeholder; returns its rows'
        extents [T] (AttentionMetadata.extents) where one of those images is bidirectional."""
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
            return None
        embeds = self._embeddings([image for _, image, _, _ in pieces])
        x = self.model.embed(work.inputs.input_ids)  # [T, H]
        for row, image, lo, hi in pieces:
            x[row : row + hi - lo] = embeds[image.hash][lo:hi].to(x.dtype)
        work.inputs.input_embeds = x
        if not any(image.bidirectional for _, image, _, _ in pieces):
            return None
        # Each row sees its sequence's tokens up to itself, an image row up to its image's end
        # (the scheduler never ends a chunk inside such an image, so those keys are in this pass).
        extents = np.concatenate(
            [np.arange(seq.num_computed + 1, seq.num_computed + n + 1) for seq, n in zip(work.rows, work.num_new)]
        )
        for row, image, lo, hi in pieces:
            if image.bidirectional:
                if hi != image.length:
                    raise ValueError(f"image {image.hash:#x}: a pass ends inside an image whose placeholders attend to each other")
                extents[row : row + hi - lo] = image.offset + image.length
        return extents

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
