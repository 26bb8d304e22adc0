"""FP8 W8A8's activation quantization as one Triton kernel: each row's amax, its scale, and the
row rounded to e4m3, where torch took five launches (abs, amax, clamp, divide, cast).

`quantize_rows(x [M, K])` -> (xq [M, K] float8_e4m3fn, scale [M, 1] float32), bit for bit what
fp8_linear.py's `quantize_per_token` (the torch reference, its test's) gives: scale =
max(amax |x[t]|, 1e-12) / 448 and xq = e4m3(clamp(x / scale, -448, 448)), both divisions
IEEE-rounded (div_rn), the e4m3 rounding to nearest even, subnormals kept. The code byte is
built from the float32's bits here rather than by the hardware's convert, because Triton's
interpreter converts to fp8 wrongly (ties rounded up, subnormals flushed): one path, exact under
the interpreter on a CPU and the same on a GPU. It costs a few integer operations an element in
a kernel that moves 3 bytes an element.

Grid: (M,), one program a row, two passes over the row in BLOCK chunks (amax, then round); the
second reads the row back from L1/L2. Nothing syncs with the host: CUDA-graph safe. Tuned for:
nothing yet measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
BLOCK = 2048


@triton.jit
def _e4m3_bits(v):
    """float32 v in [-448, 448] -> its e4m3fn code (int32 0..255), rounded to nearest even."""
    a = tl.abs(v)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # -127 for 0
    step = tl.maximum(exponent, -6) - 3  # e4m3 keeps 3 mantissa bits; below 2^-6, steps of 2^-9
    to_steps = ((127 - step) << 23).to(tl.float32, bitcast=True)  # 2^-step: exact products
    steps = (a * to_steps + 8388608.0) - 8388608.0  # rounded to an integer, ties to even (2^23)
    r = steps * ((127 + step) << 23).to(tl.float32, bitcast=True)  # an e4m3 value, exactly
    r_bits = r.to(tl.int32, bitcast=True)
    normal = (((((r_bits >> 23) & 0xFF) - 120) << 3) | ((r_bits >> 20) & 7)).to(tl.int32)
    code = tl.where(r >= 0.015625, normal, (r * 512.0).to(tl.int32))
    return code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 7)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    amax = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 448.0)
    for start in range(0, K, BLOCK):
        ok = start + cols < K
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_row + start + cols, _e4m3_bits(v).to(tl.uint8), mask=ok)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float16, bfloat16 or float32, unit stride along K -> (xq [M, K] float8_e4m3fn,
    scale [M, 1] float32), x ~= xq * scale."""
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"quantize_rows: x {tuple(x.shape)} with strides {x.stride()} is not [M, K] with unit stride along K")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        block = min(BLOCK, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x, q.view(torch.uint8), scale, k, x.stride(0), q.stride(0), BLOCK=block, num_warps=4)
    return q, scale
