"""Reasoning split off a chat answer: `<think>...</think>` becomes `reasoning_content`.

`qwen3`: an output that opens with `<think>` reasons until `</think>` (or its end); one that
does not is all content. `deepseek_r1`: its chat template opens `<think>` in the prompt, so
everything before `</think>` is reasoning, with or without an opening tag, and an output that
never closes it is all reasoning (vLLM's reading of both). Content after `</think>` starts at
its first non-space character. `split(text, final)` gives what is sure so far; `ReasoningStream`
turns it into (reasoning, content) pieces as text deltas arrive.
"""

from __future__ import annotations

from conveyor.stages.ingress.tools.base import held_prefix

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
        self.name = name
        self.opened_by_prompt = name == "deepseek_r1"

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) so far; None for a part that has not begun. Text that could
        still be a tag is held back unless `final`."""
        start = len(text) - len(text.lstrip())
        if text.startswith(OPEN, start):
            start += len(OPEN)
        elif not final and OPEN.startswith(text[start:]):  # undecided while it may be the tag
            return None, None
        elif not self.opened_by_prompt:
            return None, text
        else:
            start = 0
        end = text.find(CLOSE, start)
        if end < 0:
            reasoning = text[start:] if final else text[start : len(text) - held_prefix(text[start:], CLOSE)]
            return reasoning, None
        return text[start:end], text[end + len(CLOSE) :].lstrip()

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """The whole answer's (reasoning_content, content); an empty part is None, except the
        content of an answer that has no reasoning."""
        reasoning, content = self.split(text, final=True)
        if reasoning is None:
            return None, content
        return reasoning or None, content or None


REASONING_PARSERS = ("qwen3", "deepseek_r1")


class ReasoningStream:
    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.num_reasoning_sent = 0
        self.num_content_sent = 0

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the content that `text` adds."""
        self.text += text
        reasoning, content = self.parser.split(self.text, final)
        reasoning_piece = (reasoning or "")[self.num_reasoning_sent :]
        content_piece = (content or "")[self.num_content_sent :]
        self.num_reasoning_sent += len(reasoning_piece)
        self.num_content_sent += len(content_piece)
        return reasoning_piece, content_piece
