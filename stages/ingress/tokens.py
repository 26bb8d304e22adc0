"""POST /tokenize and POST /detokenize, answered in the ingress process itself.

Both use a PromptEncoder (tokenizers + jinja2, no torch) built from the checkpoint, with the
server's chat template override, exactly as the tokenizer stage builds its own: /tokenize gives
the ids a generation request would be scheduled with. The encoder loads on first use, off the
event loop; so does every encode or decode, a long prompt being milliseconds of CPU. The
generation routes borrow it to echo prompts given as token ids. Messages with images are a 400
naming the first image part (`check_no_images`, which count_tokens shares).
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.stages.ingress.bodies import DetokenizeBody, DetokenizeResult, TokenizeBody, TokenizeResult
from conveyor.stages.ingress.chat_messages import chat_messages
from conveyor.stages.ingress.errors import ApiError, check_model, read_body
from conveyor.stages.ingress.media.urls import ImageUrl, refuse
from conveyor.stages.ingress.protocol import decode
from conveyor.stages.ingress.tool_params import template_tool
from conveyor.stages.tokenizer.encoder import PromptEncoder, template_messages
from conveyor.stages.tokenizer.length_limit import PromptTooLong

log = logging.getLogger(__name__)

TOKENIZE_CONTEXTS = 16  # /tokenize counts up to this many times max_model_len tokens


class LazyEncoder:
    """The PromptEncoder, built once, on the first request that needs it."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._encoder: PromptEncoder | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> PromptEncoder:
        async with self._lock:
            if self._encoder is None:
                try:
                    self._encoder = await asyncio.to_thread(PromptEncoder.for_engine, self.config)
                except Exception as err:
                    log.exception("cannot load the tokenizer of %s", self.config.model.path)
                    raise ApiError(500, "the server cannot load the model's tokenizer", code="tokenizer_unavailable") from err
            return self._encoder

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        encoder = await self.get()
        return await asyncio.to_thread(encoder.decode, token_ids, skip_special_tokens)


class TokenRoutes:
    def __init__(self, config: EngineConfig, encoder: LazyEncoder):
        self.config = config
        self.encoder = encoder

    async def tokenize(self, request: web.Request) -> web.Response:
        body: TokenizeBody = decode(await read_body(request, self.config.server.max_body_bytes), TokenizeBody)
        check_model(self.config, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        encoder = await self.encoder.get()
        # /tokenize also counts texts longer than the context (benchmark clients calibrate with
        # them), so it refuses only past TOKENIZE_CONTEXTS contexts, having encoded about that
        # much: a 4 MB body is then a bounded slice of a thread's CPU, not seconds of it.
        max_len = TOKENIZE_CONTEXTS * self.config.model.max_model_len
        try:
            if body.prompt is not None:
                ids = await asyncio.to_thread(encoder.encode_prompt, body.prompt, max_len)
            else:
                chat, images = chat_messages(body.messages or [])
                check_no_images(images, "/tokenize")
                messages = template_messages(chat)
                try:
                    tools = None if body.tools is None else [template_tool(t) for t in body.tools]
                    ids = await asyncio.to_thread(encoder.encode_chat, messages, body.add_generation_prompt, max_len, tools)
                except ValueError as e:
                    raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
        except PromptTooLong as e:
            message = f"/tokenize counts at most {max_len} tokens; the prompt has at least {e.num_tokens}"
            raise ApiError(400, message, param="prompt", code="prompt_too_long") from None
        result = TokenizeResult(tokens=ids, count=len(ids), max_model_len=self.config.model.max_model_len)
        return _json(result)

    async def detokenize(self, request: web.Request) -> web.Response:
        body: DetokenizeBody = decode(await read_body(request, self.config.server.max_body_bytes), DetokenizeBody)
        check_model(self.config, body.model)
        vocab_size = self.config.model.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
        text = await self.encoder.decode(body.tokens, body.skip_special_tokens)
        return _json(DetokenizeResult(prompt=text))


def check_no_images(images: list[ImageUrl], route: str) -> None:
    """The counting routes take text alone. An image's tokens are known only once the tokenizer
    stage has preprocessed it (their number follows its size for Qwen2-VL); vLLM's /tokenize
    counts the unexpanded image markers instead (vllm issue 16191), a number no generation uses."""
    if images:
        message = (
            f"{route} counts text only: an image's tokens are known once the tokenizer stage has "
            "preprocessed it; send the request and read its usage instead"
        )
        raise refuse(images[0].part, message, "images_not_supported")


def _json(result: msgspec.Struct) -> web.Response:
    return web.Response(body=msgspec.json.encode(result), content_type="application/json")
