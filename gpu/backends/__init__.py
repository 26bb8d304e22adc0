"""Execution backends: the attention backend and ops the model runs on (interfaces: base.py).

    torch   the reference: plain torch, any device and dtype (torch/)
    cpu     the C++ kernels and oneDNN, float32 on a CPU (cpu/)
    triton  Triton kernels, CUDA (CPU tensors under TRITON_INTERPRET=1) (triton/)

`select(name, device, model_config)` builds one, once, at start-up. "auto" is triton on CUDA and
cpu on a CPU; where the cpu backend cannot run (no compiler, a non-float32 model) the torch
backend serves instead, with a warning. triton is imported only when it is selected, so the
torch and cpu backends run without it.
"""

from __future__ import annotations

import logging

# Not `import torch`: the torch/ subpackage, once imported, is this package's attribute `torch`.
import torch as _torch

from conveyor.config.engine import ATTENTION_BACKENDS as BACKEND_NAMES
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata, Backend, BackendUnavailable, Ops

log = logging.getLogger(__name__)


def select(name: str, device: _torch.device | str, model_config: ModelConfig) -> Backend:
    """The backend `name` (one of BACKEND_NAMES) for `model_config` on `device`."""
    device = _torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "triton":
        from conveyor.gpu.backends.triton.backend import triton_backend

        return triton_backend(model_config, device)
    if name == "cpu":
        from conveyor.gpu.backends.cpu import cpu_backend

        try:
            return cpu_backend(model_config, device)
        except BackendUnavailable as e:
            log.warning("the cpu backend cannot run here (%s): using the torch backend", e)
    elif name != "torch":
        raise ValueError(f"unknown backend {name!r}: one of {', '.join(BACKEND_NAMES)}")
    return torch_backend(model_config, device)


def torch_backend(model_config: ModelConfig, device: _torch.device | str) -> Backend:
    from conveyor.gpu.backends.torch import TorchAttention, TorchOps

    device = _torch.device(device)
    return Backend("torch", TorchAttention(model_config, device), TorchOps(), f"torch (reference paths on {device.type})")


__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "Backend", "BackendUnavailable", "Ops", "select", "torch_backend"]
