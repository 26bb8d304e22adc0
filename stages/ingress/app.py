"""The aiohttp application: the OpenAI-compatible routes, /health, /v1/models and /metrics.

A generation request is parsed (protocol.py), submitted as a TokenizeRequest, and answered from
its RequestStream: the first event is the engine's verdict (RequestRejected, a tokenizer's 400 or
the scheduler's 429 with Retry-After, becomes an error answer before any SSE byte; the
scheduler's RequestAccepted or a first TextDelta starts the answer), then TextDelta events until
every choice has a finish reason. A client that goes away before that (a failed write, or
aiohttp cancelling the handler) turns into an AbortRequest to the scheduler.
A rejection after the answer began (the engine stopping) ends a stream with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.stages.ingress.engine_client import EngineClient, Event, RequestStream
from conveyor.stages.ingress.errors import ApiError, not_ready
from conveyor.stages.ingress.metrics import make_registry, metrics_handler
from conveyor.stages.ingress.protocol import Generation, parse_chat, parse_completion
from conveyor.stages.ingress.responses import DONE, SSE_HEADERS, ResponseBuilder
from conveyor.wire.messages import RequestAccepted, RequestRejected, TextDelta

log = logging.getLogger(__name__)


def build_app(config: EngineConfig, engine: EngineClient) -> web.Application:
    routes = Routes(config, engine)
    # The body limit is enforced in `read_body`, where it becomes a 413 in the OpenAI shape.
    app = web.Application(middlewares=[errors_as_json], client_max_size=config.server.max_body_bytes)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/metrics", metrics_handler(make_registry()))
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    return app


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:  # the router's 404 and 405, aiohttp's own 4xx
        if e.status < 400:
            raise
        message = f"no route {request.method} {request.path}" if e.status in (404, 405) else e.reason
        return ApiError(e.status, message).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return ApiError(500, "internal server error", error_type="server_error").response()


class Routes:
    def __init__(self, config: EngineConfig, engine: EngineClient):
        self.config = config
        self.engine = engine
        self.created = int(time.time())

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.ready:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        model = self.config.model
        card = {
            "id": model.served_name,
            "object": "model",
            "created": self.created,
            "owned_by": "conveyor",
            "max_model_len": model.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        if not self.engine.ready:
            raise not_ready()
        data = await read_body(request, self.config.server.max_body_bytes)
        model = self.config.model
        gen = (parse_chat if chat else parse_completion)(data, model.vocab_size)
        if gen.model is not None and gen.model != model.served_name:
            message = f"the model `{gen.model}` does not exist; this server serves `{model.served_name}`"
            raise ApiError(404, message, param="model", code="model_not_found")

        request_id = self.engine.new_request_id("chatcmpl" if chat else "cmpl")
        builder = ResponseBuilder(
            request_id,
            model.served_name,
            chat=chat,
            params=gen.params,
            stream=gen.stream,
            include_usage=gen.include_usage,
            return_token_ids=gen.return_token_ids,
        )
        stream = self.engine.submit(request_id, gen)
        try:
            events = await stream.take()
            if isinstance(events[0], RequestRejected):
                raise _rejection(events[0])
            if gen.stream:
                return await self._answer_stream(request, gen, builder, stream, events)
            while True:
                _fold(builder, events)
                if builder.finished:
                    return web.Response(body=builder.body(), content_type="application/json")
                events = await stream.take()
        except ApiError:  # rejected: the engine has forgotten the request already
            self.engine.release(request_id)
            raise
        finally:
            if builder.finished:
                self.engine.release(request_id)
            else:
                self.engine.abort(request_id)  # no-op once released

    async def _answer_stream(
        self,
        request: web.Request,
        gen: Generation,
        builder: ResponseBuilder,
        stream: RequestStream,
        events: list[Event],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            while True:
                deltas = _fold(builder, events)
                if deltas:
                    await response.write(builder.sse_chunks(deltas))
                if builder.finished:
                    break
                events = await stream.take()
            if gen.include_usage:
                await response.write(builder.usage_chunk())
            await response.write(DONE)
            await response.write_eof()
        except ApiError as e:  # rejected after the stream began: say so in the stream, then end it
            self.engine.release(builder.request_id)
            await _write_quietly(response, b"data: " + e.body() + b"\n\n" + DONE)
        except ConnectionResetError:
            log.debug("client of %s went away", builder.request_id)
        return response


async def read_body(request: web.Request, max_body_bytes: int) -> bytes:
    too_large = ApiError(413, f"request body is larger than {max_body_bytes} bytes", code="request_too_large")
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


def _fold(builder: ResponseBuilder, events: list[Event]) -> list[TextDelta]:
    """Take the events into the builder; the TextDeltas among them, in order."""
    deltas = []
    for event in events:
        if isinstance(event, TextDelta):
            builder.add(event)
            deltas.append(event)
        elif isinstance(event, RequestAccepted):
            builder.accept(event.num_prompt_tokens)
        else:
            raise _rejection(event)
    return deltas


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
        await response.write_eof()
    except ConnectionResetError:
        pass


def _rejection(msg: RequestRejected) -> ApiError:
    # The wire's default type is a 400's: a 429 or a 5xx that kept it gets its status's type instead.
    keeps_default = msg.error_type == "invalid_request_error" and (msg.status == 429 or msg.status >= 500)
    return ApiError(
        msg.status,
        msg.message,
        param=msg.param,
        code=msg.code or ("rate_limit_exceeded" if msg.status == 429 else None),
        error_type=None if keeps_default else msg.error_type,
        retry_after=msg.retry_after,
    )
