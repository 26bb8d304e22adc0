"""Where the launcher's stage processes run: on this machine (LocalProcesses), or, for an engine's
scheduler and worker ranks, on the nodes of a Ray cluster (`--ray-address`: stages/ray/).

A process handle is whatever `start` returns with subprocess.Popen's supervision surface: `pid`,
`poll()`, `wait(timeout)`, `send_signal(sig)`, `kill()`. The launcher (stages/launcher.py) uses
nothing else, so where a process runs never changes how it is supervised.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Protocol

from conveyor.config import ConfigError, EngineConfig
from conveyor.wire.topology import WORKER, Stage


class ProcessHandle(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Processes(Protocol):
    """Where stage processes run. `place` comes first: it may give the config the tcp://
    endpoints (server.endpoints) of stages that other machines reach, which the launcher then
    writes to the run directory for every stage to read."""

    def place(self, config: EngineConfig) -> EngineConfig: ...

    def start(self, stage: Stage[Any], index: int, cmd: list[str], env: dict[str, str]) -> ProcessHandle: ...

    def close(self) -> None: ...


class LocalProcesses:
    """Every stage a child process of the launcher, on this machine.

    CPU worker ranks share the machine's cores: with several (data- or tensor-parallel) each
    gets an equal share as OMP_NUM_THREADS, which both torch and the C++ kernels' OpenMP read at
    start. Left to themselves each would start a thread per core, and OpenMP kernels whose
    threads outnumber the cores stall on each other's barriers (a user's own OMP_NUM_THREADS wins).
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.worker_threads: int | None = None
        if config is not None and config.parallel.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            num_workers = WORKER.num_processes(config)
            if num_workers > 1:
                self.worker_threads = max(1, len(os.sched_getaffinity(0)) // num_workers)

    def place(self, config: EngineConfig) -> EngineConfig:
        return config  # ipc:// sockets in the run directory: nothing to place

    def start(self, stage: Stage[Any], index: int, cmd: list[str], env: dict[str, str]) -> ProcessHandle:
        if stage is WORKER and self.worker_threads is not None:
            env = dict(env, OMP_NUM_THREADS=str(self.worker_threads))
        return subprocess.Popen(cmd, env=env)

    def close(self) -> None:
        pass


def processes_for(config: EngineConfig) -> Processes:
    """The process placement `config` asks for: on a Ray cluster with --ray-address."""
    if config.parallel.ray_address is None:
        return LocalProcesses(config)
    try:
        from conveyor.stages.ray.processes import RayProcesses
    except ImportError as e:
        raise ConfigError(f"--ray-address needs ray (pip install 'conveyor[ray]'): {e}") from e
    return RayProcesses(config)
