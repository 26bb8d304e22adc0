"""Tool calls and reasoning in chat answers (issue 18): the text formats models write them in.

A tool-call format (base.ToolParser) splits an output into content and calls, whole
(`parse`) or as OpenAI stream deltas fed text deltas (stream.ToolStream). The formats by the
name `--tool-call-parser` takes: `hermes` (Hermes, Qwen), `llama3_json` (Llama 3.x), `mistral`;
without the flag one is guessed from the chat template (template.py). reasoning.py splits
`<think>...</think>` off first (`--reasoning-parser`), and answer.py puts the two together
per choice for the ingress answer (the parent package's responses module).
"""

from __future__ import annotations

from conveyor.stages.ingress.tools.base import ToolParser
from conveyor.stages.ingress.tools.hermes import HermesParser
from conveyor.stages.ingress.tools.llama3_json import Llama3JsonParser
from conveyor.stages.ingress.tools.mistral import MistralParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None
