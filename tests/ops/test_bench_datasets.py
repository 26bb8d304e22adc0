"""conveyor bench's datasets: synthetic prompts that hit their lengths on the counter they are
given, which is the server's tokenizer when it has /tokenize (a file or words when not), and
ShareGPT conversations kept by vLLM's filter (test_bench_sharegpt_vllm.py: vLLM's very picks)."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import numpy as np
import pytest

from conveyor.bench.dataset import DatasetConfig, make_dataset
from conveyor.bench.prompts import FileCounter, ServerCounter, WordCounter, choose_counter
from conveyor.sim.sharegpt import sharegpt_pairs
from tests.ops.bench_fakes import SHAREGPT, FakeServer


def test_synthetic_prompts_hit_their_lengths(tiny_counter):
    random = asyncio.run(make_dataset(DatasetConfig("random", 20, input_len=300, output_len=40), tiny_counter))
    assert len(random) == 20 and all(r.output_len == 40 for r in random)
    assert all(abs(r.prompt_len - 300) <= 3 for r in random)
    counted = asyncio.run(tiny_counter.count([r.prompt for r in random]))
    assert counted == [r.prompt_len for r in random]  # the stated length is the counted one
    assert len({tuple(r.prompt.split()[:3]) for r in random}) == 20  # no two share an opening

    heavy = asyncio.run(make_dataset(DatasetConfig("decode-heavy", 30), tiny_counter))
    assert all(0.9 * 462 - 3 <= r.prompt_len <= 1.1 * 462 + 3 and 230 <= r.output_len <= 282 for r in heavy)

    fastgen = asyncio.run(make_dataset(DatasetConfig("fastgen-1200-60", 200), tiny_counter))
    prompts = np.array([r.prompt_len for r in fastgen])
    outputs = np.array([r.output_len for r in fastgen])
    assert abs(prompts.mean() - 1200) < 60 and 0.2 < prompts.std() / prompts.mean() < 0.4
    assert abs(outputs.mean() - 60) < 5


def test_prompts_follow_the_servers_tokenizer(server):
    async def run():
        async with aiohttp.ClientSession() as session:
            counter = await choose_counter(session, server.url, "fake-model")
            assert isinstance(counter, ServerCounter)
            return await make_dataset(DatasetConfig("random", 5, input_len=50, output_len=8), counter)

    requests = asyncio.run(run())
    assert [r.prompt_len for r in requests] == [50] * 5
    assert all(FakeServer.count(r.prompt) == 50 for r in requests)


def test_counter_falls_back_without_tokenize():
    async def run(tokenizer):
        async with aiohttp.ClientSession() as session:
            return await choose_counter(session, "http://127.0.0.1:9", "m", tokenizer)  # nothing listens

    from conveyor.tiny.checkpoint import ensure_default_model

    assert isinstance(asyncio.run(run(None)), WordCounter)
    assert isinstance(asyncio.run(run(str(ensure_default_model() / "tokenizer.json"))), FileCounter)


def test_sharegpt_follows_the_vllm_filter(tiny_counter):
    requests = asyncio.run(make_dataset(DatasetConfig("sharegpt", 50, path=SHAREGPT, seed=1), tiny_counter))
    in_file = collections.Counter(prompt for prompt, _ in sharegpt_pairs(SHAREGPT))
    # No conversation twice (the file itself opens a few alike: vLLM keeps both, and so do we).
    assert len(requests) == 50 and all(n <= in_file[p] for p, n in collections.Counter(r.prompt for r in requests).items())
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048 for r in requests)
    with pytest.raises(ValueError, match="dataset-path"):
        asyncio.run(make_dataset(DatasetConfig("sharegpt", 5), tiny_counter))
