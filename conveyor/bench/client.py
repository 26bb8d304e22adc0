"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

`send` POSTs a completion (or chat completion) with `stream: true` and
`stream_options.include_usage`, reads the server-sent events as they arrive, and returns a
RequestResult: when it was sent, when each chunk carrying output arrived, how many tokens each
chunk carried (its `token_ids` when the server returns them, else one), the usage totals, and
the error if it failed (HTTP status, an error event, a dropped connection, no output at all).

Totals come from `usage` when the server sends it (prompt_tokens, completion_tokens), else
from the dataset's prompt length and the chunks. TTFT is the first output chunk; ITL the gaps
between output chunks (vLLM's definition: a chunk holding several tokens is one gap); TPOT
(last chunk - first chunk) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp
import numpy as np

from conveyor.bench.dataset import BenchRequest


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # tokens generated (usage, else the chunks' count)
    start: float  # perf_counter when the request was sent
    end: float = 0.0  # when the stream ended
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # each output chunk's arrival
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)  # tokens in each (>= 1)
    error: str | None = None
    text: str = ""  # the output text, as streamed (a multi-turn conversation sends it back)
    num_images: int = 0  # pictures the request carried: results split text from image requests by it

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> np.ndarray:
        return np.diff(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_len - 1)

    def token_times(self) -> list[float]:
        """One arrival time per output token: each chunk's time once per token it carried. When
        usage counts more tokens than the chunks told, the rest are spread evenly over them."""
        per_chunk = list(self.chunk_tokens)
        missing = self.output_len - sum(per_chunk)
        if missing > 0 and per_chunk:
            extra, rest = divmod(missing, len(per_chunk))
            per_chunk = [n + extra + (i < rest) for i, n in enumerate(per_chunk)]
        return [t for t, n in zip(self.chunk_times, per_chunk) for _ in range(n)]


def payload(request: BenchRequest, model: str, *, chat: bool, ignore_eos: bool, return_token_ids: bool) -> dict:
    """The JSON body: greedy, max_tokens = the wanted output length, streamed with usage. A shared
    system prompt is a system message in a chat, and opens the prompt of a completion. A request's
    images go first in its user message, as image_url parts, then its prompt as a text part."""
    body: dict = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        system = [{"role": "system", "content": request.system_prompt}] if request.system_prompt else []
        body["messages"] = [*system, {"role": "user", "content": _content(request)}]
    elif request.images:
        raise ValueError("a request with images needs the chat endpoint (--endpoint /v1/chat/completions)")
    else:
        body["prompt"] = request.text  # the system prompt, if any, then the prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, which conveyor and SGLang share
    if return_token_ids:
        body["return_token_ids"] = True  # exact tokens per chunk where the server supports it
    return body


def _content(request: BenchRequest) -> str | list[dict]:
    """The user message's content: the prompt, or the images and then the prompt as parts."""
    if not request.images:
        return request.prompt
    images = [{"type": "image_url", "image_url": {"url": url}} for url in request.images]
    return [*images, {"type": "text", "text": request.prompt}]


async def send(session: aiohttp.ClientSession, url: str, request: BenchRequest, body: dict) -> RequestResult:
    """POST `body` to `url` and time its stream; never raises for a failed request."""
    result = RequestResult(prompt_len=request.prompt_len, output_len=0, start=time.perf_counter(), num_images=len(request.images))
    usage: dict | None = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                buffer = b""
                async for data in resp.content.iter_any():
                    arrived = time.perf_counter()
                    *lines, buffer = (buffer + data).split(b"\n")
                    for event in _events(lines):
                        if "error" in event:
                            raise _StreamError(str(event["error"])[:200])
                        usage = event.get("usage") or usage
                        tokens = _output_tokens(event)
                        if tokens:
                            result.chunk_times.append(arrived)
                            result.chunk_tokens.append(tokens)
                            result.text += _output_text(event)
    except _StreamError as e:
        result.error = f"error event: {e}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: bad JSON
        result.error = f"{type(e).__name__}: {e}"
    result.end = time.perf_counter()
    if usage:
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
        result.output_len = int(usage.get("completion_tokens") or 0)
    if not result.output_len:
        result.output_len = sum(result.chunk_tokens)
    if result.error is None and not result.chunk_times:
        result.error = "the stream ended without output"
    return result


class _StreamError(Exception):
    pass


def _events(lines: list[bytes]):
    """The JSON objects of complete `data:` lines ([DONE] and other lines skipped)."""
    for line in lines:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data and data != b"[DONE]":
            yield json.loads(data)


def _output_text(event: dict) -> str:
    """The text an event carries: a completion choice's, or a chat delta's content."""
    for choice in event.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            return text
    return ""


def _output_tokens(event: dict) -> int:
    """Tokens of output an event carries: its token_ids' count, or one if it has text."""
    for choice in event.get("choices") or ():
        token_ids = choice.get("token_ids")
        if token_ids:
            return len(token_ids)
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            return 1
    return 0
