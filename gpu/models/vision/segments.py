"""Segments: attention within sets of token rows of a packed vision stream (issue 51).

A vision tower packs several images' patches into one [N, ...] stream, but a token attends only
within its set: one frame of one image (transformers' cu_seqlens), or one of Qwen2.5-VL's windows
inside it. Each set is a list of row indices; the sets are padded to the longest into one batch
[S, L] for one SDPA call, the padding masked out as keys (its query rows are computed and dropped),
and each output row scattered back to its input row. Sets partition the rows, so nothing is
written twice and the stream keeps its order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence


@dataclass(frozen=True)
class Segments:
    index: torch.Tensor  # [S, L] int64: the rows of each set, padding 0
    valid: torch.Tensor  # [S, L] bool: False on the padding
    mask: torch.Tensor | None  # [S, 1, 1, L]: SDPA's key mask; None when every set is full

    @classmethod
    def of(cls, sets: list[torch.Tensor]) -> Segments:
        padded = pad_sequence(sets, batch_first=True, padding_value=-1)
        valid = padded >= 0
        full = all(len(s) == padded.shape[1] for s in sets)  # known on the host: no device sync
        return cls(padded.clamp(min=0), valid, None if full else valid[:, None, None, :])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [N, heads, head_dim] -> [N, heads, head_dim], each row attending over its set."""
        qs, ks, vs = (x[self.index].transpose(1, 2) for x in (q, k, v))  # [S, heads, L, head_dim]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self.mask).transpose(1, 2)  # [S, L, heads, hd]
        result = torch.empty_like(q)
        result[self.index[self.valid]] = out[self.valid]
        return result


def frame_segments(grids: list[tuple[int, int, int]], device: torch.device) -> Segments:
    """One set per frame of each image: h * w consecutive rows."""
    lengths = [h * w for t, h, w in grids for _ in range(t)]
    return Segments.of(list(torch.arange(sum(lengths), device=device).split(lengths)))


def window_segments(grids: list[tuple[int, int, int]], merge: int, side: int, device: torch.device) -> Segments:
    """Qwen2.5-VL's windows: per frame, side x side merge units tiled from the top left (the last
    ones cut short), each unit its merge^2 consecutive rows. Units are numbered row by row per frame,
    as the pixels lay them out (stages/tokenizer/images/qwen2_vl.py)."""
    sets: list[torch.Tensor] = []
    start = 0  # the first unit of this image
    for t, h, w in grids:
        uh, uw = h // merge, w // merge
        units = torch.arange(t * uh * uw, device=device).view(t, uh, uw) + start
        nh, nw = -(-uh // side), -(-uw // side)
        units = F.pad(units, (0, nw * side - uw, 0, nh * side - uh), value=-1)
        # [t, nh*side, nw*side] -> [t, nh, nw, side, side]: one row of units per window
        tiles = units.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        for tile in tiles:
            kept = tile[tile >= 0]
            rows = kept[:, None] * merge * merge + torch.arange(merge * merge, device=device)
            sets.append(rows.flatten())
        start += t * uh * uw
    return Segments.of(sets)
