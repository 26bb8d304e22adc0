"""The two OpenAI shapes of a choice's `logprobs`, from the detokenizer's TextLogprob entries.

/v1/completions (the legacy shape): parallel lists, one entry per token,
    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{token: logprob}],
     "text_offset": [int]}
where each top_logprobs dict holds the requested alternatives plus the sampled token (so up to
logprobs + 1 entries, as OpenAI documents) and text_offset is the token's character offset in
the choice's text. /v1/chat/completions:
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
In a stream each chunk carries the entries of its own tokens, offsets continuing the choice's.
"""

from __future__ import annotations

from typing import Any

from conveyor.wire.messages import TextLogprob


def completion_logprobs(entries: list[TextLogprob], first_offset: int) -> dict[str, Any]:
    """`first_offset`: characters of the choice's text before the first entry's token."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = first_offset
    for entry in entries:
        tokens.append(entry.token)
        token_logprobs.append(entry.logprob)
        top = {alt.token: alt.logprob for alt in entry.top}
        top.setdefault(entry.token, entry.logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(entry.token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(entries: list[TextLogprob]) -> dict[str, Any]:
    content = []
    for entry in entries:
        item = _chat_token(entry)
        item["top_logprobs"] = [_chat_token(alt) for alt in entry.top]
        content.append(item)
    return {"content": content}


def _chat_token(entry: TextLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes}
