"""The ingress's listening socket: at most `max_connections` open connections per process.

`BoundedSite` takes the place of aiohttp's TCPSite. It binds the same way (SO_REUSEPORT, so the
ingress processes share the port) but accepts a connection only while fewer than
`config.server.max_connections` are open. Past the bound, new connections wait in the kernel's
listen backlog, where the client's own connect timeout applies, and are accepted as soon as one
closes. Waiting is the kinder choice: a burst of clients is served a little later rather than
refused, and an accepted-then-dropped connection would look to a client like a crashed server.
(When the backlog itself is full the kernel drops further SYNs and clients retry.)

Each accepted connection gets a LimitedHandler (limits.py), which bounds how long it may take.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from aiohttp import web

from conveyor.config import ServerConfig
from conveyor.stages.ingress.limits import LimitedHandler

log = logging.getLogger(__name__)

BACKLOG = 1024  # connections the kernel holds for us past max_connections (capped by somaxconn)
ACCEPT_RETRY_S = 0.1  # after an accept error such as EMFILE, before trying again


class BoundedSite(web.BaseSite):
    def __init__(self, runner: web.BaseRunner, limits: ServerConfig):
        super().__init__(runner, backlog=BACKLOG)
        self.limits = limits
        self.sock: socket.socket | None = None
        self.accepting: asyncio.Task | None = None
        self.slots = asyncio.Semaphore(limits.max_connections)

    @property
    def name(self) -> str:
        return f"http://{self.limits.host}:{self.limits.port}"

    async def start(self) -> None:
        await super().start()
        family = socket.AF_INET6 if ":" in self.limits.host else socket.AF_INET
        self.sock = socket.create_server(
            (self.limits.host, self.limits.port), family=family, backlog=self._backlog, reuse_port=True
        )
        self.sock.setblocking(False)
        self.accepting = asyncio.create_task(self._accept(), name=f"accept {self.name}")

    async def stop(self) -> None:
        """Stop accepting (connections already open are the runner's to drain) and unbind."""
        if self.accepting is not None:
            self.accepting.cancel()
            await asyncio.gather(self.accepting, return_exceptions=True)
        if self.sock is not None:
            self.sock.close()
        await super().stop()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.slots.acquire()  # past the bound, connections wait in the backlog
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as e:  # out of file descriptors, or the client gave up before accept
                self.slots.release()
                log.warning("cannot accept a connection: %s", e)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            except BaseException:
                self.slots.release()
                raise
            handlers = []  # the slot is released by the handler once it exists, else here
            try:
                await loop.connect_accepted_socket(lambda: handlers.append(self._new_handler()) or handlers[0], conn)
            except OSError:  # reset before it could start
                conn.close()
                if not handlers:
                    self.slots.release()

    def _new_handler(self) -> LimitedHandler:
        # As web.Server.__call__ makes aiohttp's RequestHandler, with the runner's keyword arguments.
        server = self._runner.server
        return LimitedHandler(server, loop=server._loop, limits=self.limits, on_closed=self.slots.release,
                              **server._kwargs)
