"""Per-sequence edits of the logits before temperature and filters, in this order:

1. repetition_penalty (CTRL / HF): the logit of every token id seen in the prompt or the output
   is divided by the penalty when positive, multiplied by it otherwise;
2. presence_penalty and frequency_penalty (OpenAI), over the output tokens only:
   logit -= presence * (count > 0) + frequency * count;
3. logit_bias, added;
4. min_tokens: while the sequence has fewer outputs than min_tokens, its EOS ids (unless
   ignore_eos) and stop_token_ids get -inf. Ids covering the vocabulary are refused at admission
   (stages/tokenizer/preparation.py); a grammar that allows only what min_tokens bans still leaves
   nothing to draw, and the sampler fails that draw rather than pick a masked id.

Invariants: draws.py calls `apply_penalties` on a pass's logits; a row is edited once, whatever
its number of draws; the raw logits stay intact (for logprobs), and a step where no row needs an
edit gets them back untouched, so rows with default params cost nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.gpu.sampling.transfer import to_device
from conveyor.wire.messages import SamplingParams


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    token_ids: list[list[int]],
    num_prompt_tokens: list[int],
    eos_token_ids: tuple[int, ...] | list[int],
    num_outputs: list[int] | None = None,
) -> torch.Tensor:
    """logits [S, V] (float32, or the model dtype: edits are float32 either way); row i belongs to
    a sequence with params[i] whose tokens so far are token_ids[i] (its first num_prompt_tokens[i]
    are the prompt). num_outputs[i] (None: from the histories) counts its outputs when its history
    may lag: only repetition penalties read the ids themselves. Returns logits [S, V]: the same
    tensor when no row needs an edit, else an edited float32 copy."""
    vocab = logits.shape[-1]
    if num_outputs is None:
        num_outputs = [len(ids) - n for ids, n in zip(token_ids, num_prompt_tokens, strict=True)]
    # Only the rows that need an edit are gathered into [P, V], edited and written back into a copy.
    # Token histories cross to the device as one padded [P, L] tensor that scatter_add turns into
    # counts; bias and banned ids as one padded [P, B] pair of ids and values added by one scatter_add.
    picked = [i for i, (p, n) in enumerate(zip(params, num_outputs, strict=True)) if _needs_edit(p, n, eos_token_ids)]
    if not picked:
        return logits
    device = logits.device
    rows = to_device(picked, torch.int64, device)
    edited = logits[rows].float()  # [P, V], a copy, in float32 whatever the logits' dtype (exact edits)
    picked_params = [params[i] for i in picked]
    if any(penalises_repeats(p) for p in picked_params):
        histories = [token_ids[i] for i in picked]
        edited = _penalise_repeats(edited, picked_params, histories, [num_prompt_tokens[i] for i in picked])
    additions = [_additions(params[i], num_outputs[i], eos_token_ids, vocab) for i in picked]
    if any(additions):
        ids = _pad([list(a) for a in additions], np.int64, 0)  # [P, B]
        values = _pad([list(a.values()) for a in additions], np.float32, 0.0)
        # Padding adds 0.0 to token 0; bias ids are distinct, and -inf plus anything stays -inf.
        edited.scatter_add_(1, to_device(ids, torch.int64, device), to_device(values, torch.float32, device))
    return logits.to(torch.float32, copy=True).index_copy_(0, rows, edited)


def _needs_edit(p: SamplingParams, num_output: int, eos_token_ids) -> bool:
    return (
        penalises_repeats(p)
        or bool(p.logit_bias)
        or (num_output < p.min_tokens and bool(p.stop_token_ids or (eos_token_ids and not p.ignore_eos)))
    )


def penalises_repeats(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _penalise_repeats(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]], num_prompt: list[int]
) -> torch.Tensor:
    """Steps 1 and 2 on logits [P, V]. A row's history is the part of its tokens its penalties
    read: prompt and output with a repetition penalty, else the output alone, else nothing."""
    starts = [
        0 if p.repetition_penalty != 1.0 else n if penalises_repeats(p) else len(h) for p, h, n in zip(params, histories, num_prompt)
    ]
    lengths = [len(h) - s for h, s in zip(histories, starts)]
    if max(lengths) == 0:
        return logits  # nothing generated yet, and no prompt to penalise
    ids = _pad([h[s:] for h, s in zip(histories, starts)], np.int64, 0)  # [P, L]
    device, (num_rows, width) = logits.device, ids.shape
    # [P, 2]: tokens in the history, position of its first output token
    bounds = to_device([[n, max(p - s, 0)] for n, p, s in zip(lengths, num_prompt, starts)], torch.int64, device)
    weights = to_device(
        [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params], torch.float32, device
    )  # [P, 3]
    ids_t = to_device(ids, torch.int64, device)
    position = torch.arange(width, device=device)[None, :]  # [1, L]
    in_history = position < bounds[:, :1]  # [P, L]; False on padding
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = logits.new_zeros(num_rows, logits.shape[-1]).scatter_add_(1, ids_t, in_history.float()) > 0
        penalty = weights[:, 0:1]  # 1.0 leaves a row exactly as it was
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        is_output = in_history & (position >= bounds[:, 1:])  # [P, L]
        counts = logits.new_zeros(num_rows, logits.shape[-1]).scatter_add_(1, ids_t, is_output.float())  # [P, V]
        logits = logits - (weights[:, 1:2] * (counts > 0) + weights[:, 2:3] * counts)
    return logits


def _additions(p: SamplingParams, num_output: int, eos_token_ids, vocab: int) -> dict[int, float]:
    """Steps 3 and 4 as {token id: value added}: the bias, then -inf on ids min_tokens bans."""
    added = dict(p.logit_bias or {})
    if num_output < p.min_tokens:
        banned = (*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids))
        added.update((t, float("-inf")) for t in banned if 0 <= t < vocab)
    return added


def _pad(rows: list, dtype, fill) -> np.ndarray:
    """Ragged lists -> [len(rows), longest] array padded with fill."""
    out = np.full((len(rows), max(len(r) for r in rows)), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
