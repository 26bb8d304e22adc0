"""Liveness: every ready stage tells the launcher, from its main loop, that the loop still turns.

Sends: Heartbeat to the launcher, at most every `interval(config)` seconds. The beat comes from
the loop itself, never from a side thread, so a stage stuck in a kernel or a tokenizer call (or
stopped with SIGSTOP) goes silent, and the launcher declares it dead after --stage-timeout.
Sync stages hang `Pulse.beat` on their receiver (`Receiver.on_wait`), which calls it whenever it
waits; the ingress beats from an asyncio task, which stops when its event loop is blocked.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import zmq

from conveyor.config import EngineConfig
from conveyor.wire.messages import Heartbeat
from conveyor.wire.topology import LAUNCHER, Stage, sender

BEATS_PER_TIMEOUT = 5  # a stage misses this many beats in a row before it is declared dead
MAX_INTERVAL_S = 1.0


def interval(config: EngineConfig) -> float:
    return min(MAX_INTERVAL_S, config.server.stage_timeout_s / BEATS_PER_TIMEOUT)


class Pulse:
    def __init__(self, ctx: zmq.Context, config: EngineConfig, stage: Stage[Any], index: int):
        self._sender = sender(ctx, config, LAUNCHER)
        self._message = Heartbeat(stage=stage.name, index=index, pid=os.getpid())
        self._interval = interval(config)
        self._next = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._interval
            self._sender.send(self._message)

    async def run(self) -> None:
        """The asyncio twin: beat until cancelled."""
        while True:
            self.beat()
            await asyncio.sleep(self._interval)

    def close(self) -> None:
        self._sender.close()
