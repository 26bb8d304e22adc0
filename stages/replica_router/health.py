"""The health poller: GET /health on every replica each `health_interval` seconds, at once (after
asking DNS for the replicas again, where they are discovered), and
mark each ready (200) or not (anything else, or no answer within the interval). conveyor answers
200 only while its engines are ready, 503 while the model loads, an engine restarts or the daemon
drains, so a replica leaves the rotation for all of those.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from conveyor.stages.replica_router.replicas import Replicas

log = logging.getLogger(__name__)


async def check_all(session: aiohttp.ClientSession, replicas: Replicas, timeout: float) -> None:
    """One round: every active replica's /health, concurrently."""
    targets = [(index, r) for index, r in enumerate(replicas.replicas) if r.active]
    results = await asyncio.gather(*(_is_healthy(session, r.url, timeout) for _, r in targets))
    for (index, r), healthy in zip(targets, results):
        if replicas[index] is not r or not r.active:  # it left while we asked
            continue
        if healthy != r.ready:
            log.info("replica %s is %s", r.url, "ready" if healthy else "not ready")
        replicas.mark(index, healthy)


async def poll(
    session: aiohttp.ClientSession, replicas: Replicas, interval: float, discover: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Each `interval` seconds: discover the replicas again (where they are found by DNS), then
    check every one, until cancelled."""
    while True:
        await asyncio.sleep(interval)
        if discover is not None:
            await discover()
        await check_all(session, replicas, timeout=interval)


async def _is_healthy(session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
