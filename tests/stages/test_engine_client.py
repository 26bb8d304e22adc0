"""EngineClient (the ingress's view of the engine), without sockets: which tokenizer a request goes
to, what a dead tokenizer (or router) fails, what a stray message aborts, when a drain is done, and
with several engines what one engine's failure fails and what /health and new requests see."""

from __future__ import annotations

from typing import TypeVar

from conveyor.stages.ingress.engine_client import EngineClient
from conveyor.stages.ingress.protocol import Generation, Prompt
from conveyor.wire.channel import Sender
from conveyor.wire.messages import (
    AbortRequest,
    AdapterCommand,
    DeltaBatch,
    EngineStatus,
    FinishReason,
    RequestAccepted,
    RequestRejected,
    SamplingParams,
    ScheduleRequest,
    StageFailed,
    TextDelta,
    TokenizerInbound,
)

T = TypeVar("T")


class Outbox(Sender[T]):
    """A Sender that records what it is handed instead of sending it."""

    def __init__(self) -> None:  # no Sender.__init__: there is no socket
        self.sent: list[T] = []

    def send(self, msg: T) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        pass


def client(num_tokenizers: int = 2, num_engines: int = 1):
    tokenizers: list[Outbox[TokenizerInbound]] = [Outbox() for _ in range(num_tokenizers)]
    scheduler: Outbox[ScheduleRequest | AbortRequest | AdapterCommand] = Outbox()
    drained: list[bool] = []
    # [*tokenizers]: the client takes a list[Sender[...]] (lists are invariant); the same outboxes.
    engine = EngineClient(0, [*tokenizers], scheduler, on_drained=lambda: drained.append(True), num_engines=num_engines)
    engine.ready = True
    return engine, tokenizers, scheduler, drained


def submit(engine: EngineClient, request_id: str):
    return engine.submit([request_id], Generation(SamplingParams(), [Prompt(text="hi")]))


def aborted(scheduler: Outbox[ScheduleRequest | AbortRequest | AdapterCommand]) -> list[str]:
    return [rid for msg in scheduler.sent if isinstance(msg, AbortRequest) for rid in msg.request_ids]


def test_requests_go_to_the_tokenizer_with_the_fewest_awaiting_a_verdict():
    engine, tokenizers, _, _ = client(2)
    submit(engine, "a")
    submit(engine, "b")
    assert [len(t.sent) for t in tokenizers] == [1, 1]
    engine.dispatch(RequestAccepted("a", 3))  # tokenizer 0 is free again
    submit(engine, "c")
    submit(engine, "d")
    assert [[m.request_id for m in t.sent] for t in tokenizers] == [["a", "c", "d"], ["b"]]


def test_a_dead_tokenizer_fails_only_the_requests_it_held():
    engine, tokenizers, scheduler, _ = client(2)
    streams = {rid: submit(engine, rid) for rid in ("a", "b", "c")}  # a, c -> 0; b -> 1
    engine.dispatch(RequestAccepted("c", 3))  # past the tokenizer: not its to fail
    engine.dispatch(StageFailed(stage="tokenizer", index=0))
    [failed] = streams["a"]._pending
    assert isinstance(failed, RequestRejected) and (failed.status, failed.code) == (503, "stage_failed")
    assert streams["b"]._pending == []
    assert [type(e) for e in streams["c"]._pending] == [RequestAccepted]
    assert aborted(scheduler) == ["a"]  # its ScheduleRequest may have got out before the crash
    engine.dispatch(StageFailed(stage="detokenizer", index=0))  # the scheduler's business
    assert streams["b"]._pending == []


def test_a_message_for_a_request_no_longer_here_aborts_it_once():
    engine, _, scheduler, _ = client(1)
    engine.dispatch(RequestAccepted("ghost", 3))
    engine.dispatch(DeltaBatch([TextDelta("ghost", 0, "x", [1])]))
    engine.dispatch(DeltaBatch([TextDelta("done", 0, "x", [1], finish_reason=FinishReason.STOP)]))
    engine.dispatch(RequestRejected("refused", 429, "busy"))
    assert aborted(scheduler) == ["ghost"]


def test_a_drain_is_done_when_the_last_request_is():
    engine, _, _, drained = client(1)
    submit(engine, "a")
    engine.dispatch(EngineStatus(ready=True, draining=True))
    assert engine.draining and drained == []
    engine.release("a")
    assert drained == [True]


def test_an_engine_that_stops_fails_everything_in_flight():
    engine, _, _, _ = client(1)
    stream = submit(engine, "a")
    engine.dispatch(EngineStatus(ready=False))
    [failed] = stream._pending
    assert not engine.ready and (failed.status, failed.code) == (503, "engine_not_ready")


def test_one_engine_of_two_stopping_fails_only_what_it_admitted():
    engine, _, _, _ = client(1, num_engines=2)
    streams = {rid: submit(engine, rid) for rid in ("a", "b", "c")}
    engine.dispatch(RequestAccepted("a", 3, engine=0))
    engine.dispatch(RequestAccepted("b", 3, engine=1))  # c: no verdict yet (the router answers it)
    engine.dispatch(EngineStatus(ready=False, engine=1))
    assert [type(e) for e in streams["a"]._pending] == [RequestAccepted]
    assert [type(e) for e in streams["c"]._pending] == []
    accepted, failed = streams["b"]._pending
    assert isinstance(failed, RequestRejected) and (failed.status, failed.code) == (503, "engine_not_ready")
    # New requests are still taken (engine 0 serves), but /health is not 200 until both are ready.
    assert engine.ready and not engine.all_ready
    engine.dispatch(EngineStatus(ready=True, engine=1))
    assert engine.ready and engine.all_ready
    engine.dispatch(EngineStatus(ready=False, engine=0))
    engine.dispatch(EngineStatus(ready=False, engine=1))
    assert not engine.ready


def test_a_dead_router_fails_every_request_awaiting_a_verdict():
    engine, _, scheduler, _ = client(2, num_engines=2)
    streams = {rid: submit(engine, rid) for rid in ("a", "b")}
    engine.dispatch(RequestAccepted("a", 3, engine=1))
    engine.dispatch(StageFailed(stage="router", index=0))
    assert [type(e) for e in streams["a"]._pending] == [RequestAccepted]
    [failed] = streams["b"]._pending
    assert isinstance(failed, RequestRejected) and (failed.status, failed.code) == (503, "stage_failed")
    assert aborted(scheduler) == ["b"]
