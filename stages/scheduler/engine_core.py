"""EngineCore: one engine's step loop, once: schedule -> plan -> execute -> update -> emit.

It owns the Scheduler and the steps in flight, and decides when the next plan may go out; a
driver moves the messages. Three drivers share it: the scheduler stage (main.py: sockets to
the worker ranks and the detokenizers), LLM (conveyor/llm.py: a ModelRunner in the same process,
through `run_step`) and the simulator (conveyor/sim/simulator.py: a cost model's virtual
device). Asynchronous scheduling and multi-step windows are paced here and nowhere else
(docs/architecture.md, "Overlap", says why): with async_scheduling two steps may be in flight,
except behind the first step after an idle spell (`may_plan`); a window stays in flight until
its last pass's result.

Invariants: results come back in plan order, each matched to the oldest step in flight (a
mismatch is logged and dropped, never fatal); every input (a request, an abort, a stop string,
a result) may unblock planning, so any of them clears `stalled`. Pure Python: no torch, no zmq.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.plan import step_plan
from conveyor.stages.scheduler.scheduled_step import ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.stages.scheduler.sequence import Sequence
from conveyor.wire.messages import KvDiskChanged, KvFetched, ScheduleRequest
from conveyor.wire.step import StepPlan, StepResult

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, *, async_scheduling: bool) -> None:
        self.scheduler = scheduler
        self.in_flight: collections.deque[ScheduledStep] = collections.deque()  # planned, last result pending
        self.max_in_flight = 2 if async_scheduling else 1
        self.stalled = False  # the last try planned nothing while a step (or a read from disk) was in flight
        self.idle = True  # nothing was in flight after the last try: the next plan follows an idle spell
        self.alone: ScheduledStep | None = None  # the first step after an idle spell

    @classmethod
    def from_config(cls, config: SchedulerConfig, **pool) -> EngineCore:
        """A core over Scheduler.from_config(config, **pool): num_blocks, block_size, ..."""
        return cls(Scheduler.from_config(config, **pool), async_scheduling=config.async_scheduling)

    # --- inputs: each may unblock planning ------------------------------------------------

    def add_request(self, request: ScheduleRequest, detokenizer: int = 0) -> Sequence | None:
        """Scheduler.add_request: raises QueueFull past the queue bounds; None when the request
        was aborted before it came."""
        self.stalled = False
        return self.scheduler.add_request(request, detokenizer)

    def abort(self, request_ids: Iterable[str]) -> None:
        self.stalled = False
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def finish_seqs(self, seq_ids: list[int]) -> None:
        """Sequences a detokenizer found a stop string in."""
        self.stalled = False
        self.scheduler.finish_seqs(seq_ids)

    def drop_requests(self, owned_by: Callable[[Sequence], bool]) -> list[Sequence]:
        """Scheduler.drop_requests: the requests of a dead ingress or detokenizer."""
        self.stalled = False
        return self.scheduler.drop_requests(owned_by)

    def kv_fetched(self, msg: KvFetched) -> None:
        """A worker rank's answers to reads from the KV disk tier (kv_disk.py)."""
        self.stalled = False
        tiers = self.scheduler.tiers
        if tiers is not None and tiers.disk is not None:
            tiers.disk.fetched(msg)

    def kv_disk_changed(self, msg: KvDiskChanged) -> None:
        """A worker rank's news of blocks other daemons wrote into (or removed from) the shared disk
        directory (kv_disk.py)."""
        self.stalled = False
        tiers = self.scheduler.tiers
        if tiers is not None and tiers.disk is not None:
            tiers.disk.changed(msg)

    def apply(self, result: StepResult) -> tuple[ScheduledStep | None, list[SeqUpdate]]:
        """One pass's result: (its step, or None when it matches no step in flight; the updates
        to emit). A window's step leaves the flight with its last pass."""
        self.stalled = False
        step = self.in_flight[0] if self.in_flight else None
        if step is None or step.step != result.step:
            log.error("step result %d does not match the step in flight", result.step)
            if result.last_pass and step is not None:
                self.in_flight.popleft()
            return None, []
        if result.last_pass:
            self.in_flight.popleft()
        return step, self.scheduler.update(step, result)

    # --- planning ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def may_plan(self) -> bool:
        """Whether another plan may go out: fewer steps in flight than allowed, and none while the
        first step after an idle spell computes. Requests of a burst arrive while that step runs
        (on a CPU, the first of 200 came 0.1 s before the last); a plan made at once would hold
        only its rows' decodes, and the burst's first full step would wait behind it."""
        if not self.in_flight:
            return True
        return len(self.in_flight) < self.max_in_flight and self.in_flight[0] is not self.alone

    def wants_to_plan(self) -> bool:
        """Whether a plan could go out now: allowed, work to do, and not stalled since the last
        input. A driver that gets False waits for its next input."""
        return self.may_plan() and self.scheduler.has_work() and not self.stalled

    def plan(self) -> tuple[ScheduledStep, StepPlan] | None:
        """Schedule the next step and its plan for the worker (None: nothing to run). A plan
        without rows only names finished sequences: it is sent, and no result comes back."""
        step = self.scheduler.schedule()
        planned = None
        if step is not None:
            plan = step_plan(step)
            plan.after_idle = self.idle
            if step.rows:
                self.in_flight.append(step)
                if plan.after_idle:
                    self.alone = step
            planned = step, plan
        tiers = self.scheduler.tiers
        waits = bool(self.in_flight) or (tiers is not None and tiers.only_reading)  # for a result, or a read from disk
        self.stalled = (step is None or not step.rows) and waits
        self.idle = not self.in_flight
        return planned

    def wake_in(self) -> float | None:
        """Seconds until planning may find something new though no input came (a sequence's
        wait for its reads from disk ends); None: only an input can."""
        tiers = self.scheduler.tiers
        return tiers.disk.wake_in() if tiers is not None and tiers.disk is not None else None

    def take_unsampled_updates(self) -> list[SeqUpdate]:
        """Sequences that ended without a token (aborted, too long for the pool) since the last
        result: to emit with the plan's turn."""
        return self.scheduler.take_unsampled_updates()

    # --- an in-process executor -------------------------------------------------------------

    def run_step(self, execute: Callable[[StepPlan], Iterable[StepResult]]) -> Iterator[list[SeqUpdate]]:
        """One step run to its end by an executor in this process (a ModelRunner's `execute`):
        the updates of each pass as it is applied, so that a driver can emit them in turn."""
        planned = self.plan()
        if planned is None:
            yield self.take_unsampled_updates()
            return
        for result in execute(planned[1]):
            yield self.apply(result)[1]
