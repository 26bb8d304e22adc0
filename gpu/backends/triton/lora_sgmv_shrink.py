"""LoRA shrink over tokens grouped by slot (SGMV, as Punica and S-LoRA): xa = x A_s^T for each slot's
tokens at once, on the tensor cores.

`sgmv_shrink(x [T, in], a [S, R, in], groups)` -> xa [P, T, R] float32: partial sums over P
slices of `in`, indexed by position in the grouped order (lora_groups.py), not by token; rows past
the pass's adapter tokens are not written. lora_sgmv_expand.py adds the P parts in order.

A program takes one tile of BLOCK_M positions of one slot's segment (`segment_tile`) and one slice
of `in`, gathers those tokens' rows of x [BLOCK_M, BLOCK_K] and multiplies them by its slot's A^T
tile [BLOCK_K, BLOCK_R] with tl.dot (16-bit in, float32 accumulate; exact float32 products for a
float32 model), so A is read once a tile of tokens, not once a token (lora.py's BGMV). Base tokens
cost nothing: they are in no segment. The grid, (max_tiles, P), comes from shapes alone: no host
sync, so a CUDA graph captures it. Invariants not checked on the device: groups as lora_groups
wrote them for these T and S.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.gpu.backends.triton.lora_groups import max_tiles, segment_tile

TARGET_PROGRAMS = 256  # ESTIMATE: about two waves of an H100's 132 SMs; unmeasured
MAX_PARTS = 16
TILE_BYTES = 8192  # of the x tile [BLOCK_M, BLOCK_K] and the A tile [BLOCK_K, BLOCK_R]: twice spilled at R = 64 (sm_90)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    groups_ptr,
    xa_ptr,
    K,
    R,
    S,
    stride_xt,
    stride_as,
    stride_ar,
    stride_xap,
    stride_xam,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PART_TILES: tl.constexpr,  # BLOCK_K tiles of `in` a program sums
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, first, end = segment_tile(groups_ptr, S, tl.program_id(0), BLOCK_M, BLOCK_S)
    if slot >= S:  # past the last tile
        return
    part = tl.program_id(1)
    m = first + tl.arange(0, BLOCK_M)
    m_ok = m < end
    tokens = tl.load(groups_ptr + S + 1 + m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    r = tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_xt  # [BLOCK_M, 1]
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + r[None, :] * stride_ar  # [1, BLOCK_R]: A^T's columns
    acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    for tile in range(PART_TILES):
        start = (part * PART_TILES + tile) * BLOCK_K
        k_ok = start + k < K
        x = tl.load(x_rows + (start + k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_cols + (start + k)[:, None], mask=k_ok[:, None] & (r < R)[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    out = xa_ptr + part * stride_xap + m[:, None].to(tl.int64) * stride_xam + r[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & (r < R)[None, :])


def block_m(num_tokens: int, num_slots: int) -> int:
    """Tokens a tile: an even spread's share of a slot, between 16 (tl.dot's least) and 64."""
    return max(16, min(64, triton.next_power_of_2(triton.cdiv(max(num_tokens, 1), num_slots))))


def num_warps(block_m: int, block_r: int) -> int:
    """Both SGMV kernels' warps: 8 for 64-token tiles and for 32 at R = 64, where 4 warps took
    188-255 registers a thread or spilled (sm_90: the gathered rows' pointers), 4 below."""
    return 8 if block_m >= 64 or (block_m >= 32 and block_r >= 64) else 4


def block_k(fan_in: int, block_m: int, block_r: int, element_size: int) -> int:
    return max(16, min(128, TILE_BYTES // element_size // max(block_m, block_r), triton.next_power_of_2(fan_in)))


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """x [T, in], a [S, R, in], groups [S + 1 + T] int32 (lora_groups) -> xa [P, T, R] float32,
    row p of part i the sum over slice i of `in` of the p-th grouped token's x @ A_s^T."""
    num_tokens, fan_in = x.shape
    if a.dim() != 3 or a.shape[2] != fan_in or groups.shape != (a.shape[0] + 1 + num_tokens,):
        shapes = f"x {tuple(x.shape)}, a {tuple(a.shape)}, groups {tuple(groups.shape)}"
        raise ValueError(f"sgmv_shrink: {shapes} are not [T, in], [S, R, in], [S + 1 + T]")
    if (fan_in > 1 and x.stride(1) != 1) or (fan_in > 1 and a.stride(2) != 1):
        raise ValueError(f"sgmv_shrink: x {x.stride()} and a {a.stride()} need unit stride along `in`")
    num_slots, rank = a.shape[0], a.shape[1]
    tile_m = block_m(num_tokens, num_slots)
    tiles = max_tiles(num_tokens, num_slots, tile_m)
    block_r = max(16, triton.next_power_of_2(rank))
    tile_k = block_k(fan_in, tile_m, block_r, x.element_size())
    k_tiles = triton.cdiv(fan_in, tile_k)
    part_tiles = triton.cdiv(k_tiles, max(1, min(MAX_PARTS, k_tiles, TARGET_PROGRAMS // max(tiles, 1))))
    parts = triton.cdiv(k_tiles, part_tiles)
    xa = torch.empty(parts, num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens and rank:
        _sgmv_shrink_kernel[(tiles, parts)](
            x,
            a,
            groups,
            xa,
            fan_in,
            rank,
            num_slots,
            x.stride(0),
            a.stride(0),
            a.stride(1),
            xa.stride(0),
            xa.stride(1),
            BLOCK_M=tile_m,
            BLOCK_R=block_r,
            BLOCK_K=tile_k,
            BLOCK_S=triton.next_power_of_2(num_slots),
            PART_TILES=part_tiles,
            # The interpreter's bf16 arithmetic is wrong: float32 there. A float32 model gets exact products, not TF32.
            UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda",
            PRECISION="ieee" if x.dtype == torch.float32 else None,
            num_warps=num_warps(tile_m, block_r),
        )
    return xa


def sgmv_shrink_reference(x: torch.Tensor, a: torch.Tensor, starts: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[starts[S], R] float32: the grouped tokens' x @ A_s^T, one slot at a time in torch."""
    xa = torch.zeros(int(starts[-1]), a.shape[1])
    for s in range(a.shape[0]):
        rows = order[starts[s] : starts[s + 1]]
        xa[starts[s] : starts[s + 1]] = x.cpu().float()[rows] @ a[s].cpu().float().T
    return xa
