"""The tokenizer stage process (one of a pool): chat template, encoding, context-length check.

Takes (TokenizerInbound): TokenizeRequest from any ingress (zmq round-robins the pool).
Sends: ScheduleRequest to the scheduler (which answers the ingress with RequestAccepted, or a
429 RequestRejected when its queue is full); RequestRejected to the owning ingress for a prompt
that cannot be encoded or cannot fit, so it is a 400 before any byte of a stream is written.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq

from conveyor.config import EngineConfig
from conveyor.stages import metrics
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import report_ready
from conveyor.stages.tokenizer.encoder import PromptEncoder
from conveyor.stages.tokenizer.length_limit import PromptTooLong
from conveyor.wire.addresses import address
from conveyor.wire.channel import Receiver, Sender
from conveyor.wire.messages import (
    RequestRejected,
    ScheduleRequest,
    TokenizeRequest,
    TokenizerInbound,
)

log = logging.getLogger(__name__)


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
    return ScheduleRequest(req.request_id, req.ingress, list(ids), params, req.arrival_time, priority=req.priority)


def _encode(encoder: PromptEncoder, config: EngineConfig, req: TokenizeRequest, limit: int) -> list[int]:
    """The prompt's ids; PromptTooLong when it surely has more than `limit`."""
    if req.messages is not None:
        try:
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            return encoder.encode_chat(messages, add_generation_prompt=req.add_generation_prompt, limit=limit)
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


def run(config: EngineConfig, index: int) -> None:
    # The pool scales by processes; a thread pool per process would only take cores from the worker.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_dir = config.server.run_dir
    encoder = PromptEncoder.for_engine(config)
    ctx = zmq.Context()
    try:
        inbox: Receiver[TokenizerInbound] = Receiver(ctx, address(run_dir, "tokenizer", index), TokenizerInbound)
        scheduler = Sender(ctx, address(run_dir, "scheduler", 0))
        ingresses = [Sender(ctx, address(run_dir, "ingress", i)) for i in range(config.stages.num_ingress)]
        report_ready(ctx, config, "tokenizer", index)
        inbox.on_wait = Pulse(ctx, config, "tokenizer", index).beat
        while True:
            req = inbox.recv()
            if req is None:
                continue
            reply_to = ingresses[req.ingress]
            try:
                request = prepare(encoder, config, req)
            except Rejected as e:
                reply_to.send(RequestRejected(req.request_id, 400, str(e), param=e.param, code=e.code))
                continue
            except Exception as e:  # a tokenizer bug must not take the stage down
                log.exception("failed to tokenize %s", req.request_id)
                reply_to.send(RequestRejected(req.request_id, 400, f"cannot tokenize the prompt: {e}"))
                continue
            request.sent_time = time.time()
            if req.sent_time:  # ingress to here, encoding included
                metrics.stage_latency.labels("tokenizer").observe(max(0.0, request.sent_time - req.sent_time))
            scheduler.send(request)
    finally:
        ctx.destroy(linger=0)
