"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items
(pages.py), POST /v1/responses/{id}/cancel.

A request becomes a chat request (items.py) that protocol.parse_chat validates, and runs through
GenerateRoutes.run, the chat route's one seam: the same template, tool and reasoning parsers,
admission (a rejection is an error answer before any byte) and aborts (a client gone, a cancel).
The chat answer becomes output items (items.py), a stream's chunk choices become events
(events.py). A request's images are resolved before anything is stored, so an image's 400 answers
even a background request. With `store` (the default) the response is kept (store.py) for GET,
`previous_response_id` and cancel; `background` runs it in a task, answers at once with status
"queued", and GET polls it; cancel aborts its engine request (status "cancelled"). Only background
responses can be cancelled, as on OpenAI (a 400 otherwise); cancelling a finished one returns it
unchanged. An unknown id is a 404.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.stages.ingress.errors import ApiError, check_json, check_model, read_body
from conveyor.stages.ingress.generate import GenerateRoutes
from conveyor.stages.ingress.protocol import Generation, decode, parse_chat
from conveyor.stages.ingress.responses import SSE_HEADERS, ResponseBuilder, write_quietly
from conveyor.stages.ingress.responses_api.answer import fail_response, finish_response, new_response
from conveyor.stages.ingress.responses_api.bodies import ResponsesBody
from conveyor.stages.ingress.responses_api.events import ResponseEvents
from conveyor.stages.ingress.responses_api.items import chat_request, input_items, new_id, output_items, responses_param
from conveyor.stages.ingress.responses_api.pages import input_items_page
from conveyor.stages.ingress.responses_api.store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
RUNNING = ("queued", "in_progress")


class ResponsesRoutes:
    def __init__(self, config: EngineConfig, generate: GenerateRoutes, store: ResponseStore | None = None):
        self.config = config
        self.generate = generate
        server = config.server
        self.store = store or ResponseStore(server.responses_store_size, server.responses_store_ttl_s)
        self.tasks: set[asyncio.Task] = set()  # background responses still running

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrival_time = time.time()
        self.generate.check_serving()
        body: ResponsesBody = decode(await read_body(request, self.config.server.max_body_bytes), ResponsesBody)
        check_model(self.config, body.model)  # here, not in a background task: a 404 answers it
        if body.background and not body.store:
            raise ApiError(400, "background responses are stored: store must be true", param="store")
        if body.background and body.stream:
            raise ApiError(400, "background responses cannot be streamed here; poll GET /v1/responses/{id}", param="stream")
        previous = self._previous(body.previous_response_id)
        conversation = previous + input_items(body)
        if not conversation:
            raise ApiError(400, "input is empty and there is no previous response to go on from", param="input")
        chat, image_parts = chat_request(body, conversation, len(previous))
        try:
            gen = parse_chat(_encode(chat), self.config.model.vocab_size)
        except ApiError as e:
            e.param = responses_param(e.param)
            raise
        gen.label_images(image_parts)
        await self.generate.images.load(gen)  # here, not in a background task: an image's 400 answers it
        entry = StoredResponse(new_response(new_id("resp"), body, self.config.model.served_name, "in_progress"), conversation)
        if body.background:
            entry.response["status"] = "queued"
            self.store.put(entry)
            entry.task = asyncio.create_task(self._background(gen, arrival_time, entry))
            self.tasks.add(entry.task)
            entry.task.add_done_callback(self.tasks.discard)
            return _json(entry.response)
        if body.stream:
            return await self._stream(request, gen, arrival_time, entry, store=body.store)
        async with self.generate.run(gen, chat=True, arrival_time=arrival_time, id_prefix="resp") as run:
            await run.finish()
            _answer(entry, run.builder)
        if body.store:
            self.store.put(entry)
        return _json(entry.response)

    async def retrieve(self, request: web.Request) -> web.Response:
        return _json(self._find(request).response)

    async def input_items(self, request: web.Request) -> web.Response:
        return _json(input_items_page(self._find(request).conversation, request.query))

    async def delete(self, request: web.Request) -> web.Response:
        entry = self._find(request)
        if entry.task is not None:
            entry.task.cancel()
        self.store.delete(entry.response["id"])
        return _json({"id": entry.response["id"], "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        check_json(request)  # no body, but a POST all the same: a cross-site form must not reach it
        entry = self._find(request)
        if not entry.response["background"]:
            raise ApiError(400, "only responses created with background set to true can be cancelled", param="response_id")
        task = entry.task
        if task is not None:
            task.cancel()
            await asyncio.wait({task})  # its engine request is aborted as it leaves GenerateRoutes.run
        if entry.response["status"] in RUNNING:  # cancelled before it began
            entry.response["status"] = "cancelled"
        return _json(entry.response)

    async def close(self, app: web.Application) -> None:
        """At shutdown: end the background responses still running (their requests are aborted)."""
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks)

    def _find(self, request: web.Request) -> StoredResponse:
        response_id = request.match_info["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return entry

    def _previous(self, response_id: str | None) -> list[dict]:
        if response_id is None:
            return []
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "previous_response_id")
        if entry.response["status"] in RUNNING:
            raise ApiError(400, f"response {response_id!r} has not finished yet", param="previous_response_id")
        return entry.next_conversation

    async def _background(self, gen: Generation, arrival_time: float, entry: StoredResponse) -> None:
        response = entry.response
        try:
            async with self.generate.run(gen, chat=True, arrival_time=arrival_time, id_prefix="resp") as run:
                response["status"] = "in_progress"
                await run.finish()
                _answer(entry, run.builder)
        except asyncio.CancelledError:
            response["status"] = "cancelled"
        except ApiError as e:
            fail_response(response, e)
        except Exception:
            log.exception("background response %s failed", response["id"])
            fail_response(response, ApiError(500, "internal server error"))
        finally:
            entry.task = None

    async def _stream(self, request: web.Request, gen: Generation, arrival_time: float, entry: StoredResponse, *, store: bool):
        events = ResponseEvents(entry.response)
        async with self.generate.run(gen, chat=True, arrival_time=arrival_time, id_prefix="resp") as run:
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            try:
                await response.write(events.start())
                finish_reason = None
                async for deltas in run.batches():
                    chunk = b""
                    for choice in run.builder.chunk_choices(deltas):
                        chunk += events.feed(choice)
                        finish_reason = choice["finish_reason"] or finish_reason
                    if chunk:
                        await response.write(chunk)
                await response.write(events.finish(finish_reason, run.builder.usage()))
                await response.write_eof()
            except ConnectionResetError:
                log.debug("client of %s went away", entry.response["id"])
                return response  # not stored: it never finished
            except ApiError as e:  # after the stream began: its terminal event says so
                await write_quietly(response, events.fail(e))
            except Exception:
                log.exception("failed while streaming %s", entry.response["id"])
                await write_quietly(response, events.fail(ApiError(500, "internal server error")))
        if store:
            self.store.put(entry)
        return response


def _answer(entry: StoredResponse, builder: ResponseBuilder) -> None:
    chat = builder.answer()
    [choice] = chat["choices"]
    finish_reason = choice["finish_reason"]
    entry.response["output"] = output_items(choice["message"], incomplete=finish_reason == "length")
    finish_response(entry.response, finish_reason, chat["usage"])


def _json(obj: dict) -> web.Response:
    return web.Response(body=_encode(obj), content_type="application/json")


def _not_found(response_id: str, param: str) -> ApiError:
    message = f"no response with id {response_id!r}: unknown, expired, or not stored (store: false)"
    return ApiError(404, message, param=param, code="response_not_found")
