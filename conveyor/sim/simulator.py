"""The discrete-event simulator: the real Scheduler and block manager, cost models for the host
and the device in place of the engine's CPU work and the worker.

    admit arrived requests -> plan (host cost) -> passes on the device (device cost) -> fake ids -> update

Every request arriving by the host's clock is added (`Scheduler.add_request`); the scheduler plans
a step exactly as in the server; the host spends `SimConfig.host` on the plan and the device the
cost model's latency on each pass. Each sampling row (and each fork) gets one fake token id,
never EOS (requests carry max_tokens = their output length and ignore_eos), and every token is
stamped with the clock at the end of the pass that drew it. Nothing here reads the wall clock,
so a run is a pure function of its inputs.

Two clocks, host and device, and the scheduler's own flags decide how they interleave:
  async_scheduling off  plan, compute, apply the ids, plan again: each plan costs host + device.
  async_scheduling on   the host plans step n+1 while step n computes (the real Scheduler allows
                        one pending draw per sequence for this), then waits for step n's ids: in
                        steady state a step costs max(host, device). As in the server, the first
                        plan after an idle spell runs alone, so a burst's first full step does not
                        queue behind a small one.
  num_scheduler_steps K a plan whose rows all decode is a window of K passes for one host cost.
                        Its inner passes are the real scheduler's next steps with admission shut
                        (arrivals wait for the window's end); a sequence that finishes inside the
                        window still occupies its row until the window ends, as on a device that
                        advances its inputs without asking the host: those passes' tokens are
                        wasted (`num_wasted_tokens`). A window whose rows have all finished ends.
The real Scheduler itself is always built with num_scheduler_steps = 1: the simulator forms the
windows, so a scheduler that plans its own windows does not count them twice.

Closed loop (`num_clients`): like FastGen's benchmark clients, that many requests are in flight
at once, each client sending its next request when the previous one finishes; the workload's
own arrival times are then ignored.
"""

from __future__ import annotations

import bisect
import dataclasses

from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.sim.costmodel import PassCost, StepShape
from conveyor.sim.hostcost import HostCost
from conveyor.sim.workloads import SYNTHETIC_VOCAB, SimRequest
from conveyor.stages.scheduler.scheduled_step import ScheduledStep
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.wire.messages import SamplingParams, ScheduleRequest


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """The engine's own SchedulerConfig and CacheConfig, plus what the simulator alone needs.
    The pool is fixed here (no worker sizes it): 4096 blocks unless given."""

    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig(num_kv_blocks=4096)
    max_model_len: int = 8192
    num_clients: int | None = None  # closed loop instead of the workload's arrival times
    host: HostCost = HostCost()  # the engine's CPU work per plan (hostcost.py)

    @property
    def num_kv_blocks(self) -> int:
        if self.cache.num_kv_blocks is None:
            raise ValueError("the simulator has no worker to size the KV pool: give CacheConfig(num_kv_blocks=N)")
        return self.cache.num_kv_blocks


