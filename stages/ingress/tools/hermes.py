"""Hermes and Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
as many as the model writes; the text outside the tags is content."""

from __future__ import annotations

from conveyor.stages.ingress.tools.base import Scan, ToolParser, held_prefix
from conveyor.stages.ingress.tools.json_scan import PartialCall, scan_call_object, skip_space

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while (start := text.find(START, pos)) >= 0:
            content.append(text[pos:start])
            j = skip_space(text, start + len(START))
            if j >= len(text) or text[j] != "{":
                return Scan("".join(content), calls, malformed=final or j < len(text))
            call, end = scan_call_object(text, j, ("arguments",), final)
            calls.append(call)
            close = text.find(END, end) if end is not None else -1
            if close < 0:  # the text up to </tool_call> belongs to the call
                return Scan("".join(content), calls, malformed=final)
            pos = close + len(END)
        tail = text[pos:]
        content.append(tail if final else tail[: len(tail) - held_prefix(tail, START)])
        return Scan("".join(content), calls)
