"""The greedy draw of logits rows: each row's argmax and whether the row had one.

Shared by the sampler (greedy batches) and the LM head (ParallelLMHead.argmax, the ids of greedy
draws that want nothing else), so both give the same ids. Any float dtype: a bfloat16 row's argmax
is its float32 copy's (the cast is exact and keeps order), ties resolve to the lowest id, and a
row is valid when its max is finite (max propagates NaN; +inf, or -inf everywhere, is no
distribution). An invalid row's id is 0, never an id outside [0, V).
"""

from __future__ import annotations

import torch


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] -> (ids [S] int64, valid [S] bool). V = 0 (a tensor-parallel rank that holds
    no logits): ids 0 and valid False, placeholders that the sampling rank's draws replace."""
    if logits.shape[-1] == 0:
        rows = logits.shape[0]
        return torch.zeros(rows, dtype=torch.int64, device=logits.device), torch.zeros(rows, dtype=torch.bool, device=logits.device)
    best, ids = logits.max(dim=-1)  # [S]: one pass per row, in the logits' own dtype
    valid = best.isfinite()
    return ids.masked_fill(~valid, 0), valid
