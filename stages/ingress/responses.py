"""OpenAI response bodies built from TextDelta events: one JSON answer, or server-sent events.

A `ResponseBuilder` follows one request: `accept` records the prompt length, `add` folds each
TextDelta into its choice (counts and cumulative logprob always, text and ids only for a
non-stream answer), `body()` gives the whole answer, and `sse_chunks()` turns a batch of deltas
into `data: {json}` events, one per choice, the chat role only in a choice's first chunk and
finish_reason null until its terminal chunk. `usage_chunk()` and `DONE` end a stream.

The engine generates `params.num_samples` choices. With best_of > n (never streamed) the answer
holds the n of them with the highest cumulative logprob, best first, re-indexed 0..n-1; usage
counts every generated token, as the engine spent them.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from conveyor.wire.messages import FinishReason, SamplingParams, TextDelta

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encode = msgspec.json.Encoder().encode


class Choice:
    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.num_output_tokens = 0
        self.num_chunks_sent = 0
        self.cumulative_logprob = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ResponseBuilder:
    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        chat: bool,
        params: SamplingParams,
        stream: bool = False,
        include_usage: bool = False,
        return_token_ids: bool = False,
    ):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.n = params.n  # choices in the answer, out of num_samples generated
        self.stream = stream
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.created = int(time.time())
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.choices = [Choice() for _ in range(params.num_samples)]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    def accept(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens

    def add(self, delta: TextDelta) -> None:
        choice = self.choices[delta.index]
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        choice.cumulative_logprob = delta.cumulative_logprob  # a running sum: the latest is the total
        # The detokenizer's running count is authoritative; counting ids covers a delta without one.
        choice.num_output_tokens = max(choice.num_output_tokens + len(delta.token_ids), delta.num_output_tokens)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
        if not self.stream:
            choice.text_parts.append(delta.text)
            choice.token_ids.extend(delta.token_ids)

    # --- one JSON answer ----------------------------------------------------------------

    def body(self) -> bytes:
        choices = []
        for index, c in enumerate(self._best()):
            text = "".join(c.text_parts)
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = None
            choice["finish_reason"] = _reason(c.finish_reason)
            if self.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        head = self._head("chat.completion" if self.chat else "text_completion")
        return _encode({**head, "choices": choices, "usage": self._usage()})

    def _best(self) -> list[Choice]:
        """The n choices of the answer: all of them, or the n most likely of best_of samples."""
        if len(self.choices) == self.n:
            return self.choices
        return sorted(self.choices, key=lambda c: c.cumulative_logprob, reverse=True)[: self.n]

    # --- a stream -----------------------------------------------------------------------

    def sse_chunks(self, deltas: list[TextDelta]) -> bytes:
        """Events for deltas already folded in with `add`: consecutive deltas of a choice merge."""
        merged: dict[int, tuple[list[str], list[int], FinishReason | None]] = {}
        for d in deltas:
            texts, ids, _ = merged.setdefault(d.index, ([], [], None))
            texts.append(d.text)
            ids.extend(d.token_ids)
            merged[d.index] = (texts, ids, d.finish_reason)
        return b"".join(self._chunk(i, "".join(t), ids, reason) for i, (t, ids, reason) in merged.items())

    def usage_chunk(self) -> bytes:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return _sse({**head, "choices": [], "usage": self._usage()})

    def _chunk(self, index: int, text: str, token_ids: list[int], reason: FinishReason | None) -> bytes:
        choice_state = self.choices[index]
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {}
            if choice_state.num_chunks_sent == 0:
                delta["role"] = "assistant"
            if text or choice_state.num_chunks_sent == 0:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = _reason(reason)
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        choice_state.num_chunks_sent += 1
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return _sse(chunk)

    def _head(self, object: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object, "created": self.created, "model": self.model}

    def _usage(self) -> dict[str, Any]:
        prompt, out = self.num_prompt_tokens, self.num_output_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": out,
            "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


def _reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.openai


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"
