"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of {"name": ..., "arguments": {...}};
text before it is content. Mistral's chat templates take only 9-alphanumeric call ids.

`[TOOL_CALLS]` is a control token in Mistral's tokenizers: it reaches the ingress only when the
request decodes with skip_special_tokens false."""

from __future__ import annotations

from conveyor.stages.ingress.tools.base import Scan, ToolParser, random_id, scan_marked_calls
from conveyor.stages.ingress.tools.json_scan import scan_call_array

START = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"

    def new_id(self) -> str:
        return random_id(9)

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked_calls(text, final, START, "[", lambda j: scan_call_array(text, j, ("arguments",), final))
