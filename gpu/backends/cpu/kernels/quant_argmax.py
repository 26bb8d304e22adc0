"""The argmax of a quantized LM head's rows without their full product: QuantArgmax.

A greedy row that asks for nothing else (no logprobs, penalties, bias or grammar) needs only
argmax_n y[n], y = x W^T. quant_linear's int8 paths quantize x in INT8_PLANES = 3 int8 planes; one
plane is about a third of the arithmetic, and its result y1 is within a bound of the three-plane
y3 that one small product gives:

    |y3 - y1|[n] <= bound[n] = sum_b amax_b * table[n, b]

amax_b the largest |x| of x's block b (32 inputs, the kernel's block). Why: plane one's step is
d = amax_b / 127, so |x - x1| <= d / 2 per input; three planes leave |x - x3| <= d / 2^16; so
|x3 - x1| <= (d / 2)(1 + 2^-15), and |W (x3 - x1)|[n] <= (amax_b / 254)(1 + 2^-15) sum_{k in b}
|w[n, k]| summed over blocks. table's second part is the float rounding of both products: each
lane's terms are at most amax_b sum_{k in b} (cmax |scale| + |min|) a block (cmax: the largest
code, 16 for u4 and 256 for u8 counting the non-VNNI shift), each term sees fewer than 32
roundings, so both products lie within 2^-18 of that; table takes 2^-14.

So the three-plane argmax is among the candidates {n : y1[n] + bound[n] >= max(y1 - bound)}: on
SmolLM2's decode rows 1 at the median and 17 at most of 49152 (docs/benchmarks.md). Their union over
the rows is recomputed by the path the full product takes at M rows (three planes, or past the
int8 path's rows W decoded to floats against x itself, within the same bound of y1 since |x - x1|
<= d / 2): the same row count, so the same per-output sums, bit-identical to those outputs of the
full product (tests/kernels/test_cpu_quant_argmax.py). On the int8 path the union's rows are read
in place (CpuQuantLinear.subset); past it, from a copy of them. Each row's argmax over its own
candidates, the lowest id among equals as torch's argmax, is the full product's. (The copy, and
the dozen torch ops that found x's block maxima and buffers, took 0.3 ms of a one-row head's
1.2-1.4; quant_argmax.cpp now finds the maxima: docs/benchmarks/cpu-isa.md.)

A row whose x is not finite gets valid False (and id 0), as the sampler marks a row whose logits
are not. Steps of up to MAX_ROWS rows come here; others take the product.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.program import Kernel
from conveyor.gpu.backends.cpu.kernels.quant_linear import PATHS, CpuQuantLinear, QuantArgs, cpu_quant_linear
from conveyor.gpu.quant.weight import QuantizedWeight

BLOCK = 32  # inputs per x scale (quant_int8.h's kBlock)
PLANE_GAP = 1.0 + 2.0**-15  # |x3 - x1| <= (d / 2) * PLANE_GAP
ROUNDING = 2.0**-14  # of amax sum (cmax |scale| + |min|) over a block: the products' float rounding, with margin
CMAX = {"u4": 16.0, "u8": 256.0}
ROW_CANDIDATES = 256  # past this many a row (flat logits), the full product is cheaper
# Rows a call takes; past them the caller takes the product. One plane is a third of the int8
# path's arithmetic, so it stays ahead of the product past the int8 path's own rows (SmolLM2's
# head over real decode rows, native build on a Zen 5 EPYC, ops/bench/head_argmax.py, ms of
# product + argmax against this: 9 rows 3.21 / 2.16, 16 rows 4.27 / 3.62, 24 rows 5.75 / 5.45,
# 32 rows 6.86 / 7.59).
MAX_ROWS = 16
TABLE_ROWS = 4096  # rows of W decoded at a time to build the table (16 MB of float32 at K = 1024)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@dataclasses.dataclass(frozen=True)
class ArgmaxTable:
    """An LM head's prepared form for QuantArgmax: table [N, K / 32] float32 (module docstring),
    4 bytes per 32 weights: 3.5 MB for SmolLM2's head, 64 MB for a [128256, 4096] one."""

    table: torch.Tensor
    widest: torch.Tensor  # [K / 32]: each block's largest entry of the table


