"""The scheduler stage's pacing of plans, on real sockets with the worker's end held by the test:
with asynchronous scheduling two steps may be in flight, except while the first step after an
idle spell computes, so that a burst arriving meanwhile fills the next step."""

from __future__ import annotations

import shutil

import pytest
import zmq

from conveyor.stages.scheduler.main import SchedulerStage
from conveyor.wire.addresses import address, make_run_dir
from conveyor.wire.channel import Receiver, Sender
from conveyor.wire.messages import (
    InitializeCache,
    SamplingParams,
    ScheduleRequest,
    StepPlan,
    StepResult,
    WorkerInbound,
    WorkerReady,
)
from tests.ingress_fakes import make_config


@pytest.fixture
def stage(tmp_path):
    run_dir = make_run_dir()
    config = make_config(tmp_path, run_dir)
    ctx = zmq.Context()
    worker = Receiver(ctx, address(run_dir, "worker", 0), WorkerInbound)
    # Bound so the stage's tokens and replies have somewhere to go; nobody reads them.
    others = [Receiver(ctx, address(run_dir, "detokenizer", 0), object), Receiver(ctx, address(run_dir, "ingress", 0), object)]
    stage = SchedulerStage(config, ctx)
    Sender(ctx, address(run_dir, "scheduler", 0)).send(WorkerReady(rank=0, num_kv_blocks=64))
    stage.start()
    assert isinstance(worker.recv(timeout_ms=5000), InitializeCache)
    assert stage.max_in_flight == 2  # asynchronous scheduling, the default
    stage.worker_end = worker  # the test's end of the worker socket, for turn()
    yield stage
    for r in [worker, *others]:
        r.close()
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


def request(n: int) -> ScheduleRequest:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return ScheduleRequest(f"r{n}", 0, [n + 1] * 12, params, arrival_time=0.0)


def turn(stage: SchedulerStage) -> StepPlan | None:
    """What the stage's loop does after taking its messages: plan if it may, and the plan the
    worker then receives (None: no plan went out)."""
    if not stage.may_plan():
        return None
    sent = stage.scheduler.num_steps
    stage.plan_next()
    if stage.scheduler.num_steps == sent:
        return None
    plan = stage.worker_end.recv(timeout_ms=5000)
    assert isinstance(plan, StepPlan)
    return plan


def rows(plan: StepPlan) -> list[tuple[int, int]]:
    return [(s.seq_id, s.num_tokens) for s in plan.scheduled]


def test_the_first_step_after_idle_runs_alone_and_the_burst_joins_the_next(stage):
    stage.handle(request(0))
    first = turn(stage)
    assert first.after_idle and rows(first) == [(0, 12)]
    # Async scheduling would allow a second step now; it would hold only seq 0's decode.
    assert turn(stage) is None
    for n in (1, 2):  # the burst arrives while the first step computes
        stage.handle(request(n))
    assert turn(stage) is None
    stage.handle(StepResult(first.step, sampled_token_ids=[7]))
    second = turn(stage)
    assert not second.after_idle
    assert rows(second) == [(0, 1), (1, 12), (2, 12)]  # the decode fused with the burst's prompts
    # From here on the lookahead is back: a third step goes out while the second computes.
    third = turn(stage)
    assert rows(third) == [(0, 1), (1, 1), (2, 1)]
    assert turn(stage) is None  # two in flight


def test_an_idle_spell_between_requests_runs_alone_again(stage):
    stage.handle(request(0))
    first = turn(stage)
    stage.handle(StepResult(first.step, sampled_token_ids=[7]))
    assert turn(stage) is not None and turn(stage) is not None  # the lookahead is back
    while stage.in_flight:  # run the request to its end, two steps in flight at most
        assert len(stage.in_flight) <= 2
        step = stage.in_flight[0]
        stage.handle(StepResult(step.step, sampled_token_ids=[7] * step.num_sampled))
        turn(stage)
    assert not stage.scheduler.has_work()
    stage.handle(request(1))
    again = turn(stage)
    assert again.after_idle and rows(again) == [(1, 12)]
    assert turn(stage) is None
