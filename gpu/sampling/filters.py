"""Support filters on temperature-scaled logits: top_k, top_p (HF's order: k first) and min_p.

Rows whose params disable a filter pass through it unchanged, and a batch where no row uses a
filter skips it entirely (no sort): that choice reads the host's SamplingParams. The values come
from `draw_params` when the caller keeps them on the device (ParamsTable), else from the params.
"""

from __future__ import annotations

import torch

from conveyor.gpu.sampling.params_table import DrawParams
from conveyor.gpu.sampling.transfer import to_device
from conveyor.wire.messages import SamplingParams


def filter_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams], draw_params: DrawParams | None = None) -> torch.Tensor:
    """logits [N, V] -> [N, V] with what top_k / top_p exclude set to -inf."""
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    use_k, use_p = any(k < vocab for k in top_ks), any(p < 1.0 for p in top_ps)
    if not (use_k or use_p):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab, device=device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        if draw_params is not None:  # 0 or >= V: no limit
            raw = draw_params.top_k
            k = torch.where((raw > 0) & (raw < vocab), raw, vocab)[:, None]
        else:
            k = to_device(top_ks, torch.int64, device)[:, None]
        drop |= rank >= k
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if use_p:
        p = (draw_params.top_p if draw_params is not None else to_device(top_ps, torch.float32, device))[:, None]
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the shortest prefix whose mass reaches top_p: drop a token when the mass before it
        # already does. The first token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= (mass_before >= p) & (rank > 0)
    dropped = torch.zeros_like(drop).scatter_(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(dropped, float("-inf"))


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
