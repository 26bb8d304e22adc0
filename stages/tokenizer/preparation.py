"""Tokenizer preparation: one TokenizeRequest becomes a ScheduleRequest, or is Rejected.

Applies the chat template or encodes the prompt (encoder.py), preprocesses the request's images
and expands each one's marker token into its placeholder tokens (images/), checks the token ids
against the vocabulary and the prompt plus max_tokens against the context length (length_limit.py
stops the encoding early), fills in max_tokens when the request left it open, and compiles an
output constraint to refuse one that cannot be (structured_check.py). Used by the tokenizer
stage's loop (main.py) and by the Python API (conveyor/llm.py).
"""

from __future__ import annotations

import json

import msgspec

from conveyor.config import EngineConfig
from conveyor.stages.tokenizer.encoder import PromptEncoder, template_messages
from conveyor.stages.tokenizer.images import expand_placeholders, to_wire
from conveyor.stages.tokenizer.length_limit import PromptTooLong
from conveyor.stages.tokenizer.rejected import Rejected
from conveyor.wire.images import ImageInput
from conveyor.wire.messages import SamplingParams, ScheduleRequest, TokenizeRequest

__all__ = ["Rejected", "prepare"]


def prepare(encoder: PromptEncoder, config: EngineConfig, req: TokenizeRequest) -> ScheduleRequest:
    """Encode the request and check it fits; raises Rejected with an OpenAI-style reason."""
    max_len = config.model.max_model_len
    if req.images and encoder.images is None:  # before the template, which may not take image parts
        raise Rejected(f"{req.images[0].part}: this model does not accept images", param=req.images[0].part)
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
    ids, images = _with_images(encoder, config, req, ids)

    params = req.params
    _check_drawable(params, config)
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
    return ScheduleRequest(req.request_id, req.ingress, list(ids), params, req.arrival_time, priority=req.priority, images=images)


def _with_images(
    encoder: PromptEncoder, config: EngineConfig, req: TokenizeRequest, ids: list[int]
) -> tuple[list[int], list[ImageInput]]:
    """The ids with each image's marker expanded into its placeholder tokens, and the images
    preprocessed. For a vision model's text-only prompt too: an image token with no image (sent
    as prompt_token_ids) is refused here, not met by the worker. An image whose placeholders
    attend to each other (Gemma 3) is computed in one pass: one longer than the step's token
    budget is refused."""
    processor = encoder.images
    if processor is None:  # a text model (prepare refused its images)
        return ids, []
    processed = [processor.process(image) for image in req.images]
    param = "messages" if req.messages is not None else "prompt"
    bidirectional = processor.family.bidirectional
    budget = config.scheduler.max_num_batched_tokens
    for image, p in zip(req.images, processed, strict=True):
        if bidirectional and p.num_tokens > budget:
            raise Rejected(
                f"{image.part}: the image takes {p.num_tokens} tokens, which this model computes in one pass; "
                f"the server's --max-num-batched-tokens is {budget}",
                param=image.part,
            )
    ids, offsets = expand_placeholders(ids, processor.image_token_id, [p.num_tokens for p in processed], param=param)
    return ids, [to_wire(p, offset, bidirectional=bidirectional) for p, offset in zip(processed, offsets, strict=True)]


def _check_drawable(params: SamplingParams, config: EngineConfig) -> None:
    """The sampler masks the ids whose logit_bias is -inf (only the Python API can send one: the
    HTTP body bounds a bias), and until min_tokens outputs are out the stop ids, and EOS unless
    ignore_eos (gpu/sampling/penalties.py). If those cover the whole vocabulary no token could
    ever be drawn: the request's fault, refused here rather than failed by the worker."""
    vocab = config.model.vocab_size
    masked = {t for t, bias in (params.logit_bias or {}).items() if bias == float("-inf")}
    if params.min_tokens > 0:
        masked |= {*params.stop_token_ids, *(() if params.ignore_eos else config.model.eos_token_ids)}
    if sum(0 <= t < vocab for t in masked) < vocab:
        return
    if params.min_tokens == 0:
        raise Rejected(f"logit_bias masks all {vocab} ids of the vocabulary: no token could be sampled", param="logit_bias")
    eos = "" if params.ignore_eos else " nor the model's EOS ids"
    bias = " (with the ids logit_bias masks)" if params.logit_bias else ""
    raise Rejected(
        f"min_tokens={params.min_tokens} cannot be met: until that many tokens are out no id in "
        f"stop_token_ids{eos} may be sampled, and they cover all {vocab} ids of the vocabulary{bias}",
        param="min_tokens",
    )


def _encode(encoder: PromptEncoder, config: EngineConfig, req: TokenizeRequest, limit: int) -> list[int]:
    """The prompt's ids; PromptTooLong when it surely has more than `limit`."""
    if req.messages is not None:
        try:
            tools = None if req.tools is None else json.loads(req.tools)
            messages = template_messages(req.messages)
            return encoder.encode_chat(messages, req.add_generation_prompt, limit, tools, frame_images=bool(req.images))
        except ValueError as e:
            raise Rejected(f"cannot apply the chat template: {e}", param="messages") from None
    if req.prompt_token_ids is not None:
        vocab = config.model.vocab_size
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise Rejected(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return req.prompt_token_ids
    if req.prompt is not None:
        return encoder.encode_prompt(req.prompt, limit=limit, frame_images=bool(req.images))
    raise Rejected("the request has no prompt", param="prompt")
