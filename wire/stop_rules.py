"""The rules the scheduler and the worker both apply to a sequence: when it stops, and how many
tokens it may still take. Each is written here once; both processes call these functions.

The two processes track a sequence apart, and the worker may hold ids the scheduler has not seen
yet (asynchronous scheduling, multi-step windows, accepted drafts), so the functions take what
the caller knows as counts, never either side's sequence class:

- `num_tokens`: tokens counted so far, prompt included (which ones is the caller's choice: a
  token's own position when asking whether it stops, pending draws too when planning ahead);
- `num_prompt_tokens`: the prompt's length; outputs are `num_tokens - num_prompt_tokens`.

A sequence stops on a token, in this order: EOS (unless `ignore_eos`) or a stop token id, each
only once `min_tokens` outputs exist, the token itself counted (FinishReason.STOP); else on
reaching `max_tokens` outputs or `max_model_len` tokens (FinishReason.LENGTH). Stop strings are
the detokenizer's. Pure Python: no torch, no zmq.
"""

from __future__ import annotations

from collections.abc import Container

from conveyor.wire.messages import FinishReason
from conveyor.wire.sampling_params import SamplingParams


def tokens_left(params: SamplingParams, num_tokens: int, num_prompt_tokens: int, max_model_len: int) -> int:
    """Tokens a sequence of `num_tokens` tokens may still take before it reaches max_tokens
    outputs or the model's length (0 or less: it has reached one)."""
    left = max_model_len - num_tokens
    if params.max_tokens is not None:
        left = min(left, params.max_tokens - (num_tokens - num_prompt_tokens))
    return left


def stops_on(params: SamplingParams, token: int, num_output_tokens: int, eos_token_ids: Container[int]) -> bool:
    """Whether `token`, the sequence's output number `num_output_tokens` (itself counted), is EOS
    or a stop token id that ends it: from min_tokens outputs on."""
    if num_output_tokens < params.min_tokens:
        return False
    return (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids


def stop_reason(
    params: SamplingParams,
    token: int,
    num_tokens: int,
    num_prompt_tokens: int,
    eos_token_ids: Container[int],
    max_model_len: int,
) -> FinishReason | None:
    """Why a sequence ends on `token`, its newest id and its `num_tokens`-th token; None: it goes
    on. A stop id outranks the length: a last token that is EOS ends with STOP."""
    if stops_on(params, token, num_tokens - num_prompt_tokens, eos_token_ids):
        return FinishReason.STOP
    if tokens_left(params, num_tokens, num_prompt_tokens, max_model_len) <= 0:
        return FinishReason.LENGTH
    return None
