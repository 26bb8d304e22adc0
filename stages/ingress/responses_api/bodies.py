"""The body of POST /v1/responses, as msgspec Structs.

What decoding enforces here (types, bounds, the tags of tools and formats) is a 400 naming the
field, as on the other routes (protocol.decode); openapi.py publishes these same classes. Input
items are one Struct with every item type's fields rather than a tagged union: OpenAI lets a
message item leave out its `type`, which a msgspec tag cannot be. items.py checks that each item
has the fields its type needs. Fields OpenAI defines that change nothing here (`reasoning`,
`truncation`, `include`, `user`, ...) are accepted and ignored, as unknown fields are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from conveyor.stages.ingress.bodies import Body, NonEmptyText, Positive

# OpenAI's bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]], Meta(max_length=16)]


class ItemContentPart(Body, kw_only=True):
    """input_text (a user's), input_image, output_text (an earlier answer's) or refusal; others are a 400."""

    type: str
    text: str | None = None
    refusal: str | None = None
    # input_image: a data: URL or an http(s) URL; file_id (OpenAI's Files API) is refused
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None  # "auto", "low", "high": accepted; the model's processor decides


class InputItem(Body, kw_only=True):
    """A message (the default type), a function_call, a function_call_output, or a reasoning
    item (an earlier answer's; dropped from the conversation, as chat templates drop it)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    id: str | None = None
    status: str | None = None
    # message
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ItemContentPart] | None = None
    # function_call (and call_id for its output)
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    # function_call_output
    output: str | list[ItemContentPart] | None = None
    # reasoning
    summary: list[Any] | None = None


class FunctionTool(Body, kw_only=True):
    """Responses' flat function tool (the chat route's has these fields under `function`)."""

    type: Literal["function"]
    name: NonEmptyText
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Body, kw_only=True):
    type: Literal["function"]
    name: str


class TextOutputFormat(Body, tag_field="type"):
    pass


class TextPlainFormat(TextOutputFormat, tag="text"):
    pass


class TextJsonObjectFormat(TextOutputFormat, tag="json_object"):
    pass


class TextJsonSchemaFormat(TextOutputFormat, tag="json_schema", kw_only=True):
    """Responses' flat json_schema format (the chat route nests these under `json_schema`)."""

    name: str | None = None
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body, kw_only=True):
    format: TextPlainFormat | TextJsonObjectFormat | TextJsonSchemaFormat | None = None


class ResponsesBody(Body, kw_only=True):
    model: str | None = None
    input: str | list[InputItem] = []
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Positive | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: Metadata | None = None
    previous_response_id: str | None = None
    user: str | None = None  # accepted, echoed, ignored
