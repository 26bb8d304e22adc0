"""W4A16 on Marlin's ideas, in Triton: codes reshuffled once at load into 32-bit words laid out
for the tile a program reads, every row of a decode-sized step in one program (the codes are
read once from memory however many rows up to 64), K split over programs when the outputs alone
give too few, and several K-blocks of loads in flight.

Layout (`word_weight`): K in blocks of 128 inputs. words [K / 8, N] int32: row 16 b + r, nibble
i (bits 4i..4i+3) holds the code of input 128 b + 16 i + r. A program's K-block is then one
[16, BLOCK_N] tile of whole words, BLOCK_N x 4 contiguous bytes a row (16-byte loads, no byte
of a 32-byte sector wasted), and nibble i of every word is the [16, BLOCK_N] operand of one
tl.dot against x's 16 contiguous columns 128 b + 16 i .. + 15: a shift, a mask and a convert a
code, no shuffle of x and no gather. Scales and mins are stored transposed, [K / G, N] float16
(a row of BLOCK_N outputs' scales is one coalesced load). Every tensor is N-minor, so a stack
of layers (gpu/backends/column_groups.py) concatenates along dim 1 and `words_rows` cuts a
layer's columns as views.

The arithmetic is quant_linear.py's: x times the codes themselves (exact in fp16, bf16, fp32),
float32 accumulation, each group's scale (and min times x's sum) applied once per group.

Invariants: u4 weights whose groups tile the 128-input blocks (G divides 128, or 128 divides
G); K a multiple of 128; x with unit stride along K (GPTQ act-order's `perm` gathers x first);
shapes alone pick grids and blocks, nothing syncs with the host (CUDA-graph safe); split
partial sums go through quant_linear_reduce.py, in split order (deterministic).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from conveyor.gpu.backends.triton.quant_linear_reduce import sum_splits
from conveyor.gpu.quant.weight import QuantizedWeight

BLOCK_K = 128  # inputs a K-block: 16 words a column
PROGRAMS = 512  # split K until about this many programs (H100: 132 SMs, ~4 a SM in flight)
MAX_SPLITS = 8
PARTIAL_SHARE = 4  # split only while the float32 partials move under 1 / PARTIAL_SHARE of the codes' bytes
NUM_STAGES = 4  # K-blocks a program has in flight, plus one (GPU only)


@dataclasses.dataclass(frozen=True)
class WordWeight:
    """A u4 weight in this kernel's layout (TritonOps.prepare may set one, by gemm_picks.py)."""

    words: torch.Tensor  # [K / 8, N] int32 (module docstring)
    scales: torch.Tensor  # [K / G, N] float16 or float32
    mins: torch.Tensor | None  # like scales; None: zero
    group_size: int
    perm: torch.Tensor | None  # [K] int64: x's column for each input; None: as is

    @property
    def shape(self) -> tuple[int, int]:
        k8, n = self.words.shape
        return n, k8 * 8


def words_take(weight: QuantizedWeight) -> bool:
    _, k = weight.shape
    g = weight.group_size
    return weight.kind == "u4" and k % BLOCK_K == 0 and (BLOCK_K % g == 0 or g % BLOCK_K == 0)


