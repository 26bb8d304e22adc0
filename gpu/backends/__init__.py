"""Execution backends: the attention backend and ops the model runs on (interfaces: base.py).

    torch   the reference: plain torch, any device and dtype (torch/)
    cpu     the C++ kernels and oneDNN, float32 on a CPU (cpu/)
    triton  Triton kernels, CUDA (CPU tensors under TRITON_INTERPRET=1) (triton/)

`select(name, device, model_config, kv_dtype)` builds one, once, at start-up; kv_dtype is what
its KV cache stores (CacheConfig.kv_dtype: a torch dtype name; None, the model's). "auto" is triton on CUDA and
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
from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata, Backend, BackendUnavailable
from conveyor.gpu.backends.ops import Ops

log = logging.getLogger(__name__)


def select(name: str, device: _torch.device | str, model_config: ModelConfig, kv_dtype: str | None = None) -> Backend:
    """The backend `name` (one of BACKEND_NAMES) for `model_config` on `device`, its KV cache in
    `kv_dtype` (None: the model's dtype)."""
    device = _torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "triton":
        from conveyor.gpu.backends.triton.backend import triton_backend

        return triton_backend(model_config, device, kv_dtype)
    if name == "cpu":
        from conveyor.gpu.backends.cpu import cpu_backend

        try:
            return cpu_backend(model_config, device, kv_dtype)
        except BackendUnavailable as e:
            log.warning("the cpu backend cannot run here (%s): using the torch backend", e)
    elif name != "torch":
        raise ValueError(f"unknown backend {name!r}: one of {', '.join(BACKEND_NAMES)}")
    return torch_backend(model_config, device, kv_dtype)


def torch_backend(model_config: ModelConfig, device: _torch.device | str, kv_dtype: str | None = None) -> Backend:
    from conveyor.gpu.backends.torch import TorchAttention, TorchOps

    device = _torch.device(device)
    attn = TorchAttention(model_config, device, kv_dtype)
    return Backend("torch", attn, TorchOps(), f"torch (reference paths on {device.type})")


__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "Backend", "BackendUnavailable", "Ops", "select", "torch_backend"]
