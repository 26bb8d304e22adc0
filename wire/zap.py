"""The ZAP handler of a process's Curve servers (curve.py): admits one client public key.

libzmq asks a handler bound to inproc://zeromq.zap.01 in the socket's own context about every
client that completes a Curve handshake (ZMQ RFC 27). This one answers 200 for the run's client
key and 400 for anything else, so a client with another key never gets a message in.

Not pyzmq's ThreadAuthenticator: its thread does not close its sockets when the context is
terminated, so a stage's `ctx.destroy()` would wait forever. This thread polls in slices and
closes its socket on ETERM or when released, so the context ends as it does without Curve.
"""

from __future__ import annotations

import logging
import threading

import zmq
import zmq.utils.z85

log = logging.getLogger(__name__)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
POLL_MS = 100  # how soon a released handler notices


class ZapHandler:
    def __init__(self, ctx: zmq.Context, allowed: bytes):
        """`allowed`: the admitted client public key, z85 (40 bytes)."""
        self.allowed = zmq.utils.z85.decode(allowed)  # libzmq hands the handler the 32 raw bytes
        # A plain Context over the same libzmq context: the socket must not be an asyncio one.
        self.socket: zmq.Socket = zmq.Context.shadow(ctx.underlying).socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)  # in the calling thread, so it is there before any bind
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def _serve(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.socket.poll(POLL_MS):
                    self.socket.send_multipart(self._answer(self.socket.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            self.socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, identity, mechanism, credentials...
        version, request_id, mechanism = request[0], request[1], request[5]
        if mechanism == b"CURVE" and len(request) > 6 and request[6] == self.allowed:
            return [version, request_id, b"200", b"OK", b"", b""]
        log.warning("refused a %s client from %s", mechanism.decode(errors="replace"), request[3].decode(errors="replace"))
        return [version, request_id, b"400", b"unknown key", b"", b""]
