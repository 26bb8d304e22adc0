"""The worker stage process: one per device (tensor-parallel rank). Runs the model.

Takes (WorkerInbound): InitializeCache once, then StepPlan per step, from the scheduler.
Sends: WorkerReady (its KV capacity) and, from rank 0, one StepResult per step with rows.
"""

from __future__ import annotations

import logging
import time

import zmq

from conveyor.config import EngineConfig
from conveyor.gpu.runner import ModelRunner
from conveyor.stages import metrics
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import report_ready
from conveyor.wire.messages import InitializeCache, StepPlan, StepResult, WorkerReady
from conveyor.wire.topology import SCHEDULER, WORKER, receiver, sender

log = logging.getLogger(__name__)


def record_step(result: StepResult) -> None:
    """The GPU bubble: busy is device compute, idle the wait on the host before the step."""
    metrics.worker_busy.inc(result.busy_time)
    metrics.worker_idle.inc(result.idle_time)
    metrics.worker_step_busy.observe(result.busy_time)
    metrics.worker_step_idle.observe(result.idle_time)


def run(config: EngineConfig, rank: int) -> None:
    runner = ModelRunner(config, rank)
    ctx = zmq.Context()
    try:
        inbox = receiver(ctx, config, WORKER, rank)
        scheduler = sender(ctx, config, SCHEDULER)
        scheduler.send(WorkerReady(rank=rank, num_kv_blocks=runner.num_available_blocks()))
        while True:
            match inbox.recv():
                case InitializeCache(num_kv_blocks=num_blocks):
                    runner.initialize_cache(num_blocks)
                    report_ready(ctx, config, WORKER, rank)
                    inbox.on_wait = Pulse(ctx, config, WORKER, rank).beat
                case StepPlan() as plan:
                    started = time.time()
                    result = runner.execute(plan)
                    if log.isEnabledFor(logging.DEBUG):  # a step timeline, next to the ingress's arrivals
                        log.debug(
                            "step %d started=%.4f rows=%d tokens=%d new=%d busy_ms=%.1f wall_ms=%.1f",
                            plan.step, started, len(plan.scheduled), sum(row.num_tokens for row in plan.scheduled),
                            len(plan.new_seqs), 1000 * result.busy_time, 1000 * (time.time() - started),
                        )  # fmt: skip
                    if rank == 0 and plan.scheduled:
                        scheduler.send(result)
                        record_step(result)
    finally:
        ctx.destroy(linger=0)
