"""OpenAI response bodies built from TextDelta events: one JSON answer, or server-sent events.

A `ResponseBuilder` follows one HTTP request (generate.py makes it), which may fan out as several
engine requests (a batch of prompts): `accept(p, ...)` records prompt p's length, `add(p, delta)`
folds in each TextDelta, then `body()` gives the whole answer (`answer()` as an object), or per
batch of deltas `sse_chunks()` the events of a stream (`chunk_choices()` their choices as objects),
which `usage_chunk()` and `DONE` end. The objects are for the routes that speak another API over
the chat path (responses_api/, anthropic/).

Invariants: prompt p's i-th choice is the answer's choice p * n + i; with best_of > n (never
streamed) the answer holds each prompt's n choices with the highest cumulative logprob, best
first; usage counts every generated token and sums the prompts; with echo, each choice's text
starts with its prompt's text. In a stream the chat role is only in a choice's first chunk and
finish_reason null until its terminal chunk. A chat answer with a shape (tools/answer.py: tool
calls, reasoning) is parsed per choice, its finish_reason "stop" becoming "tool_calls" when the
choice called tools; without one, chat answers are plain text.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from conveyor.stages.ingress.openai_logprobs import chat_logprobs, completion_logprobs, join_completion_logprobs, vllm_prompt_logprobs
from conveyor.stages.ingress.tools.answer import ChatAnswer, ChoiceStream
from conveyor.wire.messages import FinishReason, SamplingParams, TextDelta, TextLogprob

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encode = msgspec.json.Encoder().encode


class Choice:
    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix  # the echoed prompt, sent before the first generated text
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TextLogprob] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.num_output_tokens = 0
        self.num_chunks_sent = 0
        self.num_chars_sent = 0  # text characters streamed so far: where the next token starts
        self.cumulative_logprob = 0.0
        self.stream: ChoiceStream | None = None  # a shaped chat answer's parse, when streamed
        self.made_calls = False

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
        system_fingerprint: str = "",
        stream: bool = False,
        include_usage: bool = False,
        return_token_ids: bool = False,
        echo: list[str] | None = None,
        num_prompts: int = 1,
        answer: ChatAnswer | None = None,
        prompt_only: bool = False,
        show_prompt_logprobs: bool = False,
    ):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.system_fingerprint = system_fingerprint
        self.n = params.n  # choices per prompt in the answer, out of num_samples generated
        self.num_samples = params.num_samples
        self.logprobs = params.logprobs is not None
        self.stream = stream
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.created = int(time.time())
        self.num_prompt_tokens = [0] * num_prompts
        self.num_cached_tokens = [0] * num_prompts
        prefixes = echo or [""] * num_prompts
        self.choices = [Choice(prefixes[p]) for p in range(num_prompts) for _ in range(self.num_samples)]
        self.num_finished = 0  # choices with a finish reason
        # Prompt logprobs, each prompt's (from its first choice's first delta): in a completion's
        # logprobs before its text's when echoed, and as vLLM's `prompt_logprobs` when asked for.
        self.prompt_logprobs: list[list[TextLogprob]] = [[] for _ in range(num_prompts)]
        self.echo_logprobs = echo is not None and self.logprobs and not chat
        self.show_prompt_logprobs = show_prompt_logprobs
        self.prompt_only = prompt_only  # max_tokens 0: each choice's one draw is left out
        self.embeddings: list[list[float]] = [[] for _ in range(num_prompts)]  # pooling requests': each prompt's vector
        self.shape = answer if chat else None  # a shaped chat answer's parser (tools/answer.py)
        if self.shape is not None and stream:
            for c in self.choices:
                c.stream = self.shape.stream()
        # A chunk's bytes around its one choice, the same in every chunk: encoded once, not per token.
        head = _encode(self._head("chat.completion.chunk" if chat else "text_completion"))
        self._chunk_open = b"data: " + head[:-1] + b',"choices":['
        self._chunk_close = b"]" + (b',"usage":null' if include_usage else b"") + b"}\n\n"

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.choices)

    def prompt_finished(self, p: int) -> bool:
        return all(c.finished for c in self._samples_of(p))

    def accept(self, p: int, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens[p] = num_prompt_tokens

    def add(self, p: int, delta: TextDelta) -> TextDelta:
        """Fold a TextDelta of prompt p into its choice: counts, logprob sum and stop reason always,
        text, ids and logprobs only for a non-stream answer (a stream sends them as they come).
        The delta as the answer has it (a prompt-only answer's: empty), for `sse_chunks`."""
        choice = self.choices[p * self.num_samples + delta.index]
        if delta.prompt_logprobs:
            self.prompt_logprobs[p] = delta.prompt_logprobs
        if delta.embedding:
            self.embeddings[p] = delta.embedding
        if self.prompt_only:  # the answer as if its one pass had drawn nothing
            finish = delta.finish_reason
            if finish is not None and finish is not FinishReason.ERROR:
                finish = FinishReason.LENGTH
            delta = msgspec.structs.replace(
                delta, text="", token_ids=[], logprobs=[], num_output_tokens=0, finish_reason=finish, stop_reason=None
            )
        if delta.num_prompt_tokens:
            self.num_prompt_tokens[p] = delta.num_prompt_tokens
        self.num_cached_tokens[p] = max(self.num_cached_tokens[p], delta.num_cached_tokens)
        choice.cumulative_logprob = delta.cumulative_logprob  # a running sum: the latest is the total
        # The detokenizer's running count is authoritative; counting ids covers a delta without one.
        choice.num_output_tokens = max(choice.num_output_tokens + len(delta.token_ids), delta.num_output_tokens)
        if delta.finish_reason is not None:
            self.num_finished += choice.finish_reason is None
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
        if not self.stream:
            choice.text_parts.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs)
        return delta

    # --- one JSON answer ----------------------------------------------------------------

    def body(self) -> bytes:
        return _encode(self.answer())

    def answer(self) -> dict[str, Any]:
        """The whole answer (a chat.completion or text_completion object), once finished."""
        choices = []
        for p in range(len(self.num_prompt_tokens)):
            for i, c in enumerate(self._best(p)):
                text = c.prefix + "".join(c.text_parts)
                offset = len(c.prefix)  # where the first generated token starts in the text
                choice = self._choice(p * self.n + i, c, text, c.token_ids, c.logprobs, c.finish_reason, offset, p)
                choices.append(choice)
        head = self._head("chat.completion" if self.chat else "text_completion")
        answer = {**head, "choices": choices, "usage": self.usage()}
        if self.chat and self.show_prompt_logprobs:  # vLLM puts a chat answer's beside its choices
            answer["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_logprobs[0])
            for choice in choices:
                del choice["prompt_logprobs"]
        return answer

    def _samples_of(self, p: int) -> list[Choice]:
        return self.choices[p * self.num_samples : (p + 1) * self.num_samples]

    def _best(self, p: int) -> list[Choice]:
        """Prompt p's choices in the answer: all, or the n most likely of best_of samples."""
        samples = self._samples_of(p)
        if self.num_samples == self.n:
            return samples
        return sorted(samples, key=lambda c: c.cumulative_logprob, reverse=True)[: self.n]

    # --- a stream -----------------------------------------------------------------------

    def sse_chunks(self, deltas: list[tuple[int, TextDelta]]) -> bytes:
        """Events for (prompt, delta) pairs already folded in with `add`: consecutive deltas of a
        choice merge into one event."""
        return b"".join(self._chunk_open + _encode(choice) + self._chunk_close for choice in self.chunk_choices(deltas))

    def chunk_choices(self, deltas: list[tuple[int, TextDelta]]) -> list[dict[str, Any]]:
        """The choices of a stream's chunks for (prompt, delta) pairs already folded in with
        `add`, one per choice that moved (its deltas merged), in order: what `sse_chunks` sends,
        as objects (a route that speaks another API translates them)."""
        if len(deltas) == 1:  # a step's one delta: what a busy stream gets, token after token
            p, d = deltas[0]
            return [self._chunk_choice(p * self.num_samples + d.index, d.text, d.token_ids, d.logprobs, d.finish_reason)]
        merged: dict[int, tuple[list[str], list[int], list[TextLogprob], FinishReason | None]] = {}
        for p, d in deltas:
            texts, ids, logprobs, _ = merged.setdefault(p * self.num_samples + d.index, ([], [], [], None))
            texts.append(d.text)
            ids.extend(d.token_ids)
            logprobs.extend(d.logprobs)
            merged[p * self.num_samples + d.index] = (texts, ids, logprobs, d.finish_reason)
        return [self._chunk_choice(i, "".join(t), ids, lps, reason) for i, (t, ids, lps, reason) in merged.items()]

    def usage_chunk(self) -> bytes:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return _sse({**head, "choices": [], "usage": self.usage()})

    def _chunk_choice(
        self, index: int, text: str, token_ids: list[int], logprobs: list[TextLogprob], reason: FinishReason | None
    ) -> dict[str, Any]:
        c = self.choices[index]  # streams never have best_of > n: answer index = choice index
        offset = c.num_chars_sent  # characters of the choice's text before this chunk's tokens
        prompt = None  # the choice's prompt: its first chunk shows the prompt's logprobs
        if c.num_chunks_sent == 0:
            text = c.prefix + text
            offset += len(c.prefix)
            prompt = index // self.num_samples
        choice = self._choice(index, c, text, token_ids, logprobs, reason, offset, prompt)
        c.num_chunks_sent += 1
        c.num_chars_sent += len(text)
        return choice

    # --- shared -------------------------------------------------------------------------

    def _choice(
        self,
        index: int,
        c: Choice,
        text: str,
        token_ids: list[int],
        logprobs: list[TextLogprob],
        reason: FinishReason | None,
        first_offset: int,
        prompt: int | None = None,
    ) -> dict[str, Any]:
        """A choice of the answer, or of a chunk (then with its delta's text, ids and logprobs);
        `prompt`: the choice's prompt, where it shows the prompt's logprobs (an answer, a first chunk)."""
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif self.shape is not None:
            self._shaped(choice, c, text, reason)
        elif not self.stream:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            delta: dict[str, Any] = {"role": "assistant"} if c.num_chunks_sent == 0 else {}
            if text or c.num_chunks_sent == 0:
                delta["content"] = text
            choice["delta"] = delta
        if not self.logprobs:
            choice["logprobs"] = None
        elif self.chat:
            choice["logprobs"] = chat_logprobs(logprobs)
        elif self.echo_logprobs and prompt is not None:  # the prompt's tokens first, from offset 0
            choice["logprobs"] = join_completion_logprobs(
                completion_logprobs(self.prompt_logprobs[prompt], 0, c.prefix), completion_logprobs(logprobs, first_offset)
            )
        else:
            choice["logprobs"] = completion_logprobs(logprobs, first_offset)
        if self.show_prompt_logprobs and prompt is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_logprobs[prompt])
        choice["finish_reason"] = None if reason is None else reason.openai
        if reason is FinishReason.STOP and c.made_calls:
            choice["finish_reason"] = "tool_calls"
        choice["stop_reason"] = c.stop_reason if reason is not None else None
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _shaped(self, choice: dict[str, Any], c: Choice, text: str, reason: FinishReason | None) -> None:
        """A shaped chat answer's message, or its chunk's delta for `text`."""
        assert self.shape is not None
        if c.stream is None:
            choice["message"], c.made_calls = self.shape.message(text)
            return
        delta: dict[str, Any] = {"role": "assistant"} if c.num_chunks_sent == 0 else {}
        delta |= c.stream.feed(text, final=reason is not None)
        if len(delta) == 1 and c.num_chunks_sent == 0:  # the first chunk says content, as unshaped ones do
            delta["content"] = ""
        c.made_calls = c.stream.made_calls
        choice["delta"] = delta

    def _head(self, object: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def usage(self) -> dict[str, Any]:
        prompt, out = sum(self.num_prompt_tokens), sum(c.num_output_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": out,
            "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": sum(self.num_cached_tokens)},
        }


async def write_quietly(response: web.StreamResponse, data: bytes) -> None:
    """The last bytes of a stream that failed after it began (an error event), then its end; a
    client already gone is no error."""
    try:
        await response.write(data)
        await response.write_eof()
    except ConnectionResetError:
        pass


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"