def word_weight(weight: QuantizedWeight, dtype: torch.dtype) -> WordWeight:
    """Reshuffle `weight` (words_take) once; float16 scales and mins for 16-bit activations
    where the caller's weight has them exact (AWQ and GPTQ publish float16)."""
    n, k = weight.shape
    q = weight.codes().to(torch.int64).view(n, k // BLOCK_K, 8, 16)  # [N, block, nibble i, word r]
    shifts = 4 * torch.arange(8, device=q.device).view(1, 1, 8, 1)
    words = (q << shifts).sum(2)  # [N, block, 16] in 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(n, k // 8)
    half = dtype in (torch.float16, torch.bfloat16) and _exact_in_fp16(weight.scales, weight.mins)

    def transposed(t: torch.Tensor) -> torch.Tensor:  # [N, K / G] -> [K / G, N]
        return (t.half() if half else t.float()).t().contiguous()

    mins = None if weight.mins is None else transposed(weight.mins)
    return WordWeight(words.t().contiguous(), transposed(weight.scales), mins, weight.group_size, weight.perm)


def _exact_in_fp16(*parts: torch.Tensor | None) -> bool:
    return all(torch.equal(t.half().float(), t.float()) for t in parts if t is not None)


def words_rows(form: WordWeight, rows: slice) -> WordWeight:
    """A stack's form -> its output rows `rows` (column views)."""
    mins = None if form.mins is None else form.mins[:, rows]
    return dataclasses.replace(form, words=form.words[:, rows], scales=form.scales[:, rows], mins=mins)


@triton.jit
def _words_kernel(
    x_ptr, w_ptr, s_ptr, m_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wk, stride_sg, stride_ym, blocks_per_split,
    GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """y's (BLOCK_M, BLOCK_N) tile over program_id(2)'s share of K; SPLIT: y is [SPLIT, M, N]
    float32 partials, without the bias."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    r = tl.arange(0, 16)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + r[None, :]  # [BLOCK_M, 16]
    w_tile = w_ptr + r[:, None].to(tl.int64) * stride_wk + cols[None, :]  # [16, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    first = tl.program_id(2) * blocks_per_split
    for block in range(first, tl.minimum(first + blocks_per_split, K // 128)):
        start = block * 128
        w = tl.load(w_tile + block * 16 * stride_wk, mask=col_ok[None, :], other=0)  # [16, BLOCK_N] int32
        part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        x_sum = tl.zeros((BLOCK_M,), tl.float32)
        for i in tl.static_range(8):
            xs = tl.load(x_rows + start + 16 * i, mask=row_ok[:, None], other=0.0).to(dtype)  # [BLOCK_M, 16]
            part = tl.dot(xs, ((w >> (4 * i)) & 0xF).to(dtype), part, input_precision=PRECISION)
            if HAS_MINS:
                x_sum += tl.sum(xs.to(tl.float32), 1)
            if i == 7 or (16 * (i + 1)) % GROUP == 0:  # the end of a group, or of the block
                g = (start + 16 * i) // GROUP
                acc += part * tl.load(s_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                if HAS_MINS:
                    mins = tl.load(m_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
                    acc += x_sum[:, None] * mins[None, :]
                    x_sum = tl.zeros((BLOCK_M,), tl.float32)
                part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if HAS_BIAS and SPLIT == 1:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + tl.program_id(2).to(tl.int64) * M * N + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def words_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, splits): up to 64 rows in one program (the codes read once), more in
    tiles of 64; K split until the grid holds about PROGRAMS programs, while the partials stay
    small against the codes (PARTIAL_SHARE) and each split keeps a whole block."""
    block_m = max(16, triton.next_power_of_2(m)) if m <= 64 else 64
    block_n = 64
    num_blocks = k // BLOCK_K
    if m > 64:
        return block_m, block_n, 1
    splits = min(MAX_SPLITS, num_blocks, triton.cdiv(PROGRAMS, triton.cdiv(n, block_n)), max(1, k // (16 * PARTIAL_SHARE * m)))
    return block_m, block_n, triton.cdiv(num_blocks, triton.cdiv(num_blocks, max(1, splits)))


def words_linear(x: torch.Tensor, weight: WordWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float16, bfloat16 or float32 -> x @ W^T + bias [M, N] in x's dtype."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"words_linear: x {tuple(x.shape)} is not [M, {k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"words_linear: bias {tuple(bias.shape)} is not [{n}]")
    groups = (k // weight.group_size, n)
    parts = [t for t in (weight.words, weight.scales, weight.mins) if t is not None]
    mins_ok = weight.mins is None or (weight.mins.shape == groups and weight.mins.stride() == weight.scales.stride())
    if weight.scales.shape != groups or any(t.stride(1) != 1 for t in parts) or not mins_ok:
        raise ValueError(f"words_linear: scales {tuple(weight.scales.shape)} not [K / G, N] = {groups}, or a tensor not N-minor")
    if weight.perm is not None:
        x = x.index_select(1, weight.perm)  # the kernel's input j is x[:, perm[j]]
    elif x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, splits = words_config(m, n, k)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    _words_kernel[grid](
        x, weight.words, weight.scales, weight.scales if weight.mins is None else weight.mins, out if bias is None else bias, out,
        m, n, k, x.stride(0), weight.words.stride(0), weight.scales.stride(0), out.stride(-2),
        triton.cdiv(k // BLOCK_K, splits),
        GROUP=weight.group_size, HAS_MINS=weight.mins is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits,
        # The interpreter's bf16 arithmetic is wrong: compute in float32 there.
        UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda",
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=4, num_stages=NUM_STAGES,
    )  # fmt: skip
    return y if splits == 1 else sum_splits(out, bias, y)
