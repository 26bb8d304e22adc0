"""The process graph's table (wire/topology.py): the start plan and the addresses it derives, and
messages crossing the typed senders and receivers it makes."""

from __future__ import annotations

import shutil
from typing import cast

import zmq

from conveyor.config import EngineConfig, ModelConfig, ParallelConfig, ServerConfig, StagesConfig
from conveyor.stages.runtime import STAGES
from conveyor.wire import topology
from conveyor.wire.addresses import make_run_dir
from conveyor.wire.messages import AbortRequest, StageFailed
from conveyor.wire.topology import (
    INGRESS,
    LAUNCHER,
    SCHEDULER,
    TOKENIZER,
    address_of,
    receiver,
    sender,
    senders,
    start_plan,
)


def engine(run_dir: str = "/run/conveyor-x", num_workers: int = 1, num_engines: int = 1, **stages: int) -> EngineConfig:
    return EngineConfig(
        model=cast(ModelConfig, None),  # the table reads no model
        parallel=ParallelConfig(tensor_parallel_size=num_workers, data_parallel_size=num_engines),
        stages=StagesConfig(**stages),
        server=ServerConfig(run_dir=run_dir),
    )


def names(plan) -> list[str]:
    return [f"{stage.name}-{index}" for stage, index in plan]


def test_the_start_plan_is_scheduler_then_workers_tokenizers_detokenizers_ingresses():
    config = engine(num_workers=2, num_tokenizers=3, num_detokenizers=2, num_ingress=2)
    assert names(start_plan(config)) == [
        "scheduler-0",
        "worker-0",
        "worker-1",
        "tokenizer-0",
        "tokenizer-1",
        "tokenizer-2",
        "detokenizer-0",
        "detokenizer-1",
        "ingress-0",
        "ingress-1",
    ]


def test_data_parallel_engines_get_a_router_before_the_pools():
    config = engine(num_workers=2, num_engines=2, num_tokenizers=1, num_detokenizers=1, num_ingress=1)
    assert names(start_plan(config)) == [
        "scheduler-0",
        "scheduler-1",
        "worker-0",
        "worker-1",
        "worker-2",
        "worker-3",
        "router-0",
        "tokenizer-0",
        "detokenizer-0",
        "ingress-0",
    ]
    # Engine 1 is scheduler 1 and workers 2, 3; the detokenizers serve both, and outlive either.
    plan = start_plan(config)
    assert [(s.name, i) for s, i in plan if topology.engine_of(config, s, i) == 1] == [("scheduler", 1), ("worker", 2), ("worker", 3)]
    assert topology.engine_of(config, topology.DETOKENIZER, 0) is None
    assert topology.engine_of(engine(), topology.DETOKENIZER, 0) == 0  # one engine: they restart with it
    assert [topology.engine_of_seq(config, seq_id) for seq_id in range(5)] == [0, 1, 0, 1, 0]


def test_requests_go_to_the_router_only_with_several_engines():
    run_dir = make_run_dir()
    ctx = zmq.Context()
    try:
        for num_engines, stage in ((1, SCHEDULER), (2, topology.ROUTER)):
            config = engine(run_dir=run_dir, num_engines=num_engines)
            inbox = receiver(ctx, config, stage)
            topology.admission(ctx, config).send(AbortRequest([f"r{num_engines}"]))
            assert inbox.recv(timeout_ms=5000) == AbortRequest([f"r{num_engines}"])
            inbox.close()
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_every_started_stage_is_one_the_stage_entry_point_accepts():
    assert {stage.name for stage, _ in start_plan(engine(num_engines=2))} == set(STAGES)
    assert {stage.name for stage, _ in start_plan(engine())} == set(STAGES) - {"router"}
    assert LAUNCHER.name not in STAGES  # an inbox, not a stage process


def test_the_supervision_groups():
    assert [s.name for s in topology.STAGES if s.fails_engine] == ["scheduler", "worker"]
    # The detokenizers' sequence state belongs to the scheduler: they restart with it.
    assert [s.name for s in topology.STAGES if s.restarts_with_engine] == ["scheduler", "worker", "detokenizer"]


def test_addresses_keep_their_format():
    config = engine(run_dir="/run/conveyor-x")
    assert address_of(config, TOKENIZER, 2) == "ipc:///run/conveyor-x/tokenizer-2.sock"
    assert address_of(config, LAUNCHER) == "ipc:///run/conveyor-x/launcher-0.sock"


def test_a_message_reaches_the_process_it_is_sent_to():
    run_dir = make_run_dir()
    config = engine(run_dir=run_dir, num_ingress=2)
    ctx = zmq.Context()
    try:
        inboxes = [receiver(ctx, config, INGRESS, i) for i in range(2)]
        scheduler_inbox = receiver(ctx, config, SCHEDULER)
        ingresses = senders(ctx, config, INGRESS)
        assert len(ingresses) == 2
        ingresses[1].send(StageFailed(stage="tokenizer", index=0))
        sender(ctx, config, SCHEDULER).send(AbortRequest(["r1"]))
        assert inboxes[1].recv(timeout_ms=5000) == StageFailed(stage="tokenizer", index=0)
        assert inboxes[0].recv(timeout_ms=50) is None
        assert scheduler_inbox.recv(timeout_ms=5000) == AbortRequest(["r1"])
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_every_stage_row_names_its_entry():
    """The runtime starts a stage by its row's entry, a run(config, index), found by name."""
    import importlib
    import inspect

    from conveyor.wire.topology import STAGES

    for stage in STAGES:
        module, _, function = stage.entry.partition(":")
        run = getattr(importlib.import_module(module), function)
        assert module == f"conveyor.stages.{stage.name}.main" and function == "run", stage.entry
        assert list(inspect.signature(run).parameters) == ["config", "index"], stage.entry