@dataclasses.dataclass
class RequestRecord:
    request_id: str
    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per output token
    finish: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One forward pass on the device."""

    end: float  # clock when the pass's tokens are out
    seconds: float  # device time
    shape: StepShape  # wasted rows of a multi-step window included
    kv_allocated: int  # token slots in blocks held by sequences
    kv_filled: int  # of those, slots holding a computed token (this step's included)


@dataclasses.dataclass
class SimResult:
    config: SimConfig
    cost_name: str
    requests: list[RequestRecord]
    steps: list[StepRecord]
    num_preemptions: int
    num_kv_slots: int  # the pool: num_kv_blocks * block_size
    num_plans: int = 0  # host plans: one per window under multi-step
    num_wasted_tokens: int = 0  # rows computed inside a window for sequences already finished


@dataclasses.dataclass
class _Pass:
    step: ScheduledStep | None  # None: only finished sequences' rows were computed
    end: float
    applied: bool = False  # its ids reached the scheduler


def build_scheduler(config: SimConfig) -> Scheduler:
    cache = config.cache
    return Scheduler.from_config(
        dataclasses.replace(config.scheduler, num_scheduler_steps=1),
        num_blocks=config.num_kv_blocks, block_size=cache.block_size, max_model_len=config.max_model_len,
    )  # fmt: skip


def simulate(requests: list[SimRequest], config: SimConfig, cost: PassCost) -> SimResult:
    """Run the workload to completion; every request must finish."""
    too_long = [r.request_id for r in requests if r.num_prompt_tokens + r.max_tokens > config.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests exceed max_model_len={config.max_model_len}: {too_long[:5]}")
    return _Run(requests, config, cost).result()


class _Run:
    def __init__(self, requests: list[SimRequest], config: SimConfig, cost: PassCost):
        self.config, self.cost = config, cost
        self.sched = build_scheduler(config)
        self.requests = requests
        self.records: dict[str, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        self.num_plans = self.num_wasted = 0
        if config.num_clients is None:
            self.pending = sorted(requests, key=lambda r: r.arrival_time)
            self.backlog: list[SimRequest] = []
        else:
            self.pending = [dataclasses.replace(r, arrival_time=0.0) for r in requests[: config.num_clients]]
            self.backlog = list(reversed(requests[config.num_clients :]))  # popped from the end
        self.loop()

    def loop(self) -> None:
        sched, asynchronous = self.sched, self.config.scheduler.async_scheduling
        host = device = 0.0  # when the host is free to plan; when the device is free to compute
        in_flight: _Pass | None = None  # async: the last pass of the plan computing, ids not applied
        idle = True  # nothing was computing when the last plan was asked for
        while True:
            self.admit(host)
            step = sched.schedule() if sched.has_work() else None
            if step is not None and not step.rows:  # it only tells the worker of finished sequences
                self.apply(_Pass(step, host))  # and brings updates of sequences ended while planning
                continue
            if step is None:
                if in_flight is not None:
                    host = max(host, in_flight.end)
                    self.apply(in_flight)
                    in_flight = None
                    continue
                if sched.has_work() and not self.pending:
                    raise RuntimeError(f"the scheduler holds work but plans no step (at t={host:.3f}s)")
                if not self.pending:
                    return
                host, idle = max(host, self.pending[0].arrival_time), True
                continue
            self.num_plans += 1
            host += self.config.host.seconds(len(step.rows))
            first = self.record(step, [], start=max(host, device))
            if in_flight is not None:  # its ids come back while this plan computes
                host = max(host, in_flight.end)
                self.apply(in_flight)
            passes = self.window(step, first)
            device = passes[-1].end
            if asynchronous and not idle:
                in_flight = passes[-1]
            else:
                host, in_flight = device, None
                self.apply(passes[-1])
            idle = False

    def window(self, step: ScheduledStep, first: _Pass) -> list[_Pass]:
        """The plan's passes: just `first`, or K of them when every row decodes. The ids of all but
        the last are applied here (their times are known); the caller applies the last."""
        passes = [first]
        if self.config.scheduler.num_scheduler_steps == 1 or not all_decode(step):
            return passes
        cached = [(row.seq.seq_id, row.seq.num_computed_tokens - 1) for row in step.rows]  # before pass 1
        for j in range(1, self.config.scheduler.num_scheduler_steps):
            self.apply(passes[-1])
            inner = self.schedule_decodes()
            live = {row.seq.seq_id for row in inner.rows} if inner is not None else set()
            if not live:
                if inner is not None:  # it only tells the worker of finished sequences
                    self.apply(_Pass(inner, passes[-1].end))
                break
            finished = [(s + j, 1) for seq_id, s in cached if seq_id not in live]  # (cached, new) rows
            passes.append(self.record(inner, finished, start=passes[-1].end))
        return passes

    def schedule_decodes(self) -> ScheduledStep | None:
        """The scheduler's next step with no seat free for a waiting request: an inner pass of a
        window admits no one. The swap lives here because the real Scheduler plans single steps."""
        sched = self.sched
        config = sched.config
        sched.config = dataclasses.replace(config, max_num_seqs=0)
        try:
            return sched.schedule() if sched.has_work() else None
        finally:
            sched.config = config

    def record(self, step: ScheduledStep | None, finished: list[tuple[int, int]], *, start: float) -> _Pass:
        """One pass on the device from `start`: the step's rows plus `finished` (cached, new) rows
        computed for sequences already done (wasted)."""
        rows = [(row.seq.num_computed_tokens - row.num_tokens, row.num_tokens) for row in step.rows] if step else []
        shape = StepShape.of_rows(rows + finished)
        allocated, filled = self.sched.kv_slots()
        seconds = self.cost.latency(shape)
        self.steps.append(StepRecord(start + seconds, seconds, shape, allocated, filled))
        self.num_wasted += len(finished)
        return _Pass(step, start + seconds)

    def admit(self, now: float) -> None:
        while self.pending and self.pending[0].arrival_time <= now:
            request = self.pending.pop(0)
            self.records[request.request_id] = RequestRecord(
                request.request_id, request.arrival_time, request.num_prompt_tokens, request.max_tokens
            )
            self.sched.add_request(_schedule_request(request))

    def apply(self, done: _Pass) -> None:
        """The pass's ids reach the scheduler (once); its tokens are stamped with its end."""
        if done.step is None or done.applied:
            return
        done.applied = True
        for update in self.sched.update(done.step, fake_tokens(done.step)):
            record = self.records[update.seq.request_id]
            record.token_times.extend([done.end] * len(update.new_token_ids))
            record.num_cached_tokens = max(record.num_cached_tokens, update.seq.num_cached_tokens)
            if update.finish_reason is not None and self.sched.by_request.get(record.request_id) is None:
                record.finish = done.end
                if self.backlog:  # its client sends the next request
                    nxt = dataclasses.replace(self.backlog.pop(), arrival_time=done.end)
                    bisect.insort(self.pending, nxt, key=lambda r: r.arrival_time)

    def result(self) -> SimResult:
        records, requests = self.records, self.requests
        unfinished = [r.request_id for r in records.values() if r.finish is None]
        if unfinished or len(records) != len(requests):
            raise RuntimeError(f"{len(unfinished)} requests did not finish: {unfinished[:5]}")
        short = [r.request_id for r in records.values() if len(r.token_times) != r.max_tokens]
        if short:  # the scheduler ended them (a sequence the whole KV pool cannot hold)
            raise RuntimeError(f"{len(short)} requests ended before max_tokens: {short[:5]}")
        return SimResult(
            config=self.config,
            cost_name=self.cost.name,
            requests=[records[r.request_id] for r in requests],
            steps=self.steps,
            num_preemptions=self.sched.num_preemptions,
            num_kv_slots=self.config.num_kv_blocks * self.config.cache.block_size,
            num_plans=self.num_plans,
            num_wasted_tokens=self.num_wasted,
        )


def all_decode(step: ScheduledStep) -> bool:
    """Every row computes one token past its prompt and draws: multi-step may run it K times."""
    return not step.new_seqs and all(
        row.num_tokens == 1 and row.samples and row.seq.num_computed_tokens > row.seq.num_prompt_tokens for row in step.rows
    )


def fake_tokens(step: ScheduledStep) -> list[int]:
    """One id per sampling row, then one per fork of that row (the order `update` reads)."""
    ids = []
    for row in step.rows:
        if row.samples:
            for seq in (row.seq, *row.forks):
                ids.append((seq.seq_id * 7919 + seq.num_tokens * 31) % SYNTHETIC_VOCAB)
    return ids


def _schedule_request(request: SimRequest) -> ScheduleRequest:
    params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
    return ScheduleRequest(request.request_id, 0, list(request.prompt_token_ids), params, request.arrival_time)
