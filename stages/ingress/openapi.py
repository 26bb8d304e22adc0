"""GET /openapi.json: an OpenAPI 3.1 description of every route the ingress serves.

Request bodies (and the fixed-shape responses: /tokenize, /detokenize, errors) come from the
msgspec Structs in bodies.py through `msgspec.json.schema_components`, so the published bounds
are the ones decoding enforces. Generation answers are described as objects (JSON) or an event
stream (each event's `data` a JSON chunk, then [DONE]); every error is the OpenAI error object,
under `default` (Anthropic's on /v1/messages and /v1/messages/count_tokens, from anthropic/bodies.py).
With an API key configured, every operation but /health and /metrics names the two ways to present it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.config import EngineConfig
from conveyor.stages.ingress.anthropic.bodies import (
    ANTHROPIC_BODIES,
    AnthropicError,
    CountTokensBody,
    CountTokensResult,
    MessagesBody,
)
from conveyor.stages.ingress.auth import OPEN_PATHS
from conveyor.stages.ingress.bodies import (
    REQUEST_BODIES,
    RESPONSE_BODIES,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    DetokenizeResult,
    EmbeddingsBody,
    ErrorBody,
    LoadLoraBody,
    TokenizeBody,
    TokenizeResult,
    UnloadLoraBody,
)
from conveyor.stages.ingress.responses_api.bodies import ResponsesBody

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"
_OBJECT = {"type": "object"}
# One server-sent event: `data` holds a chunk's JSON, an error object's, or "[DONE]".
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}


def document(config: EngineConfig, version: str) -> dict[str, Any]:
    bodies = REQUEST_BODIES + RESPONSE_BODIES + ANTHROPIC_BODIES + (ResponsesBody,)
    _, schemas = msgspec.json.schema_components(bodies, ref_template=_REF)
    generation = {"application/json": _OBJECT, "text/event-stream": _SSE_EVENT}
    paths = {
        "/health": {
            "get": _operation(
                "health",
                "Readiness: 200 once the engine serves, 503 before",
                {"application/json": _OBJECT},
                also={"503": _ok({"application/json": _OBJECT}, "Not ready")},
            )
        },
        "/metrics": {"get": _operation("metrics", "Prometheus metrics of every stage", {"text/plain": {"type": "string"}})},
        "/openapi.json": {"get": _operation("openapi", "This document", {"application/json": _OBJECT})},
        "/v1/models": {"get": _operation("listModels", "The served model", {"application/json": _OBJECT})},
        "/v1/completions": {
            "post": _operation("createCompletion", "Complete a prompt, or a batch of prompts", generation, CompletionBody)
        },
        "/v1/chat/completions": {"post": _operation("createChatCompletion", "Answer a conversation", generation, ChatBody)},
        "/v1/load_lora_adapter": {
            "post": _operation("loadLoraAdapter", "Serve a LoRA adapter (--enable-lora)", {"application/json": _OBJECT}, LoadLoraBody)
        },
        "/v1/unload_lora_adapter": {
            "post": _operation("unloadLoraAdapter", "Stop serving a LoRA adapter", {"application/json": _OBJECT}, UnloadLoraBody)
        },
        "/v1/embeddings": {
            "post": _operation("createEmbedding", "One vector per input", {"application/json": _OBJECT}, EmbeddingsBody)
        },
        "/v1/messages": {
            "post": _operation(
                "createMessage", "Answer a conversation (Anthropic's Messages API)", generation, MessagesBody, error=AnthropicError
            )
        },
        "/v1/messages/count_tokens": {
            "post": _operation(
                "countMessageTokens",
                "Tokens of a Messages request's prompt",
                {"application/json": _ref(CountTokensResult)},
                CountTokensBody,
                error=AnthropicError,
            )
        },
        "/v1/responses": {"post": _operation("createResponse", "Answer input items (the Responses API)", generation, ResponsesBody)},
        "/v1/responses/{response_id}": {
            "get": _by_id(_operation("getResponse", "A stored response", {"application/json": _OBJECT})),
            "delete": _by_id(_operation("deleteResponse", "Forget a stored response", {"application/json": _OBJECT})),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": _by_id(_operation("listInputItems", "A stored response's input items", {"application/json": _OBJECT}), _PAGE)
        },
        "/v1/responses/{response_id}/cancel": {
            "post": _by_id(_operation("cancelResponse", "Cancel a background response", {"application/json": _OBJECT}))
        },
        "/tokenize": {
            "post": _operation(
                "tokenize", "Token ids of a prompt or a conversation", {"application/json": _ref(TokenizeResult)}, TokenizeBody
            )
        },
        "/detokenize": {
            "post": _operation("detokenize", "Text of token ids", {"application/json": _ref(DetokenizeResult)}, DetokenizeBody)
        },
    }
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "conveyor", "version": version, "description": f"Serving `{config.model.served_name}`"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if config.server.api_key is not None:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"},
        }
        for path, operations in paths.items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}, {"apiKey": []}]
    return doc


def _operation(
    operation_id: str,
    summary: str,
    content: dict[str, Any],
    body: type | None = None,
    also: dict[str, Any] | None = None,
    error: type = ErrorBody,
) -> dict[str, Any]:
    operation: dict[str, Any] = {"operationId": operation_id, "summary": summary}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    operation["responses"] = {"200": _ok(content), **(also or {}), "default": _error(error)}
    return operation


def _by_id(operation: dict[str, Any], query: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """An operation on one stored response, named by the path's `response_id`."""
    operation["parameters"] = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}, *query]
    return operation


# The query of a page of input items (responses_api/pages.py).
_PAGE = (
    {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    {"name": "after", "in": "query", "schema": {"type": "string"}},
    {"name": "before", "in": "query", "schema": {"type": "string"}},
)


def _ok(content: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {media: {"schema": schema} for media, schema in content.items()}}


def _error(error: type) -> dict[str, Any]:
    return {"description": "An error", "content": {"application/json": {"schema": _ref(error)}}}


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}
