"""Responses items to chat messages and back: what makes /v1/responses a translation of the chat
route rather than a second generation path.

`input_items` checks the request's input (a string is one user message) and gives it as stored
items: plain dicts in the Responses shape, each with an id (the client's, else a new one), a
message's content as one text part, or, where it holds input_image parts, its parts in order (the
image_url kept, so a later turn that goes on from it sends the image again). `chat_request`
turns a whole conversation (a previous response's input and output, then the new input) plus the
request's options into a /v1/chat/completions body, which protocol.parse_chat then validates
exactly as the chat route does, and names each image part as the Responses body did
(`input[i].content[j]`; `previous_response_id` for one an earlier request sent). `output_items`
turns a chat answer's message into output items: a reasoning item (from the reasoning parser's
`reasoning_content`), a message (output_text), then one function_call per tool call, in that order.
Invariants: a function_call joins the assistant message just before it (one chat turn: its text,
then its calls); reasoning items are not sent back to the model (chat templates drop earlier
turns' reasoning); ids are new per item (`msg_`, `fc_`, `rs_`), a call's `call_id` is the chat
tool call's id.
"""

from __future__ import annotations

import secrets
from typing import Any

from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.responses_api.bodies import (
    FunctionToolChoice,
    InputItem,
    ItemContentPart,
    ResponsesBody,
    TextJsonObjectFormat,
    TextJsonSchemaFormat,
)

Item = dict[str, Any]
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def input_items(body: ResponsesBody) -> list[Item]:
    if isinstance(body.input, str):
        return [_message(None, "user", body.input)]
    return [_item(item, f"input[{i}]") for i, item in enumerate(body.input)]


def _item(item: InputItem, at: str) -> Item:
    match item.type:
        case "message":
            if item.role is None:
                raise ApiError(400, f"{at} is a message and needs a role", param=f"{at}.role")
            if item.content is None:
                raise ApiError(400, f"{at} is a message and needs content", param=f"{at}.content")
            return _message(item.id, item.role, _content(item.content, item.role, f"{at}.content"))
        case "function_call":
            for field in ("call_id", "name", "arguments"):
                if getattr(item, field) is None:
                    raise ApiError(400, f"{at} is a function_call and needs {field}", param=f"{at}.{field}")
            assert item.call_id is not None and item.name is not None and item.arguments is not None
            return call_item(item.call_id, item.name, item.arguments, item_id=item.id)
        case "function_call_output":
            if item.call_id is None or item.output is None:
                field = "call_id" if item.call_id is None else "output"
                raise ApiError(400, f"{at} is a function_call_output and needs {field}", param=f"{at}.{field}")
            output = _text(item.output, f"{at}.output")
            return {
                "id": item.id or new_id("fco"),
                "type": "function_call_output",
                "status": "completed",
                "call_id": item.call_id,
                "output": output,
            }
        case _:  # reasoning: kept in the conversation, never sent to the model
            return {"id": item.id or new_id("rs"), "type": "reasoning", "summary": item.summary or []}


def _message(item_id: str | None, role: str, content: str | list[Item]) -> Item:
    """An input message as stored (and listed): its text as one part, as OpenAI lists it, or its
    parts where it has images."""
    if role == "assistant":
        assert isinstance(content, str)  # _content refuses images there
        return message_item(content, item_id=item_id)
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
    return {"id": item_id or new_id("msg"), "type": "message", "status": "completed", "role": role, "content": parts}


def _content(content: str | list[ItemContentPart], role: str, param: str) -> str | list[Item]:
    """A message's text; where it holds input_image parts, each part in order as stored."""
    if isinstance(content, str) or not any(part.type == "input_image" for part in content):
        return _text(content, param)
    if role == "assistant":
        raise ApiError(400, f"{param}: an assistant message cannot hold images", param=param)
    parts = []
    for j, part in enumerate(content):
        at = f"{param}[{j}]"
        if part.type != "input_image":
            parts.append({"type": "input_text", "text": _text([part], at)})
        elif part.image_url:
            parts.append({"type": "input_image", "image_url": part.image_url, "detail": part.detail or "auto"})
        elif part.file_id is not None:
            message = f"{at}: input_image with file_id is not supported (no Files API here): send image_url, a data: or http(s) URL"
            raise ApiError(400, message, param=at, code="unsupported_image_source")
        else:
            raise ApiError(400, f"{at}: an input_image part needs image_url", param=at)
    return parts


