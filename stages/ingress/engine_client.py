"""The ingress's view of the engine: readiness, and the in-flight requests keyed by request id.

Sends TokenizeRequest (to the tokenizer pool) and AbortRequest (to the scheduler). Takes every
IngressInbound message through `dispatch`: RequestAccepted (from the scheduler, after admission),
RequestRejected (a 400 from a tokenizer, a 429 from the scheduler) and each TextDelta go to their
request's `RequestStream` (one stream serves every engine request of a batch of prompts: the
events carry their request id); EngineStatus flips `ready` (and when the engine stops, every
request in flight gets a 503 rejection). Messages for a request that is no longer here (it
finished, or its client went away) are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time

from conveyor.stages.ingress.protocol import Generation
from conveyor.stages.ingress.telemetry import Telemetry
from conveyor.wire.channel import Sender
from conveyor.wire.messages import (
    AbortRequest,
    DeltaBatch,
    EngineStatus,
    RequestAccepted,
    RequestRejected,
    TextDelta,
    TokenizeRequest,
)

Event = RequestAccepted | RequestRejected | TextDelta


class RequestStream:
    """What the engine has said about one HTTP request's engine requests, waiting for its handler."""

    def __init__(self) -> None:
        self._pending: list[Event] = []
        self._wakeup = asyncio.Event()

    def put(self, event: Event) -> None:
        self._pending.append(event)
        self._wakeup.set()

    async def take(self) -> list[Event]:
        """Every event that arrived since the last take (at least one), oldest first."""
        while not self._pending:
            await self._wakeup.wait()
            self._wakeup.clear()
        events, self._pending = self._pending, []
        return events


class EngineClient:
    def __init__(self, index: int, tokenizers: Sender, scheduler: Sender):
        self.index = index
        self.ready = False
        self._tokenizers = tokenizers
        self._scheduler = scheduler
        self._streams: dict[str, RequestStream] = {}
        self._counter = itertools.count()
        self._nonce = secrets.token_hex(3)  # tells this process's ids from a restarted one's
        self.telemetry = Telemetry()

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{self.index}-{next(self._counter)}-{self._nonce}"

    def submit(self, request_ids: list[str], gen: Generation, arrival_time: float | None = None) -> RequestStream:
        """One TokenizeRequest per prompt of `gen`, under the matching id; one stream for all.
        `arrival_time`: when the HTTP request reached its handler (default: now)."""
        stream = RequestStream()
        arrival_time = arrival_time or time.time()
        for request_id, prompt in zip(request_ids, gen.prompts, strict=True):
            self._streams[request_id] = stream
            self.telemetry.submitted(request_id, arrival_time, gen.params.num_samples)
            self._tokenizers.send(
                TokenizeRequest(
                    request_id=request_id,
                    ingress=self.index,
                    params=gen.params,
                    arrival_time=arrival_time,
                    prompt=prompt.text,
                    prompt_token_ids=prompt.token_ids,
                    messages=prompt.messages,
                    add_generation_prompt=gen.add_generation_prompt,
                    priority=gen.priority,
                    sent_time=time.time(),
                )
            )
        return stream

    def release(self, request_id: str) -> None:
        """The request is done (finished or rejected): forget it."""
        self._streams.pop(request_id, None)
        self.telemetry.forget(request_id)

    def abort(self, request_ids: list[str]) -> None:
        """The client went away before these finished: stop them in the engine, forget them."""
        live = [request_id for request_id in request_ids if self._streams.pop(request_id, None) is not None]
        for request_id in request_ids:
            self.telemetry.forget(request_id)
        if live:
            self._scheduler.send(AbortRequest(request_ids=live))

    def dispatch(self, msg: object) -> None:
        match msg:
            case DeltaBatch(deltas=deltas, sent_time=sent_time):
                self.telemetry.batch_received(sent_time)
                now = time.time()
                for delta in deltas:
                    self.telemetry.delta(delta, now)
                    self._put(delta.request_id, delta)
            case RequestAccepted() | RequestRejected():
                self._put(msg.request_id, msg)
            case EngineStatus(ready=ready):
                self.ready = ready
                if not ready:  # the engine is stopping: nothing in flight will finish
                    self.fail_all()

    def fail_all(self) -> None:
        """Answer every request in flight with a 503 (an error event, once a stream has begun)."""
        for request_id, stream in self._streams.items():
            stream.put(RequestRejected(request_id, 503, "the engine stopped", code="engine_not_ready"))

    def _put(self, request_id: str, event: Event) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(event)
