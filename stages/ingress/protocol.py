"""Request bodies of /v1/completions and /v1/chat/completions, decoded and checked.

`parse_completion` and `parse_chat` turn raw body bytes into a `Generation`: what goes into the
TokenizeRequest (prompt text, prompt ids or chat messages, plus SamplingParams) and how to answer
(stream, usage, token ids). Every problem is an ApiError naming the offending `param`; unknown
fields are ignored, as OpenAI-compatible servers do. `best_of` (accepted on both routes, as vLLM
does) asks for that many samples of which the `n` most likely are returned, so it cannot stream.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any

import msgspec

from conveyor.stages.ingress.errors import ApiError
from conveyor.wire.messages import ChatMessage, SamplingParams

# Anything that travels on the wire as msgpack must fit in 64 bits.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MAX_SAMPLES = 128  # n and best_of above this are a 400: each sample is a sequence in the batch
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class _Body(msgspec.Struct, forbid_unknown_fields=False):
    pass


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body, kw_only=True):
    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    seed: Int64 | None = None
    n: Int64 = 1
    best_of: Int64 | None = None
    priority: Int64 = 0  # lower runs first
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: Int64 | None = None
    echo: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessageBody(_Body):
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessageBody]
    max_completion_tokens: Int64 | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False


@dataclasses.dataclass
class Generation:
    """One validated request, ready to become a TokenizeRequest."""

    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    model: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    priority: int = 0


def parse_completion(data: bytes, vocab_size: int) -> Generation:
    body = _decode(data, CompletionBody)
    if body.logprobs is not None or body.echo:
        param = "echo" if body.logprobs is None else "logprobs"
        raise ApiError(400, "logprobs and echo are not supported yet", param=param)
    gen = _generation(body, body.max_tokens if body.max_tokens is not None else 16, vocab_size)
    gen.prompt, gen.prompt_token_ids = _prompt(body.prompt, vocab_size)
    return gen


def parse_chat(data: bytes, vocab_size: int) -> Generation:
    body = _decode(data, ChatBody)
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported yet", param="logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    gen = _generation(body, max_tokens, vocab_size)  # None: until EOS or the context is full
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    gen.messages = [_chat_message(m, i) for i, m in enumerate(body.messages)]
    gen.add_generation_prompt = body.add_generation_prompt
    return gen


def _decode(data: bytes, type: Any) -> Any:
    try:
        return msgspec.json.decode(data, type=type)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}", param=_param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


def _param_of(message: str) -> str | None:
    """`... - at `$.messages[0].content`` -> "messages[0].content"; a missing field names itself."""
    if m := re.search(r"at `\$\.?(.+?)`$", message):
        return m.group(1)
    if m := re.search(r"missing required field `(.+?)`", message):
        return m.group(1)
    return None


def _generation(body: _Common, max_tokens: int | None, vocab_size: int) -> Generation:
    if body.stop:
        raise ApiError(400, "stop strings are not supported yet; use stop_token_ids", param="stop")
    for token_id in body.stop_token_ids or []:
        if not 0 <= token_id < vocab_size:
            raise ApiError(400, f"stop token id {token_id} is outside the vocabulary", param="stop_token_ids")
    for name, value in (("n", body.n), ("best_of", body.best_of)):
        if value is not None and value > MAX_SAMPLES:
            raise ApiError(400, f"{name} must be at most {MAX_SAMPLES}", param=name)
    fields = dict(
        n=body.n,
        best_of=body.best_of,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop_token_ids=body.stop_token_ids,
    )
    try:
        params = SamplingParams(
            **{k: v for k, v in fields.items() if v is not None},
            max_tokens=max_tokens,
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as e:
        field = str(e).split(" ", 1)[0]  # SamplingParams messages start with the field's name
        raise ApiError(400, str(e), param=field if field in SamplingParams.__struct_fields__ else None) from None
    if body.stream and params.num_samples > params.n:
        raise ApiError(400, "best_of greater than n cannot be streamed", param="best_of")
    return Generation(
        params=params,
        stream=body.stream,
        include_usage=body.stream and body.stream_options is not None and body.stream_options.include_usage,
        return_token_ids=body.return_token_ids,
        model=body.model,
        priority=body.priority,
    )


def _prompt(prompt: str | list[Any], vocab_size: int) -> tuple[str | None, list[int] | None]:
    """A string, a list of one string, or a list of token ids."""
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        if not all(0 <= p < vocab_size for p in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return None, prompt
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) and p for p in prompt):
        if len(prompt) > 1:
            raise ApiError(400, "a batch of several prompts is not supported yet", param="prompt")
        if isinstance(prompt[0], str) or all(isinstance(p, int) for p in prompt[0]):
            return _prompt(prompt[0], vocab_size)
    raise ApiError(400, "prompt must be a string, a list of strings or a list of token ids", param="prompt")


def _chat_message(message: ChatMessageBody, i: int) -> ChatMessage:
    role = ROLES.get(message.role)
    if role is None:
        raise ApiError(400, f"unsupported role {message.role!r}", param=f"messages[{i}].role")
    if message.content is None or isinstance(message.content, str):
        return ChatMessage(role=role, content=message.content or "")
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, "only text content parts are supported", param=f"messages[{i}].content")
        texts.append(part.text)
    return ChatMessage(role=role, content="\n".join(texts))
