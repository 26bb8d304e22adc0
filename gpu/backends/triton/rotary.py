"""Rotary position embedding applied in place to q and k, as one Triton kernel.

`apply_rotary_(q [T, Hq, D], k [T, Hkv, D], positions [T] int64, cos_sin [P, R] float32)` serves
TritonOps.rotary; `rotary_reference` is the torch rotation its test compares with. cos_sin is
gpu/models/rope.py's table, cat(cos, sin) of [P, R/2] each, R <= D the rotary width (R < D: partial
rotary, the last D - R dims of each head pass through). Every rope scaling lives in the table, so
the kernel only applies it, in the "rotate half" (GPT-NeoX) convention: with x1, x2 the two
halves of a head's first R dims, out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin).

Invariants: unit stride along D (token and head strides are free: q and k may be views into one
fused qkv buffer); positions lie in [0, P), unchecked on the device; the rounding is the torch
backend's (gpu/backends/torch/ops.py `rotary`), so fp16 (and bf16 on a GPU) match it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# No multiply-add contraction: on sm_90 LLVM fuses `round(x2 * sin)` and the subtraction after it
# into one bf16/fp16 fma.rn, skipping the product's rounding that torch's eager ops do, which left
# 1 ulp differences in 17% of elements (measured on an H200). Unfused, the PTX is mul.rn, sub.rn and
# add.rn in the activation dtype: one rounding each, as torch.
COMPILE_OPTIONS = dict(enable_fp_fusion=False)


@triton.jit
def _rotate_heads(base_ptr, stride_head, cos, sin, num_heads, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # base_ptr: this token's first head; cos, sin [1, BLOCK_HALF] float32 already rounded to the dtype.
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    ptrs1 = base_ptr + heads * stride_head + cols  # [BLOCK_HEADS, BLOCK_HALF], first half
    x1 = tl.load(ptrs1, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(ptrs1 + HALF, mask=mask, other=0.0).to(tl.float32)
    # Each product is rounded to the activation dtype before the sum, as torch's eager ops do.
    o1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(ptrs1, o1, mask=mask)
    tl.store(ptrs1 + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos_sin,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + position * stride_cos_sin + cols
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(row, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)  # [1, BLOCK_HALF]
    sin = tl.load(row + HALF, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_q_token, stride_q_head, cos, sin, num_q_heads, BLOCK_Q_HEADS, HALF, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_k_token, stride_k_head, cos, sin, num_kv_heads, BLOCK_KV_HEADS, HALF, BLOCK_HALF)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by positions [T] int64 through cos_sin [P, R]
    float32 (R <= D, even). Positions must lie in [0, P): they are not checked on the device.

    Grid: (T,), one program per token rotating all its q heads and then all its k heads as
    [heads, R/2] tiles, so cos and sin are read once per token. Tuned for: nothing yet measured;
    the tiles are sized for Llama-3-8B (32 q heads, 8 kv heads, D = 128: 4 warps, 75 registers a
    thread and no spills for sm_90 by ptxas), and a warp per 1024 elements of a wider q half-tile
    (4 to 16). Rounding: cos and sin are cast to the activation dtype and each product and sum is
    rounded to it, as the torch backend does. The Triton interpreter rounds float32 -> bf16 by
    truncation, so bf16 is checked on a GPU only."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.dtype != q.dtype:
        raise ValueError(f"rotary: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must be [T, H, D] alike")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"rotary: q and k need unit stride along D, got {q.stride()} and {k.stride()}")
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(f"rotary: positions must be [T] int64, got {tuple(positions.shape)} {positions.dtype}")
    rotary_dim = cos_sin.shape[1]
    if cos_sin.dim() != 2 or cos_sin.dtype != torch.float32 or rotary_dim % 2 or rotary_dim > q.shape[2]:
        raise ValueError(f"rotary: cos_sin must be [P, R] float32 with R even and <= {q.shape[2]}, got {tuple(cos_sin.shape)}")
    cos_sin = cos_sin.contiguous()
    if q.shape[0] == 0:
        return
    half = rotary_dim // 2
    block_half, block_q_heads = triton.next_power_of_2(half), triton.next_power_of_2(q.shape[1])
    _rotary_kernel[(q.shape[0],)](
        q,
        k,
        positions,
        cos_sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin.stride(0),
        q.shape[1],
        k.shape[1],
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_KV_HEADS=triton.next_power_of_2(k.shape[1]),
        num_warps=min(max(block_q_heads * block_half // 1024, 4), 16),  # ~16 q elements a thread per half
        **COMPILE_OPTIONS,
    )


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend's rotation (gpu/backends/torch/ops.py) on the first R dims of each head,
    for tests: returns rotated copies and leaves q and k alone."""
    rotary_dim = cos_sin.shape[1]
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, R/2] each
    cos, sin = cos.to(q.dtype)[:, None, :], sin.to(q.dtype)[:, None, :]  # rounded to the dtype, as HF

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)  # torch/ops.py's `_rotate`, the rest passed through
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]), dim=-1)

    return rotate(q), rotate(k)
