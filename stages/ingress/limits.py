"""How long one HTTP connection to the ingress may take, and how many requests it may carry.

aiohttp bounds only idle keep-alive time; a client that trickles its headers or stops half way
through its body would hold a connection (and a parser, and a handler) for as long as it likes.
`LimitedHandler`, aiohttp's per-connection protocol with the bounds of `config.server`, closes
that gap; listener.py creates one per connection.

Invariants (the bounds: docs/architecture.md, section 1): a connection whose headers are late is
closed without an answer (there is no request yet to answer); a request whose body is late gets a
408 in the OpenAI error shape from the handler reading it, and its connection closes after that;
HTTP that aiohttp cannot parse (a malformed header, a Content-Encoding it cannot decode) gets a
400 in the same shape and one log line, not aiohttp's text page and a traceback. The class leans
on aiohttp's internals (its docstring names them): an upgrade that renames them fails
tests/api/test_ingress_limits.py.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from conveyor.config import ServerConfig
from conveyor.stages.ingress.errors import ApiError

log = logging.getLogger(__name__)


class LimitedHandler(RequestHandler):
    """aiohttp's RequestHandler with deadlines. Headers: within header_timeout_s of the connection
    being accepted, or of the first byte of the next request on a kept-alive connection. Body:
    within body_timeout_s of its headers. Keep-alive: idle time is aiohttp's own timer
    (keepalive_timeout_s, given to the runner); the max_keepalive_requests-th answer says
    `Connection: close`.

    It overrides the hooks aiohttp calls per connection (connection_made/lost, data_received), per
    answer (finish_response) and per unparseable request (handle_error), and reads the counters
    aiohttp keeps (`_request_count`: requests parsed; `_messages`: parsed, not yet handled;
    `_current_request`). Written against aiohttp 3.14."""

    def __init__(self, manager: web.Server, *, limits: ServerConfig, on_closed=None, **kwargs):
        super().__init__(manager, **kwargs)
        self.limits = limits
        self.on_closed = on_closed  # called once, when the connection is gone
        self.num_unanswered = 0  # requests parsed (headers complete) and not yet answered
        self.num_answered = 0
        self.header_deadline: asyncio.TimerHandle | None = None
        self.body_deadlines: dict[StreamReader, asyncio.TimerHandle] = {}  # by the request's payload

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        num_parsed = self._request_count
        super().data_received(data)
        num_new = self._request_count - num_parsed
        if num_new:  # these requests' headers are complete; their bodies start their clocks
            self.num_unanswered += num_new
            self._cancel_header_deadline()
            for _, payload in list(self._messages)[-num_new:]:
                if not payload.is_eof():
                    when = self._loop.time() + self.limits.body_timeout_s
                    self.body_deadlines[payload] = self._loop.call_at(when, self._body_timed_out, payload)
        elif data and not self.num_unanswered and self.header_deadline is None:
            self._arm_header_deadline()  # the first byte of the next request on a kept-alive connection

    async def finish_response(self, request, resp, start_time):
        self.num_answered += 1
        if self.num_answered >= self.limits.max_keepalive_requests:
            resp.force_close()
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.num_unanswered = max(0, self.num_unanswered - 1)
            # Answered: a body left unread is aiohttp's to drain or drop (its lingering_time).
            if (deadline := self.body_deadlines.pop(request.content, None)) is not None:
                deadline.cancel()

    def handle_error(self, request, status=500, exc=None, message=None):
        if status >= 500:  # a bug of ours, not the client's bytes: keep aiohttp's traceback
            return super().handle_error(request, status, exc, message)
        log.info("unparseable HTTP request from %s: %s", request.remote, message or exc)
        return ApiError(status, f"malformed HTTP request: {message or exc}", close_connection=True).response()

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._cancel_header_deadline()
        for deadline in self.body_deadlines.values():
            deadline.cancel()
        self.body_deadlines.clear()
        if self.on_closed is not None:
            on_closed, self.on_closed = self.on_closed, None
            on_closed()

    def _arm_header_deadline(self) -> None:
        when = self._loop.time() + self.limits.header_timeout_s
        self.header_deadline = self._loop.call_at(when, self._headers_timed_out)

    def _cancel_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_timed_out(self) -> None:
        self.header_deadline = None
        if not self.num_unanswered:  # else a request is being handled: the next byte re-arms it
            log.debug("closing a connection whose headers took over %.1f s", self.limits.header_timeout_s)
            self.force_close()

    def _body_timed_out(self, payload: StreamReader) -> None:
        del self.body_deadlines[payload]
        if payload.is_eof() or self.transport is None:
            return
        request = self._current_request
        if request is None or request.content is not payload:
            self.force_close()  # no handler is reading it (aiohttp drains it, or it waits its turn)
            return
        # The handler reading it gets the 408; nothing more is read from this connection, which
        # closes after that answer. The body ends here, so aiohttp does not try to drain the rest.
        self.close()
        message = f"the request body did not arrive within {self.limits.body_timeout_s:g} s of its headers"
        payload.set_exception(ApiError(408, message, code="body_timeout", close_connection=True))
        payload.feed_eof()
