"""API key check: with `config.server.api_key` set, every route but /health and /metrics needs it.

The key is accepted as `Authorization: Bearer KEY` (what the openai SDK sends) or `X-Api-Key:
KEY` (what the anthropic SDK sends); a missing or wrong key is a 401 of type authentication_error. Keys are compared in
constant time. CORS preflights never reach this check (cors.py answers them first): browsers
send them without credentials.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from conveyor.stages.ingress.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no key


def api_key_middleware(api_key: str):
    expected = api_key.encode()

    @web.middleware
    async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = _presented_key(request)
            if given is None:
                raise ApiError(
                    401, "this server needs an API key: `Authorization: Bearer KEY` or `X-Api-Key: KEY`", code="invalid_api_key"
                )
            if not hmac.compare_digest(given.encode(errors="replace"), expected):
                raise ApiError(401, "the API key is not valid", code="invalid_api_key")
        return await handler(request)

    return require_api_key


def _presented_key(request: web.Request) -> str | None:
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return request.headers.get("X-Api-Key")
