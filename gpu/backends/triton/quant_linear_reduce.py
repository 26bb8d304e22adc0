"""Split-K's second kernel for quant_linear.py: sum the splits' float32 partial products, add the
bias, round once to the output's dtype.

Layout: partial [S, M, N] float32, contiguous (split s holds x @ W^T over its share of K); bias
[N] or None; out [M, N] with unit stride along N. out = sum_s partial[s] (+ bias), summed in split
order, so the result does not depend on which program finished first (atomics would).

Grid: (M, cdiv(N, BLOCK)), BLOCK = 256 outputs a program. Tuned for: nothing yet measured; it
moves S x M x N x 4 bytes, a few KB to a few hundred at decode's M, against the weight's MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _sum_splits_kernel(
    partial_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_splits(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """partial [S, M, N] float32 -> out [M, N] = partial.sum(0) + bias, written in place."""
    splits, m, n = partial.shape
    if partial.dtype != torch.float32 or not partial.is_contiguous() or out.shape != (m, n) or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"sum_splits: partial {tuple(partial.shape)} {partial.dtype}, out {tuple(out.shape)} {out.stride()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"sum_splits: bias {tuple(bias.shape)} is not [{n}]")
    if m and n:
        grid = (m, triton.cdiv(n, BLOCK))
        _sum_splits_kernel[grid](
            partial, out if bias is None else bias, out, m, n, out.stride(0), SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=BLOCK
        )
    return out
