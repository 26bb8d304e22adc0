"""Logprobs under the model's own distribution: log_softmax of the raw logits, before penalties,
temperature or filters (what ranks best_of candidates and what clients see as `logprobs`)."""

from __future__ import annotations

import torch


def sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(logits)[logit_rows[i], token_ids[i]]: logits [S, V] float32 as the model gave
    them, token_ids [N] int64 in [0, V) (the sampler's, failed draws included), logit_rows [N]
    int64 (None: row i) -> [N] float32; NaN where the raw row was not finite."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, V]
    rows = torch.arange(len(token_ids), device=logits.device) if logit_rows is None else logit_rows
    return logprobs[rows, token_ids]


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits [R, V] -> (logprobs [R, k], token ids [R, k]) of each row's k most likely
    tokens, most likely first (k is capped at V)."""
    values, ids = torch.log_softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return values, ids
