"""The launcher: starts every stage process, waits until all are ready, and keeps them serving.

Takes (LauncherInbound): StageReady and Heartbeat from each stage, Drained from each ingress.
Sends: EngineStatus to each ingress and the router (ready, not ready, draining; per engine with
data parallelism, stages/engines.py); StageFailed to each ingress and every scheduler when a stage
process died and is being restarted.

It owns the child processes (started in wire/topology.py's start_plan order), the run directory
and the failure budget; what a death or a signal does to the requests in flight is told once, in
docs/architecture.md, sections 0 and 0b. Invariants: a stage is dead when its process exits or,
once ready, sends no Heartbeat for --stage-timeout; a death before the daemon is first ready ends
it (exit 1); a scheduler's or worker's death restarts its whole engine (topology's engine_of),
any other stage restarts alone, and nothing restarts during a drain; more than
--max-engine-restarts deaths within --restart-window exit 1; `serve` stops every child and
removes the run directory on its way out, whichever way that is.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import zmq
from prometheus_client import multiprocess

from conveyor.config import EngineConfig, config_to_json
from conveyor.config.env import API_KEY_VARIABLE
from conveyor.stages.engines import Engines
from conveyor.stages.processes import ProcessHandle, processes_for
from conveyor.wire.addresses import make_run_dir, sweep_stale_run_dirs
from conveyor.wire.channel import Sender
from conveyor.wire.messages import (
    Drained,
    EngineStatus,
    Heartbeat,
    IngressInbound,
    LauncherInbound,
    RouterInbound,
    StageFailed,
    StageReady,
)
from conveyor.wire.signals import STOP
from conveyor.wire.topology import INGRESS, LAUNCHER, ROUTER, SCHEDULER, Stage, engine_of, receiver, senders, start_plan

log = logging.getLogger("conveyor")
GRACE_S = 5.0
POLL_MS = 100  # how often a dead child is noticed


@dataclass
class Child:
    stage: Stage[Any]
    index: int
    process: ProcessHandle | None  # None: stopped, waiting for an engine restart
    restarts: int = 0  # times this slot was started before this process
    ready: bool = False
    last_beat: float = 0.0  # time.monotonic() of the last Heartbeat (or of StageReady)

    @property
    def name(self) -> str:
        return f"{self.stage.name}-{self.index}"


class Launcher:
    def __init__(self, config: EngineConfig):
        sweep_stale_run_dirs()
        self.run_dir = make_run_dir()
        self.config = replace(config, server=replace(config.server, run_dir=self.run_dir))
        self.server = self.config.server
        self.children: dict[str, Child] = {}  # by name, in start order
        self.signals = 0  # SIGTERM/SIGINT received: 1 drains, 2 stops now
        self.engines = Engines(self.config.parallel.data_parallel_size)
        self.failures: collections.deque[float] = collections.deque()  # monotonic times, in the window
        self.drain_deadline: float | None = None
        self.drained: set[int] = set()
        self.ctx = zmq.Context()
        # Senders to the ingresses and the router (_open_sockets): none until the sockets open.
        self.ingresses: list[Sender[IngressInbound]] = []
        self.router: list[Sender[RouterInbound]] = []
        self.processes = processes_for(self.config)  # where stage processes run (stages/processes.py)
        self.config = self.processes.place(self.config)  # Ray: tcp:// endpoints for what other nodes reach

    def serve(self) -> int:
        """Run until a signal, or until the engine failed too often; the exit status for the CLI."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._open_sockets()
            for stage, index in start_plan(self.config):
                self._start(stage, index)
            if not self._wait_until_ready():
                return 0 if self.signals else 1
            log.info("serving %s on http://%s:%d", self.config.model.served_name, self.server.host, self.server.port)
            return self._supervise()
        finally:
            self._stop_children()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1

    # --- processes ---------------------------------------------------------------------------

    def _open_sockets(self) -> None:
        self.config_path = os.path.join(self.run_dir, "config.json")
        with open(self.config_path, "wb") as f:
            f.write(config_to_json(self.config))  # without the API key
        self.metrics_dir = os.path.join(self.run_dir, "metrics")
        os.mkdir(self.metrics_dir, 0o700)
        self.env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir, PYTHONUNBUFFERED="1")
        self.env.pop(API_KEY_VARIABLE, None)  # only the ingress needs it
        self.inbox = receiver(self.ctx, self.config, LAUNCHER)
        self.ingresses = senders(self.ctx, self.config, INGRESS)
        self.schedulers = senders(self.ctx, self.config, SCHEDULER)
        self.router = senders(self.ctx, self.config, ROUTER)  # none with one engine

    def _forget(self, child: Child) -> None:
        """A stage process is gone for good: its live gauges (the scheduler's) stop counting.
        Its counters and histograms stay, as totals must."""
        if child.process is not None:
            multiprocess.mark_process_dead(child.process.pid, self.metrics_dir)

    def _start(self, stage: Stage[Any], index: int, restarts: int = 0) -> None:
        cmd = [sys.executable, "-m", "conveyor.stages", stage.name, str(index), self.config_path, str(restarts)]
        env = self.env
        if stage is INGRESS and self.server.api_key is not None:
            env = dict(env, **{API_KEY_VARIABLE: self.server.api_key})  # never on disk, never in ps
        child = Child(stage, index, self.processes.start(stage, index, cmd, env), restarts)
        self.children[child.name] = child

    def _kill(self, children: list[Child]) -> None:
        """STOP (stages ignore SIGTERM and SIGINT: wire/signals.py), then SIGKILL what is still
        there after the grace period."""
        running = [(c, c.process) for c in children if c.process is not None]
        for _, process in running:
            if process.poll() is None:
                process.send_signal(STOP)
        deadline = time.monotonic() + GRACE_S
        for child, process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("stage %s did not stop in %.0f s; killing it", child.name, GRACE_S)
                process.kill()
                process.wait()

    # --- start-up ----------------------------------------------------------------------------

    def _wait_until_ready(self) -> bool:
        next_report = time.monotonic() + 10
        while not all(c.ready for c in self.children.values()):
            if self.signals or self._exited():
                return False
            if time.monotonic() > next_report:
                pending = ", ".join(c.name for c in self.children.values() if not c.ready)
                log.info("waiting for %s to start", pending)
                next_report += 10
            self._receive(POLL_MS)
        self._tell(self.engines.all_started())
        return True

    # --- supervision -------------------------------------------------------------------------

    def _supervise(self) -> int:
        while self.signals < 2:
            self._receive(POLL_MS)
            for child in self._exited() + self._silent():
                if not self._recover(child):
                    return 1
            self._maybe_restart_engine()
            if self.signals and self._drain_done():
                return 0
        return 0

    def _receive(self, timeout_ms: int) -> None:
        """Handle every message waiting, waiting up to timeout_ms for the first."""
        msg = self.inbox.recv(timeout_ms=timeout_ms)
        while msg is not None:
            self._handle(msg)
            msg = self.inbox.recv_nowait()

    def _handle(self, msg: LauncherInbound) -> None:
        match msg:
            case StageReady(stage=stage, index=index):
                child = self.children.get(f"{stage}-{index}")
                if child is None:
                    return
                child.ready, child.last_beat = True, time.monotonic()
                if child.restarts:
                    log.info("stage %s is back", child.name)
                if stage == INGRESS.name and self.engines.any_ready:  # a restarted ingress
                    for status in self.engines.statuses():
                        self.ingresses[index].send(status)
                if stage == ROUTER.name and self.engines.any_ready:  # a restarted router
                    for status in self.engines.statuses():
                        self.router[index].send(status)
                self._maybe_engine_back()
            case Heartbeat(stage=stage, index=index, pid=pid):
                child = self.children.get(f"{stage}-{index}")
                if child is not None and child.process is not None and child.process.pid == pid:
                    child.last_beat = time.monotonic()
            case Drained(index=index):
                self.drained.add(index)

    def _exited(self) -> list[Child]:
        dead = []
        for child in self.children.values():
            code = None if child.process is None else child.process.poll()
            if code is not None:
                log.error("stage %s exited with status %s", child.name, code)
                dead.append(child)
        return dead

    def _silent(self) -> list[Child]:
        """Ready stages that sent no heartbeat for --stage-timeout: killed, and returned."""
        now, timeout = time.monotonic(), self.server.stage_timeout_s
        silent = [
            (c, c.process)
            for c in self.children.values()
            if c.ready and c.process is not None and c.process.poll() is None and now - c.last_beat > timeout
        ]
        for child, process in silent:
            log.error("stage %s sent no heartbeat for %.1f s; declaring it dead", child.name, now - child.last_beat)
            process.kill()
            process.wait()
        return [child for child, _ in silent]

    def _recover(self, child: Child) -> bool:
        """Restart a dead stage (or the whole engine); False when the daemon should give up."""
        if child.process is None or self.children.get(child.name) is not child:
            return True  # found dead in the same look as an engine failure that already stopped it
        if self.drain_deadline is not None:
            self._lost_in_drain(child)
            return True
        now = time.monotonic()
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.server.restart_window_s:
            self.failures.popleft()
        if len(self.failures) > self.server.max_engine_restarts:
            log.error(
                "%d stage failures within %.0f s (--max-engine-restarts %d); giving up",
                len(self.failures),
                self.server.restart_window_s,
                self.server.max_engine_restarts,
            )
            return False
        self._forget(child)
        engine = engine_of(self.config, child.stage, child.index)
        if child.stage.fails_engine and engine is not None:
            self._engine_failed(engine)
        else:
            log.warning("restarting stage %s", child.name)
            failed = StageFailed(stage=child.stage.name, index=child.index)
            for scheduler in self.schedulers:
                scheduler.send(failed)
            for ingress in self.ingresses:
                ingress.send(failed)
            self._start(child.stage, child.index, child.restarts + 1)
        return True

    def _lost_in_drain(self, child: Child) -> None:
        """A stage that dies while the daemon drains is not restarted: the daemon is stopping. An
        engine's death ends its requests in flight with an error; a dead ingress holds none."""
        log.warning("stage %s exited during the drain; not restarted", child.name)
        self._forget(child)
        child.process, child.ready = None, False
        engine = engine_of(self.config, child.stage, child.index)
        if child.stage.fails_engine and engine is not None:
            self._tell(self.engines.stopped(engine))
        if child.stage is INGRESS:
            self.drained.add(child.index)

    def _engine_failed(self, engine: int) -> None:
        """Fail what the engine holds, stop what is left of it, restart it after a backoff."""
        backoff = self.engines.failed(engine, len(self.failures))
        self._tell(self.engines.status(engine))
        self._kill(self._engine_children(engine))
        for child in self._engine_children(engine):  # their exits are this failure, not new ones
            self._forget(child)
            child.process, child.ready = None, False
        name = "the engine" if self.engines.num_engines == 1 else f"engine {engine}"
        log.warning("%s failed; restarting it in %.1f s", name, backoff)

    def _engine_children(self, engine: int) -> list[Child]:
        return [c for c in self.children.values() if engine_of(self.config, c.stage, c.index) == engine]

    def _maybe_restart_engine(self) -> None:
        for engine in self.engines.due():
            for child in self._engine_children(engine):
                self._start(child.stage, child.index, child.restarts + 1)

    def _maybe_engine_back(self) -> None:
        for engine in range(self.engines.num_engines):
            if self.engines.may_come_back(engine) and all(c.ready for c in self._engine_children(engine)):
                log.info("the engine is back" if self.engines.num_engines == 1 else f"engine {engine} is back")
                self._tell(self.engines.back(engine))

    # --- drain and stop ----------------------------------------------------------------------

    def _drain_done(self) -> bool:
        """Start the drain on the first signal; True once every ingress is drained or time is up."""
        if self.drain_deadline is None:
            log.info("draining: new requests get 503, requests in flight have %.0f s", self.server.drain_timeout_s)
            self.drain_deadline = time.monotonic() + self.server.drain_timeout_s
            self.engines.draining = True
            for status in self.engines.statuses():
                self._tell(status)
        if len(self.drained) >= len(self.ingresses):
            log.info("drained")
            return True
        if time.monotonic() > self.drain_deadline:
            log.warning("drain timeout: ending the requests still in flight")
            return True
        return False

    def _tell(self, status: EngineStatus) -> None:
        """Every ingress and the router."""
        for ingress in self.ingresses:
            ingress.send(status)
        for router in self.router:
            router.send(status)

    def _stop_children(self) -> None:
        if self.ingresses:
            self._tell(EngineStatus(ready=False))
            time.sleep(0.05)  # let the ingresses end open streams with an error event first
        self._kill(list(self.children.values()))
        self.processes.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("stopped")
