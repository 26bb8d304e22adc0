"""Host <-> device copies for the sampler: small per-step inputs go up without blocking, and a
step's results come down together, either behind one synchronisation (`to_host`) or on a side
stream ordered by events (`HostCopy`), so the device goes on with the next step meanwhile."""

from __future__ import annotations

from typing import Any

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list / numpy array -> a tensor on `device`, copied from pinned memory on CUDA so
    that the copy does not block the host."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor | None) -> list[Any]:
    """Device tensors -> CPU tensors, waiting on the device once for all of them (None passes:
    each item is a tensor where the argument was one, which a list type cannot say)."""
    if all(t is None or t.device.type == "cpu" for t in tensors):
        return list(tensors)
    # non_blocking device-to-host copies land in pinned memory; one stream sync covers them all.
    host = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    device = next(t.device for t in tensors if t is not None)
    torch.cuda.current_stream(device).synchronize()
    return host


class HostCopy:
    """Device tensors -> host tensors without stalling the device. On CUDA the copies run on a
    side stream that first waits for an event recorded on the compute stream after the tensors
    were produced, into pinned memory, and record `done`; the compute stream goes on at once
    with the next step. `ready()` asks without blocking, `wait()` blocks until the copies landed.
    On a CPU the tensors already are on the host. None passes through."""

    _streams: dict[torch.device, torch.cuda.Stream] = {}

    def __init__(self, tensors: list[torch.Tensor | None]) -> None:
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        self.done: torch.cuda.Event | None = None
        if device.type != "cuda":
            self.host: list[Any] = list(tensors)
            return
        produced = torch.cuda.Event()
        produced.record()  # on the compute stream: after the tensors' kernels
        stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        with torch.cuda.stream(stream):
            stream.wait_event(produced)
            self.host = []
            for t in tensors:
                if t is None:
                    self.host.append(None)
                    continue
                t.record_stream(stream)  # the allocator must not reuse t until the copy ran
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out.copy_(t, non_blocking=True)
                self.host.append(out)
            self.done = torch.cuda.Event()
            self.done.record(stream)

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def seconds_left(self) -> float | None:
        """0.0 once the copies landed; None before (an event cannot say when it will complete)."""
        return 0.0 if self.ready() else None

    def wait(self) -> list[Any]:
        if self.done is not None:
            self.done.synchronize()
        return self.host
