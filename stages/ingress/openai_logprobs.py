"""The two OpenAI shapes of a choice's `logprobs`, from the detokenizer's TextLogprob entries.

/v1/completions (the legacy shape): parallel lists, one entry per token,
    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{token: logprob}],
     "text_offset": [int]}
where each top_logprobs dict holds the requested alternatives plus the sampled token (so up to
logprobs + 1 entries, as OpenAI documents) and text_offset is the token's character offset in
the choice's text. /v1/chat/completions:
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
In a stream each chunk carries the entries of its own tokens, offsets continuing the choice's.
With echo, a completion's logprobs begin with its prompt's tokens (offsets from 0, the first
token's logprob and top null), as OpenAI's legacy API gives them. vLLM's `prompt_logprobs`
extension has a shape of its own (`vllm_prompt_logprobs`).
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.wire.messages import TextLogprob


def completion_logprobs(entries: list[TextLogprob], first_offset: int, echoed: str | None = None) -> dict[str, Any]:
    """`first_offset`: characters of the choice's text before the first entry's token; `echoed`:
    the text the entries are a prompt's tokens of, their offsets found in it (echo_offsets). A
    prompt's first token (nothing predicts it: its logprob is NaN) has null for its logprob and top."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset = echo_offsets(entries, echoed) if echoed is not None else []
    offset = first_offset
    for entry in entries:
        tokens.append(entry.token)
        if echoed is None:
            text_offset.append(offset)
            offset += len(entry.token)
        if math.isnan(entry.logprob):
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {alt.token: alt.logprob for alt in entry.top}
        top.setdefault(entry.token, entry.logprob)
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def echo_offsets(entries: list[TextLogprob], text: str) -> list[int]:
    """Where each of a prompt's tokens starts in its echoed text, matched by bytes: a token the
    text leaves out (a special token its decoding skipped) starts where the next one does, and a
    token holding part of a character counts that character once it holds its first byte."""
    data = text.encode()
    offsets, at, chars = [], 0, 0  # at: bytes of `data` matched; chars: the characters they begin
    for entry in entries:
        offsets.append(chars)
        piece = bytes(entry.bytes)
        if piece and data.startswith(piece, at):
            at += len(piece)
            chars += sum(1 for b in piece if b & 0xC0 != 0x80)  # a UTF-8 character's first byte
    return offsets


def join_completion_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two runs of the legacy shape, one after the other (an echoed prompt's, then the text's)."""
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(entries: list[TextLogprob]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from token id
    (as a string) to its logprob, rank and text: the prompt's own token, then its alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries[1:]:
        tokens = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token}}
        for alt in entry.top:
            tokens.setdefault(str(alt.token_id), {"logprob": alt.logprob, "rank": alt.rank, "decoded_token": alt.token})
        out.append(tokens)
    return out


def chat_logprobs(entries: list[TextLogprob]) -> dict[str, Any]:
    content = []
    for entry in entries:
        item = _chat_token(entry)
        item["top_logprobs"] = [_chat_token(alt) for alt in entry.top]
        content.append(item)
    return {"content": content}


def _chat_token(entry: TextLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes}
