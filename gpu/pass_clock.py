"""PassClock: how long the device computed one forward pass, and how long it sat idle before it.

The GPU bubble is the device's idle time while work exists. With asynchronous scheduling,
multi-step windows and CUDA graphs the host runs ahead of the device, so host timestamps say
little about the device. On CUDA both figures therefore come from events on the compute stream:
busy = start -> end of the pass's kernels, idle = end of the previous pass -> start of this one
(the device waiting for the host to launch it). After an idle spell (nothing to run, so no
bubble) idle counts from the plan's arrival instead. On a CPU the device is the host: the same
points are read from the host clock, and idle is the host work between passes.

Read a clock only once its pass's results were copied back (the events have completed).
"""

from __future__ import annotations

import time

import torch


class PassClock:
    def __init__(self, device: torch.device, idle_since: PassClock | Mark | None) -> None:
        self.cuda = device.type == "cuda"
        self.idle_since = idle_since  # the previous pass, or the plan's arrival
        self.start = Mark(self.cuda)
        self.end: Mark | None = None

    def stop(self) -> None:
        self.end = Mark(self.cuda)

    def busy(self) -> float:
        assert self.end is not None, "the pass has not ended"
        return self.start.seconds_until(self.end)

    def idle(self) -> float:
        since = self.idle_since
        if since is None:
            return 0.0
        mark = since.end if isinstance(since, PassClock) else since
        return 0.0 if mark is None else max(0.0, mark.seconds_until(self.start))


class Mark:
    """A point on the device's timeline: a CUDA event on the current stream, or the host clock."""

    def __init__(self, cuda: bool) -> None:
        if cuda:
            self.event: torch.cuda.Event | None = torch.cuda.Event(enable_timing=True)
            self.event.record()
            self.at = 0.0
        else:
            self.event = None
            self.at = time.perf_counter()

    def seconds_until(self, later: Mark) -> float:
        if self.event is not None and later.event is not None:
            later.event.synchronize()
            return self.event.elapsed_time(later.event) / 1000
        return later.at - self.at
