"""The cpu attention backend: the C++ paged attention of gpu/backends/cpu/kernels/paged_attention.cpp
(float32, CPU), reading the cache in place through the block tables, no gathers, no masks; sliding windows
and the logit soft-cap are the kernel's arguments.

Cache layout: one tensor per layer, [2, num_blocks, Hkv, block_size * D] float32, or e4m3 codes
with --kv-cache-dtype fp8 (quantized here in torch, gpu/kv/kv_fp8.py; the kernel copies the codes
into place and widens them to float as it reads), the order the kernel reads and writes
(head-major, keys transposed, values not):
- keys of block b, head h: cache[0, b, h] viewed as [D, block_size];
- values of block b, head h: cache[1, b, h] viewed as [block_size, D].
One (block, head) tile is contiguous (see the .cpp for why). Only this backend's write_kv and
attend touch the inside of a block; copy-on-write copies whole blocks (the base class's).

What all layers share is checked once (kernels/paged_attention.py): each cache's view as it is
allocated, and a step's tables on its first layer, reused while the metadata's tensors are the
same objects.
"""

from __future__ import annotations

import torch

from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata
from conveyor.gpu.backends.cpu.kernels.paged_attention import CacheView, PagedAttentionKernel, StepTables
from conveyor.gpu.kv.kv_fp8 import UNIT_SCALES, KVScales, as_bytes, dequantize_kv, quantize_kv


class CpuAttention(AttentionBackend):
    kv_layout = "[2, num_blocks, Hkv, block_size * D]: keys [D, block_size], values [block_size, D] per (block, head)"
    supports_decode_graphs = True  # the kernels read the tables, lengths and slots from tensors only

    def __init__(self, model, device: torch.device, kernel: PagedAttentionKernel, kv_dtype: str | None = None) -> None:
        super().__init__(model, device, kv_dtype)
        self.kernel = kernel
        self._views: dict[int, CacheView] = {}  # id(cache) -> its view, for the caches allocated last
        self._tables: StepTables | None = None  # the last step's

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.num_kv_heads, block_size * self.head_dim)
        caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]
        self._views = {id(c): self.kernel.cache_view(c, self.head_dim) for c in caches}
        return caches

    def _view(self, kv_cache: torch.Tensor) -> CacheView:
        view = self._views.get(id(kv_cache))
        # A cache this backend did not allocate (a test's own) is checked on every call.
        return view if view is not None and view.cache is kv_cache else self.kernel.cache_view(kv_cache, self.head_dim)

    def write_kv(self, kv_cache, k, v, meta: AttentionMetadata, kv_scales: KVScales = UNIT_SCALES) -> None:
        if self.kv_fp8:
            k, v = quantize_kv(k, kv_scales.k), quantize_kv(v, kv_scales.v)
        self.kernel.write(self._view(kv_cache), k, v, meta.slot_mapping)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, kv_scales: KVScales = UNIT_SCALES) -> torch.Tensor:
        tables = self._tables
        if tables is None or not tables.holds(meta.block_tables, meta.query_start_loc, meta.seq_lens):
            tables = self._tables = self.kernel.step_tables(meta.block_tables, meta.query_start_loc, meta.seq_lens)
        scales = (kv_scales.k, kv_scales.v) if self.kv_fp8 else (1.0, 1.0)
        return self.kernel.attend(q, self._view(kv_cache), tables, meta.sliding_window, scale, self.softcap, *scales)

    def read_kv(self, kv_cache, block_ids, seq_len: int, dtype: torch.dtype, kv_scales: KVScales = UNIT_SCALES):
        """[seq_len, Hkv, D] keys and values from this layout (the base class's generic extents
        path, gpu/backends/extents.py): keys [D, block_size] and values [block_size, D] per (block, head)."""
        num_blocks, heads, d = block_ids.shape[0], self.num_kv_heads, self.head_dim
        blocks = as_bytes(kv_cache)[:, block_ids].view(kv_cache.dtype)  # [2, nb, Hkv, bs * D]
        keys = blocks[0].view(num_blocks, heads, d, -1).permute(0, 3, 1, 2).reshape(-1, heads, d)[:seq_len]
        values = blocks[1].view(num_blocks, heads, -1, d).permute(0, 2, 1, 3).reshape(-1, heads, d)[:seq_len]
        if self.kv_fp8:
            return dequantize_kv(keys, kv_scales.k, dtype), dequantize_kv(values, kv_scales.v, dtype)
        return keys.to(dtype), values.to(dtype)
