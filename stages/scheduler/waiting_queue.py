"""WaitingQueue: sequences not running, in scheduling order, with the counts admission control
reads. Ordered by (priority, arrival, id): first come first served unless priorities differ, and
a preempted sequence (an old arrival) goes back near the front. A heap with lazy removal: an
aborted sequence stays in the heap, marked finished, until it reaches the top.
"""

from __future__ import annotations

import heapq

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.sequence import SeqStatus, Sequence


class QueueFull(Exception):
    """The waiting queue is at its bound: the request is refused (HTTP 429)."""


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Sequence]] = []
        self.num_seqs = 0
        self.num_tokens = 0  # known tokens of the waiting sequences (their prompts, mostly)
        self.num_preempted = 0  # waiting sequences that had been running

    def __len__(self) -> int:
        return self.num_seqs

    def __bool__(self) -> bool:
        return self.num_seqs > 0

    def check_room(self, num_tokens: int, config: SchedulerConfig) -> None:
        """Raise QueueFull unless a request of `num_tokens` prompt tokens fits the queue bounds."""
        if config.max_queued_requests is not None and self.num_seqs >= config.max_queued_requests:
            raise QueueFull(f"{self.num_seqs} requests are waiting (--max-queued-requests)")
        if config.max_queued_tokens is not None and self.num_tokens + num_tokens > config.max_queued_tokens:
            raise QueueFull(f"{self.num_tokens} prompt tokens are waiting (--max-queued-tokens)")

    def push(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._heap, (seq.sort_key, seq))
        self.num_seqs += 1
        self.num_tokens += seq.num_tokens
        self.num_preempted += seq.num_preemptions > 0

    def peek(self) -> Sequence | None:
        heap = self._heap
        while heap and heap[0][1].status is not SeqStatus.WAITING:
            heapq.heappop(heap)  # aborted while waiting
        return heap[0][1] if heap else None

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        self.remove(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Forget a sequence leaving the queue: popped, or about to change status (lazy removal:
        an aborted one stays in the heap until it reaches the top)."""
        self.num_seqs -= 1
        self.num_tokens -= seq.num_tokens
        self.num_preempted -= seq.num_preemptions > 0
