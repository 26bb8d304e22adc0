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
import functools
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
        self.socks: list[socket.socket] = []
        self.accepting: list[asyncio.Task] = []
        self.slots = asyncio.Semaphore(limits.max_connections)

    @property
    def name(self) -> str:
        return f"http://{self.limits.host}:{self.limits.port}"

    async def start(self) -> None:
        await super().start()
        # Every address the host names, as asyncio's create_server binds them ("localhost": both
        # 127.0.0.1 and ::1). They share the bound: at its edge, the last free slot waits on
        # whichever address took it first.
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.limits.host or None, self.limits.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, _, _, _, address in dict.fromkeys(infos):
            sock = socket.create_server(address, family=family, backlog=self._backlog, reuse_port=True)
            sock.setblocking(False)
            self.socks.append(sock)
            self.accepting.append(asyncio.create_task(self._accept(sock), name=f"accept {address}"))

    async def stop(self) -> None:
        """Stop accepting (connections already open are the runner's to drain) and unbind."""
        for task in self.accepting:
            task.cancel()
        await asyncio.gather(*self.accepting, return_exceptions=True)
        for sock in self.socks:
            sock.close()
        await super().stop()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.slots.acquire()  # past the bound, connections wait in the backlog
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:  # out of file descriptors, or the client gave up before accept
                self.slots.release()
                log.warning("cannot accept a connection: %s", e)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            except BaseException:
                self.slots.release()
                raise
            made: list[LimitedHandler] = []  # once a handler exists, it releases the slot when closed
            try:
                await loop.connect_accepted_socket(functools.partial(self._new_handler, made), conn)
            except OSError:  # reset before it could start
                conn.close()
                if not made:
                    self.slots.release()

    def _new_handler(self, made: list[LimitedHandler]) -> LimitedHandler:
        # As web.Server.__call__ makes aiohttp's RequestHandler, with the runner's keyword arguments.
        server = self._runner.server
        assert server is not None  # runner.setup() made it before the first connection
        handler = LimitedHandler(server, loop=server._loop, limits=self.limits, on_closed=self.slots.release, **server._kwargs)
        made.append(handler)
        return handler
