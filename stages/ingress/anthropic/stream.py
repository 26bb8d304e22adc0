"""A streamed chat answer as Anthropic's server-sent events, each `event: TYPE` then `data: JSON`.

Order, as Anthropic sends it: message_start (the message with no content, input usage); then per
content block content_block_start, its content_block_delta events (text_delta, thinking_delta,
input_json_delta) and content_block_stop; then message_delta (stop_reason, stop_sequence, the
final usage) and message_stop. Blocks open in the order the model writes them, indexes 0, 1, ...;
one block is open at a time, and a delta of another kind closes it and opens the next. A text
delta opens a text block only when it has text; a tool call opens its tool_use block (id, name,
input {}) when its name is whole, and its arguments follow as partial JSON. An error after the
stream began is an `error` event, and the stream ends there (no message_stop).
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.stages.ingress.anthropic.reply import stop_reason, usage

_encode = msgspec.json.Encoder().encode


def event(type: str, data: dict[str, Any]) -> bytes:
    return b"event: " + type.encode() + b"\ndata: " + _encode({"type": type} | data) + b"\n\n"


class MessageEvents:
    """One streamed message: chat chunk choices in, its events out."""

    def __init__(self, message_id: str, model: str, stop_sequences: list[str]):
        self.message_id = message_id
        self.model = model
        self.stop_sequences = stop_sequences
        self.num_blocks = 0  # started so far; the open one, if any, is the last
        self.open_kind: str | None = None  # "text", "thinking" or "tool_use"
        self.tool_blocks: dict[int, int] = {}  # chat tool call index -> its block's index
        # Trailing whitespace of the text so far, sent only once more text follows: dropped when a
        # tool_use block opens, sent at the end otherwise (as reply.py cuts the whole text).
        self._held = ""

    def start(self, chat_usage: dict[str, Any]) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(chat_usage) | {"output_tokens": 0},  # the final count comes in message_delta
        }
        return event("message_start", {"message": message})

    def feed(self, choice: dict[str, Any]) -> bytes:
        """The events of one chunk choice (its `delta` as the chat route streams it)."""
        delta = choice["delta"]
        out = []
        if thinking := delta.get("reasoning_content"):
            out += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": thinking}))
        calls = delta.get("tool_calls") or []
        # The last arguments of the open call may share a delta with the text written after it:
        # they go first, while its block is open.
        while calls and "id" not in calls[0] and self.tool_blocks.get(calls[0]["index"]) == self._open_tool_block:
            out.append(self._arguments(calls.pop(0)))
        if text := delta.get("content"):
            text = self._held + text
            body = text.rstrip()
            self._held = text[len(body) :]
            if body:
                out += self._text(body)
        for call in calls:
            if "id" in call:
                self._held = ""
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                out += self._open("tool_use", block)
                self.tool_blocks[call["index"]] = self.num_blocks - 1
            out.append(self._arguments(call))
        return b"".join(out)

    def finish(self, choice: dict[str, Any], chat_usage: dict[str, Any]) -> bytes:
        """The last events, for the choice's terminal chunk (already fed)."""
        reason, sequence = stop_reason(choice, self.stop_sequences)
        delta = event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(chat_usage)})
        held = b"".join(self._text(self._held)) if self._held and not self.tool_blocks else b""
        return held + self._close() + delta + event("message_stop", {})

    def _text(self, text: str) -> list[bytes]:
        return [*self._into("text", {"type": "text", "text": ""}), self._delta({"type": "text_delta", "text": text})]

    @property
    def _open_tool_block(self) -> int | None:
        return self.num_blocks - 1 if self.open_kind == "tool_use" else None

    def _arguments(self, call: dict[str, Any]) -> bytes:
        """A call's arguments piece, if it has one, into its block."""
        arguments = call.get("function", {}).get("arguments")
        if not arguments:
            return b""
        return self._delta({"type": "input_json_delta", "partial_json": arguments}, self.tool_blocks[call["index"]])

    def _into(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        """Events that make a block of `kind` the open one (none if it already is)."""
        return [] if self.open_kind == kind else self._open(kind, block)

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        closing = self._close()
        self.open_kind = kind
        self.num_blocks += 1
        return [closing, event("content_block_start", {"index": self.num_blocks - 1, "content_block": block})]

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        self.open_kind = None
        return event("content_block_stop", {"index": self.num_blocks - 1})

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> bytes:
        return event("content_block_delta", {"index": self.num_blocks - 1 if index is None else index, "delta": delta})
