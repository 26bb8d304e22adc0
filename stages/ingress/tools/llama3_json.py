"""Llama 3.x JSON tool calls: the whole output, optionally after `<|python_tag|>`, is
{"name": ..., "parameters": {...}} (or "arguments"), or several such objects separated by `;`.
An output that begins otherwise is content."""

from __future__ import annotations

from conveyor.stages.ingress.tools.base import Scan, ToolParser
from conveyor.stages.ingress.tools.json_scan import PartialCall, scan_call_object, skip_space

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        j = skip_space(text, 0)
        if text.startswith(TAG, j):
            j = skip_space(text, j + len(TAG))
            if j >= len(text):
                return Scan("", [], malformed=final)
        elif not final and TAG.startswith(text[j:]):  # undecided: nothing or a tag's beginning
            return Scan("", [])
        if text[j : j + 1] != "{":
            return Scan(text, [])
        calls: list[PartialCall] = []
        while True:
            call, end = scan_call_object(text, j, ("parameters", "arguments"), final)
            calls.append(call)
            if end is None:
                return Scan("", calls, malformed=final)
            j = skip_space(text, end)
            if j < len(text) and text[j] == ";":
                j = skip_space(text, j + 1)
                if j < len(text) and text[j] == "{":
                    continue
            # Past the last call only whitespace (or a trailing ";") may follow.
            return Scan("", calls, malformed=final and j < len(text))
