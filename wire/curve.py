"""CurveZMQ for the sockets that leave the machine: authenticated and encrypted, keys made per run.

Within one machine stages talk over ipc:// sockets in the private 0700 run directory, which the
file system already guards. Once engine ranks run on other nodes (stages/ray/), a stage's inbox
is a tcp:// endpoint instead, and a tcp:// socket is always a Curve socket:
- every binding (receiving) socket is a Curve server, and a ZAP handler in its process admits only
  the run's client public key: a client with another key, or a plain one, never gets a message in;
- every connecting (sending) socket is a Curve client that knows the server's public key.

The launcher makes the two key pairs (server, client) at start with `zmq.curve_keypair()` and
hands them to its stage processes in the environment (`CONVEYOR_CURVE_KEYS`, config/env.py), like
the API key: never on disk, never in the config file, never on a command line.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import zmq

from conveyor.config.env import curve_keys_from_env
from conveyor.wire.zap import ZapHandler

ZAP_DOMAIN = b"conveyor"


@dataclass(frozen=True)
class CurveKeys:
    """A run's keys, z85-encoded (40 bytes each): one pair for the servers, one for the clients."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def encode(self) -> str:
        """The value of CONVEYOR_CURVE_KEYS: the four keys, space-separated (z85 has no space)."""
        return b" ".join((self.server_public, self.server_secret, self.client_public, self.client_secret)).decode()

    @classmethod
    def decode(cls, text: str) -> CurveKeys:
        parts = text.encode().split()
        if len(parts) != 4 or any(len(p) != 40 for p in parts):
            raise ValueError("CONVEYOR_CURVE_KEYS must hold four z85 keys of 40 characters")
        return cls(*parts)


_installed: CurveKeys | None = None


def install(keys: CurveKeys | None) -> None:
    """Use `keys` in this process (the launcher, which made them) rather than the environment's."""
    global _installed
    _installed = keys


def run_keys() -> CurveKeys:
    """This run's keys; a tcp:// endpoint without them is refused rather than opened in the clear."""
    if not zmq.has("curve"):  # pyzmq's wheels carry it; a libzmq built without libsodium may not
        raise RuntimeError("a tcp:// endpoint needs CurveZMQ, and this libzmq was built without it")
    if _installed is not None:
        return _installed
    text = curve_keys_from_env()
    if text is None:
        raise RuntimeError("a tcp:// endpoint needs the run's CurveZMQ keys (CONVEYOR_CURVE_KEYS), and none were given")
    return CurveKeys.decode(text)


def make_client(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Before connect: this socket proves the run's client key and checks the server's."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret


def make_server(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Before bind: Curve server, and ZAP asked about every client (acquire_authenticator first)."""
    socket.curve_server = True
    socket.curve_publickey = keys.server_public
    socket.curve_secretkey = keys.server_secret
    socket.zap_domain = ZAP_DOMAIN
    # With no ZAP handler answering, libzmq would admit any client that knows the (public) server
    # key; enforcing the domain makes a missing handler a refusal instead.
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


# One ZAP handler per libzmq context (it binds the context's inproc://zeromq.zap.01), shared by
# the Curve servers of that context and stopped with the last of them.
_lock = threading.Lock()
_handlers: dict[int, tuple[ZapHandler, int]] = {}


def acquire_authenticator(ctx: zmq.Context, keys: CurveKeys) -> None:
    """Start (or share) the ZAP handler of `ctx` that admits only the run's client key."""
    with _lock:
        entry = _handlers.get(ctx.underlying)
        if entry is None or not entry[0].alive:  # none yet, or its context was terminated
            entry = (ZapHandler(ctx, keys.client_public), 0)
        _handlers[ctx.underlying] = (entry[0], entry[1] + 1)


def release_authenticator(ctx: zmq.Context) -> None:
    with _lock:
        entry = _handlers.pop(ctx.underlying, None)
        if entry is None:
            return
        handler, count = entry
        if count > 1:
            _handlers[ctx.underlying] = (handler, count - 1)
            return
    handler.stop()
