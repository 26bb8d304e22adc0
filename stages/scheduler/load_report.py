"""LoadReports: paces the EngineLoad messages a scheduler sends the router (data parallelism).

The router balances on them, so they must be fresh while the engine is busy and final when it goes
idle, yet not one per step: a report goes out when the load changed and LOAD_REPORT_INTERVAL_S
passed since the last one, or at once when the engine has nothing in flight (its queue may have
just emptied, and it may stay quiet for long). No zmq here: `send` is the caller's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from conveyor.wire.messages import EngineLoad

LOAD_REPORT_INTERVAL_S = 0.025


class LoadReports:
    def __init__(self, send: Callable[[EngineLoad], None], interval_s: float = LOAD_REPORT_INTERVAL_S):
        self._send = send
        self.interval_s = interval_s
        self._last: EngineLoad | None = None
        self._sent_at = float("-inf")  # time.monotonic() of the last report

    def offer(self, load: EngineLoad, *, idle: bool) -> bool:
        """Send `load` if it is news and due; whether it went out."""
        if load == self._last:
            return False
        now = time.monotonic()
        if not idle and now - self._sent_at < self.interval_s:
            return False
        self._send(load)
        self._last, self._sent_at = load, now
        return True
