"""POST /v1/completions and /v1/chat/completions: from a body to an answer, through the engine.

A request is parsed (protocol.py) and submitted as one TokenizeRequest per prompt (a completion
batch fans out; each engine request has its own id, the answer the HTTP request's). Its
RequestStream first brings each engine request's verdict: a RequestRejected (a tokenizer's 400,
the scheduler's 429 with Retry-After) becomes an error answer before any SSE byte, and the other
prompts of the batch are aborted; a RequestAccepted or a first TextDelta admits it. Once every
prompt is admitted the answer begins: TextDelta events until every choice has a finish reason.
A client that goes away before that (a failed write, or aiohttp cancelling the handler) turns
into an AbortRequest to the scheduler. An error after a stream began (the engine stopping, a
bug, or a choice the scheduler ended with FinishReason.ERROR) ends the stream with an error
event, then [DONE]; before any byte, the same errors are a 500 JSON answer. A choice that ends
in ERROR (its logits were not finite) fails the whole HTTP request: its other prompts and
choices are aborted. A chat's images are resolved (media/loader.py: decoded, fetched, checked)
before submission, so an image's 400 comes before the tokenizer sees the request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.stages.ingress.engine_client import EngineClient, Event, RequestStream
from conveyor.stages.ingress.errors import ApiError, check_model, draining, not_ready, read_body
from conveyor.stages.ingress.media.loader import ImageLoader
from conveyor.stages.ingress.protocol import Generation, check_num_seqs, parse_chat, parse_completion
from conveyor.stages.ingress.responses import DONE, SSE_HEADERS, ResponseBuilder, write_quietly
from conveyor.stages.ingress.tokens import LazyEncoder
from conveyor.stages.ingress.tools.answer import chat_answer
from conveyor.stages.ingress.tools.reasoning import ReasoningParser
from conveyor.stages.ingress.tools.template import tool_format
from conveyor.wire.messages import FinishReason, RequestAccepted, RequestRejected, TextDelta

log = logging.getLogger(__name__)


class Fanout:
    """The engine requests behind one HTTP request: which prompt each is, which were admitted."""

    def __init__(self, request_ids: list[str], builder: ResponseBuilder):
        self.request_ids = request_ids
        self.builder = builder
        self.prompt_of = {request_id: p for p, request_id in enumerate(request_ids)}
        self.awaiting_verdict = set(request_ids)
        self.rejected: set[str] = set()

    def fold(self, events: list[Event]) -> list[tuple[int, TextDelta]]:
        """Take the events into the builder; the (prompt, TextDelta) pairs among them, in order.
        A rejection raises its ApiError."""
        deltas = []
        for event in events:
            p = self.prompt_of[event.request_id]
            self.awaiting_verdict.discard(event.request_id)
            if isinstance(event, TextDelta):
                delta = self.builder.add(p, event)
                if event.finish_reason is FinishReason.ERROR:
                    raise _sampling_failed()
                deltas.append((p, delta))
            elif isinstance(event, RequestAccepted):
                self.builder.accept(p, event.num_prompt_tokens)
            else:
                self.rejected.add(event.request_id)
                raise _rejection(event)
        return deltas

    def verdicts_end(self, events: list[Event]) -> int:
        """How many of `events` to fold before every prompt has its verdict (all of them if they
        do not get there): what comes after belongs to the answer, not to its admission."""
        waiting = set(self.awaiting_verdict)
        for i, event in enumerate(events):
            waiting.discard(event.request_id)
            if not waiting:
                return i + 1
        return len(events)

    def close(self, engine: EngineClient) -> None:
        """Forget the finished and rejected engine requests; abort the others."""
        unfinished = []
        for p, request_id in enumerate(self.request_ids):
            if request_id in self.rejected or self.builder.prompt_finished(p):
                engine.release(request_id)
            else:
                unfinished.append(request_id)
        engine.abort(unfinished)


class Run:
    """One admitted HTTP request, from its engine requests' events to its answer: the builder
    folds them in; `batches()` gives a stream's deltas as they come, `finish()` waits for a
    one-body answer. The routes that speak another API over the chat path (responses_api/,
    anthropic/) read its builder's objects instead of its bytes."""

    def __init__(self, fanout: Fanout, stream: RequestStream, deltas: list[tuple[int, TextDelta]], rest: list[Event]):
        self.fanout = fanout
        self.builder = fanout.builder
        self._stream = stream
        self._deltas = deltas  # folded with the verdicts, not yet sent
        self._rest = rest  # came with the last verdict, not yet folded

    async def batches(self) -> AsyncIterator[list[tuple[int, TextDelta]]]:
        """Folded (prompt, delta) pairs, a batch at a time, until every choice has finished. A
        choice ending in ERROR, or a rejection, raises its ApiError."""
        deltas, rest = self._deltas, self._rest
        self._deltas, self._rest = [], []
        while True:
            if deltas:
                yield deltas
            if self.builder.finished:
                return
            events, rest = rest or await self._stream.take(), []  # first what came with the verdicts
            deltas = self.fanout.fold(events)

    async def finish(self) -> None:
        """Fold every event until every choice has finished."""
        async for _ in self.batches():
            pass


