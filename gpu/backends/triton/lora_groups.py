"""A pass's tokens grouped by adapter slot on the device, for the SGMV kernels (lora_sgmv_shrink.py,
lora_sgmv_expand.py): `lora_groups(slots [T], S)` -> groups [S + 1 + T] int32, once a pass.

Layout: groups[:S + 1] are the segment starts (slot s's tokens are positions starts[s] to
starts[s + 1] - 1 of the order; starts[S] is the number of adapter tokens), groups[S + 1:] the
order: token indices by slot, in token order within a slot (a stable counting sort). Tokens with
slots[t] < 0 (the base model) are in no segment, and the order's tail past starts[S] is not
written: the kernels never read it. A slot with no token has an empty segment.

One program walks `slots` twice (count, then place), BLOCK_T tokens at a time against all S slots
at once: the grid and every buffer come from shapes alone and nothing syncs with the host, so a
decode graph captures it with `slots` among its static inputs. `segment_tile` is the kernels'
reading of the layout: tiles of BLOCK_M positions go slot by slot, cdiv(count, BLOCK_M) a slot, so
cdiv(T, BLOCK_M) + min(S, T) tiles always cover them (each non-empty segment's ragged tail adds at
most one) and the programs past the last tile return at once.

KERNEL_BY_ROWS is the Triton backend's choice between these kernels and lora.py's (TritonOps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (least rows T of a pass, kernel), ascending: the last entry with least T <= T holds. "bgmv": lora.py,
# each token's own programs; "sgmv": tokens grouped by slot, tiles on the tensor cores. Filled from
# `ops/gpu/lora_bench.py`'s "choose" line on a GPU; until measured, today's kernels at every T.
KERNEL_BY_ROWS: tuple[tuple[int, str], ...] = ((1, "bgmv"),)
HIT_TILE = 8192  # elements of the [BLOCK_S, BLOCK_T] slot-match tile


def kernel_for(num_rows: int, table: tuple[tuple[int, str], ...] | None = None) -> str:
    """The table's kernel (None: KERNEL_BY_ROWS as it is now) for a pass of `num_rows` tokens
    ("bgmv" below its first entry)."""
    entries = KERNEL_BY_ROWS if table is None else table
    return next((kernel for least, kernel in reversed(entries) if num_rows >= least), "bgmv")


@triton.jit
def _lora_groups_kernel(slots_ptr, groups_ptr, T, S, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    counts = tl.zeros((BLOCK_S,), tl.int32)
    for start in range(0, T, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        slot = tl.load(slots_ptr + t, mask=t < T, other=-1)
        hit = (slot[None, :] == s[:, None]) & s_ok[:, None]  # [BLOCK_S, BLOCK_T]
        counts += tl.sum(hit.to(tl.int32), 1)
    starts = tl.cumsum(counts, 0) - counts  # [BLOCK_S], exclusive
    tl.store(groups_ptr + s, starts, mask=s_ok)
    tl.store(groups_ptr + S, tl.sum(counts, 0))
    order = groups_ptr + S + 1
    for start in range(0, T, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        slot = tl.load(slots_ptr + t, mask=t < T, other=-1)
        hit = ((slot[None, :] == s[:, None]) & s_ok[:, None]).to(tl.int32)  # [BLOCK_S, BLOCK_T]
        before = tl.cumsum(hit, 1) - hit  # this chunk's tokens of the same slot before each
        place = tl.sum(hit * (starts[:, None] + before), 0)  # [BLOCK_T]: each adapter token's position
        tl.store(order + place, t, mask=tl.sum(hit, 0) > 0)
        starts += tl.sum(hit, 1)


@triton.jit
def segment_tile(groups_ptr, S, tile, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program `tile`'s (slot, first position, end position) in the order; slot >= S past the
    last tile (the program has nothing to do)."""
    s = tl.arange(0, BLOCK_S)
    lo = tl.load(groups_ptr + s, mask=s < S, other=0)
    hi = tl.load(groups_ptr + s + 1, mask=s < S, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M  # [BLOCK_S]
    ends = tl.cumsum(tiles, 0)  # [BLOCK_S]: the tiles of slots 0..s
    slot = tl.sum((ends <= tile).to(tl.int32), 0)  # slots whose tiles all come before this one (padding counts only past the last)
    mine = s == slot
    first = tl.sum(tl.where(mine, lo + (tile - ends + tiles) * BLOCK_M, 0), 0)
    end = tl.sum(tl.where(mine, hi, 0), 0)
    return slot, first, end


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """The grid's tiles along the order: enough for any grouping of num_tokens over num_slots."""
    return triton.cdiv(num_tokens, block_m) + min(num_slots, num_tokens)


def lora_groups(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """slots [T] int64 (-1: the base model; else < num_slots) -> groups [S + 1 + T] int32 (above)."""
    if slots.dim() != 1 or num_slots < 1:
        raise ValueError(f"lora_groups: slots {tuple(slots.shape)} are not [T], or num_slots {num_slots} < 1")
    num_tokens = slots.shape[0]
    groups = torch.empty(num_slots + 1 + num_tokens, dtype=torch.int32, device=slots.device)
    block_s = triton.next_power_of_2(num_slots)
    block_t = max(16, min(1024, triton.next_power_of_2(max(num_tokens, 1)), HIT_TILE // block_s))
    _lora_groups_kernel[(1,)](slots, groups, num_tokens, num_slots, BLOCK_T=block_t, BLOCK_S=block_s, num_warps=4)
    return groups


def lora_groups_reference(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts [S + 1], order [starts[S]]) int64 by torch's stable sort: what lora_groups writes."""
    adapter = slots.cpu().long()
    order = torch.argsort(torch.where(adapter < 0, num_slots, adapter), stable=True)[: int((adapter >= 0).sum())]
    counts = torch.bincount(adapter[adapter >= 0], minlength=num_slots)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]), order
