"""conveyor bench's HTTP client and load generators against a fake OpenAI server (bench_fakes):
a stream timed and counted by its usage, a chat's deltas, token times without token ids, and
open and closed loops that keep their concurrency."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import numpy as np
import pytest

from conveyor.bench import client, load
from conveyor.bench.client import RequestResult
from conveyor.bench.dataset import BenchRequest
from conveyor.bench.results import compute
from tests.ops.bench_fakes import FakeServer


def test_client_times_a_stream_and_counts_by_usage(server):
    requests = [BenchRequest("one two three", 4, 5), BenchRequest("a b c d e FAIL", 7, 5)]

    async def run():
        async with aiohttp.ClientSession() as session:
            out = []
            for r in requests:
                body = client.payload(r, "fake-model", chat=False, ignore_eos=True, return_token_ids=True)
                out.append(await client.send(session, server.url + "/v1/completions", r, body))
            return out

    ok, failed = asyncio.run(run())
    sent = server.bodies[0]
    assert sent["max_tokens"] == 5 and sent["ignore_eos"] is True and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True} and sent["temperature"] == 0.0
    assert ok.success and ok.prompt_len == 4 and ok.output_len == 5
    assert ok.chunk_tokens == [1] * 5 and len(ok.token_times()) == 5
    assert ok.ttft >= FakeServer.TTFT_S  # the server waits that long before the first chunk
    assert FakeServer.TTFT_S + 4 * FakeServer.GAP_S <= ok.e2e < 5.0
    assert len(ok.itl) == 4 and ok.tpot == pytest.approx((ok.chunk_times[-1] - ok.chunk_times[0]) / 4)
    assert not failed.success and failed.error.startswith("HTTP 500")

    metrics = compute([ok, failed], 1.0, label="x")
    assert metrics.num_completed == 1 and metrics.num_failed == 1
    assert metrics.output_throughput == 5.0 and metrics.input_throughput == 4.0
    assert list(metrics.errors.values()) == [1]


def test_chat_endpoint_reads_deltas(server):
    r = BenchRequest("hello there", 3, 3)

    async def run():
        async with aiohttp.ClientSession() as session:
            body = client.payload(r, "fake-model", chat=True, ignore_eos=False, return_token_ids=False)
            return await client.send(session, server.url + "/v1/chat/completions", r, body)

    result = asyncio.run(run())
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hello there"}]
    assert "ignore_eos" not in server.bodies[0]
    assert result.success and result.output_len == 3 and len(result.chunk_times) == 3


def test_token_times_spread_usage_over_chunks_without_token_ids():
    r = RequestResult(prompt_len=4, output_len=7, start=0.0, end=1.0, chunk_times=[0.1, 0.2, 0.3], chunk_tokens=[1, 1, 1])
    assert r.token_times() == [0.1, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3]


def _send_to(server: FakeServer, session: aiohttp.ClientSession):
    async def send(r: BenchRequest) -> RequestResult:
        body = client.payload(r, "fake-model", chat=False, ignore_eos=True, return_token_ids=True)
        return await client.send(session, server.url + "/v1/completions", r, body)

    return send


def test_open_loop_respects_max_concurrency_and_closed_loop_keeps_n_in_flight(server):
    requests = [BenchRequest(f"p{i} x", 3, 3) for i in range(8)]

    async def run(**kw):
        async with aiohttp.ClientSession() as session:
            if "num_clients" in kw:
                return await load.closed_loop(requests, _send_to(server, session), **kw)
            return await load.open_loop(requests, _send_to(server, session), **kw)

    results, duration = asyncio.run(run(rate=math.inf, max_concurrency=2))
    assert len(results) == 8 and all(r.success for r in results) and server.max_in_flight == 2
    server.reset()
    results, _ = asyncio.run(run(num_clients=3))
    assert len(results) == 8 and server.max_in_flight == 3
    server.reset()
    results, duration = asyncio.run(run(rate=40.0, seed=3))
    offsets = np.cumsum(np.random.default_rng(3).exponential(1 / 40.0, 8))
    assert duration >= offsets[-1]  # the last request was not sent before its arrival time
