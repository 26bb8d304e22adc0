"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

/v1/messages decodes the body (bodies.py), translates it into a chat request's Generation
(translate.py) and runs it through GenerateRoutes.run like any chat request: a rejection is an
error answer before any byte, a client gone aborts it. One answer is the chat answer shaped as a
message (reply.py); a stream is the chat chunk choices turned into Anthropic's events
(stream.py). count_tokens renders the same prompt (messages and tools through the chat template)
with the ingress's PromptEncoder, as /tokenize does, and answers {"input_tokens": N}; it needs no
engine, so it answers while the engine loads; it counts text alone (images are a 400). Errors
take Anthropic's shape (errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.stages.ingress.anthropic import errors
from conveyor.stages.ingress.anthropic.bodies import CountTokensBody, CountTokensResult, MessagesBody
from conveyor.stages.ingress.anthropic.reply import message
from conveyor.stages.ingress.anthropic.stream import MessageEvents, event
from conveyor.stages.ingress.anthropic.translate import generation, prompt_of
from conveyor.stages.ingress.errors import ApiError, check_model, read_body
from conveyor.stages.ingress.generate import GenerateRoutes, Run
from conveyor.stages.ingress.protocol import decode
from conveyor.stages.ingress.responses import SSE_HEADERS, write_quietly
from conveyor.stages.ingress.tokens import TOKENIZE_CONTEXTS, check_no_images
from conveyor.stages.tokenizer.encoder import template_messages
from conveyor.stages.tokenizer.length_limit import PromptTooLong

log = logging.getLogger(__name__)


class MessagesRoutes:
    def __init__(self, config: EngineConfig, generate: GenerateRoutes):
        self.config = config
        self.generate = generate

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrival_time = time.time()
        self.generate.check_serving()
        body: MessagesBody = decode(await read_body(request, self.config.server.max_body_bytes), MessagesBody)
        gen = generation(body, self.config.model.vocab_size)
        stop_sequences = body.stop_sequences or []
        async with self.generate.run(gen, chat=True, arrival_time=arrival_time, id_prefix="msg") as run:
            if body.stream:
                return await self._stream(request, run, stop_sequences)
            await run.finish()
            answer = message(run.builder.answer(), stop_sequences)
            return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    async def count_tokens(self, request: web.Request) -> web.Response:
        body: CountTokensBody = decode(await read_body(request, self.config.server.max_body_bytes), CountTokensBody)
        gen = prompt_of(body, self.config.model.vocab_size)
        check_model(self.config, gen.model)
        check_no_images(gen.image_urls, "count_tokens")
        assert gen.prompts[0].messages is not None  # a chat request's one prompt is its messages
        messages = template_messages(gen.prompts[0].messages)
        encoder = await self.generate.encoder.get()
        max_len = TOKENIZE_CONTEXTS * self.config.model.max_model_len  # as /tokenize bounds its work
        try:
            ids = await asyncio.to_thread(encoder.encode_chat, messages, gen.add_generation_prompt, max_len, gen.tools)
        except ValueError as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
        except PromptTooLong as e:
            too_long = f"count_tokens counts at most {max_len} tokens; the prompt has at least {e.num_tokens}"
            raise ApiError(400, too_long, param="messages", code="prompt_too_long") from None
        return web.Response(body=msgspec.json.encode(CountTokensResult(input_tokens=len(ids))), content_type="application/json")

    async def _stream(self, request: web.Request, run: Run, stop_sequences: list[str]) -> web.StreamResponse:
        builder = run.builder
        events = MessageEvents(builder.request_id, builder.model, stop_sequences)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            await response.write(events.start(builder.usage()))
            async for deltas in run.batches():
                out = []
                for choice in builder.chunk_choices(deltas):
                    out.append(events.feed(choice))
                    if choice["finish_reason"] is not None:
                        out.append(events.finish(choice, builder.usage()))
                await response.write(b"".join(out))
            await response.write_eof()
        except ConnectionResetError:
            log.debug("client of %s went away", builder.request_id)
        except ApiError as e:  # after the stream began: an error event ends it
            await _end_with(response, e)
        except Exception:
            log.exception("failed while streaming %s", builder.request_id)
            await _end_with(response, ApiError(500, "internal server error", error_type="server_error"))
        return response


async def _end_with(response: web.StreamResponse, error: ApiError) -> None:
    await write_quietly(response, event("error", {"error": msgspec.to_builtins(errors.error_object(error).error)}))
