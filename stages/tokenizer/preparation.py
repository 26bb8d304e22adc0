"""Tokenizer preparation: one TokenizeRequest becomes a ScheduleRequest, or is Rejected.

Applies the chat template or encodes the prompt (encoder.py), checks the token ids against the
vocabulary and the prompt plus max_tokens against the context length (length_limit.py stops the
encoding early), fills in max_tokens when the request left it open, and compiles an output
constraint to refuse one that cannot be (structured_check.py). Used by the tokenizer
stage's loop (main.py) and by the Python API (conveyor/llm.py).
"""

from __future__ import annotations

import json

import msgspec

from conveyor.config import EngineConfig
from conveyor.stages.tokenizer.encoder import PromptEncoder, template_messages
from conveyor.stages.tokenizer.length_limit import PromptTooLong
from conveyor.wire.messages import ScheduleRequest, TokenizeRequest


class Rejected(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def prepare(encoder: PromptEncoder, config: EngineConfig, req: TokenizeRequest) -> ScheduleRequest:
    """Encode the request and check it fits; raises Rejected with an OpenAI-style reason."""
    max_len = config.model.max_model_len
    try:
        ids = _encode(encoder, config, req, limit=max_len - 1)  # one token left to generate
    except PromptTooLong as e:  # refused before all of it was encoded
        raise Rejected(
            f"this model's maximum context length is {max_len} tokens; the prompt has at least {e.num_tokens} tokens",
            param="prompt",
            code="context_length_exceeded",
        ) from None
    if not ids:
        raise Rejected("the prompt is empty", param="prompt")

    params = req.params
    budget = max_len - len(ids)
    if params.max_tokens is not None and params.max_tokens > budget:
        raise Rejected(
            f"this model's maximum context length is {max_len} tokens; the prompt has {len(ids)} "
            f"tokens and max_tokens asks for {params.max_tokens} more",
            param="max_tokens" if budget > 0 else "prompt",
            code="context_length_exceeded",
        )
    if budget < 1:
        raise Rejected(
            f"this model's maximum context length is {max_len} tokens; the prompt has {len(ids)}",
            param="prompt",
            code="context_length_exceeded",
        )
    if params.max_tokens is None:
        params = msgspec.structs.replace(params, max_tokens=budget)
    if params.structured is not None:  # a constraint that cannot compile is refused here, not in the worker
        from conveyor.stages.tokenizer.structured_check import check_structured  # it imports Rejected from here

        check_structured(params, config.model)
    return ScheduleRequest(req.request_id, req.ingress, list(ids), params, req.arrival_time, priority=req.priority)


def _encode(encoder: PromptEncoder, config: EngineConfig, req: TokenizeRequest, limit: int) -> list[int]:
    """The prompt's ids; PromptTooLong when it surely has more than `limit`."""
    if req.messages is not None:
        try:
            tools = None if req.tools is None else json.loads(req.tools)
            messages = template_messages(req.messages)
            return encoder.encode_chat(messages, req.add_generation_prompt, limit, tools)
        except ValueError as e:
            raise Rejected(f"cannot apply the chat template: {e}", param="messages") from None
    if req.prompt_token_ids is not None:
        vocab = config.model.vocab_size
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise Rejected(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return req.prompt_token_ids
    if req.prompt is not None:
        return encoder.encode_prompt(req.prompt, limit=limit)
    raise Rejected("the request has no prompt", param="prompt")
