"""The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`, for every non-200.

ApiError is raised anywhere under a route (request decoding, validation, a RequestRejected from
a tokenizer or the scheduler) and turned into that body by the app's middleware, so a client
never sees a bare aiohttp page or a 500 for input it got wrong. A 429 says when to come back in
a `Retry-After` header (whole seconds, at least 1). `read_body` (415 for a body that does not
say it is JSON, 413, 400 for a Content-Encoding that does not decode) and `check_model` (the 404)
are the checks every POST route starts with. An error after which the connection cannot carry
another request (its body was abandoned half read) closes it: `close_connection`.
"""

from __future__ import annotations

import math

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from conveyor.config import EngineConfig
from conveyor.stages import metrics

# The `type` OpenAI puts in an error body, by HTTP status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
SERVER_ERROR = "server_error"  # any other 5xx
metrics.zero_series(metrics.errors, sorted(set(_TYPES.values()) | {SERVER_ERROR}))


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        retry_after: float | None = None,
        close_connection: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        default_type = SERVER_ERROR if status >= 500 else "invalid_request_error"
        self.error_type = error_type or _TYPES.get(status, default_type)
        self.retry_after = retry_after  # seconds
        self.close_connection = close_connection

    def body(self) -> bytes:
        metrics.errors.labels(self.error_type).inc()  # once per error answered, JSON or SSE
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}
        return msgspec.json.encode({"error": error})

    def response(self, body: bytes | None = None) -> web.Response:
        """The JSON answer: `body` (another API's shape of this error: anthropic/errors.py), else OpenAI's."""
        headers = {} if self.retry_after is None else {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
        body = self.body() if body is None else body
        response = web.Response(status=self.status, body=body, content_type="application/json", headers=headers)
        if self.close_connection:
            response.force_close()
        return response


RETRY_AFTER_S = 5.0  # what a 503 tells a client while the engine loads or restarts


def not_ready() -> ApiError:
    message = "the engine is loading or restarting; retry shortly"
    return ApiError(503, message, code="engine_not_ready", retry_after=RETRY_AFTER_S)


def draining() -> ApiError:
    return ApiError(503, "the server is shutting down", code="server_draining")


async def read_body(request: web.Request, max_body_bytes: int) -> bytes:
    check_json(request)
    too_large = ApiError(413, f"request body is larger than {max_body_bytes} bytes", code="request_too_large")
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except RequestPayloadError:  # a corrupt gzip or deflate body (aiohttp inflates it as it reads)
        # Say the body ended: else aiohttp reads on to drain it after our answer, fails again and
        # logs a traceback. Its parser gave up on the connection, so the connection closes.
        request.content.feed_eof()
        if encoding := request.headers.get("Content-Encoding"):
            message, code = f"the request body does not decode as Content-Encoding {encoding!r}", "invalid_content_encoding"
        else:
            message, code = "the request body is malformed (its chunked framing)", "invalid_body"
        raise ApiError(400, message, code=code, close_connection=True) from None


def check_json(request: web.Request) -> None:
    """A POST body must say it is JSON. A web page may send text/plain, urlencoded and multipart
    form bodies to any origin without a CORS preflight, and a no-cors fetch of an untyped Blob sends
    no Content-Type at all; refusing those keeps a page from driving a server that has no API key.
    application/json needs a preflight, which cors.py grants only to allowed origins."""
    if request.content_type == "application/json":  # aiohttp lowercases it and drops the charset
        return
    if "Content-Type" not in request.headers:
        message = "the request has no Content-Type: send the JSON body with `Content-Type: application/json`"
    else:
        message = f"Content-Type {request.content_type!r} is not supported: send `Content-Type: application/json`"
    raise ApiError(415, message, code="unsupported_media_type")


def check_model(config: EngineConfig, model: str | None) -> None:
    """A request may name the served model, or none; any other name is a 404."""
    served = config.model.served_name
    if model is not None and model != served:
        message = f"the model `{model}` does not exist; this server serves `{served}`"
        raise ApiError(404, message, param="model", code="model_not_found")
