"""The router's aiohttp app: every request but its own /health and /metrics goes to one replica
and comes back unchanged, streamed as it arrives (SSE events keep their timing).

main.py serves it; replicas.py picks each request's replica (POST /v1/completions and
/v1/chat/completions by their prompt's chunk hashes, prompt.py; any other request by load alone),
and health.py keeps their readiness. Invariants:
- /health is 200 while at least one replica is ready, else 503: the router is the load balancer
  and routes around the others, and each replica's own probe speaks for that replica.
- errors have OpenAI's shape (stages/ingress/errors.py): 413 request_too_large for a body past
  what a replica would take (read whole, to route it), 503 no_replica_ready with Retry-After,
  502 no_replica_answered when each ready replica was tried and none could be reached.
- a request is sent to another replica only when the first failed before answering (`forward`);
  once an answer began it is the client's, even if broken (`_end_broken`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from conveyor.config import ServerConfig
from conveyor.config.engine import VISION_BODY_BYTES
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.replica_router import discovery, health
from conveyor.stages.replica_router.config import RouterConfig
from conveyor.stages.replica_router.metrics import RouterMetrics
from conveyor.stages.replica_router.prompt import prompt_hashes
from conveyor.stages.replica_router.replicas import Replicas

log = logging.getLogger(__name__)

# Bodies as large as a replica accepts (a vision model's cap, the largest): a larger one gets the router's 413.
MAX_BODY_BYTES = max(ServerConfig.max_body_bytes, VISION_BODY_BYTES)
REPLICA_HEADER = "X-Conveyor-Replica"  # the index of the replica that answered, for debugging
# Headers that describe one connection, not the message (RFC 9110 7.6.1), and the ones aiohttp
# sets itself from what it sends.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


class Proxy:
    def __init__(self, config: RouterConfig, resolve: discovery.Resolve = discovery.resolve):
        self.config = config
        num_slots = config.max_replicas if config.backends_dns else 0
        self.replicas = Replicas(config.backends, config.routing_policy, config.routing_settings, num_slots)
        self.metrics = RouterMetrics(self.replicas)
        self.resolve = resolve
        self.session: aiohttp.ClientSession | None = None

    async def discover(self) -> None:
        """The replicas DNS names now (only with --backends-dns)."""
        assert self.config.backends_dns is not None
        urls = await self.resolve(self.config.backends_dns)
        if urls is not None:
            self.replicas.sync(urls)

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: one client session (bodies passed through as the replica encoded them), a
        first discovery and round of health checks before the first request, then the poller."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)) as session:
            self.session = session
            discover = self.discover if self.config.backends_dns else None
            if discover is not None:
                await discover()
            await health.check_all(session, self.replicas, timeout=self.config.health_interval)
            poller = asyncio.create_task(health.poll(session, self.replicas, self.config.health_interval, discover))
            try:
                yield
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller

    async def health(self, request: web.Request) -> web.Response:
        num_ready = self.replicas.num_ready
        body = {
            "status": "ok" if num_ready else "no replica is ready",
            "num_ready": num_ready,
            "replicas": [{"url": r.url, "ready": r.ready, "in_flight": r.num_in_flight} for r in self.replicas.active],
        }
        return web.json_response(body, status=200 if num_ready else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None  # set by lifetime() before the app serves
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return ApiError(
                413, f"request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large", close_connection=True
            ).response()
        hashes = prompt_hashes(request.path, body, self.config.chunk_chars)
        failure = None
        while (route := self.replicas.route(hashes)) is not None:
            index, replica = route.engine, self.replicas[route.engine]
            self.metrics.requests.labels(replica.url, route.reason).inc()
            try:
                upstream = await self.session.request(
                    request.method, replica.url + request.path_qs, data=body, headers=_pass_headers(request.headers)
                )
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                # It never reached a model, or the replica died under it: either way no answer was
                # sent, so the replica is marked not ready and the request goes to the next one.
                self.replicas.finish(index)
                self._failed(index, e)
                failure = f"{replica.url}: {type(e).__name__}"
                continue
            try:
                return await self._relay(request, upstream, index)
            finally:
                self.replicas.finish(index)
        if failure is not None:
            return ApiError(502, f"no replica answered (last: {failure})", code="no_replica_answered").response()
        message = "no replica is ready; retry shortly"
        return ApiError(503, message, code="no_replica_ready", retry_after=self.config.health_interval).response()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, index: int) -> web.StreamResponse:
        """The replica's answer to the client, chunk by chunk as it arrives."""
        async with upstream:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            resp.headers.extend(_pass_headers(upstream.headers))
            resp.headers[REPLICA_HEADER] = str(index)
            if upstream.content_length is not None:
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    self._failed(index, e)
                    await self._end_broken(resp, upstream)
                    return resp
                if not chunk:
                    break
                try:
                    await resp.write(chunk)
                except ConnectionResetError:  # the client left: drop the replica's connection so it aborts
                    upstream.close()
                    return resp
            await resp.write_eof()
            return resp

    async def _end_broken(self, resp: web.StreamResponse, upstream: aiohttp.ClientResponse) -> None:
        """The replica broke off mid-answer, which no other replica can take over: an SSE stream
        ends with an error event and [DONE], as conveyor ends its own; any other body is cut short."""
        if upstream.content_type == "text/event-stream":
            error = ApiError(502, "the replica broke off the answer", code="replica_failed")
            with contextlib.suppress(ConnectionResetError):
                await resp.write(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
                await resp.write_eof()
        else:
            resp.force_close()

    def _failed(self, index: int, error: BaseException) -> None:
        url = self.replicas[index].url
        log.warning("replica %s failed: %s: %s; not ready until its /health says so", url, type(error).__name__, error)
        self.replicas.fail(index)
        self.metrics.failures.labels(url).inc()


def _pass_headers(headers) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP]


PROXY = web.AppKey("proxy", Proxy)


def make_app(config: RouterConfig, resolve: discovery.Resolve = discovery.resolve) -> web.Application:
    proxy = Proxy(config, resolve)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[PROXY] = proxy
    app.cleanup_ctx.append(proxy.lifetime)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics_text)
    app.router.add_route("*", "/{tail:.*}", proxy.forward)
    return app
