"""Where the launcher's stage processes run: on this machine (LocalProcesses), or, for an engine's
scheduler and worker ranks, on the nodes of a Ray cluster (`--ray-address`: stages/ray/).

A process handle is whatever `start` returns with subprocess.Popen's supervision surface: `pid`,
`poll()`, `wait(timeout)`, `send_signal(sig)`, `kill()`. The launcher (stages/launcher.py) uses
nothing else, so where a process runs never changes how it is supervised.
"""

from __future__ import annotations

import subprocess
from typing import Any, Protocol

from conveyor.config import EngineConfig
from conveyor.wire.topology import Stage


class ProcessHandle(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class LocalProcesses:
    """Every stage a child process of the launcher, on this machine."""

    def start(self, stage: Stage[Any], index: int, cmd: list[str], env: dict[str, str]) -> ProcessHandle:
        return subprocess.Popen(cmd, env=env)

    def close(self) -> None:
        pass


def processes_for(config: EngineConfig) -> LocalProcesses:
    """The process placement `config` asks for."""
    return LocalProcesses()
