"""The worker stage process: one per device (tensor-parallel rank). Runs a ModelRunner.

With tensor_parallel_size > 1 the ranks of an engine first form their group (gpu/parallel/), then
each loads its shard; all of them run every plan, and rank 0 alone answers.

Takes (WorkerInbound): InitializeCache once, then StepPlan per step, from the scheduler.
Sends: WorkerReady (its KV capacity) and, from rank 0, one StepResult per forward pass of a plan
with rows (a multi-step plan has several), each as soon as its ids reach the host; from every
rank, KvFetched as its reads from the KV disk tier finish (looked for every READ_POLL_MS while
some are in flight, whether or not a plan runs), and KvDiskChanged as the disk tier finds blocks
other daemons sharing its directory wrote or removed (looked for every --kv-disk-scan-s at least).

The loop is receive, launch, send, and never lets the device wait for a result to be sent: it
waits for whichever comes first, the next plan (launched at once, behind the passes in flight)
or the oldest pass's ids (sent as they land), looking every POLL_MS where the device cannot say
when a pass lands. Why a plan arrives while a pass computes: docs/architecture.md ("Overlap").
"""

from __future__ import annotations

import logging
import time

import zmq

from conveyor.config import EngineConfig
from conveyor.gpu.parallel.rendezvous import init_group
from conveyor.gpu.step.features.kv_offload import KvOffloadStep
from conveyor.gpu.step.runner import ModelRunner
from conveyor.stages import metrics
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import report_ready
from conveyor.wire.messages import InitializeCache, WorkerReady
from conveyor.wire.step import StepPlan, StepResult
from conveyor.wire.topology import SCHEDULER, WORKER, engine_and_rank, receiver, sender

log = logging.getLogger(__name__)

POLL_MS = 1  # how often to look for a plan while a pass whose landing time is unknown computes
READ_POLL_MS = 2  # how often to look for finished reads from the KV disk tier while some are in flight


def record_step(result: StepResult) -> None:
    """The GPU bubble: busy is device compute, idle the wait on the host before the step."""
    metrics.worker_busy.inc(result.busy_time)
    metrics.worker_idle.inc(result.idle_time)
    metrics.worker_step_busy.observe(result.busy_time)
    metrics.worker_step_idle.observe(result.idle_time)


def wait_ms(runner: ModelRunner, offload: KvOffloadStep | None = None) -> int | None:
    """How long to wait for a message: forever with nothing in flight, else until the oldest pass
    lands (rounded down: the rest is waited for by collecting it), or POLL_MS where unknown; at
    most READ_POLL_MS while reads from disk are in flight, and at most the disk tier's period of
    looking for other daemons' blocks, so that its news goes out while no plan comes."""
    reading = offload is not None and offload.reading
    news_ms = offload.disk_news_ms if offload is not None else None
    if not runner.has_pending():
        wait = READ_POLL_MS if reading else None
    else:
        left = runner.landing_in()
        wait = POLL_MS if left is None else int(left * 1000)
        wait = min(wait, READ_POLL_MS) if reading else wait
    if news_ms is not None:
        wait = news_ms if wait is None else min(wait, news_ms)
    return wait


def run(config: EngineConfig, index: int) -> None:
    """Worker process `index`: rank `rank` of engine `engine` (wire/topology.py)."""
    engine, rank = engine_and_rank(config, index)
    runner = ModelRunner(config, index, tp=init_group(config, engine, rank))  # device: its index on this machine
    ctx = zmq.Context()
    try:
        inbox = receiver(ctx, config, WORKER, index)
        scheduler = sender(ctx, config, SCHEDULER, engine)
        offload = runner.feature(KvOffloadStep)
        num_slots = offload.num_slots if offload is not None else 0
        block_bytes = runner.attn.bytes_per_block(config.cache.block_size)
        warm = offload.warm if offload is not None else []
        on_disk, num_disk_blocks = (offload.disk_names(), offload.num_disk_blocks) if offload is not None else ([], 0)
        scheduler.send(WorkerReady(rank, runner.num_available_blocks(), num_slots, block_bytes, warm, on_disk, num_disk_blocks))

        def send(results: list[StepResult]) -> None:
            for result in results:
                if rank == 0:
                    scheduler.send(result)
                    record_step(result)

        while True:
            match inbox.recv(timeout_ms=wait_ms(runner, offload)):
                case InitializeCache(num_kv_blocks=num_blocks):
                    runner.initialize_cache(num_blocks)
                    report_ready(ctx, config, WORKER, index)
                    inbox.on_wait = Pulse(ctx, config, WORKER, index).beat
                case StepPlan() as plan:
                    started = time.time()
                    for _ in runner.launch(plan):
                        # Every landed pass; the one just launched may wait, so a multi-step window's results
                        # trail the device by one pass at most (on a CPU, compute is synchronous: none).
                        send(runner.collect(keep=1))
                    for seconds in offload.take_load_seconds() if offload is not None and rank == 0 else ():
                        metrics.kv_load_seconds.observe(seconds)
                    if log.isEnabledFor(logging.DEBUG):  # a step timeline, next to the ingress's arrivals
                        log.debug(
                            "step %d started=%.4f rows=%d tokens=%d new=%d passes=%d launch_ms=%.1f",
                            plan.step,
                            started,
                            len(plan.scheduled),
                            sum(row.num_tokens for row in plan.scheduled),
                            len(plan.new_seqs),
                            plan.num_steps,
                            1000 * (time.time() - started),
                        )
                case None:  # no plan came while the oldest pass computed (or a read from disk went on)
                    send(runner.collect_due())
            if offload is not None and (fetched := offload.take_fetched()) is not None:
                scheduler.send(fetched)
            if offload is not None and (news := offload.take_disk_news()) is not None:
                scheduler.send(news)
    finally:
        ctx.destroy(linger=0)
