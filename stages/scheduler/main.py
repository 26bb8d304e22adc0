"""The scheduler stage process: its EngineCore (engine_core.py) behind sockets.

Takes (one socket, SchedulerInbound): ScheduleRequest from tokenizers (with data parallelism,
from the router), AbortRequest from ingress (the router), FinishSeqs (a stop string matched) from
detokenizers, WorkerReady and StepResult from worker rank 0, KvFetched (answers to reads from
the KV disk tier) and KvDiskChanged (blocks other daemons wrote into a shared disk directory, or
removed) from every worker rank, StageFailed from the launcher (a detokenizer's requests
fail with a 503, a dead ingress's are aborted).
Sends: InitializeCache and StepPlan to its engine's worker ranks; EngineStarted, then one
TokenBatch per detokenizer per step; RequestAccepted (naming its engine), or RequestRejected (429)
past the queue bounds, to the request's ingress; StageReady to the launcher; with data
parallelism, EngineLoad to the router (load_report.py paces it).

The loop: receive everything pending, let the core plan if it may, send the plan, then emit the
tokens that came in, so detokenizing overlaps the next step (docs/architecture.md, "Overlap").
Engine e of n numbers its sequences e, e + n, ... (wire/topology.seq_ids_of).
"""

from __future__ import annotations

import logging
import time

import zmq