class GenerateRoutes:
    def __init__(self, config: EngineConfig, engine: EngineClient, encoder: LazyEncoder, system_fingerprint: str):
        self.config = config
        self.engine = engine
        self.encoder = encoder
        self.system_fingerprint = system_fingerprint
        self.images = ImageLoader(config)  # its fetch session closes with the app (app.py)
        # Chat answers' formats, found once at start: a bad flag fails the ingress, not a request.
        self.tool_format = tool_format(config)
        self.reasoning_format = config.server.reasoning_parser
        if self.reasoning_format is not None:
            ReasoningParser(self.reasoning_format)  # raises ValueError for an unknown name

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def check_serving(self) -> None:
        """Every generation route's first check: a 503 while draining or (re)loading."""
        if self.engine.draining:
            raise draining()
        if not self.engine.ready:
            raise not_ready()

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrival_time = time.time()
        self.check_serving()
        data = await read_body(request, self.config.server.max_body_bytes)
        gen = (parse_chat if chat else parse_completion)(data, self.config.model.vocab_size)
        async with self.run(gen, chat=chat, arrival_time=arrival_time) as run:
            if gen.stream:
                return await self._answer_stream(request, run)
            await run.finish()
            return web.Response(body=run.builder.body(), content_type="application/json")

    @contextlib.asynccontextmanager
    async def run(self, gen: Generation, *, chat: bool, arrival_time: float, id_prefix: str | None = None) -> AsyncIterator[Run]:
        """Submit `gen` and wait until every prompt is admitted: a rejection raises its ApiError
        before the caller has sent a byte. On leaving, the finished and rejected engine requests
        are forgotten and the others aborted (a client gone, an error)."""
        check_num_seqs(gen, self.config.server.max_seqs_per_request)
        model = self.config.model
        if self.config.lora.enable_lora and gen.model not in (None, model.served_name):
            gen.params = msgspec.structs.replace(gen.params, adapter=gen.model)  # the scheduler knows the adapters: 404 there
        else:
            check_model(self.config, gen.model)
        if model.pooling is not None and gen.params.pooling is None:
            message = f"the model `{model.served_name}` is an embedding model: it serves POST /v1/embeddings, not generation"
            raise ApiError(400, message, param="model", code="model_not_generative")
        await self.images.load(gen)  # done already for a background response (responses_api/routes.py)
        response_id = self.engine.new_request_id(id_prefix or ("chatcmpl" if chat else "cmpl"))
        num_prompts = len(gen.prompts)
        request_ids = [response_id] if num_prompts == 1 else [f"{response_id}-{p}" for p in range(num_prompts)]
        builder = ResponseBuilder(
            response_id,
            model.served_name,
            chat=chat,
            params=gen.params,
            system_fingerprint=self.system_fingerprint,
            stream=gen.stream,
            include_usage=gen.include_usage,
            return_token_ids=gen.return_token_ids,
            echo=await self._echo(gen) if gen.echo else None,
            num_prompts=num_prompts,
            answer=chat_answer(gen.tool_mode, gen.tool_name, self.tool_format, self.reasoning_format) if chat else None,
            prompt_only=gen.prompt_only,
            show_prompt_logprobs=gen.show_prompt_logprobs,
        )
        fanout = Fanout(request_ids, builder)
        stream = self.engine.submit(request_ids, gen, arrival_time)
        try:
            # Held until every prompt is admitted: a rejection must come before any byte. Events
            # that arrive with the last verdict are the answer's: once admitted, a stream begins,
            # and a failure after that is an error event in it, however fast it came.
            deltas: list[tuple[int, TextDelta]] = []
            rest: list[Event] = []
            while fanout.awaiting_verdict:
                events = await stream.take()
                cut = fanout.verdicts_end(events)
                deltas += fanout.fold(events[:cut])
                rest = events[cut:]
            yield Run(fanout, stream, deltas, rest)
        finally:
            fanout.close(self.engine)

    async def _answer_stream(self, request: web.Request, run: Run) -> web.StreamResponse:
        builder = run.builder
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            async for deltas in run.batches():
                await response.write(builder.sse_chunks(deltas))
            if builder.include_usage:
                await response.write(builder.usage_chunk())
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            log.debug("client of %s went away", builder.request_id)
        except ApiError as e:  # after the stream began: say so in the stream, then end it
            await write_quietly(response, b"data: " + e.body() + b"\n\n" + DONE)
        except Exception:
            log.exception("failed while streaming %s", builder.request_id)
            error = ApiError(500, "internal server error", error_type="server_error")
            await write_quietly(response, b"data: " + error.body() + b"\n\n" + DONE)
        return response

    async def _echo(self, gen: Generation) -> list[str]:
        """Each prompt's text, as echo puts it before its choices' text."""
        skip = gen.params.skip_special_tokens
        texts = []
        for prompt in gen.prompts:
            if prompt.token_ids is not None:
                texts.append(await self.encoder.decode(prompt.token_ids, skip))
            else:
                assert prompt.text is not None  # a prompt is text or token ids (messages are not echoed)
                texts.append(prompt.text)
        return texts


def _sampling_failed() -> ApiError:
    message = (
        "the model produced non-finite logits for this request (NaN, infinity, or every token "
        "masked, e.g. by min_tokens past the end of a structured output), so no token could be sampled"
    )
    return ApiError(500, message, code="non_finite_logits")  # a 5xx: its type is server_error


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
