"""top_k and top_p by one descending sort of the whole row: the filters as they were before issue
48, kept as the reference that tests/gpu/test_sampling_filters.py holds filters.py to, and as the
old path that ops/bench/sampling_paths.py times against it. Not on the sampler's path.

Ties at a cut keep whichever equals the sort left first (filters.py keeps them all).
"""

from __future__ import annotations

import torch


def sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32, top_k [N] int64 (0 or >= V: no limit), top_p [N] float32 -> [N, V]
    with what top_k, then top_p over the renormalised survivors, exclude set to -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None]
    drop = rank >= k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the shortest prefix whose mass reaches top_p: drop a token when the mass before it
    # already does. The first token always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= (mass_before >= top_p[:, None]) & (rank > 0)
    dropped = torch.zeros_like(drop).scatter_(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(dropped, float("-inf"))
