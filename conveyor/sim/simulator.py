"""The discrete-event simulator: the engine's own EngineCore (its Scheduler and block manager,
its pacing of asynchronous scheduling and multi-step windows), with cost models for the host's
planning and the device's passes in place of the scheduler stage's CPU work and the worker.

    arrivals -> EngineCore.plan (host cost) -> passes on a virtual device (device cost) -> apply

`simulate` runs a workload (__main__.py, the tests); run_metrics.py reads its SimResult.
Invariants: the loop is the scheduler stage's (`_Run.loop`), so a run makes the decisions the
server would; a pass starts once its plan is made and the device is free, and its result lands at
its end, which stamps its tokens; draws are fake ids and requests carry max_tokens = their output
length and ignore_eos, so every request must finish with exactly its tokens (`result` raises
otherwise); nothing reads the wall clock: a run is a pure function of its inputs. With
`num_clients` the loop is closed (FastGen's benchmark clients): that many requests in flight, each
client sending its next when the previous one finishes, the workload's arrival times ignored.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math

from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.gpu.emulated.costmodel import PassCost, StepShape
from conveyor.sim.hostcost import HostCost
from conveyor.sim.workloads import SYNTHETIC_VOCAB, SimRequest
from conveyor.stages.scheduler.engine_core import EngineCore
from conveyor.stages.scheduler.scheduled_step import ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.wire.messages import SamplingParams, ScheduleRequest
from conveyor.wire.step import StepResult


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
    num_plans: int = 0  # host plans: one per window under multi-step


@dataclasses.dataclass(frozen=True)
class _Landing:
    end: float  # when the pass's ids reach the host
    result: StepResult


def build_scheduler(config: SimConfig) -> Scheduler:
    cache = config.cache
    return Scheduler.from_config(
        config.scheduler, num_blocks=config.num_kv_blocks, block_size=cache.block_size, max_model_len=config.max_model_len
    )


def simulate(requests: list[SimRequest], config: SimConfig, cost: PassCost) -> SimResult:
    """Run the workload to completion; every request must finish."""
    too_long = [r.request_id for r in requests if r.num_prompt_tokens + r.max_tokens > config.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests exceed max_model_len={config.max_model_len}: {too_long[:5]}")
    return _Run(requests, config, cost).result()


class _Run:
    def __init__(self, requests: list[SimRequest], config: SimConfig, cost: PassCost):
        self.config, self.cost = config, cost
        self.core = EngineCore(build_scheduler(config), async_scheduling=config.scheduler.async_scheduling)
        self.requests = requests
        self.records: dict[str, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        self.num_plans = 0
        self.host = self.device = 0.0  # when the host is free to plan; when the device is free to compute
        self.landings: collections.deque[_Landing] = collections.deque()  # in plan order
        if config.num_clients is None:
            self.pending = sorted(requests, key=lambda r: r.arrival_time)
            self.backlog: list[SimRequest] = []
        else:
            self.pending = [dataclasses.replace(r, arrival_time=0.0) for r in requests[: config.num_clients]]
            self.backlog = list(reversed(requests[config.num_clients :]))  # popped from the end
        self.loop()

    def loop(self) -> None:
        """The scheduler stage's loop: wait for an input unless the core wants to plan, take every
        input that has come, then let the core plan if it may."""
        core = self.core
        while True:
            if not core.wants_to_plan():
                landing = self.landings[0].end if self.landings else math.inf
                arrival = self.pending[0].arrival_time if self.pending else math.inf
                if landing == arrival == math.inf:
                    if core.has_work():
                        raise RuntimeError(f"the scheduler holds work but plans no step (at t={self.host:.3f}s)")
                    return
                self.host = max(self.host, min(landing, arrival))
            while self.landings and self.landings[0].end <= self.host:
                self.apply(self.landings.popleft())
            self.admit(self.host)  # after the results: a closed loop's finish sends the next request
            if core.may_plan():
                self.plan()

    def plan(self) -> None:
        planned = self.core.plan()
        if planned is not None and planned[0].rows:
            step = planned[0]
            self.num_plans += 1
            self.host += self.config.host.seconds(len(step.rows))
            self.run_passes(step)
        self.record_updates(self.core.take_unsampled_updates(), self.host)

    def run_passes(self, step: ScheduledStep) -> None:
        """The step's passes on the device from when both the plan and the device are ready, each
        pass's ids landing at its end. Pass k computes the rows with more than k tokens to go
        (a single step: every row, its whole chunk)."""
        rows = [(row.seq.num_computed_tokens - row.num_tokens, row.num_tokens) for row in step.rows]
        allocated, filled = self.core.scheduler.kv_slots()
        end = max(self.host, self.device)
        for k in range(step.num_steps):
            shape = StepShape.of_rows(rows if step.num_steps == 1 else [(cached + k, 1) for cached, n in rows if n > k])
            seconds = self.cost.latency(shape)
            end += seconds
            self.steps.append(StepRecord(end, seconds, shape, allocated, filled))
            self.landings.append(_Landing(end, fake_result(step, k)))
        self.device = end

    def admit(self, now: float) -> None:
        while self.pending and self.pending[0].arrival_time <= now:
            request = self.pending.pop(0)
            self.records[request.request_id] = RequestRecord(
                request.request_id, request.arrival_time, request.num_prompt_tokens, request.max_tokens
            )
            self.core.add_request(_schedule_request(request))

    def apply(self, landing: _Landing) -> None:
        """A pass's ids reach the scheduler; its tokens are stamped with its end."""
        self.record_updates(self.core.apply(landing.result)[1], landing.end)

    def record_updates(self, updates: list[SeqUpdate], now: float) -> None:
        for update in updates:
            record = self.records[update.seq.request_id]
            record.token_times.extend([now] * len(update.new_token_ids))
            record.num_cached_tokens = max(record.num_cached_tokens, update.seq.num_cached_tokens)
            if update.finish_reason is not None and self.core.scheduler.by_request.get(record.request_id) is None:
                record.finish = now
                if self.backlog:  # its client sends the next request
                    nxt = dataclasses.replace(self.backlog.pop(), arrival_time=now)
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
            num_preemptions=self.core.scheduler.num_preemptions,
            num_kv_slots=self.config.num_kv_blocks * self.config.cache.block_size,
            num_plans=self.num_plans,
        )


def fake_result(step: ScheduledStep, k: int = 0) -> StepResult:
    """Pass k's result: a fake id for each of its draws (never EOS: nothing stops on it)."""
    draws = [seq for _, seq in step.draws(k)]
    ids = [(seq.seq_id * 7919 + (seq.num_tokens + k) * 31) % SYNTHETIC_VOCAB for seq in draws]
    return StepResult(step.step, ids, pass_index=k, last_pass=k == step.num_steps - 1, seq_ids=[seq.seq_id for seq in draws])


def _schedule_request(request: SimRequest) -> ScheduleRequest:
    params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
    return ScheduleRequest(request.request_id, 0, list(request.prompt_token_ids), params, request.arrival_time)
