"""Hermes and Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
as many as the model writes; the text outside the tags is content."""

from __future__ import annotations

from conveyor.stages.ingress.tools.base import Scan, ToolParser, scan_marked_calls
from conveyor.stages.ingress.tools.json_scan import PartialCall, scan_call_object

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        def read(j: int) -> tuple[list[PartialCall], int | None]:
            call, end = scan_call_object(text, j, ("arguments",), final)
            close = text.find(END, end) if end is not None else -1  # the text up to </tool_call> is the call's
            return [call], close + len(END) if close >= 0 else None

        return scan_marked_calls(text, final, START, "{", read)
