"""The top-p cut without sorting: each row's smallest kept probability, found by a radix selection
of probability mass in three fixed rounds (no host synchronisation, no data-dependent loop).

A token is kept when the mass of the tokens strictly more likely than it is below top_p times the
row's total (HF's rule: the shortest prefix of the sorted row whose mass reaches top_p), so the kept
set is every token at or above one threshold. Ties at the cut are all kept: a sort keeps the first
of equals in whatever order it left them, which no caller can rely on.

How: the probabilities are non-negative float32 in [0, 1], so their bits order them as integers
below 2**30. Each of three rounds takes 10 of those bits: it sums the mass of each value of its
digit among the tokens that share the digits found so far ([N, 1024] bins) and finds the digit
where the mass from the top reaches the target; the third pins the threshold to one float. Each
round is a few passes over [N, V] and a scatter, the bins stay small. Masses are summed as
integers (probability * 2**44), so the sums are exact and the same on every device and run (a
float atomic add is neither); the rounding is below float32's own in a sorted cumsum.
"""

from __future__ import annotations

import torch

FRACTION_BITS = 44  # fixed-point masses: V * 2**44 < 2**63 for V < 2**19
ONE_BITS = 0x3F800000  # 1.0's bits: the row maximum (probabilities are exp(x - max)), below 2**30
DIGIT_BITS = 10
SHIFTS = (20, 10, 0)  # the rounds' digits, most significant first


def top_p_thresholds(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [N, V] float32, unnormalised with row max 1.0 (0 where an earlier filter dropped a
    token), top_p [N] float32 in (0, 1] -> [N, 1] float32: keep the row's tokens with
    probs >= threshold (0 where top_p is 1). A NaN row gets some threshold and stays NaN
    (NaN < threshold is False), so the sampler still finds it invalid."""
    num_rows, vocab = probs.shape
    assert vocab < 1 << (63 - FRACTION_BITS), "fixed-point masses would overflow"
    weights = probs.mul(2.0**FRACTION_BITS).to(torch.int64)  # [N, V] floor; 0 for the dropped
    keys = probs.view(torch.int32).clamp(0, ONE_BITS)  # [N, V]: integer order = float order
    total = weights.sum(dim=-1, keepdim=True)  # [N, 1]
    target = top_p.double()[:, None] * total.double()  # keep a token while the mass above it < target
    prefix, reached = torch.zeros_like(total), total  # [N, 1]: the digits found, the mass at or above them
    for shift in SHIFTS:
        # [N, V]: the masses of the tokens that share the digits found so far (all, in the first round)
        inside = weights if shift == SHIFTS[0] else torch.where((keys >> (shift + DIGIT_BITS)) == prefix, weights, 0)
        digits = ((keys >> shift) & ((1 << DIGIT_BITS) - 1)).long()
        digit, reached = _crossing(digits, inside, 1 << DIGIT_BITS, reached, target)
        prefix = (prefix << DIGIT_BITS) | digit
    threshold = prefix.to(torch.int32).view(torch.float32)  # [N, 1]
    return torch.where(top_p[:, None] >= 1.0, 0.0, threshold)


def _crossing(
    bins: torch.Tensor, weights: torch.Tensor, num_bins: int, ceiling: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """bins, weights [N, V] int64; ceiling [N, 1]: the mass at or above bin 0 -> (the highest bin
    whose mass from the top, itself included, reaches target [N, 1]; that mass), [N, 1] int64
    each. That bin holds mass: the one above it does not reach the target."""
    hist = torch.zeros(bins.shape[0], num_bins, dtype=torch.int64, device=bins.device).scatter_add_(1, bins, weights)
    at_or_above = ceiling - hist.cumsum(dim=-1) + hist  # [N, B], non-increasing in the bin
    found = ((at_or_above >= target).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)  # a prefix of bins reaches it
    return found, at_or_above.gather(1, found)
