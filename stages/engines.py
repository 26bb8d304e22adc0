"""The launcher's books on its engines: which are ready, which wait for a restart, what to say.

An engine is a scheduler and its worker ranks (wire/topology.engine_of names a process's engine;
with one engine its detokenizers too). The launcher (stages/launcher.py) starts and stops the
processes; this class decides, per engine, when it is ready, when it failed and when its restart
is due (a backoff that doubles per failure in the window), and words the EngineStatus the
ingresses and the router get.

With one engine the words are today's: EngineStatus without an engine index (the whole daemon).
With several, each names its engine: a failed engine's in-flight requests fail and the router
stops sending it any, while the others keep serving; its processes alone are restarted.
"""

from __future__ import annotations

import dataclasses
import time

from conveyor.wire.messages import EngineStatus

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


@dataclasses.dataclass
class EngineState:
    ready: bool = False
    restart_at: float | None = None  # time.monotonic() its restart is due; None: not waiting
    failed_before: bool = False  # its processes have been restarted at least once


class Engines:
    def __init__(self, num_engines: int):
        self.states = [EngineState() for _ in range(num_engines)]
        self.draining = False

    @property
    def num_engines(self) -> int:
        return len(self.states)

    @property
    def any_ready(self) -> bool:
        return any(s.ready for s in self.states)

    def status(self, engine: int) -> EngineStatus:
        """What the ingresses and the router are told about `engine` now."""
        ready = self.states[engine].ready
        if self.num_engines == 1:
            return EngineStatus(ready=ready, draining=self.draining)
        return EngineStatus(ready=ready, draining=self.draining, engine=engine)

    def statuses(self) -> list[EngineStatus]:
        """The whole picture, for a process that (re)starts, or for a drain that begins."""
        return [self.status(e) for e in range(self.num_engines)]

    def all_started(self) -> EngineStatus:
        """Every engine came up at start-up: one word for all of them."""
        for state in self.states:
            state.ready = True
        return EngineStatus(ready=True, draining=self.draining)

    def failed(self, engine: int, num_recent_failures: int) -> float:
        """`engine` failed (its processes are being stopped); its restart is due after the
        returned backoff, which doubles with each failure in the window."""
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (num_recent_failures - 1))
        state = self.states[engine]
        state.ready, state.failed_before = False, True
        state.restart_at = time.monotonic() + backoff
        return backoff

    def stopped(self, engine: int) -> EngineStatus:
        """`engine` died during the drain: not restarted; what the ingresses and router are told."""
        state = self.states[engine]
        state.ready, state.restart_at = False, None
        return self.status(engine)

    def due(self) -> list[int]:
        """Engines whose restart is due now (each is returned once)."""
        now = time.monotonic()
        due = [e for e, s in enumerate(self.states) if s.restart_at is not None and now >= s.restart_at]
        for e in due:
            self.states[e].restart_at = None
        return due

    def may_come_back(self, engine: int) -> bool:
        """Whether `engine` is a restarted one not yet back (its processes' readiness decides)."""
        state = self.states[engine]
        return not state.ready and state.restart_at is None and state.failed_before

    def back(self, engine: int) -> EngineStatus:
        self.states[engine].ready = True
        return self.status(engine)
