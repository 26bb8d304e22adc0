"""A scheduler as one engine of several (data parallelism), on real sockets with its peers' ends
held by the test: it tells the detokenizers it started before any tokens, names its engine when it
admits a request, numbers its sequences engine mod N, and reports its load to the router, paced."""

from __future__ import annotations

import dataclasses
import shutil

import zmq

from conveyor.stages.scheduler.load_report import LoadReports
from conveyor.stages.scheduler.main import SchedulerStage
from conveyor.wire.addresses import make_run_dir
from conveyor.wire.messages import (
    EngineLoad,
    EngineStarted,
    InitializeCache,
    RequestAccepted,
    SamplingParams,
    ScheduleRequest,
    WorkerReady,
)
from conveyor.wire.step import StepPlan
from conveyor.wire.topology import DETOKENIZER, INGRESS, ROUTER, SCHEDULER, WORKER, receiver, sender
from tests.ingress_server import make_config


def load(num_waiting: int = 0, num_received: int = 0) -> EngineLoad:
    return EngineLoad(1, num_waiting, 0, 0, 64, num_received)


def test_engine_one_of_two_names_itself_everywhere(tmp_path):
    run_dir = make_run_dir()
    config = make_config(tmp_path, run_dir)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_size=2))
    ctx = zmq.Context()
    try:
        worker = receiver(ctx, config, WORKER, 1)  # engine 1's only rank (tp = 1)
        detokenizer = receiver(ctx, config, DETOKENIZER)
        ingress = receiver(ctx, config, INGRESS)
        router = receiver(ctx, config, ROUTER)
        stage = SchedulerStage(config, ctx, engine=1)
        sender(ctx, config, SCHEDULER, 1).send(WorkerReady(rank=0, num_kv_blocks=64, num_host_slots=32))
        stage.start()
        assert isinstance(worker.recv(timeout_ms=5000), InitializeCache)
        assert detokenizer.recv(timeout_ms=5000) == EngineStarted(1)  # before any TokenBatch

        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        for n in range(3):
            stage.handle(ScheduleRequest(f"r{n}", 0, [n + 1] * 12, params, arrival_time=0.0, sent_time=0.0))
        replies = [ingress.recv(timeout_ms=5000) for _ in range(3)]
        assert all(isinstance(r, RequestAccepted) and r.engine == 1 for r in replies)
        stage.plan_next()
        plan = worker.recv(timeout_ms=5000)
        assert isinstance(plan, StepPlan) and [s.seq_id for s in plan.new_seqs] == [1, 3, 5]

        stage.report_load()
        report = router.recv(timeout_ms=5000)
        assert isinstance(report, EngineLoad)
        assert (report.engine, report.num_received, report.num_running, report.num_kv_blocks) == (1, 3, 3, 64)
        assert report.num_host_blocks == 32  # the router bounds its prefix map by pool + host tier
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_load_reports_are_paced_while_busy_and_final_when_idle():
    sent: list[EngineLoad] = []
    reports = LoadReports(sent.append, interval_s=60.0)
    assert reports.offer(load(1, 1), idle=False)  # the first goes out at once
    assert not reports.offer(load(2, 2), idle=False)  # busy: within the interval, held back
    assert not reports.offer(load(1, 1), idle=True)  # idle, but nothing new to say
    assert reports.offer(load(0, 2), idle=True)  # idle: the last word goes out at once
    assert sent == [load(1, 1), load(0, 2)]


def test_a_busy_engine_reports_each_change_once_the_interval_passed():
    sent: list[EngineLoad] = []
    reports = LoadReports(sent.append, interval_s=0.0)
    for n in range(3):
        reports.offer(load(n, n), idle=False)
    assert sent == [load(n, n) for n in range(3)]
