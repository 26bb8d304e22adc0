"""The ingress's view of the engine: readiness, and the in-flight requests keyed by request id.

Sends TokenizeRequest (to the tokenizer with the fewest requests awaiting a verdict from this
ingress: a long prompt in one tokenizer does not hold up the others' queues), AbortRequest (to the
scheduler, or with several engines to the router, which knows each request's engine) and Drained
(to the launcher). Takes every IngressInbound message through `dispatch`, which puts each
request's verdict (RequestAccepted, RequestRejected) and TextDeltas on its `RequestStream` (one
stream serves every engine request of a batch of prompts: the events carry their request id).

Invariants: new requests are taken while any engine is ready (`ready`), /health is 200 only while
every engine is (`all_ready`); every request in flight gets an answer, a 503 when its engine
stops or its tokenizer or the router dies before its verdict; a message for a request no longer
here is dropped, and if it says the request still runs (admitted, or a delta without a finish
reason) the scheduler is told to abort it, so no request runs without a client.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import secrets
import time
from collections.abc import Callable

import msgspec

from conveyor.stages.ingress.protocol import Generation
from conveyor.stages.ingress.telemetry import Telemetry
from conveyor.wire.channel import Sender
from conveyor.wire.messages import (
    AbortRequest,
    AdapterCommand,
    DeltaBatch,
    EngineStatus,
    RequestAccepted,
    RequestRejected,
    ScheduleRequest,
    StageFailed,
    TextDelta,
    TokenizeRequest,
    TokenizerInbound,
)

STRAY_MEMORY = 4096  # ids of requests aborted because of a stray message, remembered to abort once

Event = RequestAccepted | RequestRejected | TextDelta


class RequestStream:
    """What the engine has said about one HTTP request's engine requests, waiting for its handler.
    Its handler waits on a bare future, not an asyncio.Event: one put per token per stream wakes it."""

    def __init__(self) -> None:
        self._pending: list[Event] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, event: Event) -> None:
        self._pending.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Event]:
        """Every event that arrived since the last take (at least one), oldest first."""
        while not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._pending = self._pending, []
        return events


class EngineClient:
    def __init__(
        self,
        index: int,
        tokenizers: list[Sender[TokenizerInbound]],
        scheduler: Sender[ScheduleRequest | AbortRequest | AdapterCommand],
        on_drained: Callable[[], None] = lambda: None,
        num_engines: int = 1,
    ):
        self.index = index
        self._ready = [False] * num_engines  # by engine
        self.draining = False
        self._tokenizers = tokenizers
        self._scheduler = scheduler  # the scheduler, or the router with several engines
        self._on_drained = on_drained
        self._streams: dict[str, RequestStream] = {}
        # Requests sent to a tokenizer with no verdict yet (admitted, rejected, or a first delta):
        # request id -> tokenizer index; and the count per tokenizer.
        self._tokenizer_of: dict[str, int] = {}
        self._awaiting = [0] * len(tokenizers)
        self._engine_of: dict[str, int] = {}  # admitted requests: request id -> engine
        self._stray: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._counter = itertools.count()
        self._nonce = secrets.token_hex(3)  # tells this process's ids from a restarted one's
        self.telemetry = Telemetry()

    @property
    def ready(self) -> bool:
        """Whether new requests are taken: some engine is ready."""
        return any(self._ready)

    @ready.setter
    def ready(self, ready: bool) -> None:
        self._ready = [ready] * len(self._ready)

    @property
    def all_ready(self) -> bool:
        """Whether every engine is ready (/health)."""
        return all(self._ready)

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
        tools = None if gen.tools is None else msgspec.json.encode(gen.tools).decode()  # once for a whole batch
        for request_id, prompt in zip(request_ids, gen.prompts, strict=True):
            self._streams[request_id] = stream
            self.telemetry.submitted(request_id, arrival_time, gen.params.num_samples)
            t = min(range(len(self._tokenizers)), key=self._awaiting.__getitem__)
            self._tokenizer_of[request_id] = t
            self._awaiting[t] += 1
            self._tokenizers[t].send(
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
                    tools=tools,
                    images=gen.images or [],  # a chat's (one prompt); loaded by GenerateRoutes.run
                )
            )
        return stream

    async def command(self, msg: AdapterCommand) -> RequestAccepted | RequestRejected:
        """Send an adapter command to the scheduler and wait for its verdict."""
        stream = self._streams[msg.request_id] = RequestStream()
        try:
            self._scheduler.send(msg)
            (verdict,) = await stream.take()
            assert not isinstance(verdict, TextDelta)
            return verdict
        finally:
            self._forget(msg.request_id)

    def release(self, request_id: str) -> None:
        """The request is done (finished or rejected): forget it."""
        self._forget(request_id)

    def abort(self, request_ids: list[str]) -> None:
        """The client went away before these finished: stop them in the engine, forget them."""
        live = [request_id for request_id in request_ids if request_id in self._streams]
        for request_id in request_ids:
            self._forget(request_id)
        if live:
            self._remember_stray(live)
            self._scheduler.send(AbortRequest(request_ids=live))

    def dispatch(self, msg: object) -> None:
        """RequestAccepted (from the scheduler, after admission, naming its engine), RequestRejected
        (a tokenizer's 400, the scheduler's 429, the router's 503) and each TextDelta go to their
        request's stream; EngineStatus sets `draining` and the readiness of one engine or all;
        StageFailed for a tokenizer fails the requests it held, for the router every request still
        awaiting a verdict. A message for a request no longer here may abort it (`_put`): a stale
        TokenizeRequest delivered after a restart runs no orphan."""
        match msg:
            case DeltaBatch(deltas=deltas, sent_time=sent_time):
                self.telemetry.batch_received(sent_time)
                now = time.time()
                for delta in deltas:
                    self.telemetry.delta(delta, now)
                    self._put(delta.request_id, delta, running=delta.finish_reason is None)
                self.telemetry.flush()
            case RequestAccepted():
                if msg.request_id in self._streams:
                    self._engine_of[msg.request_id] = msg.engine
                self._put(msg.request_id, msg, running=True)
            case RequestRejected():
                self._put(msg.request_id, msg, running=False)
            case EngineStatus(ready=ready, draining=draining, engine=engine):
                self.draining = draining
                if engine is None:  # every engine
                    self.ready = ready
                    if not ready:  # the engine stopped: nothing in flight will finish
                        self.fail_all()
                else:
                    self._ready[engine] = ready
                    if not ready:  # that engine stopped: what it admitted will not finish
                        self._fail_engine(engine)
                self._check_drained()
            case StageFailed(stage="tokenizer", index=t):
                self._fail_tokenizer(t)
            case StageFailed(stage="router"):
                self._fail_unadmitted()

    def fail_all(self) -> None:
        """Answer every request in flight with a 503 (an error event, once a stream has begun)."""
        for request_id, stream in self._streams.items():
            stream.put(RequestRejected(request_id, 503, "the engine stopped", code="engine_not_ready"))

    def _fail_engine(self, engine: int) -> None:
        """One engine of several stopped: fail the requests it admitted. (Those on their way to it
        the router fails; those it rejected were answered.)"""
        for request_id in [r for r, e in self._engine_of.items() if e == engine]:
            message = "the engine serving this request stopped; retry it"
            self._streams[request_id].put(RequestRejected(request_id, 503, message, code="engine_not_ready"))
            del self._engine_of[request_id]

    def _fail_unadmitted(self) -> None:
        """The router died: the requests awaiting a verdict may have died with it. Fail them all,
        and abort them wherever they got to."""
        self._fail_held(list(self._tokenizer_of), "the router handling this request failed; retry it")

    def _fail_tokenizer(self, t: int) -> None:
        """Tokenizer t died: the requests it held will get no verdict. Fail them, and abort them in
        the scheduler in case their ScheduleRequest got out before the tokenizer died."""
        held = [request_id for request_id, tokenizer in self._tokenizer_of.items() if tokenizer == t]
        self._fail_held(held, "the tokenizer handling this request failed; retry it")

    def _fail_held(self, held: list[str], message: str) -> None:
        for request_id in held:
            self._streams[request_id].put(RequestRejected(request_id, 503, message, code="stage_failed"))
            self._verdict(request_id)
        if held:
            self._remember_stray(held)
            self._scheduler.send(AbortRequest(request_ids=held))

    def _put(self, request_id: str, event: Event, *, running: bool) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            if running and request_id not in self._stray:
                self._remember_stray([request_id])
                self._scheduler.send(AbortRequest(request_ids=[request_id]))
            return
        self._verdict(request_id)
        stream.put(event)

    def _verdict(self, request_id: str) -> None:
        t = self._tokenizer_of.pop(request_id, None)
        if t is not None:
            self._awaiting[t] -= 1

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._engine_of.pop(request_id, None)
        self._verdict(request_id)
        self.telemetry.forget(request_id)
        self._check_drained()

    def _remember_stray(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._stray[request_id] = None
        while len(self._stray) > STRAY_MEMORY:
            self._stray.popitem(last=False)

    def _check_drained(self) -> None:
        if self.draining and not self._streams:
            self._on_drained()
