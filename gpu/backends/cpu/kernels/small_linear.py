"""The ctypes face of small_linear.cpp: y = x W^T (+ bias) from weights stored transposed.

`cpu_small_linear()` is None where the library cannot be had (see build.load_library); the
model's Linear layers then keep torch's GEMM. See gpu/backends/cpu/ops.py (`prepare`) for where
the transposed storage comes from.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.program import Kernel

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
# On an AVX2-only Zen 3 (2 cores), once the kernel's vectors matched the registers (8 lanes),
# against sgemm for one SmolLM2 layer's six narrow projections (median of 15 calls): 1 row 0.28
# against 0.28 ms, 8 rows 0.46 against 1.18, 32 rows 1.27 against 2.07, 128 rows 4.58 against
# 4.73, 160 rows 5.66 against 5.62: it takes steps up to 128 rows there, sgemm the rest; and
# oneDNN's packed weights lost to sgemm on 2048-row steps (7.9 against 7.2 ms for 576 x 576), so
# AVX2 keeps no packed copy.
AVX2_MAX_ROWS = 128
# The weights small_linear does not take (wider than MAX_IN_FEATURES, or a tied LM head, whose
# [out, in] layout the embedding needs) in steps of at most this many rows go to the row kernel
# (conveyor_row_linear_f32, the weight as stored), oneDNN's GEMM past it (onednn_linear.py's
# ONEDNN_MIN_ROWS, 17). Before it those products were torch's at decode, which a recording
# refuses: a one-row step of SmolLM2 float32 (down_proj 1536 inputs, the tied head) took 26.9-27.4
# ms, its head 7.4 (15 GB/s); with it 12.8-13.2, the head 1.8-1.9, and the step records (AMD EPYC
# Zen 5, interleaved). Cold, ms, [49152, 576] at 1 / 4 / 16 rows: this kernel 2.35 / 3.07 / 6.30,
# torch 7.21 / 12.98 / 15.46, oneDNN 2.45 / 4.94 / 6.02; [576, 1536]: 0.085 / 0.121 / 0.203 against
# torch 0.199 / 0.291 / 0.411 and oneDNN 0.181 / 0.201 / 0.216.
ROW_MAX_ROWS = 16


class CpuSmallLinear:
    """`max_rows`: steps of more rows go to torch's sgemm; `packs`: whether oneDNN's packed
    weights serve the steps they suit (measured to pay only with AVX-512)."""

    def __init__(self, lib: ctypes.CDLL, max_rows: int = MAX_ROWS, packs: bool = True) -> None:
        self._fn = Kernel(lib, "conveyor_small_linear_f32", [_ptr] * 4 + [_i64] * 3)
        self._rows = Kernel(lib, "conveyor_row_linear_f32", [_ptr] * 4 + [_i64] * 3)
        self.max_rows = max_rows
        self.packs = packs

    @staticmethod
    def supports_weight(weight_t: torch.Tensor) -> bool:
        """weight_t [K, N]: float32, contiguous, on the CPU, K <= MAX_IN_FEATURES, N a multiple
        of 16."""
        return (
            weight_t.dtype == torch.float32
            and weight_t.device.type == "cpu"
            and weight_t.is_contiguous()
            and weight_t.dim() == 2
            and weight_t.shape[0] <= MAX_IN_FEATURES
            and weight_t.shape[1] % 16 == 0
        )

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
            x.data_ptr(),
            weight_t.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            k,
            weight_t.shape[1],
        )
        return y

    @staticmethod
    def takes_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether `rows` takes x [M, K] against weight [N, K] as stored: float32, contiguous, on
        the CPU, M at most ROW_MAX_ROWS, K a multiple of 16."""
        tensors = (x, weight) if bias is None else (x, weight, bias)
        return (
            x.dim() == 2
            and weight.dim() == 2
            and 0 < x.shape[0] <= ROW_MAX_ROWS
            and x.shape[1] == weight.shape[1]
            and weight.shape[1] % 16 == 0
            and (bias is None or bias.shape == (weight.shape[0],))
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        )

    def rows(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K], weight [N, K] as stored, bias [N] (takes_rows) -> x weight^T + bias [M, N]."""
        if not self.takes_rows(x, weight, bias):
            raise ValueError(f"row_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}: see takes_rows")
        rows, k = x.shape
        y = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        self._rows(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), rows, k, weight.shape[0])
        return y


def pays_on_this_cpu() -> bool:
    """Whether the model should route linears here: with AVX-512 (measured above) or AVX2 (up to
    AVX2_MAX_ROWS rows). Before its vectors followed the target's width, the kernel made a 200-row
    decode step of the tiny model 3.4x slower than sgemm on AVX2 and was kept off there."""
    return _capability() in ("avx512", "avx2")


def _capability() -> str:
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return "avx512" if capability.startswith("avx512") else capability


@functools.cache
def cpu_small_linear() -> CpuSmallLinear | None:
    lib = load_library("small_linear")
    if lib is None:
        return None
    if _capability() == "avx512":
        return CpuSmallLinear(lib)
    return CpuSmallLinear(lib, max_rows=AVX2_MAX_ROWS, packs=False)
