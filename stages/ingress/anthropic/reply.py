"""A finished chat answer as Anthropic's message object, and the two facts streams share with it.

Content blocks, in the order the model wrote them: thinking (the reasoning parser's
reasoning_content; its `signature` is empty, as nothing here signs), text (omitted when empty),
then one tool_use block per parsed call (its `input` the arguments object). `stop_reason` from the
chat choice: "tool_calls" is tool_use, "length" max_tokens, "stop" ended by one of the request's
stop strings stop_sequence (with `stop_sequence` that string), any other stop end_turn. Usage:
Anthropic's input_tokens leaves out the tokens read from a cache, which it reports beside them, so
input_tokens + cache_read_input_tokens is the prompt's length (what count_tokens counts).
"""

from __future__ import annotations

import json
from typing import Any


def message(answer: dict[str, Any], stop_sequences: list[str]) -> dict[str, Any]:
    """The Anthropic message for a chat.completion object of one choice."""
    choice = answer["choices"][0]
    chat = choice["message"]
    content: list[dict[str, Any]] = []
    if chat.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": chat["reasoning_content"], "signature": ""})
    # Before tool calls the text ends at its last non-blank character: the whitespace around the
    # calls' markup is no one's text (stream.py holds it back the same way, whatever the chunking).
    text = (chat.get("content") or "").rstrip() if chat.get("tool_calls") else chat.get("content")
    if text:
        content.append({"type": "text", "text": text})
    for call in chat.get("tool_calls") or []:
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])})
    reason, sequence = stop_reason(choice, stop_sequences)
    return {
        "id": answer["id"],
        "type": "message",
        "role": "assistant",
        "model": answer["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(answer["usage"]),
    }


def stop_reason(choice: dict[str, Any], stop_sequences: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice that has its finish_reason."""
    finish = choice["finish_reason"]
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    matched = choice.get("stop_reason")
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat_usage: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage for the chat answer's."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "output_tokens": chat_usage["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
