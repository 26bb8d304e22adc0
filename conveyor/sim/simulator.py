"""The discrete-event simulator: the real Scheduler and block manager, a cost model for the worker.

    admit arrived requests -> schedule a step -> clock += cost(step) -> fake sampled ids -> update

Every request arriving by the clock is added (`Scheduler.add_request`); the scheduler plans a
step exactly as in the server; the step takes the cost model's latency for its shape; each
sampling row (and each fork) gets one fake token id, never EOS (requests carry
max_tokens = their output length and ignore_eos), and every token a request receives is stamped
with the clock at the end of its step. An idle scheduler jumps the clock to the next arrival.
Nothing here reads the wall clock, so a run is a pure function of its inputs.

Closed loop (`num_clients`): like FastGen's benchmark clients, that many requests are in flight
at once, each client sending its next request when the previous one finishes; the workload's
own arrival times are then ignored.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.sim.costmodel import CostModel, StepShape
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
    end: float  # clock when the step's tokens are out
    seconds: float
    shape: StepShape
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


def build_scheduler(config: SimConfig) -> Scheduler:
    cache = config.cache
    return Scheduler.from_config(
        config.scheduler, num_blocks=config.num_kv_blocks, block_size=cache.block_size, max_model_len=config.max_model_len
    )


def simulate(requests: list[SimRequest], config: SimConfig, cost: CostModel) -> SimResult:
    """Run the workload to completion; every request must finish."""
    too_long = [r.request_id for r in requests if r.num_prompt_tokens + r.max_tokens > config.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests exceed max_model_len={config.max_model_len}: {too_long[:5]}")
    sched = build_scheduler(config)
    records: dict[str, RequestRecord] = {}
    steps: list[StepRecord] = []
    if config.num_clients is None:
        pending = deque(sorted(requests, key=lambda r: r.arrival_time))
        backlog: deque[SimRequest] = deque()
    else:
        pending = deque(dataclasses.replace(r, arrival_time=0.0) for r in requests[: config.num_clients])
        backlog = deque(requests[config.num_clients :])
    clock = 0.0

    while True:
        while pending and pending[0].arrival_time <= clock:
            request = pending.popleft()
            records[request.request_id] = RequestRecord(
                request.request_id, request.arrival_time, request.num_prompt_tokens, request.max_tokens
            )
            sched.add_request(_schedule_request(request))
        step = sched.schedule() if sched.has_work() else None
        if step is None:
            if sched.has_work() and not pending:
                raise RuntimeError(f"the scheduler holds work but plans no step (at t={clock:.3f}s)")
            if not pending:
                break
            clock = max(clock, pending[0].arrival_time)
            continue
        shape = StepShape.of_rows((row.seq.num_computed_tokens - row.num_tokens, row.num_tokens) for row in step.rows)
        allocated, filled = sched.kv_slots()
        seconds = cost.latency(shape)
        clock += seconds
        if step.rows:
            steps.append(StepRecord(clock, seconds, shape, allocated, filled))
        for update in sched.update(step, fake_tokens(step)):
            record = records[update.seq.request_id]
            record.token_times.extend([clock] * len(update.new_token_ids))
            record.num_cached_tokens = max(record.num_cached_tokens, update.seq.num_cached_tokens)
            if update.finish_reason is not None and sched.by_request.get(record.request_id) is None:
                record.finish = clock
                if backlog:
                    pending.append(dataclasses.replace(backlog.popleft(), arrival_time=clock))

    unfinished = [r.request_id for r in records.values() if r.finish is None]
    if unfinished or len(records) != len(requests):
        raise RuntimeError(f"{len(unfinished)} requests did not finish: {unfinished[:5]}")
    short = [r.request_id for r in records.values() if len(r.token_times) != r.max_tokens]
    if short:  # the scheduler ended them (a sequence the whole KV pool cannot hold)
        raise RuntimeError(f"{len(short)} requests ended before max_tokens: {short[:5]}")
    return SimResult(
        config=config,
        cost_name=cost.name,
        requests=[records[r.request_id] for r in requests],
        steps=steps,
        num_preemptions=sched.num_preemptions,
        num_kv_slots=config.num_kv_blocks * config.cache.block_size,
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
