"""The scheduler stage process: receive, schedule, send to the worker, fan tokens out.

Takes (one socket, SchedulerInbound): ScheduleRequest from tokenizers (with data parallelism,
from the router), AbortRequest from ingress (the router), FinishSeqs (a stop string matched) from
detokenizers, WorkerReady and StepResult from worker rank 0, StageFailed from the launcher (a
detokenizer's requests fail with a 503, a dead ingress's are aborted).
Sends: InitializeCache and StepPlan to its engine's worker ranks; EngineStarted, then one
TokenBatch per detokenizer per step; RequestAccepted (naming its engine), or RequestRejected (429)
past the queue bounds, to the request's ingress; StageReady to the launcher; with data
parallelism, EngineLoad to the router (load_report.py paces it).

Data parallelism: engine e of n is scheduler e; it numbers its sequences e, e + n, e + 2n, ... so
that detokenizers send each FinishSeqs to the engine that owns the sequence.

Overlap, two kinds:
- Asynchronous scheduling (the default): step n+1 is planned and sent while the worker computes
  step n, so its plan is waiting in the worker's socket when step n ends and the device never
  waits on this process. Sequences drawing in step n decode that token in step n+1; the worker
  has it by then (Scheduler's docstring says what this costs: at most a wasted token per stop).
  The one exception is the first step after an idle spell, which runs alone: see `may_plan`.
- Output processing: step n's tokens go to the detokenizers after the next plan is sent, so
  detokenization and streaming run while the worker computes.

Multi-step windows (--num-scheduler-steps): a window plan answers with one StepResult per pass.
It stays in flight until its last_pass result; each pass's tokens are applied and streamed as
they come, so clients see the per-pass cadence. The next plan may go out while a window runs.
"""

from __future__ import annotations

import collections
import logging
import time

import zmq

from conveyor.config import EngineConfig
from conveyor.stages import metrics
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import report_ready
from conveyor.stages.scheduler.load_report import LoadReports
from conveyor.stages.scheduler.plan import step_plan, token_batches
from conveyor.stages.scheduler.scheduled_step import SeqUpdate
from conveyor.stages.scheduler.scheduler import ScheduledStep, Scheduler
from conveyor.stages.scheduler.stats_log import StatsLog
from conveyor.stages.scheduler.waiting_queue import QueueFull
from conveyor.wire.messages import (
    AbortRequest,
    EngineLoad,
    EngineStarted,
    FinishReason,
    FinishSeqs,
    InitializeCache,
    RequestAccepted,
    RequestRejected,
    ScheduleRequest,
    SchedulerInbound,
    StageFailed,
    StepResult,
    WorkerReady,
)
from conveyor.wire.topology import DETOKENIZER, INGRESS, ROUTER, SCHEDULER, engine_workers, receiver, sender, senders, seq_ids_of

log = logging.getLogger(__name__)

# The gauges (running, waiting, KV use) are scraped every few seconds: written at most this often
# while busy (a dozen locked writes to the shared metrics file per step otherwise), and always
# when the engine goes idle, so a scrape never sees a stale busy state.
GAUGE_INTERVAL_S = 0.05


