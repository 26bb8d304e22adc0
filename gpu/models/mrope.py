"""M-RoPE: the three-dimensional rotary positions of Qwen2-VL's and Qwen2.5-VL's language model (issue 51).

Each token has three positions (temporal, height, width), and the rotary frequencies are cut into
sections (config.json's `mrope_section`, summing to head_dim / 2), section i turning by position
row i % 3. A text token's three positions are equal, so for it M-RoPE is the ordinary rotary at
that position; only an image's placeholders differ. With the image's grid in tokens (t, h, w) (its
patches over the spatial merge) and `base` the position its first placeholder would have as text,
placeholder j sits at (base + j // (h w), base + (j // w) % h, base + j % w), and the text after it
goes on from base + max(h, w), as transformers' `get_rope_index` counts (its 5.x spacing: images
keep a temporal step of 1 whatever Qwen2.5-VL's second_per_grid_t; t is 1 for an image). So each
image moves every later token by max(h, w) - t h w (never positive), and after a sequence's last
image every token's three positions are p + delta.

`RopeLayout`: one sequence's images as M-RoPE sees them, from its NewSeq.images; immutable, so a
fork shares its parent's. `MRope`: the model's sections and merge size, the `layout` of a
sequence's images, and `table`: a pass's rotary table, row t token t's cos/sin, section i of the
frequencies gathered from position row i % 3 of the model's table [P, D] (cos in the first half,
sin in the second, as gpu/models/rope.py lays it out), so the backend's `ops.rotary` serves it
with positions arange(T).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from conveyor.gpu.models.rope import RotaryEmbedding
from conveyor.wire.images import ImageInput


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """One image's placeholders [offset, offset + length), its grid in tokens, and `base`: the
    position its first placeholder takes (offset plus the shift of the images before it)."""

    offset: int
    length: int
    grid: tuple[int, int, int]  # (t, h, w) after the spatial merge
    base: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def shift_after(self) -> int:
        """The shift of every token after this image: base + max(h, w) stands at position end."""
        _, h, w = self.grid
        return self.base + max(h, w) - self.end


@dataclasses.dataclass(frozen=True)
class RopeLayout:
    spans: tuple[ImageSpan, ...]  # in prompt order, at least one

    @property
    def end(self) -> int:
        """The index past the last image's placeholders: tokens from here on sit at p + delta."""
        return self.spans[-1].end

    @property
    def delta(self) -> int:
        return self.spans[-1].shift_after

    def positions(self, start: int, num: int) -> np.ndarray:
        """[3, num] int64: the positions of tokens [start, start + num)."""
        p = np.arange(start, start + num, dtype=np.int64)
        if start >= self.end:  # a decode row, most rows of a busy step
            return np.broadcast_to(p + self.delta, (3, num))
        shift = np.zeros(num, dtype=np.int64)
        for span in self.spans:  # in order: a later image's shift covers the earlier ones'
            shift[p >= span.end] = span.shift_after
        out = np.repeat((p + shift)[None], 3, axis=0)
        for span in self.spans:
            lo, hi = max(start, span.offset), min(start + num, span.end)
            if lo < hi:
                _, h, w = span.grid
                j = np.arange(lo - span.offset, hi - span.offset, dtype=np.int64)
                out[:, lo - start : hi - start] = span.base + np.stack((j // (h * w), (j // w) % h, j % w))
        return out


class PassRotary(RotaryEmbedding):
    """One pass's table, where a RotaryEmbedding's rows are positions: row t is token t's (the
    layers rotate it with positions arange(T)). Built from a table, not from the config."""

    def __init__(self, cos_sin: torch.Tensor) -> None:  # no super().__init__: nothing to compute
        self.cos_sin, self.head_dim = cos_sin, cos_sin.shape[-1]


@dataclasses.dataclass(frozen=True)
class MRope:
    sections: tuple[int, ...]  # frequencies per section, summing to head_dim / 2
    merge_size: int  # the vision tower's spatial merge: a grid of (t, h, w) patches is (t, h/m, w/m) tokens

    def layout(self, images: Sequence[ImageInput]) -> RopeLayout | None:
        """The layout of a prompt's images (wire/images.py ImageInput: offset, length, grid in
        patches); None without images."""
        spans: list[ImageSpan] = []
        shift = 0
        for image in sorted(images, key=lambda i: i.offset):
            if len(image.grid) != 3:
                raise ValueError(f"image {image.hash:#x}: M-RoPE needs its (t, h, w) grid, got {image.grid}")
            t, h, w = image.grid[0], image.grid[1] // self.merge_size, image.grid[2] // self.merge_size
            if t * h * w != image.length:
                raise ValueError(f"image {image.hash:#x}: grid {image.grid} makes {t * h * w} tokens, not {image.length}")
            span = ImageSpan(image.offset, image.length, (t, h, w), image.offset + shift)
            spans.append(span)
            shift = span.shift_after
        return RopeLayout(tuple(spans)) if spans else None

    def column_rows(self) -> torch.Tensor:
        """[D] int64 on the CPU: the position row each column of a [P, D] cos/sin table turns by."""
        half = [i % 3 for i, size in enumerate(self.sections) for _ in range(size)]
        return torch.tensor(half + half, dtype=torch.int64, device="cpu")

    @staticmethod
    def table(cos_sin: torch.Tensor, rope_positions: torch.Tensor, columns: torch.Tensor) -> PassRotary:
        """The pass's table [T, D]: cos_sin [P, D], rope_positions [3, T] int64, columns [D] (column_rows)."""
        index = rope_positions[columns].T  # [T, D]: the position each entry of token t's row is read at
        return PassRotary(cos_sin.gather(0, index))
