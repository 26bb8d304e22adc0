"""The ctypes face of fused_ops.cpp: RMSNorm (+ residual), rotary embedding, SiLU * up.

Each method takes what its torch counterpart in gpu/models/llama.py or gpu/models/rope.py takes and
returns the same thing; `supports(t)` says whether a tensor can go to C (float32, contiguous, on
the CPU). `cpu_fused_ops()` is None where the library cannot be had (see build.load_library).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.program import Kernel

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def supports(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


class CpuFusedOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norm = Kernel(lib, "conveyor_rms_norm_f32", [_ptr] * 4 + [_i64] * 2 + [_f32])
        self._rotary = Kernel(lib, "conveyor_rotary_f32", [_ptr] * 4 + [_i64] * 4)
        self._silu_mul = Kernel(lib, "conveyor_silu_mul_f32", [_ptr] * 2 + [_i64])
        self._copy_columns = Kernel(lib, "conveyor_copy_columns_f32", [_ptr, _i64, _ptr, _i64, _i64])
        self._embedding = Kernel(lib, "conveyor_embedding_f32", [_ptr, _ptr, _ptr, _i64, _i64, _i64])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], weight [H] -> [T, H]. With residual [T, H]: residual += x in place, and the
        norm is of that sum."""
        tokens, hidden = x.shape
        if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
            raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match")
        out = torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            tokens,
            hidden,
            eps,
        )
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """q [T, Hq, D], k [T, Hkv, D] rotated in place; positions [T] int64 (each below the
        table's P); cos_sin [P, D]."""
        tokens, num_heads, head_dim = q.shape
        if k.shape[0] != tokens or k.shape[2] != head_dim or cos_sin.shape[1] != head_dim or head_dim % 2:
            raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, table {tuple(cos_sin.shape)}")
        if positions.dtype != torch.int64 or positions.shape != (tokens,) or not positions.is_contiguous():
            raise ValueError("rotary: positions must be a contiguous int64 [T] tensor")
        self._rotary(q.data_ptr(), k.data_ptr(), positions.data_ptr(), cos_sin.data_ptr(), tokens, num_heads, k.shape[1], head_dim)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate = silu(gate) * up, in place; returns gate."""
        if gate.shape != up.shape:
            raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        self._silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel())
        return gate

    def columns(self, y: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """y [T, N] float32, contiguous -> its columns [start, end) as a new contiguous [T, end - start]."""
        rows, width = y.shape
        if not 0 <= start <= end <= width:
            raise ValueError(f"columns [{start}, {end}) of a [{rows}, {width}] product")
        out = torch.empty(rows, end - start, dtype=y.dtype)
        self._copy_columns(y.data_ptr() + 4 * start, width, out.data_ptr(), rows, end - start)
        return out

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """ids [T] int64, contiguous; table [V, H] (supports) -> rows ids[t] of table, [T, H]. An id
        outside [0, V) gives a row of zeros (torch's F.embedding raises): the kernel never reads
        past the table, and checking here would be a torch op per call, which a recording refuses."""
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous() or table.dim() != 2:
            raise ValueError(f"embedding: ids {ids.dtype} {tuple(ids.shape)}, table {tuple(table.shape)}")
        (tokens,), (rows, hidden) = ids.shape, table.shape
        out = torch.empty(tokens, hidden, dtype=table.dtype)
        self._embedding(table.data_ptr(), ids.data_ptr(), out.data_ptr(), tokens, hidden, rows)
        return out


@functools.cache
def cpu_fused_ops() -> CpuFusedOps | None:
    lib = load_library("fused_ops")
    return None if lib is None else CpuFusedOps(lib)
