"""A tool-call format streamed: text deltas in, OpenAI chat delta fields out.

Each `feed` rescans the choice's text so far and sends what is new since the last: content the
format no longer holds back, then for each call, once its name is whole, the opening piece
{index, id, type: "function", function: {name, arguments: ""}} and after it the arguments' text
as it grows ({index, function: {arguments: piece}}), which is how the OpenAI SDK's stream helpers
assemble calls. Whitespace-only content is held until real content follows (or the output ends
with no call), so the joined stream equals the whole-text parse.
"""

from __future__ import annotations

from typing import Any

from conveyor.stages.ingress.tools.base import ToolParser


class ToolStream:
    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.num_content_sent = 0
        self.ids: list[str] = []  # of the calls whose opening piece was sent
        self.num_arguments_sent: list[int] = []

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries (at most one per call) that `text` adds."""
        self.text += text
        scan = self.parser.scan(self.text, final)
        content = ""
        if len(scan.content) > self.num_content_sent and (scan.content.strip() or (final and not scan.calls)):
            content = scan.content[self.num_content_sent :]
            self.num_content_sent = len(scan.content)
        entries = []
        for i, call in enumerate(scan.calls):
            entry: dict[str, Any] = {"index": i}
            if i == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(self.parser.new_id())
                self.num_arguments_sent.append(0)
                entry |= {"id": self.ids[i], "type": "function", "function": {"name": call.name, "arguments": ""}}
            piece = call.arguments[self.num_arguments_sent[i] :]
            if piece:
                self.num_arguments_sent[i] = len(call.arguments)
                entry.setdefault("function", {})["arguments"] = piece
            if len(entry) > 1:
                entries.append(entry)
        return content, entries
