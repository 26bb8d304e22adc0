"""EarlyAborts: aborts that overtook their request. An AbortRequest (from an ingress) and the
ScheduleRequest it names (from a tokenizer) travel different paths, so the abort may come first;
it is remembered for EARLY_ABORT_TTL_S, and the request is dropped when it arrives."""

from __future__ import annotations

import time

EARLY_ABORT_TTL_S = 60.0


class EarlyAborts:
    def __init__(self) -> None:
        self._since: dict[str, float] = {}  # request id -> time.monotonic() of its abort

    def remember(self, request_id: str) -> None:
        now = time.monotonic()
        self._since = {r: t for r, t in self._since.items() if now - t < EARLY_ABORT_TTL_S}
        self._since[request_id] = now

    def take(self, request_id: str) -> bool:
        """Whether `request_id` was aborted before it arrived (then forget the abort)."""
        return self._since.pop(request_id, None) is not None
