"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, for every error on its paths.

The app's errors middleware asks `speaks_anthropic(path)` and answers with `response(error)`, so
the errors raised before a handler runs (the API key's 401, read_body's 413 and 415, a 405) take
this shape on these paths too. The type follows the HTTP status as Anthropic lists them; a 503
(the engine loading, the server draining) is overloaded_error, Anthropic's "come back later". An
error after a stream began is the same object in an `error` event (stream.py).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from conveyor.stages import metrics
from conveyor.stages.ingress.anthropic.bodies import AnthropicError, AnthropicErrorDetail
from conveyor.stages.ingress.errors import ApiError

PATH = "/v1/messages"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def speaks_anthropic(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_object(error: ApiError) -> AnthropicError:
    metrics.errors.labels(error.error_type).inc()  # counted under the OpenAI type, as every route's errors are
    return AnthropicError(type="error", error=AnthropicErrorDetail(type=error_type(error.status), message=error.message))


def response(error: ApiError) -> web.Response:
    return error.response(msgspec.json.encode(error_object(error)))
