"""LoRA expand over tokens grouped by slot (SGMV): y[t] += scale_s * xa B_s^T for each slot's tokens
at once, on the tensor cores, in place.

`sgmv_expand(y [T, out], xa [P, T, R], b [S, out, R], scales [S], groups)` adds into y the update
of every adapter token; xa is lora_sgmv_shrink.py's (rows by position in the grouped order, its P
partial sums added here in order), b any strides (TritonOps.lora_b stores [out, S, R]). Rows of
base-model tokens are in no segment: not read, not written.

A program takes one tile of BLOCK_M positions of one slot's segment (`segment_tile`,
lora_groups.py) and N_TILES tiles of BLOCK_N outputs: it sums its rows' xa once, rounds them to
B's dtype for tl.dot (float32 accumulate), then for each output tile multiplies by its slot's B^T
[BLOCK_R, BLOCK_N], scales in float32 and adds into the gathered rows of y, rounding once on the
store. Each (token, output) belongs to one program: no atomics, and the result does not depend on
program order. The grid, (max_tiles, cdiv(out, BLOCK_N N_TILES)), comes from shapes alone: no host
sync, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.gpu.backends.triton.lora_groups import max_tiles, segment_tile
from conveyor.gpu.backends.triton.lora_sgmv_shrink import TARGET_PROGRAMS, block_m, num_warps

BLOCK_N = 64  # outputs a tile in a 16-bit dtype, half in float32: twice spilled at 64-token tiles (sm_90)
MAX_N_TILES = 8


def block_n(fan_out: int, element_size: int) -> int:
    return max(16, min(BLOCK_N * 2 // element_size, triton.next_power_of_2(fan_out)))


@triton.jit
def _sgmv_expand_kernel(
    y_ptr,
    xa_ptr,
    b_ptr,
    scales_ptr,
    groups_ptr,
    N,
    R,
    S,
    P,
    stride_yt,
    stride_xap,
    stride_xam,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    N_TILES: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, first, end = segment_tile(groups_ptr, S, tl.program_id(0), BLOCK_M, BLOCK_S)
    if slot >= S:  # past the last tile
        return
    m = first + tl.arange(0, BLOCK_M)
    m_ok = m < end
    tokens = tl.load(groups_ptr + S + 1 + m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    xa = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    rows = xa_ptr + m[:, None].to(tl.int64) * stride_xam + r[None, :]
    for part in range(P):  # shrink's partial sums, in order
        xa += tl.load(rows + part * stride_xap, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    if not UPCAST:
        xa = xa.to(b_ptr.dtype.element_ty)  # the tensor cores' input; float32 stays float32
    scale = tl.load(scales_ptr + slot).to(tl.float32)
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs + r[:, None] * stride_br  # [BLOCK_R, 1]: B^T's rows
    y_rows = y_ptr + tokens[:, None] * stride_yt  # [BLOCK_M, 1]
    for j in range(N_TILES):
        n = (tl.program_id(1) * N_TILES + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        b = tl.load(b_slot + n[None, :] * stride_bn, mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        if UPCAST:
            b = b.to(tl.float32)
        delta = tl.dot(xa, b, input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N] float32
        y_ok = m_ok[:, None] & n_ok[None, :]
        y = tl.load(y_rows + n[None, :], mask=y_ok, other=0.0).to(tl.float32)
        tl.store(y_rows + n[None, :], (y + delta).to(y_ptr.dtype.element_ty), mask=y_ok)


def sgmv_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """y [T, out] += scales[s] * (xa's parts added) @ b[s]^T for each grouped token of slot s, in
    place; xa [P, T, R] as sgmv_shrink gives it; returns y."""
    num_tokens, fan_out = y.shape
    if b.dim() != 3 or b.shape[1] != fan_out or xa.dim() != 3 or xa.shape[1:] != (num_tokens, b.shape[2]):
        shapes = f"y {tuple(y.shape)}, xa {tuple(xa.shape)}, b {tuple(b.shape)}"
        raise ValueError(f"sgmv_expand: {shapes} are not [T, out], [P, T, R], [S, out, R]")
    num_slots, rank = b.shape[0], b.shape[2]
    if scales.shape != (num_slots,) or groups.shape != (num_slots + 1 + num_tokens,):
        raise ValueError(f"sgmv_expand: scales {tuple(scales.shape)}, groups {tuple(groups.shape)} are not [S], [S + 1 + T]")
    if (fan_out > 1 and y.stride(1) != 1) or (rank > 1 and xa.stride(2) != 1):
        raise ValueError(f"sgmv_expand: y {y.stride()} and xa {xa.stride()} need unit stride along their last dimension")
    if not (num_tokens and rank and fan_out):
        return y
    tile_m = block_m(num_tokens, num_slots)
    block_r = max(16, triton.next_power_of_2(rank))
    tiles = max_tiles(num_tokens, num_slots, tile_m)
    tile_n = block_n(fan_out, b.element_size())
    n_blocks = triton.cdiv(fan_out, tile_n)
    n_tiles = max(1, min(MAX_N_TILES, n_blocks * tiles // TARGET_PROGRAMS))  # fewer re-reads of xa where programs abound
    _sgmv_expand_kernel[(tiles, triton.cdiv(n_blocks, n_tiles))](
        y,
        xa,
        b,
        scales,
        groups,
        fan_out,
        rank,
        num_slots,
        xa.shape[0],
        y.stride(0),
        xa.stride(0),
        xa.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        BLOCK_M=tile_m,
        BLOCK_N=tile_n,
        BLOCK_R=block_r,
        BLOCK_S=triton.next_power_of_2(num_slots),
        N_TILES=n_tiles,
        UPCAST=b.dtype == torch.bfloat16 and b.device.type != "cuda",
        PRECISION="ieee" if b.dtype == torch.float32 else None,
        num_warps=num_warps(tile_m, block_r),
    )
    return y


def sgmv_expand_reference(
    y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, starts: torch.Tensor, order: torch.Tensor
) -> torch.Tensor:
    """y [T, out] float32 plus each grouped token's scaled xa[position] @ B_s^T, one slot at a time
    in torch; xa [starts[S], R] (its parts added)."""
    out = y.cpu().float().clone()
    for s in range(b.shape[0]):
        rows = order[starts[s] : starts[s + 1]]
        out[rows] += scales[s].item() * (xa.cpu().float()[starts[s] : starts[s + 1]] @ b[s].cpu().float().T)
    return out
