"""The ctypes face of quant_linear.cpp: y = x W^T (+ bias), W a QuantizedWeight read packed.

`cpu_quant_linear()` is None where the library cannot be had (see build.load_library); the cpu
ops then keep the reference (dequantize + F.linear). `supports(weight)` says which weights the
kernel takes: on the CPU, kinds u4 (groups a multiple of 32), u8 and e4m3 (a multiple of 16),
codes, scales and mins contiguous, scales and mins float32 or both float16
(QuantizedWeight.compact). A GPTQ act-order `perm` gathers x's columns here, so the kernel's
groups stay contiguous. `prepare(weight)` is the weight's `prepared` form: its pointers and sizes
as the C call takes them, read once instead of on every call (a decode step of SmolLM2 makes 121
of these calls, q/k/v and gate/up stacked by the cpu ops). Which of the kernel's paths a call
takes is decided here, by its row count, the build's byte products and their width
(`int8_max_rows`) and whether oneDNN's GEMM takes bfloat16 inputs (DEQUANTIZE_MIN_ROWS,
DEQUANTIZE_MIN_ROWS_BF16).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from conveyor.gpu.backends.cpu.kernels import onednn_linear as onednn
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.program import Kernel
from conveyor.gpu.quant.weight import QuantizedWeight

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

KIND_CODES = {"u4": 0, "u8": 1, "e4m3": 2}  # quant_linear.cpp's enum Kind
GROUP_MULTIPLE = {"u4": 32, "u8": 16, "e4m3": 16}  # the decoders' chunk of inputs
# The paths (quant_linear.cpp): direct decodes W to float in registers; int8, int8x2, int8x3
# quantize x to 1, 2 or 3 int8 planes (each the remainder of the ones before, at 1/128 of their
# step: 8, 15 or 22 bits per block of 32) and multiply the codes as bytes; dequantize decodes a
# slice of W at a time into a float scratch for torch's GEMM. Values: the C enum Path.
PATHS = {"direct": 0, "int8": 2, "int8x2": 3, "int8x3": 4, "dequantize": -1}
_DIRECT, _DEQUANTIZE = PATHS["direct"], PATHS["dequantize"]
MAX_ROWS = 4096  # a step's rows: the cpu backend's largest token budget
# Where the paths cross. On a 2-core AVX-512 Xeon (gate 1536 x 576 u4, us): 16 rows int8x3 424,
# direct 425, dequantize (MKL) 478; 32 rows 917, 851, 641. On a 2-core AMD EPYC (Zen 5), a layer's
# four products (q/k/v 960, o 576, gate/up 3072 x 576, down 576 x 1536; u4), ms, int8x3 / direct
# (/ dequantize, its GEMM oneDNN's), medians of 5 interleaved rounds (ops/bench/quant_paths.py):
#   rows                 1            2            8            12           16           32
#   native (VNNI, zmm)   0.06 / 0.08  0.09 / 0.11  0.26 / 0.26  0.39 / 0.30  0.51 / 0.38  1.16 / 0.71 / 0.87
#   x86-64-v3-vnni       0.08 / 0.12  0.12 / 0.15  0.39 / 0.39  0.60 / 0.55  0.79 / 0.70  1.56 / 1.30 / 0.86
#   x86-64-v3 (AVX2)     0.09 / 0.12  0.16 / 0.15  0.54 / 0.39  0.79 / 0.55  1.03 / 0.70  2.04 / 1.28 / 0.88
#   x86-64-v4 (no VNNI)  0.07 / 0.08  0.10 / 0.10  0.35 / 0.29  0.53 / 0.32  0.71 / 0.41  1.47 / 0.68 / 0.85
# With a VNNI dot product the int8 path pays up to 8 rows; from 12 the direct path's decode-once
# (quant_linear.cpp `rows`) is ahead. Without one (a vpmaddubsw + vpmaddwd per plane), that table
# gave int8 one row only. It predates the u4 pair sums (quant_int8.h `dot_u4_pairs`); since them,
# on an Intel Emerald Rapids, int8x3 / direct (quant_paths.py x86-64-v3,x86-64-v4 1,2,3,4,5,6,8
# 25, two runs):
#   rows                 1     2          3          4          5          6          8
#   x86-64-v3 (ymm)      0.67  0.83-0.86  1.03-1.05  0.80       0.93-0.98  1.00-1.01  1.16
#   x86-64-v4 (zmm)      0.70  0.94-0.97  0.97-0.98  1.06-1.13  0.98-1.01  1.02-1.06  1.11-1.14
# The direct path's passes are kMB = 3 rows on AVX2, each decoding its block of W, so 4 and 5
# rows take two decodes where the int8 path takes one: AVX2 builds without VNNI take int8 to 5
# rows (3 rows lose 3-5%). AVX-512 builds without it keep one row: 2-3 rows gained 2-6%, too
# little to move a limit the AMD machine has not measured. There, before the pair sums (which
# took 7-20% off int8x3 here), x86-64-v3 at 2 rows was 0.16 / 0.15 ms and x86-64-v4 even.
# The limits by the int8 vectors' 32-bit lanes: INT8_MAX_ROWS_WITHOUT_VNNI.
# The dequantize path decodes all of W into a float scratch, then oneDNN's GEMM; in a layer's
# products alone, warm in the caches, it pays from 17 rows on AVX2 (oneDNN changes kernels past 16:
# x86-64-v3 24 rows 0.97 direct / 0.70 dequantize) and from about 112 with AVX-512. In served decode
# steps it pays later, and unevenly: the same step varies by up to 1.6x from one process to the
# next, and perf puts the slow processes' time on the decode's stores to the scratch (three times
# their share in a fast one; why, not yet known). Whole steps, context 128, ms, direct / dequantize
# (in one process, interleaved; AMD EPYC Zen 5): x86-64-v3 48 rows 92 / 147, 96 rows 173 / 214 (158
# once), 128 rows 217 / 200, 192 rows 324 / 283; native 48 rows 56.5 / 66.6 (process ABAB), 96 rows
# 98-102 / 101-160, 128 rows 131.5 / 132.8, 256 rows 275 / 241. So the kernel's paths take up to 96
# rows; every decode-graph bucket (up to 32, gpu/step/cuda_graphs.py) among them, so those steps
# record (a recording refuses the GEMM).
INT8_MAX_ROWS = 8  # with a VNNI dot product (`int8_max_rows`)
INT8_MAX_ROWS_WITHOUT_VNNI = {8: 5, 16: 1}  # by the int8 path's lanes, conveyor_quant_linear_int8_lanes
DEQUANTIZE_MIN_ROWS = 97
# Where oneDNN's GEMM takes bfloat16 inputs (--float32-matmul-precision medium on a CPU with AMX:
# onednn_linear.bfloat16_products), at about 4x float32's rate, the dequantize path pays from fewer
# rows. Whole served steps on an Intel Emerald Rapids guest, context 128, ms, dequantize / direct
# (ops/bench/dequantize_rows.py ROWS ROWS,1000 3 medium): 33 rows 129 / 124, 40 rows 97 / 120,
# 48 rows 121 / 167 and 139 / 204, 96 rows 174 / 246 (at highest, 48 rows: 186 / 168). Above 32,
# as the other: recorded steps never take the GEMM.
DEQUANTIZE_MIN_ROWS_BF16 = 40
# The float slice of W decoded at a time: 8 MB, SmolLM2's stacked gate/up (3072 x 576) whole. At
# 4 MB it took two slices, each product copied into a column range of the output: a 2048-token
# prefill step took 2207 ms against 1994 (medians of 5, interleaved; float32's own GEMM 1864).
SCRATCH_FLOATS = 1 << 21
# x's planes for the int8 paths. Against the dequantized reference (torch backend), greedy, 6
# prompts x 64 tokens of SmolLM2 Q4_1: one plane (llama.cpp's Q8_1 precision) changed the text
# within 5 to 40 tokens on 5 of the 6; two and three planes kept all of it, as they kept the tiny
# model's (tests/kernels/test_cpu_quant_linear.py). Three keep x to 22 bits per block, about
# float's own rounding, for a margin: a one-row step of SmolLM2 took 7.3 ms against 6.8 with two
# and 6.5 with one. The margin is needed: with two, a tiny GPTQ act-order model's greedy tokens
# left the dequantized float model's after 3 tokens on one prompt of four
# (tests/gpu/test_quant_awq_gptq.py), where three keep them all.
INT8_PLANES = 3


class _WeightArgs(ctypes.Structure):
    """quant_linear.cpp's WeightArgs."""

    _fields_ = [
        ("q", _ptr),
        ("scales", _ptr),
        ("mins", _ptr),
        ("K", _i64),
        ("N", _i64),
        ("G", _i64),
        ("kind", _i64),
        ("half_scales", _i64),
    ]


