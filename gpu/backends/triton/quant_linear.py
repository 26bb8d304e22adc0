"""A quantized linear layer as a Triton kernel that dequantizes inside the GEMM (W4A16, W8A16,
and FP8 weight-only).

Computes `Ops.quant_linear` (gpu/backends/ops.py) for the triton backend: `quant_linear(x [M, K],
weight: KernelWeight, bias [N] | None)` -> y [M, N] in x's dtype, where KernelWeight is a
QuantizedWeight (gpu/quant/weight.py) as the kernel reads it: the same packed codes (viewed as
bytes, never copied or unpacked) and its scales and mins, in float16 where that loses nothing
that matters (`kernel_weight`). The reference is QuantizedWeight.dequantize() + F.linear, which
its test compares with.

The arithmetic: a K-block of BLOCK_K inputs lies inside one group (BLOCK_K divides G), so with
c the codes, s and m the group's scale and min, sum_k x_k (c_k s + m) = s (x . c) + m sum_k x_k.
The kernel multiplies x by the codes themselves (every code, 0..15, 0..255 or an e4m3 value, is
exact in fp16, bf16 and fp32), accumulates in float32, and applies s and m once per block and
output: the weight is never rounded to x's dtype, as the reference rounds it, so the kernel is
the closer of the two to the exact product. Per code it spends a mask or shift and a convert.

Invariants: x has unit stride along K (a GPTQ act-order `perm` gathers x's columns first, in
torch); grids and blocks come from shapes alone and nothing syncs with the host, so a decode
step that calls it captures in a CUDA graph. Decode-sized steps split K over several programs
(`_config` says why) and sum the splits in quant_linear_reduce.py. Tuned for: nothing yet
measured (no GPU here); the configurations are reasoned starting points (`_config`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from conveyor.gpu.backends.triton.quant_linear_reduce import sum_splits
from conveyor.gpu.quant.weight import CHUNK, QuantizedWeight

KIND_IDS = {"u4": 0, "u8": 1, "e4m3": 2}  # the kernel's KIND
FP16_NORMAL = (2.0**-14, 65504.0)  # scales and mins inside this keep 11 significant bits in fp16
SPLIT_OUTPUTS = 16384  # decode splits K until outputs x splits reaches this (_config)
MAX_SPLITS = 8
NUM_STAGES = 4  # K-blocks a program has in flight, plus one (GPU only: the interpreter ignores it)


@dataclasses.dataclass(frozen=True)
class KernelWeight:
    """A QuantizedWeight as the kernel reads it (TritonOps.prepare sets one as its `prepared`)."""

    kind: str
    group_size: int
    codes: torch.Tensor  # [N, K / 2] (u4) or [N, K] (u8, e4m3's bits) uint8: the weight's own storage
    scales: torch.Tensor  # [N, K / G] float16 or float32
    mins: torch.Tensor | None  # like scales; None: zero
    perm: torch.Tensor | None  # [K] int64: x's column for each kernel input; None: as is

    @property
    def shape(self) -> tuple[int, int]:
        n, stored = self.codes.shape
        return n, stored * 2 if self.kind == "u4" else stored


def kernel_weight(weight: QuantizedWeight, dtype: torch.dtype) -> KernelWeight:
    """`weight` for activations of `dtype`. With 16-bit activations the scales and mins become
    float16 (new tensors: 4 bytes per group and row, 0.25 bit per weight at G = 128, where the
    float32 ones stay for the reference and a quantized embedding's rows) when every value is 0
    or in fp16's normal range: 11 significant bits, as the fp16 weight the reference rounds to,
    and half the bytes a decode step streams for them. float32 activations keep them float32."""
    scales, mins = weight.scales, weight.mins
    if dtype in (torch.float16, torch.bfloat16) and all(_fits_fp16(t) for t in (scales, mins) if t is not None):
        scales, mins = scales.half(), None if mins is None else mins.half()
    return KernelWeight(weight.kind, weight.group_size, weight.qweight.view(torch.uint8), scales, mins, weight.perm)


def _fits_fp16(t: torch.Tensor) -> bool:
    magnitude = t.abs()
    low, high = FP16_NORMAL
    return bool(((magnitude == 0) | ((magnitude >= low) & (magnitude <= high))).all())


@triton.jit
def _codes(b, KIND: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """Bytes b (u8 or e4m3 codes) -> their float32 values."""
    if KIND == 1:
        return b.to(tl.float32)
    if FP8_NATIVE:  # sm_89+: the hardware converts e4m3
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # e4m3fn by its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0: subnormal.
    e = ((b >> 3) & 0xF).to(tl.int32)
    m = (b & 0x7).to(tl.int32)
    power = ((e + 117) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10), as float32 bits
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (8 + m).to(tl.float32) * power)
    return tl.where((b >> 7) != 0, -magnitude, magnitude)


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ym,
    blocks_per_split,
    GROUP: tl.constexpr,
    KIND: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[rows, cols] of one (BLOCK_N, BLOCK_M) tile: a loop over K in blocks of BLOCK_K inputs,
    each inside one group. q is [N, K / 2] (u4) or [N, K] bytes, scales and mins [N, K / G].
    SPLIT: y is [SPLIT, M, N] float32, and program_id(2)'s share of K (blocks_per_split blocks)
    writes its partial product there, without the bias."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    s_rows = scales_ptr + cols.to(tl.int64) * stride_sn  # [BLOCK_N]
    m_rows = mins_ptr + cols.to(tl.int64) * stride_sn
    if KIND == 0:
        # u4: byte j of a 32-input chunk holds input j (low nibble) and j + 16 (high nibble).
        j = tl.arange(0, BLOCK_K // 2)
        low_inputs = (j // 16) * 32 + j % 16  # [BLOCK_K / 2]: the block's inputs in low nibbles
        q_cols = q_ptr + cols.to(tl.int64)[None, :] * stride_qn + j[:, None]  # [BLOCK_K / 2, BLOCK_N]
    else:
        j = tl.arange(0, BLOCK_K)
        q_cols = q_ptr + cols.to(tl.int64)[None, :] * stride_qn + j[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    first = tl.program_id(2) * blocks_per_split * BLOCK_K
    for start in range(first, tl.minimum(first + blocks_per_split * BLOCK_K, K), BLOCK_K):
        if KIND == 0:
            b = tl.load(q_cols + start // 2, mask=col_ok[None, :], other=0)
            x_low = tl.load(x_rows + (start + low_inputs)[None, :], mask=row_ok[:, None], other=0.0).to(dtype)
            x_high = tl.load(x_rows + (start + 16 + low_inputs)[None, :], mask=row_ok[:, None], other=0.0).to(dtype)
            part = tl.dot(x_low, (b & 0xF).to(dtype), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
            part = tl.dot(x_high, (b >> 4).to(dtype), part, input_precision=PRECISION)
            if HAS_MINS:
                x_sum = tl.sum(x_low.to(tl.float32), 1) + tl.sum(x_high.to(tl.float32), 1)  # [BLOCK_M]
        else:
            b = tl.load(q_cols + start, mask=col_ok[None, :], other=0)
            xs = tl.load(x_rows + (start + j)[None, :], mask=row_ok[:, None], other=0.0).to(dtype)
            part = tl.dot(xs, _codes(b, KIND, FP8_NATIVE).to(dtype), input_precision=PRECISION)
            if HAS_MINS:
                x_sum = tl.sum(xs.to(tl.float32), 1)
        group = start // GROUP
        scale = tl.load(s_rows + group, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc += part * scale[None, :]
        if HAS_MINS:
            acc += x_sum[:, None] * tl.load(m_rows + group, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS and SPLIT == 1:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + tl.program_id(2).to(tl.int64) * M * N + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_k(kind: str, group_size: int) -> int | None:
    """The largest power of two up to 128 that divides the group, so that a K-block never
    straddles two groups; None where that is under what tl.dot takes (16 inputs a side, so 32
    for u4's two halves, a u4 group's chunk anyway)."""
    block = 128
    while group_size % block:
        block //= 2
    return block if block >= (CHUNK if kind == "u4" else 16) else None


def kernel_takes(weight: QuantizedWeight) -> bool:
    """Whether the kernel multiplies by `weight`: any u4 weight; u8 and e4m3 with groups of a
    multiple of 16 inputs (others go to the reference, Ops.quant_linear)."""
    return block_k(weight.kind, weight.group_size) is not None


def _config(m: int, n: int, num_blocks: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, splits, num_warps) for M rows, N outputs, K in num_blocks blocks.

    Decode (up to 16 rows) is a GEMV in all but name: the weight's bytes are the cost, and a
    program keeps about num_stages - 1 of its K-blocks in flight, so the whole grid keeps about
    N x (num_stages - 1) x BLOCK_K / 2 bytes (u4) in flight whatever BLOCK_N is. Covering HBM's
    latency at full bandwidth takes about 3.35 TB/s x ~0.7 us ~ 2.3 MB, which 4096 outputs (an 8B
    Llama's q, o and down projections) reach only with K split in 4 (SPLIT_OUTPUTS; the splits'
    float32 partials are summed by quant_linear_reduce.py). 16 rows is tl.dot's least. More rows
    reuse each dequantized tile over more of x, K whole."""
    if m <= 16:
        splits = max(1, min(MAX_SPLITS, SPLIT_OUTPUTS // n, num_blocks))
        per_split = triton.cdiv(num_blocks, splits)
        return 16, max(16, min(32, triton.next_power_of_2(n))), triton.cdiv(num_blocks, per_split), 4
    if m <= 64:
        return 32, 64, 1, 4
    return 64, 64, 1, 4


def quant_linear(x: torch.Tensor, weight: KernelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float16, bfloat16 or float32 -> x @ W^T + bias [M, N] in x's dtype."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quant_linear: x {tuple(x.shape)} is not [M, {k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"quant_linear: bias {tuple(bias.shape)} is not [{n}]")
    groups = (n, k // weight.group_size)
    scales, mins = weight.scales, weight.mins
    if (
        not weight.codes.is_contiguous()
        or scales.shape != groups
        or not scales.is_contiguous()
        or (mins is not None and (mins.shape != groups or not mins.is_contiguous()))
    ):
        shapes = f"codes {tuple(weight.codes.shape)}, scales {tuple(scales.shape)}"
        raise ValueError(f"quant_linear: {shapes} and mins are not contiguous, or the scales not [N, K / G] = {groups}")
    block = block_k(weight.kind, weight.group_size)
    if block is None:
        raise ValueError(f"quant_linear: groups of {weight.group_size} inputs do not split into the kernel's blocks")
    if weight.perm is not None:
        x = x.index_select(1, weight.perm)  # the kernel's input j is x[:, perm[j]]
    elif x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    num_blocks = k // block
    block_m, block_n, splits, num_warps = _config(m, n, num_blocks)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    on_gpu = x.device.type == "cuda"
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    _quant_linear_kernel[grid](
        x,
        weight.codes,
        scales,
        scales if mins is None else mins,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.codes.stride(0),
        scales.stride(0),
        out.stride(-2),
        triton.cdiv(num_blocks, splits),
        GROUP=weight.group_size,
        KIND=KIND_IDS[weight.kind],
        HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None,
        FP8_NATIVE=on_gpu and torch.cuda.get_device_capability(x.device) >= (8, 9),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block,
        SPLIT=splits,
        # The interpreter's bf16 arithmetic is wrong: compute in float32 there.
        UPCAST=x.dtype == torch.bfloat16 and not on_gpu,
        # float32 activations get exact float32 products, not TF32: they are the reference precision.
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=num_warps,
        num_stages=NUM_STAGES,
    )
    return y if splits == 1 else sum_splits(out, bias, y)