class QuantArgmax:
    """argmax over outputs of x W^T: one plane, the bound, the candidates in three planes.
    `kernel` multiplies, `lib` (quant_argmax.cpp) finds the candidates and picks among them."""

    def __init__(self, kernel: CpuQuantLinear, lib: ctypes.CDLL) -> None:
        self.kernel = kernel
        # The candidates' count steers the host, so a recording refuses both (program.py).
        candidates_args = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr]
        self._candidates = Kernel(lib, "conveyor_argmax_candidates", candidates_args, _i64, replayable=False)
        self._pick = Kernel(lib, "conveyor_argmax_pick", [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr], replayable=False)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _scratch(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The candidates' buffers for m rows, made once: cols [m, ROW_CANDIDATES] int32, counts [m]
        int64, union [m * ROW_CANDIDATES] int32. A worker runs one step at a time, and nothing
        returned points into them."""
        buffers = self._buffers.get(m)
        if buffers is None:
            buffers = self._buffers[m] = (
                torch.empty(m, ROW_CANDIDATES, dtype=torch.int32),
                torch.empty(m, dtype=torch.int64),
                torch.empty(m * ROW_CANDIDATES, dtype=torch.int32),
            )
        return buffers

    def supports(self, weight: QuantizedWeight) -> bool:
        prepared = weight.prepared
        return (
            isinstance(prepared, QuantArgs)
            and prepared.int8
            and prepared.perm is None
            and self.kernel.int8_path != PATHS["int8"]  # one plane already: nothing to gain
            and weight.shape[1] % BLOCK == 0
        )

    @staticmethod
    def table(weight: QuantizedWeight) -> ArgmaxTable:
        """weight (supports) -> its bound table, built once (40 ms for SmolLM2's head)."""
        n, k = weight.shape
        parts = []
        for r0 in range(0, n, TABLE_ROWS):
            rows = torch.arange(r0, min(n, r0 + TABLE_ROWS))
            w_abs = weight.dequantize(rows=rows).abs_().view(len(rows), k // BLOCK, BLOCK).sum(-1)  # [R, K / 32]
            terms = weight.scales[rows].float().abs() * CMAX[weight.kind]  # [R, K / G]: a term's largest factor
            if weight.mins is not None:
                terms += weight.mins[rows].float().abs()
            terms = terms.repeat_interleave(weight.group_size, dim=1).view(len(rows), k // BLOCK, BLOCK).sum(-1)  # groups of 16 too
            parts.append(w_abs * (PLANE_GAP / 254.0) + terms * ROUNDING)
        table = torch.cat(parts)
        return ArgmaxTable(table, table.amax(0))

    def __call__(self, x: torch.Tensor, weight: QuantizedWeight, table: ArgmaxTable) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [M, K] float32 contiguous, weight (supports) [N, K] -> (ids [M] int64, valid [M] bool):
        each row's argmax of x W^T as the full product gives it; None where M is past the int8
        paths (the caller takes the product)."""
        m, k = x.shape
        if m > MAX_ROWS:
            return None
        n = weight.shape[0]
        y1 = self.kernel(x, weight, path="int8")  # [M, N], one plane
        valid = torch.empty(m, dtype=torch.bool)  # x's rows finite: the others' logits are not either
        cols, counts, union = self._scratch(m)
        size = self._candidates(
            y1.data_ptr(), x.data_ptr(), m, n, table.table.data_ptr(), table.widest.data_ptr(), k // BLOCK,
            valid.data_ptr(), cols.data_ptr(), counts.data_ptr(), ROW_CANDIDATES, union.data_ptr(),
        )  # fmt: skip
        if size < 0:  # a row with too many: its logits are too flat for the bound to pay
            best, ids = self.kernel(x, weight).max(dim=-1)  # as the sampler's greedy rows
            finite = best.isfinite()
            return ids.masked_fill_(~finite, 0), finite
        ids = torch.zeros(m, dtype=torch.int64)
        if size == 0:  # no valid row
            return ids, valid
        y3 = self.kernel.subset(x, weight, union[:size])  # [M, U]: the int8 path, in place
        if y3 is None:  # past the int8 path's rows: the path the full product takes, on a copy
            rows, mins = union[:size].long(), weight.mins
            sub = dataclasses.replace(
                weight,
                qweight=weight.qweight.index_select(0, rows),
                scales=weight.scales.index_select(0, rows),
                mins=None if mins is None else mins.index_select(0, rows),
                prepared=None,
            )
            y3 = self.kernel(x, sub)
        self._pick(
            y3.data_ptr(), m, size, union.data_ptr(), cols.data_ptr(), counts.data_ptr(), ROW_CANDIDATES,
            valid.data_ptr(), ids.data_ptr(),
        )  # fmt: skip
        return ids, valid


@functools.cache
def cpu_quant_argmax() -> QuantArgmax | None:
    kernel, lib = cpu_quant_linear(), load_library("quant_argmax")
    return None if kernel is None or lib is None else QuantArgmax(kernel, lib)
