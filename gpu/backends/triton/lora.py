"""Batched LoRA for a step whose tokens use different adapters: shrink (x A^T) and expand
(y += scale * xa B^T) as Triton kernels, each token's adapter slot read on the device.

Computes `Ops.lora_shrink` and `Ops.lora_expand` (gpu/backends/ops.py) for the triton backend:
- shrink: x [T, in], a [S, R, in] (slot s's A, zero rows past its rank), slots [T] int64 ->
  xa [P, T, R] float32, partial sums over P slices of `in` (their sum: x[t] @ a[slots[t]]^T), zero
  where slots[t] < 0;
- expand: y [T, out] += scales[slots[t]] * (sum over p of xa[p, t]) @ b[slots[t]]^T in place
  (xa [T, R] is taken as P = 1), b [S, out, R] (any strides; fastest with R innermost, as
  TritonOps.lora_b stores it), scales [S] float32; rows with slots[t] < 0 are not written (not even
  rewritten with their own value).

In the BGMV manner, each program loads its token's slot, returns at once for a base-model token,
and otherwise multiplies its row by its slot's matrix tile by tile, upcast to float32 on load,
accumulated in float32; expand rounds once, on the store. Shrink splits `in` over up to MAX_PARTS
programs a token: one program walking all of `in` waited on its loads one tile after the other
(on an H200 a rank-16 shrink of one token took about 16 us over 4096 inputs and 60 over 14336,
against 10-40 us for the base product), and the partial sums stay apart, added by expand in order,
so the result does not depend on which program finished first (no atomics) and no third launch
reduces them. Grids come from shapes alone and nothing syncs with the host, so a decode step
captures in a CUDA graph with `slots` among its static inputs. Invariants not checked on the
device: 0 <= slots[t] < S or slots[t] < 0. A prompt chunk re-reads its slot's A and B once per
token (from L2); grouping tokens by slot (SGMV) would read them once per tile, at the cost of a
sorted plan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements of a program's float32 tile (BLOCK_R x BLOCK_K or BLOCK_N x BLOCK_R); 8192 spills at R = 64 (sm_90)
MAX_BLOCK = 256
MAX_PARTS = 16  # shrink's programs a token, each summing a slice of `in`


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    xa_ptr,
    K,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    stride_xap,
    stride_xat,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PART_TILES: tl.constexpr,  # BLOCK_K tiles of `in` a program sums
):
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    out = xa_ptr + part * stride_xap + token * stride_xat + r
    if slot < 0:  # a base-model token
        tl.store(out, tl.zeros((BLOCK_R,), tl.float32), mask=r < R)
        return
    k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + slot * stride_as + r[:, None] * stride_ar  # [BLOCK_R, 1]
    acc = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    for tile in range(PART_TILES):
        start = (part * PART_TILES + tile) * BLOCK_K
        k_ok = start + k < K
        x = tl.load(x_ptr + token * stride_xt + start + k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + (start + k)[None, :], mask=(r < R)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += a * x[None, :]
    tl.store(out, tl.sum(acc, 1), mask=r < R)


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    xa_ptr,
    b_ptr,
    scales_ptr,
    slots_ptr,
    N,
    R,
    P,
    stride_yt,
    stride_xap,
    stride_xat,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:  # a base-model token: y stays as it is
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    n_ok, r_ok = n < N, r < R
    xa = tl.zeros((BLOCK_R,), tl.float32)
    for part in range(P):  # shrink's partial sums, in order
        xa += tl.load(xa_ptr + part * stride_xap + token * stride_xat + r, mask=r_ok, other=0.0)
    b_tile = b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :] * stride_br  # [BLOCK_N, BLOCK_R]
    b = tl.load(b_tile, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * xa[None, :], 1) * tl.load(scales_ptr + slot).to(tl.float32)  # [BLOCK_N]
    y_row = y_ptr + token * stride_yt + n
    y = tl.load(y_row, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_row, (y + delta).to(y_ptr.dtype.element_ty), mask=n_ok)


def _block(width: int, rank_block: int) -> int:
    """The tile's other side: the width's next power of two, within TILE elements and MAX_BLOCK."""
    return max(16, min(triton.next_power_of_2(width), MAX_BLOCK, TILE // rank_block))


def _check_unit_stride(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} needs unit stride along its last dimension, got {t.stride()}")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], a [S, R, in], slots [T] -> xa [P, T, R] float32: partial sums over P slices of
    `in` (zero rows where slots < 0), for lora_expand to add."""
    num_tokens, fan_in = x.shape
    if a.dim() != 3 or a.shape[2] != fan_in or slots.shape != (num_tokens,):
        shapes = f"x {tuple(x.shape)}, a {tuple(a.shape)}, slots {tuple(slots.shape)}"
        raise ValueError(f"lora_shrink: {shapes} are not [T, in], [S, R, in], [T]")
    _check_unit_stride("lora_shrink", x=x, a=a)
    rank = a.shape[1]
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = _block(fan_in, block_r)
    tiles = triton.cdiv(fan_in, block_k)
    part_tiles = triton.cdiv(tiles, MAX_PARTS)
    parts = triton.cdiv(tiles, part_tiles)
    xa = torch.empty(parts, num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens and rank:
        _lora_shrink_kernel[(num_tokens, parts)](
            x,
            a,
            slots,
            xa,
            fan_in,
            rank,
            x.stride(0),
            a.stride(0),
            a.stride(1),
            xa.stride(0),
            xa.stride(1),
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            PART_TILES=part_tiles,
            num_warps=4,
        )
    return xa


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] += scales[s] * (xa's partial sums added) @ b[s]^T, s = slots[t] >= 0, in place;
    xa [P, T, R] as lora_shrink gives it, or [T, R]; returns y."""
    num_tokens, fan_out = y.shape
    parts = xa.unsqueeze(0) if xa.dim() == 2 else xa
    if b.dim() != 3 or b.shape[1] != fan_out or parts.shape[1:] != (num_tokens, b.shape[2]) or slots.shape != (num_tokens,):
        shapes = f"y {tuple(y.shape)}, xa {tuple(xa.shape)}, b {tuple(b.shape)}, slots {tuple(slots.shape)}"
        raise ValueError(f"lora_expand: {shapes} are not [T, out], [P, T, R] or [T, R], [S, out, R], [T]")
    if scales.shape != (b.shape[0],):
        raise ValueError(f"lora_expand: scales {tuple(scales.shape)} are not one per slot ({b.shape[0]})")
    _check_unit_stride("lora_expand", y=y, xa=parts)
    rank = b.shape[2]
    if num_tokens and rank and fan_out:
        block_r = max(16, triton.next_power_of_2(rank))
        block_n = _block(fan_out, block_r)
        _lora_expand_kernel[(num_tokens, triton.cdiv(fan_out, block_n))](
            y,
            parts,
            b,
            scales,
            slots,
            fan_out,
            rank,
            parts.shape[0],
            y.stride(0),
            parts.stride(0),
            parts.stride(1),
            b.stride(0),
            b.stride(1),
            b.stride(2),
            BLOCK_N=block_n,
            BLOCK_R=block_r,
            num_warps=4,
        )
    return y
