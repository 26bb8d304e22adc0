"""Support filters, HF's order: top_k on the temperature-scaled logits, then top_p and min_p on
their unnormalised probabilities exp(x - max). No filter sorts the vocabulary.

- top_k: the k-th largest value by a partial selection (torch.topk of the batch's largest k; a
  sort's values only past TOP_K_SELECT_MAX), every token below it dropped;
- top_p: top_p.py's threshold, over the top_k survivors (renormalised: the others are 0);
- min_p: tokens below min_p times the row's largest probability dropped.
Ties at a cut are all kept (HF's top_k does the same; a sort kept whichever came first), and the
most likely token always stays. Rows whose params disable a filter pass through it unchanged, and
a batch where no row uses a filter skips it: that choice reads the host's SamplingParams. The
values come from `draw_params` when the caller keeps them on the device (ParamsTable), else from
the params. sorted_filters.py keeps the sort-based filters as the tests' reference.
"""

from __future__ import annotations

import torch

from conveyor.gpu.sampling.params_table import DrawParams
from conveyor.gpu.sampling.top_p import top_p_thresholds
from conveyor.gpu.sampling.transfer import to_device
from conveyor.wire.messages import SamplingParams

# Above this k, torch.topk costs about a sort (ESTIMATE: its selection then sorts the k it kept).
TOP_K_SELECT_MAX = 1024


def filter_top_k(logits: torch.Tensor, params: list[SamplingParams], draw_params: DrawParams | None = None) -> torch.Tensor:
    """logits [N, V] float32 -> the same tensor, tokens below each row's k-th largest set to -inf
    in place (top_k 0 or >= V: no limit)."""
    vocab = logits.shape[-1]
    k_max = max((p.top_k for p in params if 0 < p.top_k < vocab), default=0)
    if not k_max:
        return logits
    raw = draw_params.top_k if draw_params is not None else to_device([p.top_k for p in params], torch.int64, logits.device)
    limited = ((raw > 0) & (raw < vocab))[:, None]  # [N, 1]
    if k_max <= TOP_K_SELECT_MAX:
        largest = logits.topk(k_max, dim=-1).values  # [N, k_max], descending
    else:
        largest = logits.sort(dim=-1, descending=True).values
    kth = largest.gather(1, (raw.clamp(1, largest.shape[-1]) - 1)[:, None])  # [N, 1]
    return logits.masked_fill_(limited & (logits < kth), float("-inf"))  # NaN < kth is False: NaN rows stay NaN


def filter_top_p(probs: torch.Tensor, params: list[SamplingParams], draw_params: DrawParams | None = None) -> torch.Tensor:
    """probs [N, V] float32 = exp(x - max) after top_k (0 where it dropped) -> the same tensor,
    tokens outside each row's top_p set to 0 in place."""
    if not any(p.top_p < 1.0 for p in params):
        return probs
    top_p = draw_params.top_p if draw_params is not None else to_device([p.top_p for p in params], torch.float32, probs.device)
    return probs.masked_fill_(probs < top_p_thresholds(probs, top_p), 0.0)


def filter_min_p(probs: torch.Tensor, params: list[SamplingParams], draw_params: DrawParams | None = None) -> torch.Tensor:
    """probs [N, V] (need not sum to 1) -> [N, V] with tokens below min_p * max prob set to 0.

    A ratio to the row's maximum does not depend on normalisation, so this may follow top_k /
    top_p without renormalising; the most likely token always stays."""
    if not any(p.min_p > 0 for p in params):
        return probs
    values = draw_params.min_p if draw_params is not None else to_device([p.min_p for p in params], torch.float32, probs.device)
    min_p = values[:, None]  # [N, 1]
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)
