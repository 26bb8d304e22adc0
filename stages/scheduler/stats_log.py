"""The periodic stats line: throughput, batch, queue, KV usage and GPU bubble since the last line."""

from __future__ import annotations

import logging
import time

from conveyor.stages.scheduler.scheduled_step import ScheduledStep
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.wire.step import StepResult

log = logging.getLogger("conveyor.stats")
INTERVAL_S = 10.0


class StatsLog:
    def __init__(self) -> None:
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.since = now
        self.prompt_tokens = self.generated = 0
        self.busy = self.idle = 0.0

    def add(self, result: StepResult, step: ScheduledStep) -> None:
        self.generated += len(result.sampled_token_ids) - len(result.masked_draws)  # per pass of a window
        self.prompt_tokens += step.num_prompt_tokens
        self.busy += result.busy_time
        self.idle += result.idle_time

    def maybe_log(self, scheduler: Scheduler) -> None:
        now = time.monotonic()
        elapsed = now - self.since
        if elapsed < INTERVAL_S:
            return
        if self.generated or self.prompt_tokens:
            blocks = scheduler.blocks
            bubble = self.idle / (self.idle + self.busy) if self.idle + self.busy else 0.0
            log.info(
                "stats prompt_tokens_per_s=%.1f generation_tokens_per_s=%.1f running=%d waiting=%d kv_usage=%.3f bubble=%.3f",
                self.prompt_tokens / elapsed,
                self.generated / elapsed,
                len(scheduler.running),
                len(scheduler.waiting),
                blocks.num_used / blocks.num_blocks,
                bubble,
            )
        self._reset(now)
