"""The paged KV cache's pool: how many blocks fit, and copying whole blocks.

The attention backend (gpu/backends) allocates the cache, one tensor per layer, in its own layout
inside a block, with dim 0 keys/values and dim 1 blocks: [2, num_blocks, ...]. Block b of every
layer belongs to the same sequence, so the scheduler hands out block ids once for all layers.
`copy_blocks` does a plan's copy-on-write copies (a forked sequence about to write into a block
it shares), whole blocks, so it serves every layout.
"""

from __future__ import annotations

import torch

from conveyor.config.engine import CacheConfig
from conveyor.config.errors import ConfigError
from conveyor.gpu.kv.kv_fp8 import as_bytes

GIB = 1024**3


def num_blocks_for_memory(per_block: int, cache: CacheConfig, device: torch.device | str) -> int:
    """How many blocks of `per_block` bytes (all layers: the backend's bytes_per_block) this
    device can hold.

    A fixed cache.num_kv_blocks wins. On CPU the pool is cache.cpu_kv_cache_gib. On CUDA it is
    gpu_memory_utilization of the device's total memory less what is in use now: call this after
    loading the model and after a profile forward at the full token budget, without emptying
    torch's allocator cache, so that the activations' peak counts as in use.
    """
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free  # the model, the profile run's peak, and other processes
        budget = cache.gpu_memory_utilization * total - in_use
    else:
        budget = cache.cpu_kv_cache_gib * GIB
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ConfigError(
            f"no memory left for the KV cache on {device} (budget {budget / GIB:.2f} GiB, "
            f"{per_block / 2**20:.2f} MiB per block): raise gpu_memory_utilization or shorten the model"
        )
    return num_blocks


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy block src into block dst, keys and values, in every layer, for each (src, dst).

    All sources are read before any destination is written; destinations must be distinct.
    """
    if not pairs:
        return
    num_blocks = kv_caches[0].shape[1]
    src, dst = zip(*pairs)
    if not 0 <= min(src + dst) <= max(src + dst) < num_blocks:
        raise ValueError(f"block copy {pairs} outside [0, {num_blocks})")
    if len(set(dst)) != len(dst):
        raise ValueError(f"block copy {pairs} writes a block twice")
    device = kv_caches[0].device
    src_t = torch.tensor(src, dtype=torch.int64).to(device, non_blocking=True)  # [P]
    dst_t = torch.tensor(dst, dtype=torch.int64).to(device, non_blocking=True)  # [P]
    for cache in kv_caches:  # [2, num_blocks, ...]; fp8 codes copied as bytes
        cache = as_bytes(cache)
        cache.index_copy_(1, dst_t, cache.index_select(1, src_t))
