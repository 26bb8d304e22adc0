"""RoutedRequests: the router's books on the requests it forwarded. Pure Python, no zmq.

- Which engine each request went to, so its AbortRequest follows it (an LRU of the last
  MAX_TRACKED ids: an abort for an id no longer here goes to every engine, each of which drops it
  or remembers it as an early abort).
- Aborts that overtook their request (the abort comes from the ingress, the request through a
  tokenizer): remembered for a while, and the request is dropped when it arrives.
- Per engine, the requests sent but not yet received, oldest first. A scheduler reads its socket in
  order and reports how many requests it has received (EngineLoad.num_received), so those past
  that count are still in transit; when the engine dies they will get no answer, and the router
  answers them with a 503 itself. (Those it received were admitted, and the ingress fails them on
  the launcher's word, or rejected with a 429.)
"""

from __future__ import annotations

import collections

from conveyor.stages.scheduler.early_aborts import EarlyAborts

MAX_TRACKED = 1 << 17  # request ids whose engine is remembered


class Sent:
    """The requests one engine was sent and has not reported received, oldest first."""

    def __init__(self) -> None:
        self.in_transit: collections.deque[tuple[str, int]] = collections.deque()  # (request id, ingress)
        self.num_sent = 0


class RoutedRequests:
    def __init__(self, num_engines: int, max_tracked: int = MAX_TRACKED):
        self.max_tracked = max_tracked
        self._engine_of: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._sent = [Sent() for _ in range(num_engines)]
        self._early_aborts = EarlyAborts()

    def sent(self, request_id: str, ingress: int, engine: int) -> None:
        self._engine_of[request_id] = engine
        if len(self._engine_of) > self.max_tracked:
            self._engine_of.popitem(last=False)
        sent = self._sent[engine]
        sent.in_transit.append((request_id, ingress))
        sent.num_sent += 1

    def received(self, engine: int, num_received: int) -> None:
        """The engine has received its first `num_received` requests."""
        sent = self._sent[engine]
        while sent.in_transit and sent.num_sent - len(sent.in_transit) < num_received:
            sent.in_transit.popleft()

    def engine_of(self, request_id: str) -> int | None:
        return self._engine_of.get(request_id)

    def abort_early(self, request_id: str) -> None:
        self._early_aborts.remember(request_id)

    def was_aborted(self, request_id: str) -> bool:
        """Whether `request_id` was aborted before it arrived (then forget the abort)."""
        return self._early_aborts.take(request_id)

    def engine_lost(self, engine: int) -> list[tuple[str, int]]:
        """The engine died: the (request id, ingress) it was sent and had not received. Its count
        starts again from 0 with the process that replaces it."""
        lost = list(self._sent[engine].in_transit)
        self._sent[engine] = Sent()
        return lost
