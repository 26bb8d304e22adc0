"""CORS for browsers calling the API from other origins: `config.server.allowed_origins`.

A request whose Origin is allowed (listed, or "*" listed) gets `Access-Control-Allow-Origin:
<its origin>` and `Vary: Origin`, added just before its headers go out (aiohttp's
on_response_prepare, so streams and errors get them too). A preflight (OPTIONS with Origin and
Access-Control-Request-Method) from an allowed origin is a 204 naming the methods and headers
the API takes; from any other origin, a 403. Without an allowed Origin nothing is added, and
the browser keeps the response from the page.
"""

from __future__ import annotations

from aiohttp import web

from conveyor.stages.ingress.errors import ApiError

ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key"
MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


class Cors:
    def __init__(self, allowed_origins: tuple[str, ...]):
        self.any_origin = "*" in allowed_origins
        self.origins = frozenset(allowed_origins)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any_origin or origin in self.origins)

    @web.middleware
    async def answer_preflight(self, request: web.Request, handler) -> web.StreamResponse:
        headers = request.headers
        if request.method != "OPTIONS" or "Origin" not in headers or "Access-Control-Request-Method" not in headers:
            return await handler(request)
        if not self.allows(headers["Origin"]):
            raise ApiError(403, f"the origin {headers['Origin']!r} may not call this API", code="origin_not_allowed")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": ALLOW_HEADERS,
                "Access-Control-Max-Age": str(MAX_AGE_S),
            },
        )

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Retry-After"
            response.headers.add("Vary", "Origin")
