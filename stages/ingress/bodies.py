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


# --- constraints on the output (structured_params.py turns them into a StructuredOutput) ------


class Format(Body, tag_field="type"):
    pass


class TextFormat(Format, tag="text"):
    pass


class JsonObjectFormat(Format, tag="json_object"):
    pass


class JsonSchemaSpec(Body, kw_only=True):
    name: str | None = None  # OpenAI requires a name; nothing here reads it
    description: str | None = None
    schema: dict[str, Any] | None = None  # None is a 400: without it there is nothing to enforce
    strict: bool | None = None  # accepted; the schema is always enforced


class JsonSchemaFormat(Format, tag="json_schema"):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat
Choices = Annotated[list[str], Meta(min_length=1)]
NonEmptyText = Annotated[str, Meta(min_length=1)]


class StructuredOutputsBody(Body, kw_only=True):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): at most one of the first five."""

    json: dict[str, Any] | str | None = None  # a JSON schema, as an object or its JSON text
    regex: NonEmptyText | None = None
    choice: Choices | None = None
    grammar: NonEmptyText | None = None  # EBNF
    json_object: bool | None = None
    structural_tag: str | None = None  # not supported: a 400
    # vLLM's options for its grammar backends; accepted, no effect here.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


# --- tool calling (chat only; tool_params.py) -------------------------------------------------


class FunctionBody(Body, kw_only=True):
    name: NonEmptyText
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema; absent: any object
    strict: bool | None = None


class ToolBody(Body, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionBody


class FunctionName(Body, kw_only=True):
    name: str


class NamedToolChoice(Body, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCallBody(Body, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text as OpenAI sends it; an object is taken too


class ToolCallBody(Body, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


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
    # One constraint on the output at most (OpenAI's response_format, or vLLM's extras).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonEmptyText | None = None
    # vLLM's extension: each prompt token's logprob, rank and this many alternatives.
    prompt_logprobs: NumLogprobs | None = None


class CompletionBody(SamplingBody, kw_only=True):
    prompt: str | PromptList
    max_tokens: NonNegative | None = None  # 0: the prompt alone (with echo or prompt_logprobs: its logprobs)
    logprobs: NumLogprobs | None = None  # top alternatives per token; 0: the sampled token's only
    echo: bool = False  # the prompt text before each choice's text
    tools: list[Any] | None = None  # a 400: tools are for /v1/chat/completions


class ImageUrlBody(Body, kw_only=True):
    url: str  # data:image/...;base64,... or an http(s) URL the ingress fetches (stages/ingress/media/)
    detail: str | None = None  # OpenAI's "auto", "low", "high": accepted; the model's processor decides


class ContentPart(Body, kw_only=True):
    type: str  # "text" or "image_url"
    text: str | None = None
    image_url: ImageUrlBody | str | None = None  # some clients send the URL as a bare string


class ChatMessageBody(Body, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None


Messages = Annotated[list[ChatMessageBody], Meta(min_length=1)]


class ChatBody(SamplingBody, kw_only=True):
    messages: Messages
    max_completion_tokens: Positive | None = None  # wins over max_tokens
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None  # with logprobs: alternatives per token
    tools: list[ToolBody] | None = None
    # "none", "auto", "required" or one function; default "auto" with tools, else "none".
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class EmbeddingsBody(Body, kw_only=True):
    """POST /v1/embeddings (embeddings.py)."""

    input: str | PromptList  # a string, token ids, or a batch of either
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Positive | None = None  # the vector's first entries, where the model was trained for it
    user: str | None = None  # accepted, ignored


class LoadLoraBody(Body, kw_only=True):
    """POST /v1/load_lora_adapter (lora_routes.py), as vLLM's."""

    lora_name: NonEmptyText
    lora_path: NonEmptyText  # a PEFT adapter directory on the server


class UnloadLoraBody(Body, kw_only=True):
    """POST /v1/unload_lora_adapter."""

    lora_name: NonEmptyText


class TokenizeBody(Body):
    """Either `prompt` (encoded with the special tokens the model adds) or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True
    tools: list[ToolBody] | None = None  # with messages: passed to the chat template


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


REQUEST_BODIES = (CompletionBody, ChatBody, EmbeddingsBody, LoadLoraBody, UnloadLoraBody, TokenizeBody, DetokenizeBody)
RESPONSE_BODIES = (TokenizeResult, DetokenizeResult, ErrorBody)
