"""The ctypes face of paged_attention.cpp: argument checks, then one C call.

`paged_attention_kernel()` is None where the library cannot be had (see build.load_library),
and the cpu backend (gpu/backends/cpu) then keeps the torch backend's attention, which computes
the same function.

The cache is [2, num_blocks, Hkv, block_size * D] float32, or float8_e4m3fn codes (--kv-cache-dtype
fp8; gpu/backends/cpu/attention.py): per (block, kv head), keys as [D, block_size] and values as
[block_size, D]. block_size is the last dim over head_dim.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.kv_fp8 import FP8

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class PagedAttentionKernel:
    """conveyor_paged_attention_{f32,fp8} and conveyor_write_kv_{f32,u8} with their argument
    checks; a float32 cache or an e4m3 one. They own the order of elements inside a cache block
    (see the .cpp): a cache they serve is read and written by them alone, block copies aside."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._attend = {torch.float32: lib.conveyor_paged_attention_f32, FP8: lib.conveyor_paged_attention_fp8}
        for fn, scales in ((self._attend[torch.float32], 2), (self._attend[FP8], 3)):
            fn.restype = ctypes.c_int
            fn.argtypes = [_ptr] * 7 + [_i64] * 7 + [_f32] * scales  # scale, softcap (, v_scale)
        self._write = {torch.float32: lib.conveyor_write_kv_f32, FP8: lib.conveyor_write_kv_u8}
        for fn in self._write.values():
            fn.restype = None
            fn.argtypes = [_ptr] * 5 + [_i64] * 4

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """kv_cache [2, N, Hkv, bs * D]; k, v [T, Hkv, D] in the cache's dtype (float32, or e4m3
        codes, quantized by the caller); slot_mapping [T] int64, distinct slots."""
        k, v = k.contiguous(), v.contiguous()
        num_kv_heads, block_size = _cache_shape(kv_cache, k.shape[-1])
        head_dim = k.shape[-1]
        if kv_cache.dtype not in self._write or k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:
            raise ValueError(
                f"the CPU paged attention kernel writes k and v of the cache's dtype (float32 or float8_e4m3fn): "
                f"got {k.dtype}, {v.dtype} for {kv_cache.dtype}"
            )
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            raise ValueError("slot_mapping must be a contiguous int64 CPU tensor")
        if k.shape != v.shape or k.shape != (slot_mapping.shape[0], num_kv_heads, head_dim):
            raise ValueError(f"k and v must be [T, {num_kv_heads}, {head_dim}] for {slot_mapping.shape[0]} slots")
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
        self._write[kv_cache.dtype](
            k.data_ptr(),
            v.data_ptr(),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            slot_mapping.data_ptr(),
            k.shape[0],
            num_kv_heads,
            head_dim,
            block_size,
        )

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        sliding_window: int | None,
        scale: float,
        softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q [T, Hq, D] float32; kv_cache [2, N, Hkv, bs * D] float32 or e4m3 codes, read as code
        * k_scale (keys) and code * v_scale (values) (this step's k/v already written);
        block_tables [B, max_blocks], query_start_loc [B + 1], seq_lens [B], all int32 and
        contiguous -> out [T, Hq, D]. softcap: scores -> softcap * tanh(scores / softcap) after
        the scale (Gemma 2); None: none."""
        q = q.contiguous()
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = _cache_shape(kv_cache, head_dim)
        num_rows, max_blocks = block_tables.shape
        for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
            if t.dtype != torch.int32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous int32 CPU tensor")
        if q.dtype != torch.float32 or kv_cache.dtype not in self._attend or not kv_cache.is_contiguous():
            raise ValueError("the CPU paged attention kernel takes float32 q and a contiguous float32 or float8_e4m3fn cache")
        if kv_cache.dtype == torch.float32 and (k_scale, v_scale) != (1.0, 1.0):
            raise ValueError("KV scales are for an fp8 cache")
        if query_start_loc.shape != (num_rows + 1,) or seq_lens.shape != (num_rows,):
            raise ValueError("query_start_loc must be [B + 1] and seq_lens [B]")
        out = torch.empty_like(q)
        # The key scale folds into the query's: q . (code * k_scale) = (q * scale * k_scale) . code.
        scales = (scale * k_scale, softcap or 0.0) + ((v_scale,) if kv_cache.dtype == FP8 else ())
        status = self._attend[kv_cache.dtype](
            q.data_ptr(),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            block_tables.data_ptr(),
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_rows,
            max_blocks,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            sliding_window or 0,
            *scales,
        )
        if status != 0:
            raise ValueError(
                f"CPU paged attention does not handle {num_heads} heads over {num_kv_heads} kv heads with blocks of {block_size}"
            )
        return out


def _cache_shape(kv_cache: torch.Tensor, head_dim: int) -> tuple[int, int]:
    """(Hkv, block_size) of a [2, N, Hkv, block_size * D] cache."""
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2 or kv_cache.shape[3] % head_dim:
        raise ValueError(f"the KV cache must be [2, N, Hkv, block_size * {head_dim}], got {tuple(kv_cache.shape)}")
    return kv_cache.shape[2], kv_cache.shape[3] // head_dim


@functools.cache
def paged_attention_kernel() -> PagedAttentionKernel | None:
    lib = load_library("paged_attention")
    return None if lib is None else PagedAttentionKernel(lib)
