"""The process graph, declared once: each stage, the message union its socket takes, and how many
of it a config starts (plus the launcher's inbox, addressed like a stage but not started as one).

Everything else is derived from the table: a stage's inbox (`receiver`), typed senders to its peers
(`sender`, `senders`: sending a message the peer does not take is a type error), the launcher's
start plan (`start_plan`) and the names the stage entry point accepts (`STAGE_NAMES`). With data
parallelism, which engine a process belongs to (`engine_of`), which engine owns a sequence
(`engine_of_seq`) and where requests go (`admission`: the router, else the scheduler). Process
`index` of stage `name` listens on `{name}-{index}.sock` in the run directory (addresses.py), or,
when the launcher placed processes on other nodes, on the tcp:// endpoint (CurveZMQ) that
`server.endpoints` names for it.
Adding a stage means a row here and the stage's package; nothing else names its socket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from conveyor.config import EngineConfig
from conveyor.wire.addresses import address
from conveyor.wire.channel import AsyncReceiver, Receiver, Sender
from conveyor.wire.messages import (
    AbortRequest,
    AdapterCommand,
    DetokenizerInbound,
    IngressInbound,
    LauncherInbound,
    RouterInbound,
    ScheduleRequest,
    SchedulerInbound,
    TokenizerInbound,
    WorkerInbound,
)

T = TypeVar("T")


def _one(config: EngineConfig) -> int:
    return 1


@dataclass(frozen=True)
class Stage(Generic[T]):
    """One row of the table: a kind of process, and what its socket takes (T, a tagged union)."""

    name: str
    inbound: Any  # the msgspec type its receiver decodes: T at run time
    # Its process's entry: "module:function", a `run(config, index)` that serves until stopped
    # (stages/runtime.py calls it). A name, not the function: wire/ imports no stage.
    entry: str
    num_processes: Callable[[EngineConfig], int] = _one
    fails_engine: bool = False  # its death is an engine failure, not a restart of itself
    # Stopped and started with the engine, because its state belongs to the engine's.
    restarts_with_engine: bool = False


# One scheduler per engine (index = engine); its worker ranks are workers engine * tp .. + tp - 1.
SCHEDULER: Stage[SchedulerInbound] = Stage(
    "scheduler",
    SchedulerInbound,
    "conveyor.stages.scheduler.main:run",
    lambda c: c.parallel.data_parallel_size,
    fails_engine=True,
    restarts_with_engine=True,
)
WORKER: Stage[WorkerInbound] = Stage(
    "worker",
    WorkerInbound,
    "conveyor.stages.worker.main:run",
    lambda c: c.parallel.data_parallel_size * c.parallel.tensor_parallel_size,
    fails_engine=True,
    restarts_with_engine=True,
)
# With data parallelism, one router picks each request's engine (stages/router/); none otherwise.
ROUTER: Stage[RouterInbound] = Stage(
    "router", RouterInbound, "conveyor.stages.router.main:run", lambda c: 1 if c.parallel.data_parallel_size > 1 else 0
)
TOKENIZER: Stage[TokenizerInbound] = Stage(
    "tokenizer", TokenizerInbound, "conveyor.stages.tokenizer.main:run", lambda c: c.stages.num_tokenizers
)
# Its sequence state belongs to the scheduler that died (sequence ids start again from 0). With
# data parallelism it serves every engine and outlives one's restart (`engine_of` says None):
# the restarted scheduler's EngineStarted has it drop that engine's sequences instead.
DETOKENIZER: Stage[DetokenizerInbound] = Stage(
    "detokenizer",
    DetokenizerInbound,
    "conveyor.stages.detokenizer.main:run",
    lambda c: c.stages.num_detokenizers,
    restarts_with_engine=True,
)
INGRESS: Stage[IngressInbound] = Stage("ingress", IngressInbound, "conveyor.stages.ingress.main:run", lambda c: c.stages.num_ingress)
LAUNCHER: Stage[LauncherInbound] = Stage("launcher", LauncherInbound, "")  # the launcher's inbox: not a stage process

# Start order: the scheduler first (workers report to it), then workers, the router, pools, ingress.
STAGES: tuple[Stage[Any], ...] = (SCHEDULER, WORKER, ROUTER, TOKENIZER, DETOKENIZER, INGRESS)
STAGE_NAMES = tuple(stage.name for stage in STAGES)
BY_NAME: dict[str, Stage[Any]] = {stage.name: stage for stage in STAGES}


def start_plan(config: EngineConfig) -> list[tuple[Stage[Any], int]]:
    """Every stage process the launcher starts, as (stage, index), in start order."""
    return [(stage, i) for stage in STAGES for i in range(stage.num_processes(config))]


def engine_and_rank(config: EngineConfig, worker_index: int) -> tuple[int, int]:
    """Worker process `worker_index` is tensor-parallel rank `rank` of engine `engine`."""
    return divmod(worker_index, config.parallel.tensor_parallel_size)


def worker_indices(config: EngineConfig, engine: int) -> range:
    """The worker processes of engine `engine`, rank 0 first."""
    tp = config.parallel.tensor_parallel_size
    return range(engine * tp, (engine + 1) * tp)


def endpoint_name(stage: Stage[Any], index: int) -> str:
    """The key of process `index` of `stage` in `server.endpoints`."""
    return f"{stage.name}-{index}"


def engine_of(config: EngineConfig, stage: Stage[Any], index: int) -> int | None:
    """The engine whose failure stops and restarts process `index` of `stage` (None: no engine's).
    A scheduler and its worker ranks are their engine's; with one engine the detokenizers are too."""
    if stage is SCHEDULER:
        return index
    if stage is WORKER:
        return engine_and_rank(config, index)[0]
    if stage.restarts_with_engine and config.parallel.data_parallel_size == 1:
        return 0
    return None


def seq_ids_of(config: EngineConfig, engine: int) -> range:
    """The sequence ids engine `engine` hands out, in order: e, e + dp, e + 2 dp, ... (int64)."""
    return range(engine, 2**63, config.parallel.data_parallel_size)


def engine_of_seq(config: EngineConfig, seq_id: int) -> int:
    """The engine that owns sequence `seq_id` (the one whose `seq_ids_of` holds it)."""
    return seq_id % config.parallel.data_parallel_size


def address_of(config: EngineConfig, stage: Stage[Any], index: int = 0) -> str:
    """Its tcp:// endpoint when another node may talk to it, else its ipc:// path."""
    name = endpoint_name(stage, index)
    for key, endpoint in config.server.endpoints:
        if key == name:
            return endpoint
    return address(config.server.run_dir, stage.name, index)


def receiver(ctx: zmq.Context, config: EngineConfig, stage: Stage[T], index: int = 0) -> Receiver[T]:
    """The one socket process `index` of `stage` binds and receives on."""
    return Receiver(ctx, address_of(config, stage, index), stage.inbound)


def async_receiver(ctx: zmq.asyncio.Context, config: EngineConfig, stage: Stage[T], index: int = 0) -> AsyncReceiver[T]:
    return AsyncReceiver(ctx, address_of(config, stage, index), stage.inbound)


def sender(ctx: zmq.Context, config: EngineConfig, stage: Stage[T], index: int = 0) -> Sender[T]:
    """A sender to process `index` of `stage` (the scheduler, the launcher: index 0)."""
    return Sender(ctx, address_of(config, stage, index))


def engine_workers(ctx: zmq.Context, config: EngineConfig, engine: int) -> list[Sender[WorkerInbound]]:
    """One sender per worker rank of engine `engine`, by rank: every rank gets every plan."""
    return [sender(ctx, config, WORKER, i) for i in worker_indices(config, engine)]


def admission(ctx: zmq.Context, config: EngineConfig) -> Sender[ScheduleRequest | AbortRequest | AdapterCommand]:
    """Where requests and their aborts go: the router with several engines, else the scheduler
    (no extra hop). Both take ScheduleRequest and AbortRequest; AdapterCommand only the scheduler
    (LoRA is refused with several engines: conveyor/engine_config.py)."""
    stage = ROUTER if ROUTER.num_processes(config) else SCHEDULER
    return Sender(ctx, address_of(config, stage, 0))


def senders(ctx: zmq.Context, config: EngineConfig, stage: Stage[T]) -> list[Sender[T]]:
    """One sender per process of `stage`, by index: replies go to the ingress that owns a request,
    tokens to the detokenizer that owns a sequence, a plan to every worker rank."""
    return [sender(ctx, config, stage, i) for i in range(stage.num_processes(config))]
