"""A short soak through the whole daemon: a few thousand requests, one in ten abandoned by its
client mid-stream. At the end no KV block is held, nothing is left running or waiting, and no
stage process grew: each one's resident memory after the soak is within a small margin of what it
was after a warm-up of the same traffic (a leak of a few KB per request would show as megabytes).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import aiohttp
import pytest

pytestmark = pytest.mark.slow  # a soak: minutes of load (-m slow)

NUM_WARMUP = 300
NUM_REQUESTS = 2000
CONCURRENCY = 32
DISCONNECT_EVERY = 10  # one request in ten is abandoned after its first chunk
MAX_GROWTH_BYTES = 24 * 1024 * 1024


def rss(pid: int) -> int:
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def drive(url: str, num_requests: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes = {"finished": 0, "abandoned": 0}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        abandon = i % DISCONNECT_EVERY == 0
        body = {
            "prompt": f"Request {i}: " + "the river runs " * rng.randint(1, 6),
            "max_tokens": rng.randint(2, 6),
            "temperature": rng.choice([0, 0.8]),
            "stream": True,
        }
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            if abandon:
                await r.content.readline()  # the first chunk, then the client is gone
                r.close()
                outcomes["abandoned"] += 1
                return
            text = await r.text()
            assert text.rstrip().endswith("data: [DONE]"), text[-200:]
            assert 'data: {"error"' not in text, text[-400:]
            outcomes["finished"] += 1

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            await one(session, queue.get_nowait())

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(CONCURRENCY)))
    return outcomes


def settle(daemon, name: str, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while (value := daemon.metric(name)) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_soak_with_disconnects_leaks_nothing(daemon_factory):
    daemon = daemon_factory("--num-kv-blocks", "512")
    asyncio.run(drive(daemon.url, NUM_WARMUP, seed=1))
    stages = {stage: daemon.stage_pids(stage) for stage in ("ingress", "tokenizer", "scheduler", "worker", "detokenizer")}
    before = {pid: rss(pid) for pids in stages.values() for pid in pids}

    outcomes = asyncio.run(drive(daemon.url, NUM_REQUESTS, seed=2))
    assert outcomes == {"finished": NUM_REQUESTS * 9 // 10, "abandoned": NUM_REQUESTS // 10}

    assert settle(daemon, "conveyor_kv_blocks_used") == 0
    assert settle(daemon, "conveyor_requests_running") == 0
    assert settle(daemon, "conveyor_requests_waiting") == 0
    assert daemon.metric("conveyor_aborts_total") > 0  # the abandoned streams were aborted
    after = {pid: rss(pid) for pid in before}
    grown = {
        f"{stage} {pid}": after[pid] - before[pid]
        for stage, pids in stages.items()
        for pid in pids
        if after[pid] - before[pid] > MAX_GROWTH_BYTES
    }
    assert not grown, f"stages grew (bytes): {grown}"
    assert stages == {stage: daemon.stage_pids(stage) for stage in stages}  # nothing died on the way
