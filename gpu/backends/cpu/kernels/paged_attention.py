"""The ctypes face of paged_attention.cpp: argument checks, then one C call.

`paged_attention_kernel()` is None where the library cannot be had (see build.load_library),
and the cpu backend (gpu/backends/cpu) then keeps the torch backend's attention, which computes
the same function.

The cache is [2, num_blocks, Hkv, block_size * D] float32, or float8_e4m3fn codes (--kv-cache-dtype
fp8; gpu/backends/cpu/attention.py): per (block, kv head), keys as [D, block_size] and values as
[block_size, D]. block_size is the last dim over head_dim.

A decode step of a small model is 30 layers of microseconds-long calls, so the checks of what
every layer shares are done once: `cache_view` once per cache (CpuAttention makes them as it
allocates), `step_tables` once per step (the block tables and lengths all layers read). `attend`
and `write` then check only the per-layer tensors; `__call__` and `write_kv` take the plain
tensors and do all of it, for tests and one-off callers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.program import Kernel
from conveyor.gpu.kv.kv_fp8 import FP8

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@dataclasses.dataclass(frozen=True)
class CacheView:
    """One layer's cache, checked: its key and value halves' addresses and its shape's ints."""

    cache: torch.Tensor  # [2, N, Hkv, bs * D]; kept so that the addresses stay its own
    keys: int
    values: int
    num_kv_heads: int
    block_size: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class StepTables:
    """A step's block tables [B, max_blocks], query starts [B + 1] and lengths [B], checked."""

    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # kept: the addresses are theirs
    addresses: tuple[int, int, int]
    num_rows: int
    max_blocks: int

    def holds(self, block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> bool:
        mine = self.tensors
        return mine[0] is block_tables and mine[1] is query_start_loc and mine[2] is seq_lens


class PagedAttentionKernel:
    """conveyor_paged_attention_{f32,fp8} and conveyor_write_kv_{f32,u8} with their argument
    checks; a float32 cache or an e4m3 one. They own the order of elements inside a cache block
    (see the .cpp): a cache they serve is read and written by them alone, block copies aside."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        # The status (0, or -1 for a shape the kernel cannot take) is read on the first, eager call;
        # a replay repeats a call that returned 0.
        attend_args = [_ptr] * 7 + [_i64] * 7 + [_f32] * 2  # ..., scale, softcap (, v_scale for fp8)
        self._attend = {
            torch.float32: Kernel(lib, "conveyor_paged_attention_f32", attend_args, ctypes.c_int),
            FP8: Kernel(lib, "conveyor_paged_attention_fp8", [*attend_args, _f32], ctypes.c_int),
        }
        write_args = [_ptr] * 5 + [_i64] * 4
        self._write = {
            torch.float32: Kernel(lib, "conveyor_write_kv_f32", write_args),
            FP8: Kernel(lib, "conveyor_write_kv_u8", write_args),
        }

    def cache_view(self, kv_cache: torch.Tensor, head_dim: int) -> CacheView:
        """kv_cache [2, N, Hkv, bs * D] float32 or e4m3 codes, contiguous -> its CacheView."""
        num_kv_heads, block_size = _cache_shape(kv_cache, head_dim)
        if kv_cache.dtype not in self._attend or not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
            raise ValueError(f"the CPU paged attention kernel takes a contiguous float32 or e4m3 CPU cache, got {kv_cache.dtype}")
        return CacheView(kv_cache, kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), num_kv_heads, block_size, head_dim)

    def step_tables(self, block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> StepTables:
        """The step's tables, all int32, contiguous, on the CPU, of matching lengths -> StepTables."""
        tensors = (block_tables, query_start_loc, seq_lens)
        for name, t in zip(("block_tables", "query_start_loc", "seq_lens"), tensors):
            if t.dtype != torch.int32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous int32 CPU tensor")
        num_rows, max_blocks = block_tables.shape
        if query_start_loc.shape != (num_rows + 1,) or seq_lens.shape != (num_rows,):
            raise ValueError("query_start_loc must be [B + 1] and seq_lens [B]")
        return StepTables(tensors, (block_tables.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr()), num_rows, max_blocks)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """kv_cache [2, N, Hkv, bs * D]; k, v [T, Hkv, D] in the cache's dtype (float32, or e4m3
        codes, quantized by the caller); slot_mapping [T] int64, distinct slots."""
        self.write(self.cache_view(kv_cache, k.shape[-1]), k, v, slot_mapping)

    def write(self, cache: CacheView, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """write_kv into a checked cache."""
        k, v = k.contiguous(), v.contiguous()
        dtype = cache.cache.dtype
        if k.dtype != dtype or v.dtype != dtype:
            raise ValueError(
                f"the CPU paged attention kernel writes k and v of the cache's dtype (float32 or float8_e4m3fn): "
                f"got {k.dtype}, {v.dtype} for {dtype}"
            )
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            raise ValueError("slot_mapping must be a contiguous int64 CPU tensor")
        if k.shape != v.shape or k.shape != (slot_mapping.shape[0], cache.num_kv_heads, cache.head_dim):
            raise ValueError(f"k and v must be [T, {cache.num_kv_heads}, {cache.head_dim}] for {slot_mapping.shape[0]} slots")
        self._write[dtype](
            k.data_ptr(),
            v.data_ptr(),
            cache.keys,
            cache.values,
            slot_mapping.data_ptr(),
            k.shape[0],
            cache.num_kv_heads,
            cache.head_dim,
            cache.block_size,
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
        view, tables = self.cache_view(kv_cache, q.shape[-1]), self.step_tables(block_tables, query_start_loc, seq_lens)
        return self.attend(q, view, tables, sliding_window, scale, softcap, k_scale, v_scale)

    def attend(
        self,
        q: torch.Tensor,
        cache: CacheView,
        tables: StepTables,
        sliding_window: int | None,
        scale: float,
        softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """__call__ on a checked cache and step tables."""
        q = q.contiguous()
        num_heads, head_dim = q.shape[1], q.shape[2]
        dtype = cache.cache.dtype
        if q.dtype != torch.float32 or head_dim != cache.head_dim:
            raise ValueError(f"the CPU paged attention kernel takes float32 q [T, Hq, {cache.head_dim}]: {q.dtype} {tuple(q.shape)}")
        if dtype == torch.float32 and (k_scale, v_scale) != (1.0, 1.0):
            raise ValueError("KV scales are for an fp8 cache")
        out = torch.empty_like(q)
        # The key scale folds into the query's: q . (code * k_scale) = (q * scale * k_scale) . code.
        scales = (scale * k_scale, softcap or 0.0) + ((v_scale,) if dtype == FP8 else ())
        status = self._attend[dtype](
            q.data_ptr(),
            cache.keys,
            cache.values,
            *tables.addresses,
            out.data_ptr(),
            tables.num_rows,
            tables.max_blocks,
            num_heads,
            cache.num_kv_heads,
            head_dim,
            cache.block_size,
            sliding_window or 0,
            *scales,
        )
        if status != 0:
            raise ValueError(
                f"CPU paged attention does not handle {num_heads} heads over {cache.num_kv_heads} kv heads "
                f"with blocks of {cache.block_size}"
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
