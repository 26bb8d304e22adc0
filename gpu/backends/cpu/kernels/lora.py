"""The ctypes face of lora.cpp: a projection's batched LoRA update (Ops.lora_add) for float32 CPU
tensors, in one call.

`CpuLora.supports` says whether a call's tensors can go to C (float32 on the CPU, each matrix's
last dimension contiguous and B's output dimension, as the default Ops.lora_b stores it; slots
contiguous int64); the cpu ops fall back to torch's path (gpu/backends/ops.py) otherwise.
`cpu_lora()` is None where the library cannot be had (build.load_library). Slots are not checked
against the stacks' S: the worker writes them (gpu/lora/slots.py), as for the Triton kernels.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.program import Kernel

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and (t.shape[-1] <= 1 or t.stride(-1) == 1) for t in tensors)


def _b_ok(b: torch.Tensor) -> bool:
    return b.dtype == torch.float32 and b.device.type == "cpu" and b.stride(1) == 1  # [S, out, R] stored [S, R, out]


class CpuLora:
    def __init__(self, lib: ctypes.CDLL) -> None:
        args = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64]
        self._add = Kernel(lib, "conveyor_lora_add_f32", args)

    @staticmethod
    def supports(slots: torch.Tensor, *matrices: torch.Tensor, b: torch.Tensor) -> bool:
        """matrices: last dimension contiguous; b: its output dimension."""
        slots_ok = slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.is_contiguous()
        return slots_ok and _rows_ok(*matrices) and _b_ok(b)

    def add(
        self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """y [T, out] += scales[s] * x[t] @ a[s]^T @ b[s]^T for s = slots[t] >= 0, in place; returns y."""
        num_tokens, fan_out = y.shape
        a_args = (a.data_ptr(), a.stride(0), a.stride(1))
        b_args = (b.data_ptr(), b.stride(0), b.stride(2), scales.data_ptr(), slots.data_ptr())
        self._add(x.data_ptr(), x.stride(0), *a_args, y.data_ptr(), y.stride(0), *b_args, num_tokens, x.shape[1], fan_out, a.shape[1])
        return y


@functools.cache
def cpu_lora() -> CpuLora | None:
    lib = load_library("lora")
    return None if lib is None else CpuLora(lib)
