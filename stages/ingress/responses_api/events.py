"""A streamed Response: chat chunk choices in, the Responses API's server-sent events out.

`ResponseEvents` follows one response. `start()` sends response.created and response.in_progress;
`feed(choice)` translates one chat.completion.chunk choice (its delta's `reasoning_content`,
`content` and `tool_calls` pieces, in that order); `finish(...)` closes the open item and sends
the one terminal event: response.completed, response.incomplete (max_output_tokens) or
response.failed. Each event is `event: <type>` and `data: <json>` with `type` and
`sequence_number` (0, 1, 2, ... in the order sent).

Invariants: at most one output item is open; a piece of another kind (reasoning, text, a new
function call) closes it first, with its done events (output_text.done / reasoning_text.done /
function_call_arguments.done, content_part.done, output_item.done). An item's output_index is its
place in response.output; message and reasoning items have one content part (content_index 0).
An item's done text is the concatenation of its deltas. The final response's output holds the
items as their done events gave them; a stream with no output item gets an empty message, as a
whole answer does.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.responses_api.answer import Response, fail_response, finish_response
from conveyor.stages.ingress.responses_api.items import Item, call_item, message_item, reasoning_item

_encode = msgspec.json.Encoder().encode
# Per item kind: its delta event's type, its text's done event's type, the text's field in the item.
_TEXT_EVENTS = {
    "message": ("response.output_text.delta", "response.output_text.done"),
    "reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done"),
}


class ResponseEvents:
    def __init__(self, response: Response):
        self.response = response
        self.num_events = 0
        self.item: Item | None = None  # the open item
        self.output_index = -1  # its place in response.output
        self.text = ""  # the open item's text (a message's, reasoning's, or a call's arguments)
        self.calls: dict[int, Item] = {}  # chat tool call index -> its function_call item

    def start(self) -> bytes:
        self.response["status"] = "in_progress"
        return self._event("response.created", response=self.response) + self._event("response.in_progress", response=self.response)

    def feed(self, choice: dict[str, Any]) -> bytes:
        delta = choice["delta"]
        out = b""
        if reasoning := delta.get("reasoning_content"):
            out += self._text("reasoning", reasoning)
        if content := delta.get("content"):
            out += self._text("message", content)
        for entry in delta.get("tool_calls") or ():
            out += self._call(entry)
        return out

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> bytes:
        finish_response(self.response, finish_reason, usage)
        out = b""
        if not self.response["output"]:
            out += self._open(message_item("", "in_progress"))
        out += self._close("incomplete" if self.response["status"] == "incomplete" else "completed")
        return out + self._event(f"response.{self.response['status']}", response=self.response)

    def fail(self, error: ApiError) -> bytes:
        fail_response(self.response, error)
        return self._event("response.failed", response=self.response)

    # --- items ----------------------------------------------------------------------------

    def _text(self, kind: str, piece: str) -> bytes:
        out = b""
        if self.item is None or self.item["type"] != kind:
            new = message_item("", "in_progress") if kind == "message" else reasoning_item("", "in_progress")
            out += self._open(new)
        assert self.item is not None
        self.text += piece
        delta_type, _ = _TEXT_EVENTS[kind]
        fields: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return out + self._event(delta_type, **self._at(), content_index=0, delta=piece, **fields)

    def _call(self, entry: dict[str, Any]) -> bytes:
        out = b""
        function = entry.get("function") or {}
        if "id" in entry:  # a call's opening piece: its id and name
            item = call_item(entry["id"], function.get("name", ""), "", "in_progress")
            self.calls[entry["index"]] = item
            out += self._open(item)
        piece = function.get("arguments") or ""
        if piece:
            # A call's arguments are whole before the next call's name is, so this is the open item.
            assert self.item is self.calls[entry["index"]]
            self.text += piece
            out += self._event("response.function_call_arguments.delta", **self._at(), delta=piece)
        return out

    def _open(self, item: Item) -> bytes:
        out = self._close("completed")
        self.item, self.text, self.output_index = item, "", len(self.response["output"])
        self.response["output"].append(item)
        out += self._event("response.output_item.added", output_index=self.output_index, item=item)
        if item["type"] != "function_call":
            out += self._event("response.content_part.added", **self._at(), content_index=0, part=item["content"][0])
        return out

    def _close(self, status: str) -> bytes:
        item = self.item
        if item is None:
            return b""
        at, text = self._at(), self.text
        out = b""
        if item["type"] == "function_call":
            item["arguments"] = text
            out += self._event("response.function_call_arguments.done", **at, name=item["name"], arguments=text)
        else:
            part = item["content"][0]
            part["text"] = text
            _, done_type = _TEXT_EVENTS[item["type"]]
            fields: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            out += self._event(done_type, **at, content_index=0, text=text, **fields)
            out += self._event("response.content_part.done", **at, content_index=0, part=part)
        item["status"] = status
        out += self._event("response.output_item.done", output_index=at["output_index"], item=item)
        self.item, self.text = None, ""
        return out

    def _at(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": self.output_index}

    def _event(self, type: str, **fields: Any) -> bytes:
        data = _encode({"type": type, "sequence_number": self.num_events, **fields})
        self.num_events += 1
        return b"event: " + type.encode() + b"\ndata: " + data + b"\n\n"
