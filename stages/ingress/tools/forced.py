"""Tool calls the request forced (tool_choice "required" or a named function): the output is
constrained JSON (params.structured), so its shape is known before a token arrives.

Named: the whole output is the arguments object of that one function. Required: the output is
a JSON array of {"name": ..., "parameters": {...}}, each element one call.
"""

from __future__ import annotations

from conveyor.stages.ingress.tools.base import Parsed, Scan, ToolCall, ToolParser
from conveyor.stages.ingress.tools.json_scan import PartialCall, scan_call_array, skip_space


class NamedCallParser(ToolParser):
    def __init__(self, function: str):
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [PartialCall(self.function, text, complete=final)])

    def parse(self, text: str) -> Parsed:
        # Always the one call, even cut short by max_tokens: finish_reason "length" says so.
        return Parsed(None, [ToolCall(self.new_id(), self.function, text)])


class RequiredCallsParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        j = skip_space(text, 0)
        if j >= len(text):
            return Scan("", [], malformed=final)
        if text[j] != "[":
            return Scan("", [], malformed=True)
        calls, end = scan_call_array(text, j, ("parameters",), final)
        return Scan("", calls, malformed=final and (end is None or skip_space(text, end) < len(text)))
