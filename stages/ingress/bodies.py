"""Request and response bodies of every route, as msgspec Structs.

The bounds OpenAI documents (temperature in [0, 2], top_p in (0, 1], n from 1, ...) sit on the
fields as msgspec.Meta: decoding enforces them, the 400 names the field (protocol.py), and
openapi.py publishes them in /openapi.json from these same classes. Unknown fields are ignored,
as OpenAI-compatible servers do. What depends on the model (token ids inside the vocabulary) is
checked after decoding.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from conveyor.wire.messages import MAX_LOGPROBS, REPETITION_PENALTY_RANGE

INT64_MAX = 2**63 - 1  # anything that travels on the wire as msgpack must fit in 64 bits
MAX_SAMPLES = 128  # n and best_of above this are a 400: each sample is a sequence in the batch

Int64 = Annotated[int, Meta(ge=-(2**63), le=INT64_MAX)]
Positive = Annotated[int, Meta(ge=1, le=INT64_MAX)]
NonNegative = Annotated[int, Meta(ge=0, le=INT64_MAX)]
NumSamples = Annotated[int, Meta(ge=1, le=MAX_SAMPLES)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Meta(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])]
# A batch of prompts: strings, token ids, or lists of token ids (msgspec takes one array type in
# a union, so the items are checked in protocol.py; the schema says what they may be).
_PROMPT_ITEM = {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "array", "items": {"type": "integer"}}]}
PromptList = Annotated[list[Any], Meta(extra_json_schema={"items": _PROMPT_ITEM, "minItems": 1})]


class Body(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    pass


class StreamOptions(Body):
    include_usage: bool = False


class SamplingBody(Body):
    """The fields both generation routes share."""

    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Int64 | None = None  # 0 or less: no top-k filter
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Int64 | None = None
    n: NumSamples = 1
    best_of: NumSamples | None = None
    priority: Int64 = 0  # lower runs first
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: NonNegative = 0
    # Token id (a decimal string, JSON keys being strings) -> bias added to its logit.
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None  # accepted, ignored


class CompletionBody(SamplingBody, kw_only=True):
    prompt: str | PromptList
    logprobs: NumLogprobs | None = None  # top alternatives per token; 0: the sampled token's only
    echo: bool = False  # the prompt text before each choice's text


class ContentPart(Body, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageBody(Body, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


Messages = Annotated[list[ChatMessageBody], Meta(min_length=1)]


class ChatBody(SamplingBody, kw_only=True):
    messages: Messages
    max_completion_tokens: Positive | None = None  # wins over max_tokens
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None  # with logprobs: alternatives per token


class TokenizeBody(Body):
    """Either `prompt` (encoded with the special tokens the model adds) or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True


class DetokenizeBody(Body, kw_only=True):
    model: str | None = None
    tokens: list[Int64]
    skip_special_tokens: bool = False


# --- responses that have a fixed shape -------------------------------------------------------


class TokenizeResult(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResult(msgspec.Struct):
    prompt: str


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


REQUEST_BODIES = (CompletionBody, ChatBody, TokenizeBody, DetokenizeBody)
RESPONSE_BODIES = (TokenizeResult, DetokenizeResult, ErrorBody)
