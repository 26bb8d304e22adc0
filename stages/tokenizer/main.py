"""The tokenizer stage process (one of a pool): chat template, encoding, context-length check.

Takes (TokenizerInbound): TokenizeRequest from any ingress (zmq round-robins the pool).
Sends: ScheduleRequest to the scheduler (which answers the ingress with RequestAccepted, or a
429 RequestRejected when its queue is full), or with several engines to the router, which picks
the engine; RequestRejected to the owning ingress for a prompt
that cannot be encoded or cannot fit, or an output constraint that does not compile
(structured_check.py), so it is a 400 before any byte of a stream is written.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from conveyor.config import EngineConfig
from conveyor.stages import metrics
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import report_ready
from conveyor.stages.tokenizer.encoder import PromptEncoder
from conveyor.stages.tokenizer.preparation import Rejected, prepare
from conveyor.wire.messages import RequestRejected
from conveyor.wire.topology import INGRESS, TOKENIZER, admission, receiver, senders

log = logging.getLogger(__name__)


def run(config: EngineConfig, index: int) -> None:
    # The pool scales by processes; a thread pool per process would only take cores from the worker.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    encoder = PromptEncoder.for_engine(config)
    ctx = zmq.Context()
    try:
        inbox = receiver(ctx, config, TOKENIZER, index)
        scheduler = admission(ctx, config)  # the scheduler, or the router with several engines
        ingresses = senders(ctx, config, INGRESS)
        report_ready(ctx, config, TOKENIZER, index)
        inbox.on_wait = Pulse(ctx, config, TOKENIZER, index).beat
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
