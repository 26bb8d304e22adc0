"""CurveZMQ on tcp:// endpoints (wire/curve.py, wire/zap.py): the run's client delivers typed
messages; a client with another key, and a plain one, are refused, their messages never
delivered; a stage whose inbox is a tcp:// endpoint in `server.endpoints` gets a Curve socket."""

from __future__ import annotations

import dataclasses
import socket
from typing import cast

import msgspec
import pytest
import zmq

from conveyor.config import EngineConfig, ModelConfig, ServerConfig
from conveyor.wire import curve
from conveyor.wire.channel import Receiver, Sender
from conveyor.wire.curve import CurveKeys
from conveyor.wire.messages import AbortRequest, SchedulerInbound
from conveyor.wire.topology import SCHEDULER, TOKENIZER, address_of, receiver, sender

REFUSED_WAIT_MS = 500  # a refused handshake never delivers; half a second shows it does not


@pytest.fixture
def keys():
    made = CurveKeys.generate()
    curve.install(made)
    yield made
    curve.install(None)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def raw_push(ctx: zmq.Context, endpoint: str, keys: CurveKeys | None) -> zmq.Socket:
    """A PUSH socket that is not our Sender: Curve with `keys`, or plain when None."""
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    if keys is not None:
        curve.make_client(push, keys)
    push.connect(endpoint)
    return push


def test_the_runs_client_delivers_typed_messages(keys, ctx):
    endpoint = free_endpoint()
    inbox: Receiver[SchedulerInbound] = Receiver(ctx, endpoint, SchedulerInbound)
    out: Sender[SchedulerInbound] = Sender(ctx, endpoint)
    out.send(AbortRequest(request_ids=["a", "b"]))
    assert inbox.recv(timeout_ms=5000) == AbortRequest(request_ids=["a", "b"])
    assert inbox.socket.curve_server
    out.close()
    inbox.close()


def test_a_client_with_another_key_is_refused(keys, ctx):
    endpoint = free_endpoint()
    inbox: Receiver[SchedulerInbound] = Receiver(ctx, endpoint, SchedulerInbound)
    # Knows the server's public key (which is no secret) but holds a client key of its own.
    stranger = CurveKeys.generate()
    theirs = dataclasses.replace(keys, client_public=stranger.client_public, client_secret=stranger.client_secret)
    intruder = raw_push(ctx, endpoint, theirs)
    intruder.send(msgspec.msgpack.encode(AbortRequest(request_ids=["forged"])))
    assert inbox.recv(timeout_ms=REFUSED_WAIT_MS) is None
    # The run's own client still gets through on the same socket.
    Sender(ctx, endpoint).send(AbortRequest(request_ids=["ours"]))
    assert inbox.recv(timeout_ms=5000) == AbortRequest(request_ids=["ours"])
    inbox.close()


def test_a_plain_client_is_refused(keys, ctx):
    endpoint = free_endpoint()
    inbox: Receiver[SchedulerInbound] = Receiver(ctx, endpoint, SchedulerInbound)
    plain = raw_push(ctx, endpoint, None)
    plain.send(msgspec.msgpack.encode(AbortRequest(request_ids=["plain"])))
    assert inbox.recv(timeout_ms=REFUSED_WAIT_MS) is None
    inbox.close()


def test_a_client_that_trusts_another_server_key_is_refused(keys, ctx):
    endpoint = free_endpoint()
    inbox: Receiver[SchedulerInbound] = Receiver(ctx, endpoint, SchedulerInbound)
    other = CurveKeys.generate()
    lost = raw_push(ctx, endpoint, dataclasses.replace(keys, server_public=other.server_public))
    lost.send(msgspec.msgpack.encode(AbortRequest(request_ids=["lost"])))
    assert inbox.recv(timeout_ms=REFUSED_WAIT_MS) is None
    inbox.close()


def test_no_tcp_socket_without_the_runs_keys(ctx, monkeypatch):
    monkeypatch.delenv("CONVEYOR_CURVE_KEYS", raising=False)
    with pytest.raises(RuntimeError, match="CONVEYOR_CURVE_KEYS"):
        Receiver(ctx, free_endpoint(), SchedulerInbound)


def test_keys_travel_as_one_environment_value(monkeypatch):
    made = CurveKeys.generate()
    monkeypatch.setenv("CONVEYOR_CURVE_KEYS", made.encode())
    assert curve.run_keys() == made
    with pytest.raises(ValueError):
        CurveKeys.decode("not keys")


def test_an_endpoint_in_the_config_replaces_the_ipc_socket(keys, ctx, tmp_path):
    endpoint = free_endpoint()
    server = ServerConfig(run_dir=str(tmp_path), endpoints=(("scheduler-0", endpoint),))
    config = EngineConfig(model=cast(ModelConfig, None), server=server)  # the table reads no model
    assert address_of(config, SCHEDULER) == endpoint
    assert address_of(config, TOKENIZER).startswith("ipc://")  # not named: stays on this machine
    inbox = receiver(ctx, config, SCHEDULER)
    sender(ctx, config, SCHEDULER).send(AbortRequest(request_ids=["x"]))
    assert inbox.recv(timeout_ms=5000) == AbortRequest(request_ids=["x"])
    inbox.close()


def test_a_context_with_a_curve_server_still_terminates(keys):
    """Stages end with ctx.destroy() without closing their inbox first: the ZAP handler must not
    keep the context alive."""
    context = zmq.Context()
    Receiver(context, free_endpoint(), SchedulerInbound)
    context.destroy(linger=0)  # returns (a hang here times the test out)
