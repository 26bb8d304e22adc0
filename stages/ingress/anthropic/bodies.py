"""Anthropic's request bodies (Messages, count_tokens) and fixed-shape answers, as msgspec Structs.

The bounds Anthropic documents sit on the fields (temperature in [0, 1], max_tokens from 1,
max_tokens and model required), so decoding enforces them and openapi.py publishes them. Content
blocks are a tagged union on `type`: text, image, tool_use, tool_result and thinking are read;
document blocks decode so that translate.py can refuse them by name. An image's source stays a
plain object that translate.py checks, so each refusal says what the block lacks. Unknown fields (cache_control,
citations, service_tier, ...) are ignored, as the chat bodies ignore theirs. Component names in
/openapi.json are the class names, so they must not repeat a name of ../bodies.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from conveyor.stages.ingress.bodies import Body, NonEmptyText, NonNegative, Positive


class Block(Body, tag_field="type"):
    pass


class TextBlockParam(Block, tag="text"):
    text: str


class ImageBlockParam(Block, tag="image"):
    # {"type": "base64", "media_type": "image/png", "data": ...} or {"type": "url", "url": ...}
    source: dict[str, Any] | None = None


class DocumentBlockParam(Block, tag="document"):  # decoded to be refused with a clear 400
    source: dict[str, Any] | None = None


class ToolUseBlockParam(Block, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ToolResultContent = TextBlockParam | ImageBlockParam | DocumentBlockParam


class ToolResultBlockParam(Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[ToolResultContent] | None = None
    is_error: bool = False  # accepted; the chat template has no place for it


class ThinkingBlockParam(Block, tag="thinking"):  # an earlier turn's reasoning: not sent to the template
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlockParam(Block, tag="redacted_thinking"):
    data: str | None = None


ContentBlockParam = (
    TextBlockParam
    | ImageBlockParam
    | DocumentBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
)


class MessageParam(Body, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class AnthropicTool(Body, kw_only=True):
    """A client tool. Anthropic's server tools (web search, code execution) have another `type`."""

    name: NonEmptyText
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # a client tool's, required (translate.py says so: server tools have none)
    type: str | None = None  # "custom" or absent


class AnthropicToolChoice(Body, tag_field="type"):
    pass


class ToolChoiceAuto(AnthropicToolChoice, tag="auto"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(AnthropicToolChoice, tag="any"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(AnthropicToolChoice, tag="tool"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(AnthropicToolChoice, tag="none"):
    pass


ToolChoiceParam = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone
Turns = Annotated[list[MessageParam], Meta(min_length=1)]


class AnthropicMetadata(Body, kw_only=True):
    user_id: str | None = None  # accepted, ignored


class AnthropicJsonFormat(Body, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class AnthropicOutputConfig(Body, kw_only=True):
    format: AnthropicJsonFormat | None = None  # structured output: the text answer follows the schema
    effort: str | None = None  # accepted, ignored


class CountTokensBody(Body, kw_only=True):
    """What count_tokens reads: the parts of a Messages body that make the prompt."""

    model: str
    messages: Turns
    system: str | list[TextBlockParam] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None  # accepted: whether a model reasons is its template's call


class MessagesBody(CountTokensBody, kw_only=True):
    max_tokens: Positive
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: NonNegative | None = None  # 0: no top-k filter
    metadata: AnthropicMetadata | None = None
    output_config: AnthropicOutputConfig | None = None


# --- answers with a fixed shape ------------------------------------------------------------


class CountTokensResult(msgspec.Struct):
    input_tokens: int


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    type: Literal["error"]
    error: AnthropicErrorDetail


ANTHROPIC_BODIES = (MessagesBody, CountTokensBody, CountTokensResult, AnthropicError)