class SchedulerStage:
    def __init__(self, config: EngineConfig, ctx: zmq.Context, engine: int = 0):
        self.config = config
        self.engine = engine  # this scheduler's engine (data-parallel index): its workers are that engine's ranks
        self.inbox = receiver(ctx, config, SCHEDULER, engine)
        self.workers = engine_workers(ctx, config, engine)
        self.detokenizers = senders(ctx, config, DETOKENIZER)
        self.ingresses = senders(ctx, config, INGRESS)
        # With data parallelism the router balances on this engine's reported load.
        self.load_reports = LoadReports(sender(ctx, config, ROUTER).send) if ROUTER.num_processes(config) else None
        self.num_received = 0  # ScheduleRequests received (EngineLoad.num_received)
        # Built by start(), once every worker rank has reported how many KV blocks it holds;
        # nothing else runs before it.
        self.scheduler: Scheduler
        self.in_flight: collections.deque[ScheduledStep] = collections.deque()  # sent, result pending
        self.max_in_flight = 2 if config.scheduler.async_scheduling else 1
        self.stalled = False  # the last try planned nothing while a step was in flight
        self.num_requests = 0
        self.seen = {"aborts": 0, "preemptions": 0, "queries": 0, "hits": 0}
        self.prompt_tokens_per_s = 0.0  # moving average, for Retry-After
        self.last_step_end = time.monotonic()
        self.stats = StatsLog()
        self.idle = True
        self.alone: ScheduledStep | None = None  # the first step after an idle spell
        self.gauges_time = 0.0  # when the gauges were last written

    def start(self) -> None:
        """Wait for every worker rank's capacity, then size the pool they all can hold."""
        reports: dict[int, int] = {}
        while len(reports) < len(self.workers):
            msg = self.inbox.recv()
            if isinstance(msg, WorkerReady):
                reports[msg.rank] = msg.num_kv_blocks
        num_blocks = min(reports.values())
        for worker in self.workers:
            worker.send(InitializeCache(num_blocks))
        for detokenizer in self.detokenizers:  # before any TokenBatch: a predecessor's sequences are gone
            detokenizer.send(EngineStarted(self.engine))
        cfg = self.config
        self.scheduler = Scheduler.from_config(
            cfg.scheduler,
            num_blocks=num_blocks,
            block_size=cfg.cache.block_size,
            max_model_len=cfg.model.max_model_len,
            eos_token_ids=cfg.model.eos_token_ids,
            seq_ids=seq_ids_of(cfg, self.engine),
        )
        metrics.kv_blocks_capacity.set(num_blocks)
        log.info("KV pool: %d blocks of %d tokens", num_blocks, cfg.cache.block_size)

    def loop(self) -> None:
        while True:
            # Block when there is nothing to plan: enough steps in flight, no work at all, or
            # nothing plannable until a result or a request arrives (`stalled`).
            nothing_to_plan = not self.may_plan() or not self.scheduler.has_work() or self.stalled
            msg = self.inbox.recv(timeout_ms=None if nothing_to_plan else 0)
            updates: list[SeqUpdate] = []
            while msg is not None:
                self.stalled = False
                updates += self.handle(msg)
                if isinstance(msg, StepResult) and not msg.last_pass:
                    # A window's inner pass leaves the steps in flight as they were: no plan to
                    # send first, so its tokens stream now.
                    self.emit(updates)
                    updates = []
                msg = self.inbox.recv_nowait()
            if self.may_plan():
                self.plan_next()  # the next plan goes out before this step's tokens do
            self.emit(updates + self.scheduler.take_unsampled_updates())
            self.report_load()

    def handle(self, msg: SchedulerInbound) -> list[SeqUpdate]:
        match msg:
            case ScheduleRequest():
                self.num_received += 1
                self.admit(msg)
            case AbortRequest():
                for request_id in msg.request_ids:
                    self.scheduler.abort(request_id)
            case FinishSeqs():
                self.scheduler.finish_seqs(msg.seq_ids)
            case StepResult():
                step = self.in_flight[0] if self.in_flight else None
                if step is None or step.step != msg.step:
                    log.error("step result %d does not match the step in flight", msg.step)
                    if msg.last_pass and step is not None:
                        self.in_flight.popleft()
                    return []
                if msg.last_pass:  # a window stays in flight until its final pass
                    self.in_flight.popleft()
                    self.record_step(step)
                self.stats.add(msg, step)
                updates = self.scheduler.update(step, msg.sampled_token_ids, msg.sampled_logprobs, msg.top_logprobs,
                                                msg.failed_draws, pass_index=msg.pass_index,
                                                masked_draws=msg.masked_draws, last_pass=msg.last_pass)  # fmt: skip
                metrics.generation_tokens.inc(sum(len(u.new_token_ids) for u in updates))
                self.record_outputs(updates)
                return updates
            case StageFailed(stage="detokenizer", index=index):
                # Its incremental decoding and stop-string state died with it: those requests
                # cannot go on. Each gets a 503 (an error event if its stream began).
                for seq in self.scheduler.drop_requests(lambda s: s.detokenizer == index):
                    message = "the detokenizer streaming this request failed; retry it"
                    self.ingresses[seq.ingress].send(RequestRejected(seq.request_id, 503, message, code="stage_failed"))
            case StageFailed(stage="ingress", index=index):
                self.scheduler.drop_requests(lambda s: s.ingress == index)  # their clients are gone
            case WorkerReady():
                log.warning("unexpected WorkerReady from rank %d", msg.rank)
        return []

    def admit(self, request: ScheduleRequest) -> None:
        reply_to = self.ingresses[request.ingress]
        try:
            seq = self.scheduler.add_request(request, detokenizer=self.num_requests % len(self.detokenizers))
        except QueueFull as e:
            queued = self.scheduler.waiting.num_tokens
            retry_after = min(60.0, max(1.0, queued / max(self.prompt_tokens_per_s, 1.0)))
            reply_to.send(RequestRejected(request.request_id, 429, f"the server is busy: {e}",
                                          error_type="rate_limit_error", retry_after=retry_after))  # fmt: skip
            metrics.rejections.inc()
            return
        self.num_requests += 1
        if seq is not None:
            seq.enqueue_time = time.time()
            reply_to.send(RequestAccepted(request.request_id, len(request.prompt_token_ids), engine=self.engine))
            metrics.prompt_tokens.inc(len(request.prompt_token_ids))

    def may_plan(self) -> bool:
        """Whether another plan may go out: fewer steps in flight than allowed, and none while the
        first step after an idle spell computes. Requests of a burst arrive while that step runs
        (on a CPU, the first of 200 came 0.1 s before the last); a plan made at once would hold
        only its rows' decodes, and the burst's first full step would wait behind it."""
        if not self.in_flight:
            return True
        return len(self.in_flight) < self.max_in_flight and self.in_flight[0] is not self.alone

    def plan_next(self) -> None:
        started = time.perf_counter()
        step = self.scheduler.schedule()
        if step is not None:
            plan = step_plan(step)
            plan.after_idle = self.idle
            metrics.scheduler_step_time.observe(time.perf_counter() - started)
            for worker in self.workers:
                worker.send(plan)
            if step.rows:  # a plan of finished ids only gets no result
                self.in_flight.append(step)
                if plan.after_idle:
                    self.alone = step
            metrics.steps.inc()
            self.record_admissions(step)
        self.stalled = (step is None or not step.rows) and bool(self.in_flight)
        self.idle = not self.in_flight  # nothing computing: the next plan follows an idle spell
        now = time.monotonic()
        if self.idle or now - self.gauges_time >= GAUGE_INTERVAL_S:
            self.record_gauges()
            self.gauges_time = now
        self.stats.maybe_log(self.scheduler)

    def record_admissions(self, step: ScheduledStep) -> None:
        now = time.time()
        for seq in step.new_seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                metrics.queue_time.observe(max(0.0, now - seq.arrival_time))
                metrics.stage_latency.labels("scheduler_queue").observe(max(0.0, now - seq.enqueue_time))

    def record_outputs(self, updates: list[SeqUpdate]) -> None:
        now = time.time()
        for u in updates:
            seq = u.seq
            if u.new_token_ids and seq.first_token_time is None:
                seq.first_token_time = now
                if seq.first_scheduled_time is not None:
                    metrics.prefill_time.observe(now - seq.first_scheduled_time)
                    metrics.stage_latency.labels("worker").observe(now - seq.first_scheduled_time)
            if u.finish_reason is not None:
                metrics.requests_finished.labels(u.finish_reason.openai).inc()
                if u.finish_reason is FinishReason.ERROR:
                    log.warning("request %s failed: its logits were not finite (sampling params: %s)",
                                seq.request_id, seq.params)  # fmt: skip
                if seq.first_token_time is not None:
                    metrics.decode_time.observe(now - seq.first_token_time)

    def emit(self, updates: list[SeqUpdate]) -> None:
        if not updates:
            return
        step = self.scheduler.num_steps
        now = time.time()
        for detokenizer, batch in zip(self.detokenizers, token_batches(step, updates, len(self.detokenizers))):
            if batch is not None:
                batch.sent_time, batch.engine = now, self.engine
                detokenizer.send(batch)

    def report_load(self) -> None:
        if self.load_reports is None:
            return
        s, blocks = self.scheduler, self.scheduler.blocks
        load = EngineLoad(self.engine, len(s.waiting), len(s.running), blocks.num_used, blocks.num_blocks, self.num_received)
        self.load_reports.offer(load, idle=not self.in_flight)

    def record_step(self, step: ScheduledStep) -> None:
        now = time.monotonic()
        rate = step.num_prompt_tokens / max(now - self.last_step_end, 1e-6)
        self.prompt_tokens_per_s = 0.9 * self.prompt_tokens_per_s + 0.1 * rate
        self.last_step_end = now

    def record_gauges(self) -> None:
        s, blocks = self.scheduler, self.scheduler.blocks
        metrics.kv_blocks_used.set(blocks.num_used)
        metrics.kv_blocks_free.set(blocks.num_free)
        metrics.kv_cache_usage.set(blocks.num_used / blocks.num_blocks)
        metrics.requests_running.set(len(s.running))
        metrics.requests_waiting.set(len(s.waiting))
        metrics.requests_preempted.set(s.waiting.num_preempted)
        for name, counter, value in (
            ("aborts", metrics.aborts, s.num_aborts),
            ("preemptions", metrics.preemptions, s.num_preemptions),
            ("queries", metrics.prefix_cache_queries, blocks.num_cache_queries),
            ("hits", metrics.prefix_cache_hits, blocks.num_cache_hits),
        ):
            if value > self.seen[name]:
                counter.inc(value - self.seen[name])
                self.seen[name] = value


def run(config: EngineConfig, index: int) -> None:
    ctx = zmq.Context()
    stage = SchedulerStage(config, ctx, engine=index)
    try:
        stage.start()
        report_ready(ctx, config, SCHEDULER, index)
        stage.inbox.on_wait = Pulse(ctx, config, SCHEDULER, index).beat
        stage.loop()
    finally:
        ctx.destroy(linger=0)
