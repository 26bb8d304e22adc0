"""Stored responses: what `previous_response_id`, GET and cancel find, bounded in size and age.

A `StoredResponse` is a Response object (updated in place while a background one runs), the
conversation it answered (its previous response's conversation and output, then its own input;
never the instructions, which OpenAI does not carry over), and the task of a background one.
`ResponseStore` keeps at most `max_size` of them, dropping the least recently used (a lookup
counts as a use), and forgets one `ttl_s` seconds after it was stored, on the clock it is given
(time.monotonic by default; tests inject their own). One store per ingress process: with several
(--ingress-workers), a response is found only by the process that made it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    task: asyncio.Task | None = None  # a background response's generation, until it ends
    stored_at: float = 0.0

    @property
    def next_conversation(self) -> list[dict[str, Any]]:
        """What a response that names this one as previous continues from."""
        return self.conversation + self.response["output"]


class ResponseStore:
    def __init__(self, max_size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_size = max_size
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        entry.stored_at = self.clock()
        response_id = entry.response["id"]
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            _, evicted = self._entries.popitem(last=False)
            if evicted.task is not None:  # a running background response nobody can reach any more
                evicted.task.cancel()

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if self.clock() - entry.stored_at >= self.ttl_s:
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._entries.pop(response_id) is not None
