"""The paged KV cache: how many blocks fit, and their allocation.

One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim] in the model dtype:
index 0 holds keys, 1 values. Block b of every layer belongs to the same sequence, so the
scheduler hands out block ids once for all layers. `copy_blocks` does a plan's copy-on-write
copies (a forked sequence about to write into a block it shares).
"""

from __future__ import annotations

import torch

from conveyor.config.engine import CacheConfig
from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig

GIB = 1024**3


def bytes_per_block(model: ModelConfig, block_size: int) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    element_size = torch.empty((), dtype=getattr(torch, model.dtype)).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element_size


def num_blocks_for_memory(model: ModelConfig, cache: CacheConfig, device: torch.device | str) -> int:
    """How many blocks this device can hold.

    A fixed cache.num_kv_blocks wins. On CPU the pool is cache.cpu_kv_cache_gib. On CUDA it is
    gpu_memory_utilization of the device's total memory less what is in use now: call this after
    loading the model and after a profile forward at the full token budget, without emptying
    torch's allocator cache, so that the activations' peak counts as in use.
    """
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = bytes_per_block(model, cache.block_size)
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


def allocate_kv_caches(model: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, Hkv, D] tensor per layer."""
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    dtype = getattr(torch, model.dtype)
    # Zeroed, not empty: padded block-table entries read block 0, and garbage there could be NaN
    # (masked scores are dropped, but NaN * 0 in the value product is not).
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]


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
    for cache in kv_caches:  # [2, num_blocks, block_size, Hkv, D]
        cache.index_copy_(1, dst_t, cache.index_select(1, src_t))
