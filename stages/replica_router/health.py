"""The health poller: GET /health on every replica each `health_interval` seconds, at once, and
mark each ready (200) or not (anything else, or no answer within the interval). conveyor answers
200 only while its engines are ready, 503 while the model loads, an engine restarts or the daemon
drains, so a replica leaves the rotation for all of those.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from conveyor.stages.replica_router.replicas import Replicas

log = logging.getLogger(__name__)


async def check_all(session: aiohttp.ClientSession, replicas: Replicas, timeout: float) -> None:
    """One round: every replica's /health, concurrently."""
    results = await asyncio.gather(*(_is_healthy(session, r.url, timeout) for r in replicas.replicas))
    for index, healthy in enumerate(results):
        if healthy != replicas[index].ready:
            log.info("replica %s is %s", replicas[index].url, "ready" if healthy else "not ready")
        replicas.mark(index, healthy)


async def poll(session: aiohttp.ClientSession, replicas: Replicas, interval: float) -> None:
    """Check every replica each `interval` seconds, until cancelled."""
    while True:
        await asyncio.sleep(interval)
        await check_all(session, replicas, timeout=interval)


async def _is_healthy(session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
