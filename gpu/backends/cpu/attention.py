"""The cpu attention backend: the C++ paged attention of gpu/backends/cpu/kernels/paged_attention.cpp
(float32, CPU), reading the cache in place through the block tables, no gathers, no masks; sliding windows
and the logit soft-cap are the kernel's arguments.

Cache layout: one tensor per layer, [2, num_blocks, Hkv, block_size * D] float32, the order the
kernel reads and writes (head-major, keys transposed, values not):
- keys of block b, head h: cache[0, b, h] viewed as [D, block_size];
- values of block b, head h: cache[1, b, h] viewed as [block_size, D].
One (block, head) tile is contiguous (see the .cpp for why). Only this backend's write_kv and
attend touch the inside of a block; copy-on-write copies whole blocks (the base class's).
"""

from __future__ import annotations

import torch

from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata
from conveyor.gpu.backends.cpu.kernels.paged_attention import PagedAttentionKernel


class CpuAttention(AttentionBackend):
    kv_layout = "[2, num_blocks, Hkv, block_size * D]: keys [D, block_size], values [block_size, D] per (block, head)"

    def __init__(self, model, device: torch.device, kernel: PagedAttentionKernel) -> None:
        super().__init__(model, device)
        self.kernel = kernel

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.num_kv_heads, block_size * self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.kernel.write_kv(kv_cache, k, v, meta.slot_mapping)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.kernel(
            q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.sliding_window, scale, self.softcap
        )
