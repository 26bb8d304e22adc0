"""One typed sender and receiver over pyzmq, used by every stage (plus the receiver's asyncio twin).

A receiver binds one PULL socket and decodes with one typed decoder; a message that fails to
decode is logged and dropped, never fatal. A sender connects a PUSH socket to one address (a
fixed destination) or several (zmq round-robins between them: a stage pool). Which stage listens
where, and what it takes, is declared once in topology.py.

An address is an ipc:// path in the private run directory or, for a stage another node talks to,
a tcp:// endpoint; a tcp:// socket is always CurveZMQ (curve.py), so nothing listens on a network
interface unauthenticated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from conveyor.wire import curve

log = logging.getLogger(__name__)
T = TypeVar("T")

HIGH_WATER_MARK = 0  # unbounded: a stage never drops a message it was handed
SIGNAL_CHECK_MS = 200  # a blocked receiver wakes this often so signal handlers can run
SEND_LINGER_MS = 2000  # a closed sender still delivers what it queued (connects are asynchronous)
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


class Sender(Generic[T]):
    """Sends T: a Sender[SchedulerInbound] takes only what the scheduler's socket decodes."""

    def __init__(self, ctx: zmq.Context, addresses: str | list[str]):
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self.socket.setsockopt(zmq.LINGER, SEND_LINGER_MS)
        addresses = [addresses] if isinstance(addresses, str) else addresses
        if any(_leaves_machine(addr) for addr in addresses):
            curve.make_client(self.socket, curve.run_keys())
        for addr in addresses:
            self.socket.connect(addr)

    def send(self, msg: T) -> None:
        self.socket.send(_encoder.encode(msg), copy=False)

    def close(self) -> None:
        self.socket.close()


class _ReceiverBase(Generic[T]):
    def __init__(self, ctx: zmq.Context, address: str, type: Any):
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._ctx: zmq.Context | None = None  # set when this socket is a Curve server
        if _leaves_machine(address):
            keys = curve.run_keys()
            curve.acquire_authenticator(ctx, keys)  # before bind: no client is let in unchecked
            self._ctx = ctx
            curve.make_server(self.socket, keys)
        self.socket.bind(address)
        self.address = address
        self._decoder = msgspec.msgpack.Decoder(type)

    def decode(self, data: bytes | memoryview) -> T | None:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("dropped an undecodable message on %s: %s", self.address, e)
            return None

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._ctx is not None:
            curve.release_authenticator(self._ctx)
            self._ctx = None


class Receiver(_ReceiverBase[T]):
    # Called on every recv and every SIGNAL_CHECK_MS of an unbounded wait: a stage hangs its
    # liveness heartbeat here (stages/liveness.py). Bounded waits are the caller's loop's to beat.
    on_wait: Callable[[], None] | None = None

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """The next message, or None after timeout_ms (or when the message was undecodable).

        Waiting forever is done in slices: a signal delivered to another thread (torch and
        tokenizers start their own) does not interrupt this thread's poll, so the wait wakes up
        now and then to let Python run its signal handlers."""
        on_wait = self.on_wait or _nothing
        on_wait()
        if timeout_ms is None:
            while not self.socket.poll(SIGNAL_CHECK_MS):
                on_wait()
        elif not self.socket.poll(timeout_ms):
            return None
        return self.decode(self.socket.recv(copy=False).buffer)

    def recv_nowait(self) -> T | None:
        try:
            frame = self.socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self.decode(frame.buffer)


def _nothing() -> None:
    pass


def _leaves_machine(address: str) -> bool:
    return address.startswith("tcp://")


class AsyncReceiver(_ReceiverBase[T]):
    def __init__(self, ctx: zmq.asyncio.Context, address: str, type: Any):
        super().__init__(ctx, address, type)

    async def recv(self) -> T | None:
        frame = await self.socket.recv(copy=False)
        return self.decode(frame.buffer)
