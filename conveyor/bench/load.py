"""How requests are sent: open loop (a Poisson arrival process) or closed loop (N clients).

  open_loop    request i is sent at its arrival time, the simulator's Poisson process at `rate`
               requests/s (conveyor.sim.workloads.arrival_times; inf: all at once), whatever
               is still in flight; with `max_concurrency`, a request that arrives while that
               many are in flight waits for one to finish (its clock starts when it is sent)
  closed_loop  FastGen's clients: N coroutines, each sending its next request as soon as its
               previous one finished, until the requests run out

Both run on the caller's event loop, tick a progress bar per finished request, and return the
results with the run's duration: first send to last finish.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import numpy as np

from conveyor.bench.client import RequestResult
from conveyor.bench.dataset import BenchRequest
from conveyor.sim.workloads import arrival_times

Send = Callable[[BenchRequest], Awaitable[RequestResult]]


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


async def open_loop(
    requests: list[BenchRequest],
    send: Send,
    *,
    rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress=None,
) -> tuple[list[RequestResult], float]:
    progress = progress or _NoBar()
    offsets = arrival_times(len(requests), rate, np.random.default_rng(seed))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if limit is None:
            result = await send(request)
        else:
            async with limit:
                result = await send(request)
        progress.update(1)
        return result

    results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets)))
    return list(results), time.perf_counter() - start


async def closed_loop(
    requests: list[BenchRequest], send: Send, *, num_clients: int, progress=None
) -> tuple[list[RequestResult], float]:
    if num_clients < 1:
        raise ValueError("a closed loop needs at least one client")
    progress = progress or _NoBar()
    pending = iter(requests)  # shared: whichever client is free takes the next request
    results: list[RequestResult] = []

    async def client() -> None:
        for request in pending:
            results.append(await send(request))
            progress.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(num_clients)))
    return results, time.perf_counter() - start
