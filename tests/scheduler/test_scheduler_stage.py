"""The scheduler stage's pacing of plans, on real sockets with the worker's end held by the test:
with asynchronous scheduling two steps may be in flight, except while the first step after an
idle spell computes, so that a burst arriving meanwhile fills the next step; a multi-step window
stays in flight to its last pass, and each pass streams on its own. With two ranks, a block on
disk counts once both have reported it, at start-up or after."""

from __future__ import annotations

import dataclasses
import shutil
from typing import NamedTuple

import pytest
import zmq

from conveyor.config import ParallelConfig, SchedulerConfig
from conveyor.stages.scheduler.main import SchedulerStage
from conveyor.wire.addresses import make_run_dir
from conveyor.wire.channel import Receiver
from conveyor.wire.messages import (
    EngineStarted,
    InitializeCache,
    KvDiskChanged,
    SamplingParams,
    ScheduleRequest,
    TokenBatch,
    WorkerInbound,
    WorkerReady,
)
from conveyor.wire.step import StepPlan, StepResult
from conveyor.wire.topology import DETOKENIZER, INGRESS, SCHEDULER, WORKER, receiver, sender
from tests.fake_worker import FakeRunner
from tests.ingress_server import make_config
from tests.scheduler.engine_driver import prompt_of


class Wired(NamedTuple):
    stage: SchedulerStage
    worker: Receiver[WorkerInbound]  # the test's end of the worker socket, for turn()


@pytest.fixture
def wired(tmp_path):
    run_dir = make_run_dir()
    config = make_config(tmp_path, run_dir)
    ctx = zmq.Context()
    worker = receiver(ctx, config, WORKER)
    # Bound so the stage's tokens and replies have somewhere to go; nobody reads them.
    others = [receiver(ctx, config, DETOKENIZER), receiver(ctx, config, INGRESS)]
    stage = SchedulerStage(config, ctx)
    sender(ctx, config, SCHEDULER).send(WorkerReady(rank=0, num_kv_blocks=64))
    stage.start()
    assert isinstance(worker.recv(timeout_ms=5000), InitializeCache)
    assert stage.core.max_in_flight == 2  # asynchronous scheduling, the default
    yield Wired(stage, worker)
    for r in [worker, *others]:
        r.close()
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


def request(n: int) -> ScheduleRequest:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return ScheduleRequest(f"r{n}", 0, [n + 1] * 12, params, arrival_time=0.0)


def turn(wired: Wired) -> StepPlan | None:
    """What the stage's loop does after taking its messages: plan if it may, and the plan the
    worker then receives (None: no plan went out)."""
    stage = wired.stage
    if not stage.may_plan():
        return None
    sent = stage.scheduler.num_steps
    stage.plan_next()
    if stage.scheduler.num_steps == sent:
        return None
    plan = wired.worker.recv(timeout_ms=5000)
    assert isinstance(plan, StepPlan)
    return plan


def rows(plan: StepPlan) -> list[tuple[int, int]]:
    return [(s.seq_id, s.num_tokens) for s in plan.scheduled]


def test_the_first_step_after_idle_runs_alone_and_the_burst_joins_the_next(wired):
    stage = wired.stage
    stage.handle(request(0))
    first = turn(wired)
    assert first.after_idle and rows(first) == [(0, 12)]
    # Async scheduling would allow a second step now; it would hold only seq 0's decode.
    assert turn(wired) is None
    for n in (1, 2):  # the burst arrives while the first step computes
        stage.handle(request(n))
    assert turn(wired) is None
    stage.handle(StepResult(first.step, sampled_token_ids=[7], seq_ids=[0]))
    second = turn(wired)
    assert not second.after_idle
    assert rows(second) == [(0, 1), (1, 12), (2, 12)]  # the decode fused with the burst's prompts
    # From here on the lookahead is back: a third step goes out while the second computes.
    third = turn(wired)
    assert rows(third) == [(0, 1), (1, 1), (2, 1)]
    assert turn(wired) is None  # two in flight


def test_an_idle_spell_between_requests_runs_alone_again(wired):
    stage = wired.stage
    stage.handle(request(0))
    first = turn(wired)
    stage.handle(StepResult(first.step, sampled_token_ids=[7], seq_ids=[0]))
    assert turn(wired) is not None and turn(wired) is not None  # the lookahead is back
    while stage.core.in_flight:  # run the request to its end, two steps in flight at most
        assert len(stage.core.in_flight) <= 2
        step = stage.core.in_flight[0]
        seq_ids = [seq.seq_id for _, seq in step.draws()]
        stage.handle(StepResult(step.step, sampled_token_ids=[7] * len(seq_ids), seq_ids=seq_ids))
        turn(wired)
    assert not stage.scheduler.has_work()
    stage.handle(request(1))
    again = turn(wired)
    assert again.after_idle and rows(again) == [(1, 12)]
    assert turn(wired) is None


# --- multi-step windows through the stage ------------------------------------------------


