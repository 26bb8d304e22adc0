"""TokenMask: one pass's grammar constraints, applied to its logits before sampling.

Only the pass's constrained sampling rows have a row in the bitmask ([C, ceil(V / 32)] int32,
filled on the host by their matchers, copied up without blocking); a pass without any has no
TokenMask at all, so unconstrained rows never pay for one. `apply_` masks an [S, V] logits tensor
in place: the constrained rows are gathered, every id their grammar forbids set to -inf by
xgrammar's kernel (Triton on CUDA, C++ on a CPU), and written back. A fork draws from its
parent's logits row, so it draws under its parent's mask.
"""

from __future__ import annotations

import dataclasses

import torch
import xgrammar as xgr

from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.structured.matcher import Matcher


@dataclasses.dataclass
class TokenMask:
    rows: torch.Tensor  # [C] int64 on the device: the logits rows to mask
    bitmask: torch.Tensor  # [C, ceil(V / 32)] int32 on the device, row i for rows[i]

    def apply_(self, logits: torch.Tensor) -> None:
        """logits [S, V] float32: the constrained rows' forbidden ids := -inf, in place."""
        picked = logits.index_select(0, self.rows)  # [C, V]
        xgr.apply_token_bitmask_inplace(picked, self.bitmask, vocab_size=logits.shape[-1])
        logits.index_copy_(0, self.rows, picked)


def combined(masks: list[TokenMask]) -> TokenMask | None:
    """Several masks of one pass's logits (one per feature that masks) as one: a row any of them
    masks may draw only the ids every one of them allows."""
    if len(masks) <= 1:
        return masks[0] if masks else None
    rows = torch.cat([m.rows for m in masks]).unique()  # [C] sorted
    bitmask = torch.full((rows.numel(), masks[0].bitmask.shape[1]), -1, dtype=torch.int32, device=rows.device)
    for m in masks:
        at = torch.searchsorted(rows, m.rows)  # each mask names a row once
        bitmask[at] = bitmask[at] & m.bitmask
    return TokenMask(rows, bitmask)


def token_mask(matchers: list[tuple[Matcher, list[int]] | None], vocab_size: int, device: torch.device) -> TokenMask | None:
    """matchers[r]: logits row r's matcher and the drafts before its position (a verifying row's
    draft positions: gpu/spec/verify.py; none for an ordinary row), None for a row without a
    constraint (or one whose sequence has stopped) -> the pass's TokenMask, None when no row has one."""
    rows = [r for r, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)  # [C, W] on the host
    for i, r in enumerate(rows):
        entry = matchers[r]
        assert entry is not None
        matcher, drafts = entry
        matcher.fill_after(bitmask, i, drafts) if drafts else matcher.fill(bitmask, i)
    return TokenMask(to_device(rows, torch.int64, device), to_device(bitmask, torch.int32, device))
