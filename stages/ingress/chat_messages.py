"""Chat message bodies as the wire's ChatMessages: roles, tool calls, and content parts in order.

A message's content is a string or a list of parts. Text parts are joined with "\n" into
`ChatMessage.content`; a message with image_url parts also keeps every part in order
(`ChatMessage.parts`), each image part naming its index in the request's images, which are
collected here as ImageUrls labelled `messages[i].content[j]` (media/ resolves them to bytes).
Other part types are a 400 naming the part. A tool turn without a name gets its call's.
"""

from __future__ import annotations

import msgspec

from conveyor.stages.ingress.bodies import ChatMessageBody, ContentPart, ToolCallBody
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.media.urls import ImageUrl
from conveyor.wire.images import ContentPart as MessagePart
from conveyor.wire.images import message_content
from conveyor.wire.messages import ChatMessage, ToolCall

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(messages: list[ChatMessageBody]) -> tuple[list[ChatMessage], list[ImageUrl]]:
    """The messages, and their image parts in order. A tool turn without a name gets the one its
    call had: some templates (Llama 3.1's, Mistral's) write the function's name beside its result."""
    names = {call.id: call.function.name for m in messages for call in m.tool_calls or ()}
    images: list[ImageUrl] = []
    return [_chat_message(m, i, names, images) for i, m in enumerate(messages)], images


def _chat_message(message: ChatMessageBody, i: int, names: dict[str, str], images: list[ImageUrl]) -> ChatMessage:
    role = ROLES[message.role]
    if message.tool_calls is not None and role != "assistant":
        raise ApiError(400, "only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
    tool_calls = [_tool_call(call) for call in message.tool_calls] if message.tool_calls else None
    name = call_id = None
    if role == "tool":
        call_id = message.tool_call_id
        name = message.name or names.get(call_id or "")
    content, parts = _content(message, i, images)
    return ChatMessage(role, content, tool_calls=tool_calls, tool_call_id=call_id, name=name, parts=parts)


def _tool_call(call: ToolCallBody) -> ToolCall:
    arguments = call.function.arguments
    text = arguments if isinstance(arguments, str) else msgspec.json.encode(arguments).decode()
    return ToolCall(id=call.id, name=call.function.name, arguments=text)


def _content(message: ChatMessageBody, i: int, images: list[ImageUrl]) -> tuple[str, list[MessagePart] | None]:
    """The message's text (its text parts joined), and where it has images, all its parts in
    order; each image_url part is added to `images` and its MessagePart names its index there."""
    if message.content is None or isinstance(message.content, str):
        return message.content or "", None
    parts = []
    for j, part in enumerate(message.content):
        at = f"messages[{i}].content[{j}]"
        if part.type == "text":
            if part.text is None:
                raise ApiError(400, f"{at}: a text part needs its text", param=at)
            parts.append(MessagePart(text=part.text))
        elif part.type == "image_url":
            parts.append(MessagePart(image=len(images)))
            images.append(ImageUrl(_image_url(part, at), at))
        else:
            refusal = f"{at}: content part type {part.type!r} is not supported: send text or image_url parts"
            raise ApiError(400, refusal, param=at)
    return message_content(parts)


def _image_url(part: ContentPart, at: str) -> str:
    url = part.image_url if isinstance(part.image_url, str) or part.image_url is None else part.image_url.url
    if not url:
        raise ApiError(400, f'{at}: an image_url part needs "image_url": {{"url": ...}}', param=at)
    return url
