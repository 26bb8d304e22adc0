"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of {"name": ..., "arguments": {...}};
text before it is content. Mistral's chat templates take only 9-alphanumeric call ids.

`[TOOL_CALLS]` is a control token in Mistral's tokenizers: it reaches the ingress only when the
request decodes with skip_special_tokens false."""

from __future__ import annotations

from conveyor.stages.ingress.tools.base import Scan, ToolParser, held_prefix, random_id
from conveyor.stages.ingress.tools.json_scan import PartialCall, scan_call_array, skip_space

START = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"

    def new_id(self) -> str:
        return random_id(9)

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while (start := text.find(START, pos)) >= 0:
            content.append(text[pos:start])
            j = skip_space(text, start + len(START))
            if j >= len(text) or text[j] != "[":
                return Scan("".join(content), calls, malformed=final or j < len(text))
            found, end = scan_call_array(text, j, ("arguments",), final)
            calls += found
            if end is None:
                return Scan("".join(content), calls, malformed=final)
            pos = end
        tail = text[pos:]
        content.append(tail if final else tail[: len(tail) - held_prefix(tail, START)])
        return Scan("".join(content), calls)
