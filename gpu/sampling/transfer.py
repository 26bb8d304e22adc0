"""Host <-> device copies for the sampler: small per-step inputs go up without blocking, and a
step's results come down together behind one synchronisation."""

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
