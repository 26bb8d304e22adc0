"""The worker stage process: one per device (tensor-parallel rank). Runs the model.

With tensor_parallel_size > 1 the ranks of an engine first form their group (gpu/parallel/), then
each loads its shard; all of them run every plan, and rank 0 samples and answers.

Takes (WorkerInbound): InitializeCache once, then StepPlan per step, from the scheduler.
Sends: WorkerReady (its KV capacity) and, from rank 0, one StepResult per forward pass of a plan
with rows (a multi-step plan has several), each as soon as its ids reach the host.

The loop never lets the device wait for a result to be sent: it launches a plan's passes, then,
if the next plan is already in the socket (asynchronous scheduling), launches that too before
waiting for the earlier ids. While a multi-step window runs, each pass's result goes out as soon
as it lands, one pass behind the device at most (on a CPU, at once: compute is synchronous).
"""

from __future__ import annotations

import logging
import time

import zmq

from conveyor.config import EngineConfig
from conveyor.gpu.parallel.rendezvous import init_group
from conveyor.gpu.runner import ModelRunner
from conveyor.stages import metrics
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import report_ready
from conveyor.wire.messages import InitializeCache, StepPlan, StepResult, WorkerReady
from conveyor.wire.topology import SCHEDULER, WORKER, engine_and_rank, receiver, sender

log = logging.getLogger(__name__)


def record_step(result: StepResult) -> None:
    """The GPU bubble: busy is device compute, idle the wait on the host before the step."""
    metrics.worker_busy.inc(result.busy_time)
    metrics.worker_idle.inc(result.idle_time)
    metrics.worker_step_busy.observe(result.busy_time)
    metrics.worker_step_idle.observe(result.idle_time)


def run(config: EngineConfig, index: int) -> None:
    """Worker process `index`: rank `rank` of engine `engine` (wire/topology.py)."""
    engine, rank = engine_and_rank(config, index)
    runner = ModelRunner(config, index, tp=init_group(config, engine, rank))  # device: its index on this machine
    ctx = zmq.Context()
    try:
        inbox = receiver(ctx, config, WORKER, index)
        scheduler = sender(ctx, config, SCHEDULER, engine)
        scheduler.send(WorkerReady(rank=rank, num_kv_blocks=runner.num_available_blocks()))

        def send(results: list[StepResult]) -> None:
            for result in results:
                if rank == 0:
                    scheduler.send(result)
                    record_step(result)

        while True:
            # Passes in flight: look for the next plan without blocking, and collect if none.
            match inbox.recv(timeout_ms=0 if runner.has_pending() else None):
                case InitializeCache(num_kv_blocks=num_blocks):
                    runner.initialize_cache(num_blocks)
                    report_ready(ctx, config, WORKER, index)
                    inbox.on_wait = Pulse(ctx, config, WORKER, index).beat
                case StepPlan() as plan:
                    started = time.time()
                    for _ in runner.launch(plan):
                        send(runner.collect(keep=1))  # every landed pass; the one just launched may wait
                    if log.isEnabledFor(logging.DEBUG):  # a step timeline, next to the ingress's arrivals
                        log.debug(
                            "step %d started=%.4f rows=%d tokens=%d new=%d passes=%d launch_ms=%.1f",
                            plan.step, started, len(plan.scheduled), sum(row.num_tokens for row in plan.scheduled),
                            len(plan.new_seqs), plan.num_steps, 1000 * (time.time() - started),
                        )  # fmt: skip
                case None:  # nothing waiting: the passes in flight are all there is to do
                    send(runner.collect(keep=0))
    finally:
        ctx.destroy(linger=0)
