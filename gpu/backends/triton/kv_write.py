"""Writing the step's new K/V into the paged cache through the slot mapping, as one Triton kernel.

Layout: kv_cache [2, num_blocks, block_size, Hkv, D] (keys, then values); k, v [T, Hkv, D], the
step's rotated keys and values (views into a fused qkv buffer are fine: only unit stride along D
is required); slot_mapping [T] int64, slot = block * block_size + offset, negative for padding
tokens (CUDA-graph padding), which are skipped. Values are cast to the cache's dtype on store;
an fp8 cache's e4m3 codes are made by torch first (gpu/kv/kv_fp8.py `quantize_kv`: the interpreter's
float -> e4m3 cast truncates) and stored as bytes.

Grid: (T,), one program per token, writing its [Hkv, D] key and value tiles (BLOCK_H and BLOCK_D
the next powers of two). Tuned for: nothing yet; checked under TRITON_INTERPRET=1 for correctness
only. The work is a copy of 2 * Hkv * D elements per token, bound by memory on any GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.gpu.kv.kv_fp8 import UNIT_SCALES, KVScales, as_bytes, is_fp8, quantize_kv


@triton.jit
def _write_kv_kernel(
    kv_ptr,
    k_ptr,
    v_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kv,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kt,
    stride_khead,
    stride_vt,
    stride_vhead,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padding token
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_khead + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vhead + offs_d[None, :], mask=mask)
    dst = kv_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + offs_h[:, None] * stride_kh + offs_d[None, :]
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: KVScales = UNIT_SCALES
) -> None:
    """kv_cache [2, N, bs, Hkv, D]; k, v [T, Hkv, D]; slot_mapping [T] int64 (negative: skip).
    Slots must be distinct; the cache is written in place (an fp8 one: k / kv_scales.k, v /
    kv_scales.v as e4m3 codes)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"write_kv: kv_cache must be [2, N, bs, Hkv, D], got {tuple(kv_cache.shape)}")
    num_tokens = slot_mapping.shape[0]
    expected = (num_tokens, *kv_cache.shape[3:])
    if k.shape != expected or v.shape != expected:
        raise ValueError(f"write_kv: k and v must be {expected}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(f"write_kv: slot_mapping must be [T] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("write_kv: k, v and kv_cache need unit stride along D")
    if num_tokens == 0:
        return
    if is_fp8(kv_cache.dtype):  # [T, Hkv, D] codes, contiguous
        k, v = as_bytes(quantize_kv(k, kv_scales.k)), as_bytes(quantize_kv(v, kv_scales.v))
        kv_cache = as_bytes(kv_cache)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    _write_kv_kernel[(num_tokens,)](
        kv_cache,
        k,
        v,
        slot_mapping.contiguous(),
        num_kv_heads,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def reference_write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: KVScales = UNIT_SCALES
) -> None:
    """The same write in torch, for tests: index_copy_ over the flattened slots, padding dropped."""
    keep = slot_mapping >= 0
    k, v = k[keep], v[keep]
    if is_fp8(kv_cache.dtype):
        k, v = as_bytes(quantize_kv(k, kv_scales.k)), as_bytes(quantize_kv(v, kv_scales.v))
    else:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    flat = as_bytes(kv_cache).view(2, -1, *kv_cache.shape[-2:])  # [2, N * bs, Hkv, D]
    flat[0].index_copy_(0, slot_mapping[keep], k)
    flat[1].index_copy_(0, slot_mapping[keep], v)
