"""The interface every tool-call format implements, and what a parse gives.

A format is one `scan(text, final)`: the output so far split into the content that is surely
content (text that could still turn out to start a tool call is held back until it cannot) and
the tool calls begun so far (`PartialCall`). The whole-text parse and the streamed deltas
(stream.py) are both derived from it, so they cannot disagree. A parse whose calls do not all
end as a name and a JSON object of arguments is not a tool call: the whole text is content, as
vLLM answers it.
"""

from __future__ import annotations

import dataclasses
import secrets
import string
from collections.abc import Callable

from conveyor.stages.ingress.tools.json_scan import PartialCall, is_json_object, skip_space

_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class Scan:
    content: str  # the content so far, without text held back
    calls: list[PartialCall]
    malformed: bool = False  # a call began but the text is not the format's (final scans only)


@dataclasses.dataclass(frozen=True)
class Parsed:
    content: str | None  # None when the answer is only tool calls
    calls: list[ToolCall]


def random_id(length: int) -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(length))


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`: held back."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def scan_marked_calls(
    text: str, final: bool, marker: str, opener: str, read: Callable[[int], tuple[list[PartialCall], int | None]]
) -> Scan:
    """The scan of a format whose calls each follow `marker`, then `opener` ("{" or "["):
    `read(j)` parses the calls starting at text[j] and gives the position after them (None: not
    there yet). The text around them is content; a tail that could still become the marker is
    held back until the text is final."""
    content: list[str] = []
    calls: list[PartialCall] = []
    pos = 0
    while (start := text.find(marker, pos)) >= 0:
        content.append(text[pos:start])
        j = skip_space(text, start + len(marker))
        if j >= len(text) or text[j] != opener:
            return Scan("".join(content), calls, malformed=final or j < len(text))
        found, end = read(j)
        calls += found
        if end is None:
            return Scan("".join(content), calls, malformed=final)
        pos = end
    tail = text[pos:]
    content.append(tail if final else tail[: len(tail) - held_prefix(tail, marker)])
    return Scan("".join(content), calls)


class ToolParser:
    name = ""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def new_id(self) -> str:
        """OpenAI's and vLLM's shape: call_ and 24 alphanumerics."""
        return "call_" + random_id(24)

    def parse(self, text: str) -> Parsed:
        scan = self.scan(text, final=True)
        if not scan.calls and not scan.malformed:
            return Parsed(scan.content, [])
        if scan.malformed or not all(c.complete and c.name is not None and is_json_object(c.arguments) for c in scan.calls):
            return Parsed(text, [])
        calls = [ToolCall(self.new_id(), c.name, c.arguments) for c in scan.calls if c.name is not None]
        # Whitespace between and around calls is no answer of its own.
        return Parsed(scan.content if scan.content.strip() else None, calls)
