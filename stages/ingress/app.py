"""The aiohttp application: its routes, and the middlewares every request passes through.

Routes: the OpenAI-compatible generation routes (generate.py; the Responses API in
responses_api/; Anthropic's Messages API in anthropic/), /tokenize and /detokenize
(tokens.py), /v1/models, /health, /metrics and /openapi.json. Middlewares, outermost first:
`errors_as_json` (every failure becomes the OpenAI error object, or Anthropic's on its paths; an
unexpected exception is logged and a 500, never a bare page), the CORS preflight answer
(cors.py), then the API key check (auth.py) when a key is configured. CORS headers are added to every response as it is
prepared, streams included.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import logging
import time

import msgspec
from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.stages.ingress.anthropic import errors as anthropic_errors
from conveyor.stages.ingress.anthropic.routes import MessagesRoutes
from conveyor.stages.ingress.auth import api_key_middleware
from conveyor.stages.ingress.cors import Cors
from conveyor.stages.ingress.embeddings import EmbeddingRoutes
from conveyor.stages.ingress.engine_client import EngineClient
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.generate import GenerateRoutes
from conveyor.stages.ingress.lora_routes import LoraRoutes, ServedAdapters
from conveyor.stages.ingress.metrics_route import make_registry, metrics_handler
from conveyor.stages.ingress.openapi import document
from conveyor.stages.ingress.responses_api.routes import ResponsesRoutes
from conveyor.stages.ingress.tokens import LazyEncoder, TokenRoutes

log = logging.getLogger(__name__)


def build_app(config: EngineConfig, engine: EngineClient) -> web.Application:
    cors = Cors(config.server.allowed_origins)
    middlewares = [errors_as_json, cors.answer_preflight]
    if config.server.api_key is not None:
        middlewares.append(api_key_middleware(config.server.api_key))
    # The body limit is enforced in `read_body`, where it becomes a 413 in the OpenAI shape.
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_body_bytes)
    app.on_response_prepare.append(cors.add_headers)

    encoder = LazyEncoder(config)
    version = package_version()
    generate = GenerateRoutes(config, engine, encoder, system_fingerprint(config, version))
    responses = ResponsesRoutes(config, generate)
    messages = MessagesRoutes(config, generate)
    tokens = TokenRoutes(config, encoder)
    adapters = ServedAdapters(config)
    info = InfoRoutes(config, engine, document(config, version), adapters)
    app.router.add_get("/health", info.health)
    app.router.add_get("/metrics", metrics_handler(make_registry()))
    app.router.add_get("/openapi.json", info.openapi)
    app.router.add_get("/v1/models", info.models)
    app.router.add_post("/v1/completions", generate.completions)
    app.router.add_post("/v1/chat/completions", generate.chat_completions)
    app.router.add_post("/v1/embeddings", EmbeddingRoutes(config, generate).embeddings)
    lora = LoraRoutes(config, engine, adapters)
    app.router.add_post("/v1/load_lora_adapter", lora.load)
    app.router.add_post("/v1/unload_lora_adapter", lora.unload)
    app.router.add_post("/v1/messages", messages.create)
    app.router.add_post("/v1/messages/count_tokens", messages.count_tokens)
    app.router.add_post("/v1/responses", responses.create)
    app.router.add_get("/v1/responses/{response_id}", responses.retrieve)
    app.router.add_delete("/v1/responses/{response_id}", responses.delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", responses.input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", responses.cancel)
    app.on_cleanup.append(responses.close)
    app.on_cleanup.append(generate.images.close)
    app.router.add_post("/tokenize", tokens.tokenize)
    app.router.add_post("/detokenize", tokens.detokenize)
    return app


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _error_answer(request, e)
    except web.HTTPException as e:  # the router's 404 and 405, aiohttp's own 4xx
        if e.status < 400:
            raise
        message = f"no route {request.method} {request.path}" if e.status in (404, 405) else e.reason
        return _error_answer(request, ApiError(e.status, message))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return _error_answer(request, ApiError(500, "internal server error", error_type="server_error"))


def _error_answer(request: web.Request, error: ApiError) -> web.Response:
    """The error in the shape of the API its path speaks: Anthropic's under /v1/messages, else OpenAI's."""
    return anthropic_errors.response(error) if anthropic_errors.speaks_anthropic(request.path) else error.response()


class InfoRoutes:
    def __init__(self, config: EngineConfig, engine: EngineClient, openapi: dict, adapters: ServedAdapters):
        self.config = config
        self.adapters = adapters
        self.engine = engine
        self.created = int(time.time())
        self.openapi_body = msgspec.json.encode(openapi)

    async def health(self, request: web.Request) -> web.Response:
        # 503 sends a load balancer elsewhere: while the engine (any of several) loads or
        # restarts, and while the server drains for shutdown.
        if self.engine.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.engine.all_ready:
            return web.json_response({"status": "unavailable"}, status=503)
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
        if self.config.parallel.device == "emulated":  # no model runs: answers and timings are modelled
            card["emulated_device"] = self.config.parallel.emulate
        adapters = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "conveyor", "root": path, "parent": model.served_name}
            for name, path in self.adapters.paths.items()
        ]
        return web.json_response({"object": "list", "data": [card, *adapters]})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self.openapi_body, content_type="application/json")


def package_version() -> str:
    try:
        return importlib.metadata.version("conveyor")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def system_fingerprint(config: EngineConfig, version: str) -> str:
    """Stable for a server version and model: clients compare it to spot a changed backend."""
    digest = hashlib.sha256(f"conveyor {version} {config.model.served_name} {config.model.dtype}".encode())
    return "fp_" + digest.hexdigest()[:12]
