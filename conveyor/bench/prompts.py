"""Prompt text of a wanted token length, counted the way the server under test counts it.

A counter turns texts into token counts, special tokens the server adds (BOS) included:
  FileCounter    a tokenizer.json (`--tokenizer`), counted here as vLLM's client does, so
                 preparing the dataset costs the server nothing (`bench cpu` measures it)
  ServerCounter  POST /tokenize on the server itself (conveyor and vLLM both answer it)
  WordCounter    4/3 tokens per word, when neither is at hand
`choose_counter` takes the first that works, in that order.

PromptMaker writes each prompt as a run of words drawn at random from the embedded tiny model's
English corpus: real words tokenize like real text, and random runs share no prefix, so a prefix
cache finds nothing by accident. It measures tokens per word once, guesses each prompt's word
count, then counts every prompt and corrects the word count, a few rounds at most: a prompt
ends within a word (one or two tokens) of its target.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Protocol

import aiohttp
import numpy as np

from conveyor.sim.workloads import WORDS_TO_TOKENS

CORPUS = Path(__file__).resolve().parent.parent / "tiny" / "corpus.txt"
MAX_ROUNDS = 4  # counting rounds per prompt after the first guess
CALIBRATION_WORDS = 2000


class TokenCounter(Protocol):
    name: str

    async def count(self, texts: list[str]) -> list[int]: ...


class ServerCounter:
    """The server's own tokenizer, through POST /tokenize ({"prompt"} -> {"count"} or {"tokens"})."""

    name = "server /tokenize"

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, concurrency: int = 32):
        self.session = session
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self._limit = asyncio.Semaphore(concurrency)

    async def count(self, texts: list[str]) -> list[int]:
        return list(await asyncio.gather(*(self._count_one(t) for t in texts)))

    async def _count_one(self, text: str) -> int:
        async with self._limit, self.session.post(self.url, json={"model": self.model, "prompt": text}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"POST {self.url}: HTTP {resp.status}: {(await resp.text())[:200]}")
            body = await resp.json()
        return int(body["count"]) if "count" in body else len(body["tokens"])


class FileCounter:
    """A tokenizer.json, with the special tokens its post-processor adds (as a server would)."""

    name = "tokenizer.json"

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))

    async def count(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]


class WordCounter:
    """The rule of thumb, 4/3 tokens per English word: rough, but needs nothing."""

    name = "words x 4/3"

    async def count(self, texts: list[str]) -> list[int]:
        return [round(len(t.split()) * WORDS_TO_TOKENS) for t in texts]


async def choose_counter(session: aiohttp.ClientSession, base_url: str, model: str, tokenizer: str | None = None) -> TokenCounter:
    """The tokenizer.json given (a file, or a checkpoint directory holding one), else the
    server's /tokenize if it answers, else words."""
    if tokenizer:
        return FileCounter(tokenizer)
    server = ServerCounter(session, base_url, model)
    try:
        if (await server.count(["hello world"]))[0] > 0:
            return server
    except (aiohttp.ClientError, RuntimeError, KeyError, ValueError):
        pass
    return WordCounter()


async def special_tokens(counter: TokenCounter) -> int:
    """Tokens the counter adds to any text (BOS): what an empty prompt counts."""
    try:
        return (await counter.count([""]))[0]
    except (aiohttp.ClientError, RuntimeError):
        return 0  # a server that refuses empty prompts: assume none


class PromptMaker:
    """Random-word prompts of given token lengths (see the module docstring)."""

    def __init__(self, counter: TokenCounter, rng: np.random.Generator):
        self.counter = counter
        self.rng = rng
        self.words = corpus_words()

    async def make(self, lengths: list[int]) -> list[tuple[str, int]]:
        """(prompt, its token count) for each wanted length, in order."""
        overhead = await special_tokens(self.counter)
        sample = self._draw(CALIBRATION_WORDS)
        per_word = max(0.1, ((await self.counter.count([" ".join(sample)]))[0] - overhead) / CALIBRATION_WORDS)
        streams = [self._draw(int((n / per_word) * 1.5) + 16) for n in lengths]
        num_words = [max(1, round((n - overhead) / per_word)) for n in lengths]
        best: list[tuple[int, int] | None] = [None] * len(lengths)  # (|error|, num_words)
        counts: dict[tuple[int, int], int] = {}
        todo = list(range(len(lengths)))
        for _ in range(1 + MAX_ROUNDS):
            if not todo:
                break
            for i in todo:  # a correction may need more words than drawn
                if num_words[i] > len(streams[i]):
                    streams[i] = [*streams[i], *self._draw(num_words[i] - len(streams[i]) + 16)]
            got = await self.counter.count([" ".join(streams[i][: num_words[i]]) for i in todo])
            next_todo = []
            for i, c in zip(todo, got):
                counts[i, num_words[i]] = c
                error = abs(c - lengths[i])
                prior = best[i]
                if prior is None or error < prior[0]:
                    best[i] = (error, num_words[i])
                step = round((lengths[i] - c) / per_word) or (1 if c < lengths[i] else -1 if c > lengths[i] else 0)
                k = max(1, num_words[i] + step)
                if c != lengths[i] and (i, k) not in counts:  # stop once the search comes back
                    num_words[i] = k
                    next_todo.append(i)
            todo = next_todo
        out = []
        for i, chosen in enumerate(best):
            assert chosen is not None  # the first round counts every prompt
            k = chosen[1]
            out.append((" ".join(streams[i][:k]), counts[i, k]))
        return out

    def _draw(self, n: int) -> list[str]:
        return [self.words[j] for j in self.rng.integers(0, len(self.words), n)]


@functools.lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """The corpus's distinct words (letters only, lower case), sorted: a fixed vocabulary."""
    text = CORPUS.read_text(encoding="utf-8")
    return tuple(sorted({w for w in (raw.strip(".,;:!?\"'()").lower() for raw in text.split()) if w.isalpha()}))
