"""Logprobs under the model's own distribution: log_softmax of the raw logits, before penalties,
temperature or filters (what ranks best_of candidates and what clients see as `logprobs`).
Logits may come in the model dtype: log_softmax runs in float32 on the rows asked for only."""

from __future__ import annotations

import torch


def sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(logits)[logit_rows[i], token_ids[i]]: logits [S, V] as the model gave them,
    token_ids [N] int64 in [0, V) (the sampler's, failed draws included), logit_rows [N] int64
    (None: row i, N = S) -> [N] float32; NaN where the raw row was not finite. Only the rows read
    go through log_softmax ([N, V] gathered when N < S or a row is read twice)."""
    picked = logits if logit_rows is None else logits[logit_rows]  # [N, V]
    logprobs = torch.log_softmax(picked, dim=-1, dtype=torch.float32)
    return logprobs.gather(1, token_ids[:, None]).squeeze(1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits [R, V] -> (logprobs [R, k] float32, token ids [R, k]) of each row's k most likely
    tokens, most likely first (k is capped at V)."""
    values, ids = torch.log_softmax(logits, dim=-1, dtype=torch.float32).topk(min(k, logits.shape[-1]), dim=-1)
    return values, ids
