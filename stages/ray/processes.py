"""RayProcesses: the launcher's stage processes with each engine on the nodes of a Ray cluster.

`conveyor serve --ray-address ADDR|auto` connects the launcher to an existing cluster. The
engines' schedulers and worker ranks run on the nodes placement.py picks, each as a child of a
StageHost actor there; the ingress, tokenizers, detokenizers and router stay on the launcher's
machine, children of the launcher as without Ray. Every stage inbox becomes a tcp:// endpoint
with CurveZMQ (wire/curve.py), keys made here per run and handed to every stage in its
environment. Handles have subprocess.Popen's supervision surface (stages/processes.py), so the
launcher supervises remote and local stages alike: a dead actor or node is an exited process.
A dead node's engine cannot come back (its endpoints were on that node): its restarts fail at
once, and the launcher gives up after --max-engine-restarts as for any engine that keeps dying.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from conveyor.config import ConfigError, EngineConfig
from conveyor.config.env import CURVE_KEYS_VARIABLE, DIST_INIT_METHOD_VARIABLE
from conveyor.stages.processes import ProcessHandle
from conveyor.stages.ray.placement import NAMESPACE, EnginePlacement, endpoints, place_engines, release
from conveyor.wire import curve
from conveyor.wire.topology import SCHEDULER, WORKER, Stage, endpoint_name, engine_and_rank

log = logging.getLogger("conveyor")
LOST = -signal.SIGKILL  # the exit status of a process whose actor or node is gone
WAIT_SLICE_S = 0.05


class RemoteProcess:
    """A stage process on another node, seen through its host actor. poll() never blocks: it
    reads the answer to the previous question and asks again, so the launcher's loop stays on
    time however slow the cluster answers (a status is at most one poll old)."""

    def __init__(self, host: Any, name: str, pid: int):
        self.host, self.name, self.pid = host, name, pid
        self.returncode: int | None = None
        self._asked: Any = None  # the ObjectRef of the last poll

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._asked is not None:
            ready, _ = ray.wait([self._asked], timeout=0)
            if not ready:
                return None
            try:
                self.returncode = ray.get(ready[0])
            except RayActorError:
                log.error("stage %s: its Ray actor or node is gone", self.name)
                self.returncode = LOST
            if self.returncode is not None:
                return self.returncode
        self._asked = self.host.poll.remote(self.name)
        return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
            time.sleep(WAIT_SLICE_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.host.send_signal.remote(self.name, int(sig))  # answered by the next poll

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class LostProcess:
    """A stage that could not be started because its host is gone: exited at once."""

    def __init__(self, name: str):
        self.name, self.pid, self.returncode = name, -1, LOST

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        pass


class RayProcesses:
    def __init__(self, config: EngineConfig):
        address = config.parallel.ray_address
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=True, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot join the Ray cluster at {address!r}: {e}") from e
        self.config = config
        self.placements: list[EnginePlacement] = []
        self.keys = curve.CurveKeys.generate()
        curve.install(self.keys)  # the launcher's own sockets; its children get them in their environment

    def place(self, config: EngineConfig) -> EngineConfig:
        """Place the engines; `config` with the endpoint of every stage inbox."""
        run_id = os.path.basename(config.server.run_dir)
        self.placements = place_engines(config, run_id)
        for engine, placed in enumerate(self.placements):
            log.info("engine %d: ranks on Ray nodes %s (%s)", engine, placed.node_ids, ", ".join(placed.ips))
        table = endpoints(config, self.placements)
        self.config = dataclasses.replace(config, server=dataclasses.replace(config.server, endpoints=table))
        return self.config

    def start(self, stage: Stage[Any], index: int, cmd: list[str], env: dict[str, str]) -> ProcessHandle:
        env = dict(env, **{CURVE_KEYS_VARIABLE: self.keys.encode()})
        if stage is not SCHEDULER and stage is not WORKER:
            return subprocess.Popen(cmd, env=env)
        engine, rank = (index, 0) if stage is SCHEDULER else engine_and_rank(self.config, index)
        placed = self.placements[engine]
        env[DIST_INIT_METHOD_VARIABLE] = placed.dist_init_method
        argv = cmd[cmd.index("conveyor.stages") + 1 :]  # STAGE INDEX CONFIG RESTARTS
        with open(argv[2], "rb") as f:
            config_json = f.read()
        name = endpoint_name(stage, index)
        host = placed.hosts[rank]
        try:
            pid = ray.get(host.start.remote(name, argv, config_json, env))
        except RayActorError:
            log.error("stage %s cannot start: its Ray actor or node is gone", name)
            return LostProcess(name)
        return RemoteProcess(host, name, pid)

    def close(self) -> None:
        release(self.placements)
        self.placements = []
        ray.shutdown()
