"""oneDNN's blocked weight layout, for linear layers in steps of many rows (prefill).

Not our C++: torch ships oneDNN, whose matmul on a weight reordered once into its own blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`: the ops torch.compile's
CPU backend freezes weights into) beats both torch's sgemm and small_linear.cpp on many rows.
The cpu backend's ops (gpu/backends/cpu/ops.py) pack a layer's weight with `pack_linear_weight`
in `prepare` and call `packed_linear` where `use_packed(rows)`; other steps keep small_linear.

Invariants: the packed copy is opaque (only `packed_linear` reads it) and a second copy of the
weight, made only for the layers small_linear takes (at most 1024 input features); only row
counts `use_packed` accepts take this path, so oneDNN builds few primitives per weight; where
`packed_linear_available()` is False (torch built without oneDNN, a version that renamed these
private ops, or a wrong answer on a probe) the layers keep the other paths.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# On this 2-core AVX-512 machine, a 10 x 200 prefill step of the tiny model took 94.9 ms with
# small_linear and 82.8 ms with the packed weights from 512 rows on (medians of 20 interleaved
# steps, one process). At 256 rows the two kernels were even, and below that small_linear wins
# (a one-row layer: 0.06 against 0.12 ms), so steps of fewer rows keep it.
PACKED_MIN_ROWS = 512  # steps with at least this many rows use the packed weight,
# oneDNN builds a primitive per input shape, and building one cost about 0.5 ms per layer here (a
# 1000-row call: 3.85 ms on a shape seen before, 4.4 ms on a new one, as slow as small_linear). A
# server's steps come in every row count, so only multiples of 64 take this path: at most 64
# shapes per weight up to the 4096-row limit, each built once, and a step that fills the default
# budget (2048 rows, every prefill step of a burst) is one of them.
PACKED_ROW_MULTIPLE = 64  # when their row count is a multiple of this


def use_packed(rows: int) -> bool:
    return rows >= PACKED_MIN_ROWS and rows % PACKED_ROW_MULTIPLE == 0


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] float32 -> oneDNN's opaque blocked copy (only packed_linear reads it). A
    second copy of the weight, cheap for the narrow layers it is made for: 11.6 MB for the tiny
    model's 28 projections."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] float32 -> [M, out], as F.linear(x, weight, bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def packed_linear_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(PACKED_MIN_ROWS, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
        got = packed_linear(x, pack_linear_weight(w), b)
        return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError):
        return False
