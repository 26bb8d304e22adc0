"""What every stage process shares: start-up from the run directory, logging, signals, readiness.

The launcher starts each stage as `python -m conveyor.stages STAGE INDEX CONFIG_JSON [RESTARTS]`
(RESTARTS: how many times this stage slot was started before; counted in
`conveyor_stage_restarts_total`). A stage's `run(config, index)` owns its sockets and loops until
the launcher's STOP signal, which arrives here as `StageStopped` (raised from the signal handler)
so that `finally` blocks close sockets cleanly; SIGINT and SIGTERM are the launcher's and are
ignored (wire/signals.py says why). The API key is not in the config file: it comes from the
environment (config/env.py). A stage that outlives its launcher (killed with -9) removes the run
directory on its way out, so no socket or metrics file stays behind.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import importlib
import logging
import os
import shutil
import signal
import sys
from typing import Any

import zmq

from conveyor.config import ConfigError, EngineConfig, config_from_json
from conveyor.config.env import api_key_from_env, log_level
from conveyor.wire.messages import StageReady
from conveyor.wire.signals import LAUNCHERS, PARENT_DIED, STOP
from conveyor.wire.topology import BY_NAME, LAUNCHER, SCHEDULER, STAGE_NAMES, WORKER, Stage, engine_of, sender

STAGES = STAGE_NAMES  # the stages `main` starts, in start order (wire/topology.py)
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (STOP, PARENT_DIED)  # wire/signals.py: a stage ignores LAUNCHERS and stops on these
orphaned = False  # set when PARENT_DIED arrived; main() then removes the run directory


class StageStopped(Exception):
    """Raised in a stage's main thread when it is asked to stop."""


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=log_level().upper(),
        format=f"%(asctime)s %(levelname)s [{name}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def die_with_parent() -> None:
    """Ask Linux to send PARENT_DIED to this process if the launcher dies without cleaning up."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, PARENT_DIED)
    except OSError:
        pass


def _note_signal(signum: int) -> None:
    global orphaned
    orphaned = orphaned or signum == PARENT_DIED


def raise_on_signals() -> None:
    """The first STOP (or PARENT_DIED) raises StageStopped; later ones are ignored, so a second
    signal cannot interrupt the cleanup the first began, or raise out of an interpreter-exit
    hook. A stage stuck in cleanup still dies: the launcher escalates to SIGKILL. SIGINT and
    SIGTERM are the launcher's (module docstring)."""

    def handler(signum, frame):
        _note_signal(signum)
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise StageStopped(signal.Signals(signum).name)

    for s in LAUNCHERS:
        signal.signal(s, signal.SIG_IGN)
    for s in STOP_SIGNALS:
        signal.signal(s, handler)


def run_async(coro) -> None:
    """Run an asyncio stage on uvloop; STOP (or PARENT_DIED) cancels it so its cleanup runs."""
    import asyncio

    import uvloop

    async def supervised():
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def stop(signum: int) -> None:
            _note_signal(signum)
            task.cancel()

        for signum in LAUNCHERS:
            signal.signal(signum, signal.SIG_IGN)
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop, signum)
        try:
            await coro
        except asyncio.CancelledError:
            pass

    uvloop.run(supervised())


def report_ready(ctx: zmq.Context, config: EngineConfig, stage: Stage[Any], index: int) -> None:
    launcher = sender(ctx, config, LAUNCHER)
    launcher.send(StageReady(stage=stage.name, index=index))
    launcher.close()
    settle()


def settle() -> None:
    """The stage's start-up is over: what it built to last (imported modules, the model, the
    tokenizer, its sockets) leaves the cyclic garbage collector's view (gc.freeze). A full
    collection otherwise traverses every one of those objects again, and the steady stream of
    per-step objects triggers one every few dozen steps: measured with a gc callback, 9% of a
    serving worker's CPU before, 4% after (docs/benchmarks.md, issue 27). Frozen objects are
    still freed when their last reference goes; only cycles among them would never be."""
    gc.freeze()


def with_api_key(config: EngineConfig) -> EngineConfig:
    key = api_key_from_env()
    if key is None:
        return config
    return dataclasses.replace(config, server=dataclasses.replace(config.server, api_key=key))


def remove_run_dir_if_orphaned(run_dir: str) -> None:
    """The launcher died without cleaning up (kill -9): the stages remove its files."""
    if orphaned and run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    stage, index, config_path = argv[0], int(argv[1]), argv[2]
    restarts = int(argv[3]) if len(argv) > 3 else 0
    if stage not in STAGES:
        print(f"conveyor: unknown stage {stage!r}", file=sys.stderr)
        return 2
    name = f"{stage}-{index}"
    setup_logging(name)
    die_with_parent()
    with open(config_path, "rb") as f:
        config = with_api_key(config_from_json(f.read()))
    from conveyor.stages import metrics  # not at the top: it imports this module

    if stage in (SCHEDULER.name, WORKER.name):  # an engine's own processes label its metrics
        metrics.bind_engine(engine_of(config, BY_NAME[stage], index) or 0, config.parallel.device_label)
    if restarts:
        metrics.stage_restarts.labels(stage).inc()
        logging.getLogger(name).warning("restarted (restart %d of this stage)", restarts)
    module_name, _, function = BY_NAME[stage].entry.partition(":")
    try:
        raise_on_signals()  # an asyncio stage's loop takes the signals over (run_async)
        getattr(importlib.import_module(module_name), function)(config, index)
    except (StageStopped, KeyboardInterrupt):
        pass
    except ConfigError as e:
        logging.getLogger(name).error("%s", e)
        return 2
    except Exception:
        logging.getLogger(name).exception("stage failed")
        return 1
    finally:
        logging.getLogger(name).debug("stopped (pid %d)", os.getpid())
        remove_run_dir_if_orphaned(config.server.run_dir)
    return 0
