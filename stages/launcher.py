"""The launcher: starts every stage process, waits until all are ready, and supervises them.

Takes (LauncherInbound): StageReady from each stage. Sends: EngineStatus to each ingress
(ready once every stage has reported, not ready while shutting down).

Shutdown (SIGTERM, SIGINT, or any stage exiting) stops every child, SIGKILLs stragglers after a
grace period, and removes the run directory with its sockets and metrics files. Stages also ask
the kernel to SIGTERM them if the launcher itself dies (runtime.die_with_parent).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import zmq

from conveyor.config import EngineConfig, config_to_json
from conveyor.wire.addresses import address, make_run_dir
from conveyor.wire.channel import Receiver, Sender
from conveyor.wire.messages import EngineStatus, LauncherInbound, StageReady

log = logging.getLogger("conveyor")
GRACE_S = 5.0
POLL_MS = 100  # how often a dead child is noticed


@dataclass
class Child:
    stage: str
    index: int
    process: subprocess.Popen

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.index}"


def stage_plan(config: EngineConfig) -> list[tuple[str, int]]:
    """Start order: the scheduler first (workers report to it), then workers, pools, ingress."""
    s = config.stages
    return (
        [("scheduler", 0)]
        + [("worker", r) for r in range(config.parallel.tensor_parallel_size)]
        + [("tokenizer", i) for i in range(s.num_tokenizers)]
        + [("detokenizer", i) for i in range(s.num_detokenizers)]
        + [("ingress", i) for i in range(s.num_ingress)]
    )


class Launcher:
    def __init__(self, config: EngineConfig):
        self.run_dir = make_run_dir()
        self.config = replace(config, server=replace(config.server, run_dir=self.run_dir))
        self.children: list[Child] = []
        self.stopping = False
        self.ctx = zmq.Context()

    def serve(self) -> int:
        """Run until a signal or a dead stage; the exit status for the CLI."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._start_children()
            if not self._wait_until_ready():
                return 0 if self.stopping else 1
            host, port = self.config.server.host, self.config.server.port
            log.info("serving %s on http://%s:%d", self.config.model.served_name, host, port)
            return self._supervise()
        finally:
            self._stop_children()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def _start_children(self) -> None:
        config_path = os.path.join(self.run_dir, "config.json")
        with open(config_path, "wb") as f:
            f.write(config_to_json(self.config))
        metrics_dir = os.path.join(self.run_dir, "metrics")
        os.mkdir(metrics_dir, 0o700)
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir, PYTHONUNBUFFERED="1")
        self.inbox: Receiver[LauncherInbound] = Receiver(self.ctx, address(self.run_dir, "launcher", 0), LauncherInbound)
        for stage, index in stage_plan(self.config):
            cmd = [sys.executable, "-m", "conveyor.stages", stage, str(index), config_path]
            self.children.append(Child(stage, index, subprocess.Popen(cmd, env=env)))

    def _wait_until_ready(self) -> bool:
        pending = {c.name for c in self.children}
        next_report = time.monotonic() + 10
        while pending:
            if self.stopping or self._dead_child():
                return False
            if time.monotonic() > next_report:
                log.info("waiting for %s to start", ", ".join(sorted(pending)))
                next_report += 10
            msg = self.inbox.recv(timeout_ms=POLL_MS)
            if isinstance(msg, StageReady):
                pending.discard(f"{msg.stage}-{msg.index}")
        self._tell_ingress(EngineStatus(ready=True))
        return True

    def _supervise(self) -> int:
        while not self.stopping:
            if self._dead_child():
                return 1
            time.sleep(POLL_MS / 1000)
        return 0

    def _dead_child(self) -> bool:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                log.error("stage %s exited with status %s; shutting down", child.name, code)
                return True
        return False

    def _tell_ingress(self, msg: EngineStatus) -> None:
        for child in self.children:
            if child.stage == "ingress" and child.process.poll() is None:
                sender = Sender(self.ctx, address(self.run_dir, "ingress", child.index))
                sender.send(msg)
                sender.close()

    def _stop_children(self) -> None:
        self._tell_ingress(EngineStatus(ready=False))
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("stage %s did not stop in %.0f s; killing it", child.name, GRACE_S)
                child.process.kill()
                child.process.wait()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("stopped")
