"""The ctypes face of small_linear.cpp: y = x W^T (+ bias) from weights stored transposed.

`cpu_small_linear()` is None where the library cannot be had (see build.load_library); the
model's Linear layers then keep torch's GEMM. See gpu/models/llama.py (Linear) for where the
transposed storage comes from.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from conveyor.gpu.backends.cpu.kernels.build import load_library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

# Where the kernel was measured against torch's sgemm (commit 36d9906's message; the `fused`
# and `all` columns of `conveyor bench forward`): with up to 1024 input features it was faster
# at every row count tried, 1 to 2000 (at 256 rows, 14 against 21 ms for the tiny model's 29
# weights; at 2000 rows, 111 against 121 ms per prefill step), so it takes every step up to the
# largest token budget. With 2048 to 4096 input features sgemm won from about 64 rows, so wider
# layers stay with sgemm: each k step reads a 128-byte slice of a row N floats long, and
# without a packed panel layout that stride costs too much when K is large.
MAX_IN_FEATURES = 1024
MAX_ROWS = 4096


class CpuSmallLinear:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.conveyor_small_linear_f32
        self._fn.restype = None
        self._fn.argtypes = [_ptr] * 4 + [_i64] * 3
        self.max_rows = MAX_ROWS

    @staticmethod
    def supports_weight(weight_t: torch.Tensor) -> bool:
        """weight_t [K, N]: float32, contiguous, on the CPU, K <= MAX_IN_FEATURES, N a multiple
        of 16."""
        return (
            weight_t.dtype == torch.float32 and weight_t.device.type == "cpu" and weight_t.is_contiguous()
            and weight_t.dim() == 2 and weight_t.shape[0] <= MAX_IN_FEATURES and weight_t.shape[1] % 16 == 0
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] contiguous float32, weight_t [K, N] (supports_weight), bias [N] contiguous ->
        [M, N]."""
        rows, k = x.shape
        if weight_t.shape[0] != k or (bias is not None and bias.shape != (weight_t.shape[1],)):
            raise ValueError(f"small_linear: x {tuple(x.shape)}, weight_t {tuple(weight_t.shape)} do not match")
        tensors = (x,) if bias is None else (x, bias)
        if not self.supports_weight(weight_t) or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            raise ValueError("small_linear takes contiguous float32 CPU tensors and N a multiple of 16")
        y = torch.empty(rows, weight_t.shape[1], dtype=torch.float32)
        self._fn(
            x.data_ptr(), weight_t.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            rows, k, weight_t.shape[1],
        )  # fmt: skip
        return y


def pays_on_this_cpu() -> bool:
    """Whether the model should route linears here. The measurements above were taken on an
    AVX-512 CPU; on an AVX2-only Zen 3 (2 cores) the same kernel made a 200-row decode step of the
    tiny model 3.4x slower than torch's sgemm (553 against 163 ms, `conveyor bench forward
    --decode 200x300`), so there it stays unused."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@functools.cache
def cpu_small_linear() -> CpuSmallLinear | None:
    lib = load_library("small_linear")
    return None if lib is None else CpuSmallLinear(lib)