@dataclasses.dataclass(frozen=True)
class QuantArgs:
    """A QuantizedWeight's prepared form: its C arguments (kept alive here) and their address."""

    args: _WeightArgs
    address: int
    shape: tuple[int, int]
    perm: torch.Tensor | None
    int8: bool  # whether the int8 paths take its kind


class CpuQuantLinear:
    """planes: x's int8 planes on the int8 paths (1 to 3; INT8_PLANES). Not re-entrant: one
    scratch serves every call (a worker runs one step at a time)."""

    def __init__(self, lib: ctypes.CDLL, planes: int = INT8_PLANES) -> None:
        self._fn = Kernel(lib, "conveyor_quant_linear_f32", [_ptr, _ptr, _i64, _i64, _ptr, _ptr])
        self._dequantize = Kernel(lib, "conveyor_quant_dequantize_f32", [_ptr, _i64, _i64, _ptr])
        self._rows = Kernel(lib, "conveyor_quant_rows_f32", [_ptr, _ptr, _i64, _ptr])
        subset_args = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr]
        self._subset = Kernel(lib, "conveyor_quant_linear_subset_f32", subset_args, _i64, replayable=False)
        int8 = lib.conveyor_quant_linear_has_int8()  # 0: no int8 path; 1: by vpmaddubsw; 2: by VNNI
        self.has_int8 = int8 > 0
        lanes = lib.conveyor_quant_linear_int8_lanes()
        self.int8_max_rows = INT8_MAX_ROWS if int8 == 2 else INT8_MAX_ROWS_WITHOUT_VNNI.get(lanes, 1)
        self.int8_path = PATHS["int8"] + planes - 1
        self._scratch = torch.empty(0)

    @staticmethod
    def supports(weight: QuantizedWeight) -> bool:
        parts = [weight.qweight, weight.scales] + ([] if weight.mins is None else [weight.mins])
        return (
            weight.kind in KIND_CODES
            and weight.group_size % GROUP_MULTIPLE[weight.kind] == 0
            and all(t.device.type == "cpu" and t.is_contiguous() for t in parts)
            and weight.scales.dtype in (torch.float32, torch.float16)
            and (weight.mins is None or weight.mins.dtype == weight.scales.dtype)
        )

    def prepare(self, weight: QuantizedWeight) -> QuantArgs:
        """weight (supports) -> its prepared form; valid while its tensors live (QuantizedWeight.to
        makes new ones, with prepared None)."""
        n, k = weight.shape
        mins = None if weight.mins is None else weight.mins.data_ptr()
        half = int(weight.scales.dtype == torch.float16)
        args = _WeightArgs(
            weight.qweight.data_ptr(), weight.scales.data_ptr(), mins, k, n, weight.group_size, KIND_CODES[weight.kind], half
        )
        return QuantArgs(args, ctypes.addressof(args), (n, k), weight.perm, self.has_int8 and weight.kind != "e4m3")

    def __call__(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, path: str | None = None
    ) -> torch.Tensor:
        """x [M, K] float32 contiguous, weight (supports) [N, K], bias [N] float32 contiguous or
        None -> [M, N]. path: force one of PATHS (tests, benchmarks); None: by the row count.
        Lean on purpose: a decode step of SmolLM2 makes 121 of these calls."""
        prepared = weight.prepared
        if prepared.__class__ is not QuantArgs:
            prepared = self.prepare(weight)
        rows, k = x.shape
        n = prepared.shape[0]
        if k != prepared.shape[1] or (bias is not None and bias.shape[0] != n):
            raise ValueError(f"quant_linear: x {tuple(x.shape)}, weight {prepared.shape} do not match")
        if prepared.perm is not None:
            x = x.index_select(1, prepared.perm)
        if path is not None:
            code = PATHS[path]
        elif rows <= self.int8_max_rows and prepared.int8:
            code = self.int8_path
        else:
            many = rows >= DEQUANTIZE_MIN_ROWS or (rows >= DEQUANTIZE_MIN_ROWS_BF16 and onednn.bfloat16_products())
            code = _DEQUANTIZE if many else _DIRECT
        if code < 0:
            return self._gemm(x, prepared, bias)
        y = torch.empty(rows, n, dtype=torch.float32)
        self._fn(x.data_ptr(), y.data_ptr(), rows, code, None if bias is None else bias.data_ptr(), prepared.address)
        return y

    def subset(self, x: torch.Tensor, weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] float32 contiguous, weight (supports, no act-order perm), rows [U] int32
        contiguous in [0, N) (unchecked) -> [M, U]: those columns of the full product, each as
        __call__ computes it at M rows, read in place. None where M rows do not take an int8
        path (the caller multiplies a copy of the rows)."""
        prepared = weight.prepared if isinstance(weight.prepared, QuantArgs) else self.prepare(weight)
        m = x.shape[0]
        if m > self.int8_max_rows or not prepared.int8 or prepared.perm is not None:
            return None
        y = torch.empty(m, rows.shape[0], dtype=torch.float32)
        if self._subset(x.data_ptr(), y.data_ptr(), m, self.int8_path, rows.data_ptr(), rows.shape[0], prepared.address) < 0:
            return None
        return y

    def _gemm(self, x: torch.Tensor, prepared: QuantArgs, bias: torch.Tensor | None) -> torch.Tensor:
        """x against W decoded SCRATCH_FLOATS at a time (whole rows, at least one), by oneDNN's GEMM
        (onednn_linear.py) where it runs, torch's F.linear otherwise."""
        n, k = prepared.shape
        step = max(1, min(n, SCRATCH_FLOATS // k))
        if self._scratch.numel() < step * k:
            self._scratch = torch.empty(step * k)
        if step == n:
            w = self._scratch[: n * k].view(n, k)
            self._dequantize(w.data_ptr(), 0, n, prepared.address)
            return onednn.linear(x, w, bias)
        y = torch.empty(x.shape[0], n)
        for n0 in range(0, n, step):
            rows = min(step, n - n0)
            w = self._scratch[: rows * k].view(rows, k)
            self._dequantize(w.data_ptr(), n0, rows, prepared.address)
            y[:, n0 : n0 + rows] = onednn.linear(x, w, None if bias is None else bias[n0 : n0 + rows])
        return y

    def rows(self, ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """ids [T] int64, contiguous; weight (supports, no act-order perm) [N, K] -> its rows ids[t]
        as float32 [T, K], each what dequantize(rows=ids) gives (exactly without mins; with them
        but for the last bit: code * scale + min is rounded once, a fused multiply-add, where torch
        rounds twice): a quantized embedding table's lookup.
        An id outside [0, N) gives a row of zeros, never a read past the codes (unchecked here:
        that would be a torch op per call, which a recording refuses)."""
        prepared = weight.prepared if isinstance(weight.prepared, QuantArgs) else self.prepare(weight)
        if prepared.perm is not None or ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
            raise ValueError(f"quant rows: ids {ids.dtype} {tuple(ids.shape)} of a weight with perm {prepared.perm is not None}")
        out = torch.empty(ids.shape[0], prepared.shape[1], dtype=torch.float32)
        self._rows(out.data_ptr(), ids.data_ptr(), ids.shape[0], prepared.address)
        return out


@functools.cache
def cpu_quant_linear() -> CpuQuantLinear | None:
    lib = load_library("quant_linear")
    return None if lib is None else CpuQuantLinear(lib)
