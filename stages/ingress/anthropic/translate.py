"""An Anthropic Messages body as the chat request that asks the same, parsed by the chat route's own
parse_chat: tools, tool_choice, stop strings and sampling are validated and mean what they mean on
/v1/chat/completions, and the prompt is the one the chat template renders there.

The mapping: `system` is a leading system message; a user turn's text blocks are its content, its
tool_result blocks tool messages (placed before the turn's text, which Anthropic puts after them);
an assistant turn's text is its content, its tool_use blocks its tool_calls, its thinking blocks
are dropped (templates drop earlier reasoning). A tool_result must answer a tool_use id of an
earlier turn. Tools become function tools (input_schema the parameters); tool_choice auto, any,
tool and none become "auto", "required", the named function and "none"; disable_parallel_tool_use
becomes parallel_tool_calls false; output_config.format (a JSON schema) becomes response_format
json_schema. A user turn's (or a tool_result's) image blocks become image_url parts in place: a
base64 source as a data: URL (JPEG, PNG, GIF or WebP, as Anthropic takes), a url source as its URL;
each is labelled `messages[i].content[j]` (in a tool_result, `...content[j].content[k]`), the
part every image refusal names. Document blocks, images in assistant turns, file sources, server
tools and a final assistant turn (prefill) are refused with a 400 that says so.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.stages.ingress.anthropic.bodies import (
    AnthropicTool,
    ContentBlockParam,
    CountTokensBody,
    ImageBlockParam,
    MessagesBody,
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingBlockParam,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceParam,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.protocol import Generation, parse_chat

# The media types Anthropic takes in a base64 image source.
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def generation(body: MessagesBody, vocab_size: int) -> Generation:
    chat, image_parts = chat_request(body)
    chat |= {"max_tokens": body.max_tokens, "stream": body.stream}
    if "" in (body.stop_sequences or []):
        raise ApiError(400, "stop_sequences must not hold an empty string", param="stop_sequences")
    sampling = {"stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    chat |= {k: v for k, v in sampling.items() if v is not None}
    if body.output_config is not None and body.output_config.format is not None:
        schema = body.output_config.format.schema
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    gen = parse_chat(msgspec.json.encode(chat), vocab_size)
    gen.label_images(image_parts)
    return gen


def prompt_of(body: CountTokensBody, vocab_size: int) -> Generation:
    """What count_tokens counts: the prompt (messages and tools) a generation would be given."""
    chat, image_parts = chat_request(body)
    gen = parse_chat(msgspec.json.encode(chat), vocab_size)
    gen.label_images(image_parts)
    return gen


def chat_request(body: CountTokensBody) -> tuple[dict[str, Any], list[str]]:
    """The chat body's model, messages, tools and tool_choice; and the label of each image part,
    in the order the chat messages hold them."""
    if body.messages[-1].role == "assistant":
        message = "a final assistant message (prefill) is not supported: end with a user message"
        raise ApiError(400, message, param=f"messages[{len(body.messages) - 1}]")
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    tool_use_ids: set[str] = set()
    image_parts: list[str] = []
    for i, turn in enumerate(body.messages):
        if isinstance(turn.content, str):
            messages.append({"role": turn.role, "content": turn.content})
        elif turn.role == "assistant":
            messages.append(_assistant(turn.content, i, tool_use_ids))
        else:
            messages.extend(_user(turn.content, i, tool_use_ids, image_parts))
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools is not None:
        chat["tools"] = [_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
        chat["parallel_tool_calls"] = not getattr(body.tool_choice, "disable_parallel_tool_use", False)
    return chat, image_parts


def _assistant(blocks: list[ContentBlockParam], i: int, tool_use_ids: set[str]) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        match block:
            case TextBlockParam():
                texts.append(_part(block.text))
            case ToolUseBlockParam():
                tool_use_ids.add(block.id)
                calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}})
            case ThinkingBlockParam() | RedactedThinkingBlockParam():
                pass
            case _:
                raise _unsupported(block, f"messages[{i}].content[{j}]", "an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[ContentBlockParam], i: int, tool_use_ids: set[str], image_parts: list[str]) -> list[dict[str, Any]]:
    """The turn's tool results as tool messages, then its text and images as a user message
    (`image_parts` gets their labels in that order too)."""
    results, parts = [], []
    result_images: list[str] = []
    turn_images: list[str] = []
    for j, block in enumerate(blocks):
        at = f"messages[{i}].content[{j}]"
        match block:
            case TextBlockParam():
                parts.append(_part(block.text))
            case ImageBlockParam():
                parts.append(_image_part(block, at))
                turn_images.append(at)
            case ToolResultBlockParam():
                if block.tool_use_id not in tool_use_ids:
                    message = f"{at}: tool_result answers tool_use_id {block.tool_use_id!r}, which no earlier tool_use block has"
                    raise ApiError(400, message, param=f"{at}.tool_use_id")
                content = _result_content(block, at, result_images)
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
            case _:
                raise _unsupported(block, at, "a user message")
    image_parts += result_images + turn_images
    return results + ([{"role": "user", "content": parts}] if parts or not results else [])


def _result_content(block: ToolResultBlockParam, at: str, image_parts: list[str]) -> str | list[dict[str, Any]]:
    """A tool_result's text; with images, its text and image parts in order."""
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    parts = []
    for k, part in enumerate(block.content):
        if isinstance(part, TextBlockParam):
            parts.append(_part(part.text))
        elif isinstance(part, ImageBlockParam):
            parts.append(_image_part(part, f"{at}.content[{k}]"))
            image_parts.append(f"{at}.content[{k}]")
        else:
            raise _unsupported(part, f"{at}.content[{k}]", "a tool_result")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image_part(block: ImageBlockParam, at: str) -> dict[str, Any]:
    """The chat route's image_url part for an image block: a base64 source as a data: URL."""
    source = block.source if isinstance(block.source, dict) else {}
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in MEDIA_TYPES:
            message = f"{at}: image media_type {media_type!r} is not supported: {', '.join(MEDIA_TYPES)}"
            raise ApiError(400, message, param=f"{at}.source.media_type")
        if not isinstance(data, str) or not data:
            raise ApiError(400, f"{at}: a base64 image source needs its data", param=f"{at}.source.data")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise ApiError(400, f"{at}: a url image source needs its url", param=f"{at}.source.url")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "file":
        message = f"{at}: file image sources are not supported (this server has no Files API): send base64 or url"
        raise ApiError(400, message, param=f"{at}.source.type", code="unsupported_image_source")
    raise ApiError(400, f"{at}: an image block needs a source of type base64 or url, not {kind!r}", param=f"{at}.source.type")


def _text(system: str | list[TextBlockParam]) -> str | list[dict[str, str]]:
    return system if isinstance(system, str) else [_part(block.text) for block in system]


def _part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}  # the chat route joins a message's parts with "\n"


def _tool(tool: AnthropicTool, i: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        message = f'tools[{i}]: tool type {tool.type!r} is not supported; only client tools (type "custom") are'
        raise ApiError(400, message, param=f"tools[{i}].type")
    if tool.input_schema is None:
        raise ApiError(
            400, f"tools[{i}].input_schema is required: the JSON schema of the tool's input", param=f"tools[{i}].input_schema"
        )
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoiceParam) -> str | dict[str, Any]:
    match choice:
        case ToolChoiceAuto():
            return "auto"
        case ToolChoiceAny():
            return "required"
        case ToolChoiceTool():
            return {"type": "function", "function": {"name": choice.name}}
        case _:
            return "none"


def _unsupported(block: msgspec.Struct, at: str, where: str) -> ApiError:
    kind = block.__struct_config__.tag
    return ApiError(400, f"{at}: {kind} content blocks are not supported in {where}", param=at)
