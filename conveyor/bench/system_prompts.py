"""Shared system prompts: K texts of about L tokens each, one of them opening every request.

It is the workload a prefix cache, and a router that sends a prefix where it is cached, are
for: many requests that differ only after a long common opening. Each system prompt is a run of
random corpus words that the PromptMaker writes to L tokens as the server's tokenizer counts
them (its BOS not included: inside a request the system prompt carries none), so K prompts
share no opening with each other. Each request picks one uniformly.

Everything follows from the dataset's seed, from streams of their own: the prompts from
[seed, 1], the picks from [seed, 2]. So the same seed gives the same prompts and the same picks,
the picks do not depend on how the tokenizer counts, and the requests' own text and lengths are
the ones drawn without system prompts. A request's prompt length is counted again, with its
system prompt, the way the completion endpoint sends it (`BenchRequest.text`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from conveyor.bench.prompts import PromptMaker, TokenCounter, special_tokens

if TYPE_CHECKING:  # dataset.py imports this module
    from conveyor.bench.dataset import BenchRequest, DatasetConfig

PROMPTS_STREAM, PICKS_STREAM = 1, 2  # second words of the seed sequences


async def make_system_prompts(num: int, length: int, seed: int, counter: TokenCounter, stream: int = PROMPTS_STREAM) -> list[str]:
    """`num` random-word texts of about `length` tokens each, special tokens not counted, drawn
    from the seed's `stream`."""
    if num < 1 or length < 1:
        raise ValueError("system prompts need a count and a length of at least 1")
    overhead = await special_tokens(counter)
    made = await PromptMaker(counter, np.random.default_rng([seed, stream])).make([length + overhead] * num)
    return [text for text, _ in made]


def pick_system_prompts(num_requests: int, num_prompts: int, seed: int) -> list[int]:
    """Which system prompt each request opens with: uniform, the same for the same seed."""
    return [int(i) for i in np.random.default_rng([seed, PICKS_STREAM]).integers(0, num_prompts, num_requests)]


async def add_system_prompts(requests: list[BenchRequest], config: DatasetConfig, counter: TokenCounter) -> list[BenchRequest]:
    """The requests, each opening with one of the config's K system prompts, lengths recounted."""
    prompts = await make_system_prompts(config.num_system_prompts, config.system_prompt_len, config.seed, counter)
    picks = pick_system_prompts(len(requests), len(prompts), config.seed)
    opened = [dataclasses.replace(r, system_prompt=prompts[i]) for r, i in zip(requests, picks)]
    counts = await counter.count([r.text for r in opened])
    return [dataclasses.replace(r, prompt_len=n) for r, n in zip(opened, counts)]