@pytest.fixture
def stage_with_windows(tmp_path):
    run_dir = make_run_dir()
    config = make_config(tmp_path, run_dir)
    config = dataclasses.replace(config, scheduler=SchedulerConfig(num_scheduler_steps=4))
    ctx = zmq.Context()
    worker, detok = receiver(ctx, config, WORKER), receiver(ctx, config, DETOKENIZER)
    ingress = receiver(ctx, config, INGRESS)  # bound so replies have somewhere to go
    stage = SchedulerStage(config, ctx)
    sender(ctx, config, SCHEDULER).send(WorkerReady(rank=0, num_kv_blocks=64))
    stage.start()
    worker.recv(timeout_ms=5000)  # InitializeCache
    assert isinstance(detok.recv(timeout_ms=5000), EngineStarted)  # before any TokenBatch
    yield stage, worker, detok
    for r in (worker, detok, ingress):
        r.close()
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_the_stage_keeps_a_window_in_flight_to_its_last_pass_and_streams_every_pass(stage_with_windows):
    stage, worker, detok = stage_with_windows
    runner = FakeRunner(64, stage.config.cache.block_size)
    stage.handle(ScheduleRequest("r0", 0, prompt_of(0, 6), SamplingParams(max_tokens=20, ignore_eos=True), 0.0))

    def plan() -> StepPlan:
        stage.plan_next()
        sent = worker.recv(timeout_ms=5000)
        assert isinstance(sent, StepPlan)
        return sent

    def result_in(result) -> list[int]:
        """The stage's loop body for one result: apply it, and the tokens it streams."""
        stage.emit(stage.handle(result) + stage.scheduler.take_unsampled_updates())
        batch = detok.recv(timeout_ms=5000)
        assert isinstance(batch, TokenBatch)
        return [t for u in batch.updates for t in u.token_ids]

    (first,) = runner.execute_passes(plan())
    assert result_in(first) == first.sampled_token_ids
    window = plan()
    assert window.num_steps == 4
    ahead = plan()  # asynchronous scheduling: the next plan goes out while the window runs
    assert ahead.num_steps == 4 and len(stage.core.in_flight) == 2 and not stage.may_plan()
    results = runner.execute_passes(window)
    for r in results:
        assert stage.core.in_flight[0].step == window.step
        assert result_in(r) == r.sampled_token_ids  # each pass streams on its own
    assert [s.step for s in stage.core.in_flight] == [ahead.step] and stage.may_plan()


# --- the KV pool it announces ----------------------------------------------------------------


def test_the_stage_names_the_kv_dtype_and_tokens_in_its_log_and_metrics(tmp_path, caplog):
    from prometheus_client import REGISTRY

    from conveyor.config import CacheConfig

    run_dir = make_run_dir()
    config = make_config(tmp_path, run_dir)
    config = dataclasses.replace(config, cache=CacheConfig(kv_cache_dtype="fp8"))
    ctx = zmq.Context()
    worker = receiver(ctx, config, WORKER)
    others = [receiver(ctx, config, DETOKENIZER), receiver(ctx, config, INGRESS)]
    stage = SchedulerStage(config, ctx)
    sender(ctx, config, SCHEDULER).send(WorkerReady(rank=0, num_kv_blocks=64))
    with caplog.at_level("INFO"):
        stage.start()
    assert "KV pool: 64 blocks of 16 tokens = 1024 tokens, KV cache float8_e4m3fn" in caplog.text
    assert REGISTRY.get_sample_value("conveyor_kv_cache_capacity_tokens", {"engine": "0"}) == 1024
    assert REGISTRY.get_sample_value("conveyor_kv_cache_info", {"engine": "0", "kv_cache_dtype": "float8_e4m3fn"}) == 1
    for r in [worker, *others]:
        r.close()
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_a_block_on_disk_counts_once_every_rank_reported_it(tmp_path):
    """Rank 0 finds 1 and 2 at start-up and, by a look while rank 1 still loads, 3; rank 1 finds
    2: only 2 is on disk (each rank keeps its own shard) until rank 1 reports the others."""
    run_dir = make_run_dir()
    config = dataclasses.replace(make_config(tmp_path, run_dir), parallel=ParallelConfig(tensor_parallel_size=2))
    ctx = zmq.Context()
    bound = [receiver(ctx, config, WORKER, 0), receiver(ctx, config, WORKER, 1)]
    bound += [receiver(ctx, config, DETOKENIZER), receiver(ctx, config, INGRESS)]
    try:
        stage = SchedulerStage(config, ctx)
        to_stage = sender(ctx, config, SCHEDULER)
        ready = dict(num_kv_blocks=64, num_host_slots=8, kv_block_bytes=1024, num_disk_blocks=100)
        to_stage.send(WorkerReady(rank=0, kv_disk=[1, 2], **ready))
        to_stage.send(KvDiskChanged(0, came=[3]))
        to_stage.send(WorkerReady(rank=1, kv_disk=[2], **ready))
        stage.start()
        tiers = stage.scheduler.tiers
        assert tiers is not None and tiers.disk is not None
        index = tiers.disk.index
        assert [n in index for n in (1, 2, 3)] == [False, True, False]
        stage.handle(KvDiskChanged(1, came=[3, 1]))
        assert [n in index for n in (1, 2, 3)] == [True, True, True]
        stage.handle(KvDiskChanged(1, went=[2]))  # rank 1's shard evicted: the block is gone
        assert 2 not in index
    finally:
        for r in bound:
            r.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)