from conveyor.config import EngineConfig
from conveyor.config.lora_adapter import read_adapter_info
from conveyor.stages import metrics
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import report_ready
from conveyor.stages.scheduler.adapters import NameTaken, UnknownAdapter, adapters_for
from conveyor.stages.scheduler.engine_core import EngineCore
from conveyor.stages.scheduler.load_report import LoadReports
from conveyor.stages.scheduler.plan import token_batches
from conveyor.stages.scheduler.scheduled_step import ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.stages.scheduler.stats_log import StatsLog
from conveyor.stages.scheduler.waiting_queue import QueueFull
from conveyor.wire.messages import (
    AbortRequest,
    AdapterCommand,
    EngineLoad,
    EngineStarted,
    FinishReason,
    FinishSeqs,
    InitializeCache,
    KvDiskChanged,
    KvFetched,
    RequestAccepted,
    RequestRejected,
    ScheduleRequest,
    SchedulerInbound,
    StageFailed,
    WorkerReady,
)
from conveyor.wire.step import StepResult
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
        self.core: EngineCore
        self.num_requests = 0
        counted = ["aborts", "preemptions", "queries", "hits", "lora_loads", "lora_evictions"]
        counted += ["host_hits", "saved", "loaded", "disk_hits", "disk_misses"]
        self.seen: dict[str, int] = dict.fromkeys(counted, 0)
        self.kv_block_bytes = 0  # a block's bytes on one rank, all layers (WorkerReady)
        self.prompt_tokens_per_s = 0.0  # moving average, for Retry-After
        self.last_step_end = time.monotonic()
        self.stats = StatsLog()
        self.gauges_time = 0.0  # when the gauges were last written

    def start(self) -> None:
        """Wait for every worker rank's capacity, then size the pool they all can hold."""
        reports: dict[int, WorkerReady] = {}
        news: list[KvDiskChanged] = []  # a rank ready before the others may find other daemons' blocks meanwhile
        while len(reports) < len(self.workers):
            msg = self.inbox.recv()
            if isinstance(msg, WorkerReady):
                reports[msg.rank] = msg
            elif isinstance(msg, KvDiskChanged):
                news.append(msg)
        num_blocks = min(report.num_kv_blocks for report in reports.values())
        num_host_slots = min(report.num_host_slots for report in reports.values())
        self.kv_block_bytes = reports[0].kv_block_bytes
        # Blocks every rank read back into the same slot (each rank keeps its own shard on disk).
        common = set.intersection(*(set(r.kv_warm) for r in reports.values()))
        warm = [entry for entry in reports[0].kv_warm if entry in common]
        # A block is on disk when every rank holds its shard there.
        on_disk = set.intersection(*(set(r.kv_disk) for r in reports.values()))
        num_disk_blocks = min(report.num_disk_blocks for report in reports.values())
        for worker in self.workers:
            worker.send(InitializeCache(num_blocks))
        for detokenizer in self.detokenizers:  # before any TokenBatch: a predecessor's sequences are gone
            detokenizer.send(EngineStarted(self.engine))
        cfg = self.config
        self.core = EngineCore.from_config(
            cfg.scheduler,
            num_blocks=num_blocks,
            block_size=cfg.cache.block_size,
            max_model_len=cfg.model.max_model_len,
            eos_token_ids=cfg.model.eos_token_ids,
            seq_ids=seq_ids_of(cfg, self.engine),
            adapters=adapters_for(cfg),
            speculative=cfg.speculative,
            num_host_slots=num_host_slots,
            kv_warm=warm,
            num_disk_blocks=num_disk_blocks,
            kv_disk=[name for name in reports[0].kv_disk if name in on_disk],
            num_ranks=len(reports),
        )
        for report in reports.values():  # a block some ranks had at start-up is on disk once the rest report it
            if some := [name for name in report.kv_disk if name not in on_disk]:
                self.core.kv_disk_changed(KvDiskChanged(report.rank, some))
        for msg in news:
            self.core.kv_disk_changed(msg)
        kv_dtype, num_tokens = cfg.cache.kv_dtype(cfg.model.dtype), num_blocks * cfg.cache.block_size
        metrics.kv_blocks_capacity.set(num_blocks)
        metrics.kv_host_blocks_capacity.set(num_host_slots)
        metrics.kv_tokens_capacity.set(num_tokens)
        metrics.kv_cache_info.labels(engine=str(self.engine), kv_cache_dtype=kv_dtype).set(1)
        log.info("KV pool: %d blocks of %d tokens = %d tokens, KV cache %s", num_blocks, cfg.cache.block_size, num_tokens, kv_dtype)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def loop(self) -> None:
        core = self.core
        while True:
            # Block until an input comes when the core cannot plan now.
            msg = self.inbox.recv(timeout_ms=0 if core.wants_to_plan() else wake_ms(core))
            updates: list[SeqUpdate] = []
            while msg is not None:
                updates += self.handle(msg)
                if isinstance(msg, StepResult) and not msg.last_pass:
                    # A window's inner pass leaves the steps in flight as they were: no plan to
                    # send first, so its tokens stream now.
                    self.emit(updates)
                    updates = []
                msg = self.inbox.recv_nowait()
            if core.may_plan():
                self.plan_next()  # the next plan goes out before this step's tokens do
            self.emit(updates + core.take_unsampled_updates())
            self.report_load()

    def handle(self, msg: SchedulerInbound) -> list[SeqUpdate]:
        match msg:
            case ScheduleRequest():
                self.num_received += 1
                self.admit(msg)
            case AbortRequest():
                self.core.abort(msg.request_ids)
            case AdapterCommand():
                self.ingresses[msg.ingress].send(self.adapter_command(msg))
            case FinishSeqs():
                self.core.finish_seqs(msg.seq_ids)
            case KvFetched():
                self.core.kv_fetched(msg)
            case KvDiskChanged():
                self.core.kv_disk_changed(msg)
            case StepResult():
                step, updates = self.core.apply(msg)
                if step is None:
                    return []
                if msg.last_pass:
                    self.record_step(step)
                self.stats.add(msg, step)
                metrics.generation_tokens.inc(sum(len(u.new_token_ids) for u in updates))
                metrics.record_speculation(msg.spec_rows)
                self.record_outputs(updates)
                return updates
            case StageFailed(stage="detokenizer", index=index):
                # Its incremental decoding and stop-string state died with it: those requests
                # cannot go on. Each gets a 503 (an error event if its stream began).
                for seq in self.core.drop_requests(lambda s: s.detokenizer == index):
                    message = "the detokenizer streaming this request failed; retry it"
                    self.ingresses[seq.ingress].send(RequestRejected(seq.request_id, 503, message, code="stage_failed"))
            case StageFailed(stage="ingress", index=index):
                self.core.drop_requests(lambda s: s.ingress == index)  # their clients are gone
            case WorkerReady():
                log.warning("unexpected WorkerReady from rank %d", msg.rank)
        return []

    def adapter_command(self, msg: AdapterCommand) -> RequestAccepted | RequestRejected:
        """Load or unload an adapter (adapters.py): accepted, or why not (a 4xx for the client)."""
        adapters, model = self.scheduler.adapters, self.config.model
        if adapters is None:
            return RequestRejected(msg.request_id, 400, "LoRA adapters need the server started with --enable-lora", param="lora_name")
        if msg.name == model.served_name:
            return RequestRejected(msg.request_id, 400, f"`{msg.name}` is the base model, not an adapter", param="lora_name")
        if msg.path is None:
            if msg.name not in adapters.registry:
                return RequestRejected(msg.request_id, 404, f"no adapter named `{msg.name}` is loaded", "not_found_error", "lora_name")
            adapters.unregister(msg.name)
        else:
            try:
                adapters.register(read_adapter_info(msg.name, msg.path, model, self.config.lora.max_lora_rank))
            except NameTaken as e:
                return RequestRejected(msg.request_id, 400, str(e), param="lora_name")
            except ValueError as e:  # LoraError (a ConfigError): the directory is no adapter this model takes
                return RequestRejected(msg.request_id, 400, str(e), param="lora_path")
        self.core.stalled = False  # waiting sequences may now take the freed slot
        return RequestAccepted(msg.request_id, 0, engine=self.engine)

    def admit(self, request: ScheduleRequest) -> None:
        reply_to = self.ingresses[request.ingress]
        try:
            seq = self.core.add_request(request, detokenizer=self.num_requests % len(self.detokenizers))
        except UnknownAdapter as e:
            message = f"the model `{e.args[0]}` does not exist; this server serves `{self.config.model.served_name}` and its adapters"
            reply_to.send(
                RequestRejected(request.request_id, 404, message, error_type="not_found_error", param="model", code="model_not_found")
            )
            return
        except QueueFull as e:
            queued = self.scheduler.waiting.num_tokens
            retry_after = min(60.0, max(1.0, queued / max(self.prompt_tokens_per_s, 1.0)))
            reply_to.send(
                RequestRejected(
                    request.request_id, 429, f"the server is busy: {e}", error_type="rate_limit_error", retry_after=retry_after
                )
            )
            metrics.rejections.inc()
            return
        self.num_requests += 1
        if seq is not None:
            seq.enqueue_time = time.time()
            reply_to.send(RequestAccepted(request.request_id, len(request.prompt_token_ids), engine=self.engine))
            if self.scheduler.adapters is not None:
                metrics.lora_requests.labels(str(self.engine), request.params.adapter or "base").inc()
            metrics.prompt_tokens.inc(len(request.prompt_token_ids))

    def may_plan(self) -> bool:
        return self.core.may_plan()

    def plan_next(self) -> None:
        started = time.perf_counter()
        planned = self.core.plan()
        if planned is not None:
            step, plan = planned
            metrics.scheduler_step_time.observe(time.perf_counter() - started)
            for worker in self.workers:
                worker.send(plan)
            metrics.steps.inc()
            self.record_admissions(step)
        now = time.monotonic()
        if self.core.idle or now - self.gauges_time >= GAUGE_INTERVAL_S:
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
                    log.warning("request %s failed: its logits were not finite (sampling params: %s)", seq.request_id, seq.params)
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
        num_host_blocks = s.tiers.host.num_slots if s.tiers is not None else 0
        load = EngineLoad(
            self.engine, len(s.waiting), len(s.running), blocks.num_used, blocks.num_blocks, self.num_received, num_host_blocks
        )
        self.load_reports.offer(load, idle=not self.core.in_flight)

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
        metrics.lora_resident.set(len(s.adapters.resident) if s.adapters else 0)
        tiers, block_bytes = s.tiers, self.kv_block_bytes
        if tiers is not None:
            metrics.kv_host_blocks_used.set(len(tiers.host))
        for name, counter, value in (
            ("host_hits", metrics.kv_host_hits, tiers.num_host_hits if tiers else 0),
            ("disk_hits", metrics.kv_disk_hits, tiers.disk.num_hits if tiers and tiers.disk else 0),
            ("disk_misses", metrics.kv_disk_misses, tiers.disk.num_misses if tiers and tiers.disk else 0),
            ("saved", metrics.kv_bytes_to_host, tiers.num_saved * block_bytes if tiers else 0),
            ("loaded", metrics.kv_bytes_to_device, tiers.num_loaded * block_bytes if tiers else 0),
            ("aborts", metrics.aborts, s.num_aborts),
            ("preemptions", metrics.preemptions, s.num_preemptions),
            ("queries", metrics.prefix_cache_queries, blocks.num_cache_queries),
            ("hits", metrics.prefix_cache_hits, blocks.num_cache_hits),
            ("lora_loads", metrics.lora_loads, s.adapters.num_loads if s.adapters else 0),
            ("lora_evictions", metrics.lora_evictions, s.adapters.num_evictions if s.adapters else 0),
        ):
            if value > self.seen[name]:
                counter.inc(value - self.seen[name])
                self.seen[name] = value


def wake_ms(core: EngineCore) -> int | None:
    """How long the loop may wait for an input when the core cannot plan now: until it may
    plan anew by itself (a wait for a read from disk ends), or forever."""
    seconds = core.wake_in()
    return None if seconds is None else max(1, int(seconds * 1000) + 1)


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
