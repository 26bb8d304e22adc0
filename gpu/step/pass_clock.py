"""PassClock: how long the device computed one forward pass, and how long it sat idle before it.

The GPU bubble is the device's idle time while work exists. With asynchronous scheduling,
multi-step windows and CUDA graphs the host runs ahead of the device, so host timestamps say
little about the device. The clock therefore reads points on the device's own timeline, made by
its platform (gpu/step/platform.py): CUDA events on the compute stream, the emulated device's virtual
events (gpu/emulated/stream.py), or, on a CPU, where the device is the host, the host clock.
busy = start -> end of the pass, idle = end of the previous pass -> start of this one (the device
waiting for the host to launch it). After an idle spell (nothing to run, so no bubble) idle
counts from the plan's arrival instead.

Read a clock only once its pass's results were copied back (the events have completed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch


class Mark(Protocol):
    """A point on the device's timeline."""

    def seconds_until(self, later: Mark) -> float: ...


class PassClock:
    def __init__(self, mark: Callable[[], Mark], idle_since: PassClock | Mark | None) -> None:
        self.mark = mark
        self.idle_since = idle_since  # the previous pass, or the plan's arrival
        self.start = mark()
        self.end: Mark | None = None

    def stop(self) -> None:
        self.end = self.mark()

    def busy(self) -> float:
        assert self.end is not None, "the pass has not ended"
        return self.start.seconds_until(self.end)

    def idle(self) -> float:
        since = self.idle_since
        if since is None:
            return 0.0
        mark = since.end if isinstance(since, PassClock) else since
        return 0.0 if mark is None else max(0.0, mark.seconds_until(self.start))


class HostMark:
    """The host clock: the device's timeline where the device is the host (a CPU)."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def seconds_until(self, later: Mark) -> float:
        assert isinstance(later, HostMark)
        return later.at - self.at


class EventMark:
    """A CUDA event recorded on the current stream."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def seconds_until(self, later: Mark) -> float:
        assert isinstance(later, EventMark)
        later.event.synchronize()
        return self.event.elapsed_time(later.event) / 1000
