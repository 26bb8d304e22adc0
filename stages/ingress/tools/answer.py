"""A chat choice's answer shaped by the request's tool mode and the server's reasoning parser.

`chat_answer` decides once per request what applies: tool_mode "auto" with a tool-call format,
"named" or "required" (forced.py), and reasoning (not with forced calls: their output is the
constrained JSON from its first token). None when nothing does: responses.py then answers as it
always has. `ChatAnswer.message(text)` shapes a whole answer's message; `ChatAnswer.stream()` a
stream's delta fields, choice by choice (n > 1 parses each choice on its own). Reasoning is
split first; tool calls are parsed from the content after it.
"""

from __future__ import annotations

from typing import Any

from conveyor.stages.ingress.tools import tool_parser
from conveyor.stages.ingress.tools.base import ToolParser
from conveyor.stages.ingress.tools.forced import NamedCallParser, RequiredCallsParser
from conveyor.stages.ingress.tools.reasoning import ReasoningParser, ReasoningStream
from conveyor.stages.ingress.tools.stream import ToolStream


class ChatAnswer:
    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None):
        self.tools = tools
        self.reasoning = reasoning

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a choice's whole text, and whether it made tool calls."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        message: dict[str, Any] = {"role": "assistant"}
        calls = []
        if self.tools is not None and content is not None:
            parsed = self.tools.parse(content)
            content, calls = parsed.content, parsed.calls
        message["content"] = content
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, bool(calls)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: text deltas in, the fields of its chunks' `delta` out."""

    def __init__(self, answer: ChatAnswer):
        self.reasoning = ReasoningStream(answer.reasoning) if answer.reasoning else None
        self.tools = ToolStream(answer.tools) if answer.tools else None

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.made_calls

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
            if reasoning:
                fields["reasoning_content"] = reasoning
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            if calls:
                fields["tool_calls"] = calls
        if content:
            fields["content"] = content
        return fields


def chat_answer(tool_mode: str, tool_name: str | None, tool_format: str | None, reasoning_format: str | None) -> ChatAnswer | None:
    """What shapes a chat request's answer: `tool_format` is the server's (configured or guessed,
    None: tool calls are not parsed in auto mode), `reasoning_format` the --reasoning-parser."""
    tools: ToolParser | None = None
    if tool_mode == "named" and tool_name is not None:
        tools = NamedCallParser(tool_name)
    elif tool_mode == "required":
        tools = RequiredCallsParser()
    elif tool_mode == "auto" and tool_format is not None:
        tools = tool_parser(tool_format)
    forced = tool_mode in ("named", "required")
    reasoning = ReasoningParser(reasoning_format) if reasoning_format and not forced else None
    if tools is None and reasoning is None:
        return None
    return ChatAnswer(tools, reasoning)