def _text(content: str | list[ItemContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        text = part.refusal if part.type == "refusal" else part.text if part.type in TEXT_PARTS else None
        if text is None:
            message = f"content part type {part.type!r} is not supported here; send text (or input_image in a message)"
            raise ApiError(400, message, param=param)
        texts.append(text)
    return "\n".join(texts)


def chat_messages(conversation: list[Item], instructions: str | None, num_previous: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages, and the label of each image part in their order: `input[i].content[j]`
    for the request's own items (conversation[num_previous + i] is its input[i])."""
    messages: list[dict[str, Any]] = [] if instructions is None else [{"role": "system", "content": instructions}]
    image_parts: list[str] = []
    for c, item in enumerate(conversation):
        match item["type"]:
            case "message":
                at = f"input[{c - num_previous}].content" if c >= num_previous else None
                messages.append({"role": item["role"], "content": _chat_content(item["content"], at, image_parts)})
            case "function_call":
                call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(call)
            case "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages, image_parts


def _chat_content(content: str | list[dict[str, Any]], at: str | None, image_parts: list[str]) -> str | list[dict[str, Any]]:
    """A stored message's content as the chat route takes it: its text, or with images its parts
    (labelled under `at`, the item's content in this request; None: an earlier request's)."""
    if isinstance(content, str) or not any(part["type"] == "input_image" for part in content):
        return _message_text(content)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part["type"] == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"], "detail": part["detail"]}})
            image_parts.append(f"{at}[{j}]" if at is not None else "previous_response_id")
        else:
            parts.append({"type": "text", "text": part.get("text") or part.get("refusal") or ""})
    return parts


def _message_text(content: str | list[dict[str, Any]]) -> str:
    """An input message's text, or an output message's (its output_text parts)."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or part.get("refusal") or "" for part in content)


def chat_request(body: ResponsesBody, conversation: list[Item], num_previous: int = 0) -> tuple[dict[str, Any], list[str]]:
    """The /v1/chat/completions body that asks what `body` asks, over `conversation` (whose first
    `num_previous` items an earlier response brought), and the labels of its image parts."""
    messages, image_parts = chat_messages(conversation, body.instructions, num_previous)
    chat: dict[str, Any] = {"messages": messages, "stream": body.stream}
    for field in ("model", "temperature", "top_p"):
        if (value := getattr(body, field)) is not None:
            chat[field] = value
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools is not None:
        chat["tools"] = [{"type": "function", "function": _function(tool)} for tool in body.tools]
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if isinstance(body.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    match body.text.format if body.text is not None else None:
        case TextJsonSchemaFormat() as f:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.schema, "strict": f.strict}}
        case TextJsonObjectFormat():
            chat["response_format"] = {"type": "json_object"}
    return chat, image_parts


def _function(tool: Any) -> dict[str, Any]:
    """The chat tool's `function`, without the fields the client left out (templates test them)."""
    spec = {"name": tool.name, "description": tool.description, "parameters": tool.parameters, "strict": tool.strict}
    return {key: value for key, value in spec.items() if value is not None}


# The chat route's params, as the Responses body names them: a 400 from parse_chat says the latter.
CHAT_PARAMS = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
)


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for chat, ours in CHAT_PARAMS:
        if param.startswith(chat):
            return ours + param[len(chat) :] if chat != "messages" else ours
    return param.replace(".function.", ".")  # tools[i].function.name -> tools[i].name


# --- the answer -------------------------------------------------------------------------------


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> Item:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id or new_id("msg"), "type": "message", "status": status, "role": "assistant", "content": [part]}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> Item:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id or new_id("rs"), "type": "reasoning", "status": status, "summary": [], "content": content}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None) -> Item:
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def output_items(message: dict[str, Any], incomplete: bool) -> list[Item]:
    """The output items of a chat answer's message; the last is "incomplete" when the answer was cut."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is not None and (content or not calls):
        items.append(message_item(content))
    for call in calls:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    if incomplete and items:
        items[-1]["status"] = "incomplete"
    return items
