"""oneDNN's float32 products, for linear layers in steps of many rows (prefill, wide batches).

Not our C++: torch ships oneDNN, and its matmul (`torch.ops.mkldnn._linear_pointwise`, the op
torch.compile's CPU backend lowers linears to) beats torch's own sgemm (MKL) on every CPU
measured, by 2.2x on an AMD EPYC, where MKL takes its AVX2 path. Two forms:
- `linear`: on the weight as stored, no copy: every float32 product of `ONEDNN_MIN_ROWS` rows or
  more that no kernel of ours takes (wide layers, a tied LM head, a quantized weight's decoded
  slices in quant_linear.py);
- `packed_linear`: on a copy reordered once into oneDNN's blocked layout
  (`pack_linear_weight`), for the narrow layers small_linear.cpp takes, in steps where
  `use_packed(rows)` (from 512 rows; x padded with zero rows to a multiple of 64); other steps
  keep small_linear.

Invariants: the packed copy is opaque (only `packed_linear` reads it) and a second copy of the
weight, made only for narrow layers; where `onednn_available()` is False (torch built without
oneDNN, a version that renamed these private ops, or a wrong answer on a probe) every product is
torch's F.linear; the results equal F.linear's up to float32 reassociation, both at the
process's float32 matmul precision (--float32-matmul-precision medium lets oneDNN, F.linear's
too, round their inputs to bfloat16 on a CPU with AMX; small_linear.cpp's products stay float32).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from conveyor.config import env
from conveyor.gpu.backends.cpu.kernels import isa

# On this 2-core AVX-512 machine, a 10 x 200 prefill step of the tiny model took 94.9 ms with
# small_linear and 82.8 ms with the packed weights from 512 rows on (medians of 20 interleaved
# steps, one process). At 256 rows the two kernels were even, and below that small_linear wins
# (a one-row layer: 0.06 against 0.12 ms), so steps of fewer rows keep it.
PACKED_MIN_ROWS = 512  # steps with at least this many rows use the packed weight
# oneDNN builds a primitive per input shape, and building one cost about 0.5 ms per layer here (a
# 1000-row call: 3.85 ms on a shape seen before, 4.4 ms on a new one, as slow as small_linear). A
# server's steps come in every row count, so x goes in padded with zero rows to a multiple of 64:
# at most 64 shapes per weight up to the 4096-row limit, each built once. Those steps once kept
# small_linear instead, and it is the slower kernel there: SmolLM2's narrow products (q/k/v, o,
# gate/up) on an Intel Emerald Rapids guest, ms, small_linear / padded / unpadded at the multiple
# of 64 above: 600 rows 39.2 / 24.4 / 23.6, 1000 rows 64.3 / 39.6 / 37.6, 2000 rows 127.8 / 76.8
# / 74.7 (docs/benchmarks/cpu-isa.md). So a prompt chunk of any length from 512 rows, and a
# step of a burst whose budget is not filled exactly, takes the GEMM.
PACKED_ROW_MULTIPLE = 64  # x's rows padded to a multiple of this

# On a 2-core AMD EPYC (Zen 5, AVX-512), SmolLM2's shapes, steady-state GFLOP/s, oneDNN on the
# weight as stored against F.linear (MKL): 17 rows 3072 x 576 0.25 ms against 0.57, 576 x 1536
# 0.12 against 0.25; 64-2048 rows 360-500 against 195-225 GFLOP/s (the machine's float32 peak
# is about 500). A new row count costs oneDNN a primitive, 0.4-3 ms once (kept in its cache of
# 1024), still less than MKL's time on it past about 64 rows. One-row to 16-row products stay
# F.linear's: they are the memory-bound decode steps, where our kernels take the common layers
# and a primitive per count would be built for little.
ONEDNN_MIN_ROWS = 17


def use_packed(rows: int) -> bool:
    return rows >= PACKED_MIN_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in], weight [out, in], bias [out] or None -> F.linear(x, weight, bias) [M, out]; by
    oneDNN where x is float32 of at least ONEDNN_MIN_ROWS rows (x and weight may be strided views)."""
    if (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] >= ONEDNN_MIN_ROWS
        and x.device.type == "cpu"
        and onednn_available()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] float32 -> oneDNN's opaque blocked copy (only packed_linear reads it). A
    second copy of the weight, cheap for the narrow layers it is made for: 11.6 MB for the tiny
    model's 28 projections."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] float32 -> [M, out] contiguous, as F.linear(x, weight, bias). oneDNN sees M
    rounded up to a multiple of PACKED_ROW_MULTIPLE (x copied, zero rows after it), so it builds
    one primitive per 64 row counts; the padding's outputs are computed and dropped."""
    rows = x.shape[0]
    pad = -rows % PACKED_ROW_MULTIPLE
    y = torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, pad)) if pad else x, packed, bias, "none", [], "")
    return y[:rows] if pad else y


def bfloat16_products() -> bool:
    """Whether oneDNN's float32 GEMMs take bfloat16 inputs now: the process's float32 matmul
    precision is medium (--float32-matmul-precision) and oneDNN may use AMX here, the only ISA on
    which it rounds (docs/benchmarks/cpu-isa.md, "Prefill on AMX"). A C call: ask it only where
    the answer changes a path."""
    return torch.get_float32_matmul_precision() == "medium" and _amx()


@functools.cache
def _amx() -> bool:
    """The CPU has AMX for bfloat16 and oneDNN is not capped below it (ONEDNN_MAX_CPU_ISA, which an
    ISA variant sets: `onednn_available`)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return {"amx_bf16", "amx_tile"} <= (isa.cpu_features() or frozenset()) and (cap == "ALL" or "AMX" in cap)


@functools.cache
def onednn_available() -> bool:
    """Whether both forms run here and agree with F.linear on a probe. First, oneDNN is held to
    the instruction set the C++ kernels are built for (CONVEYOR_CPU_ISA, isa.py; a user's own
    ONEDNN_MAX_CPU_ISA stands): a variant measures what that CPU would run, GEMMs included.
    oneDNN reads the setting once, at its first primitive: this probe, in a worker."""
    if not torch.backends.mkldnn.is_available():
        return False
    limit = isa.VARIANTS.get(env.cpu_isa())
    if limit is not None and limit.onednn is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", limit.onednn)
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(PACKED_MIN_ROWS, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
        want = F.linear(x, w, b)
        packed = packed_linear(x, pack_linear_weight(w), b)
        plain = torch.ops.mkldnn._linear_pointwise(x, w.t().contiguous().t(), b, "none", [], "")  # a strided weight
        return bool(torch.allclose(packed, want, rtol=1e-4, atol=1e-4) and torch.allclose(plain, want, rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError):
        return False
