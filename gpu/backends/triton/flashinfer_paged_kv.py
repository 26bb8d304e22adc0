"""A step's paged KV as FlashInfer's wrappers take it, built from conveyor's block tables.

FlashInfer's BatchDecode/BatchPrefillWithPagedKVCacheWrapper `plan` takes the cache's pages in
CSR form: kv_indptr [B + 1] (row r's pages are kv_indices[kv_indptr[r]:kv_indptr[r + 1]], in
order), kv_indices [pages] and kv_last_page_len [B] (entries used in each row's last page,
1..block_size), with qo_indptr [B + 1] for a prefill (conveyor's query_start_loc), all int32.
Conveyor keeps fixed-width tables [B, max_blocks] padded past each row's blocks (never read).
The cache needs no copy: conveyor's [2, N, block_size, Hkv, D] is FlashInfer's "NHD" paged
layout as the pair (kv_cache[0], kv_cache[1]).

Invariants: the counts come from host seq lens (a plan reads its indptr on the host anyway), so
nothing here syncs with the device; kv_indices is gathered on the tables' device, the rest is on
the host. Used by ops/gpu/attention_bench.py's FlashInfer candidates; no serving path uses
FlashInfer yet (docs/benchmarks/gpu-runs.md says what a measurement must show first).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One step's pages in FlashInfer's CSR form (int32)."""

    qo_indptr: torch.Tensor  # [B + 1], host: row r's queries are q[qo_indptr[r]:qo_indptr[r + 1]]
    kv_indptr: torch.Tensor  # [B + 1], host
    kv_indices: torch.Tensor  # [kv_indptr[-1]], on the block tables' device
    kv_last_page_len: torch.Tensor  # [B], host

    @property
    def num_pages(self) -> int:
        return int(self.kv_indptr[-1])


def paged_kv_of(block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int], block_size: int) -> PagedKV:
    """block_tables [B, max_blocks] int32 (any device); query_lens, seq_lens: one int per row
    (host), seq_len >= query_len >= 1 as AttentionMetadata keeps them -> the step's PagedKV."""
    num_rows, max_blocks = block_tables.shape
    if len(query_lens) != num_rows or len(seq_lens) != num_rows:
        raise ValueError(f"paged_kv_of: {num_rows} table rows, {len(query_lens)} query lens, {len(seq_lens)} seq lens")
    if any(not 1 <= q <= s for q, s in zip(query_lens, seq_lens)):
        raise ValueError("paged_kv_of: every row needs 1 <= query_len <= seq_len")
    pages = [-(-s // block_size) for s in seq_lens]  # blocks each row reads
    if max(pages, default=0) > max_blocks:
        raise ValueError(f"paged_kv_of: a row of {max(seq_lens)} tokens needs more than {max_blocks} blocks of {block_size}")
    kv_indptr = torch.tensor([0, *pages], dtype=torch.int64).cumsum(0)
    qo_indptr = torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0)
    # Page p of the CSR is column p - kv_indptr[row] of its row's table: a gather, no host sync.
    device = block_tables.device
    total = int(kv_indptr[-1])
    rows = torch.repeat_interleave(torch.arange(num_rows, device=device), torch.tensor(pages, device=device), output_size=total)
    cols = torch.arange(total, device=device) - kv_indptr.to(device)[rows]
    return PagedKV(
        qo_indptr=qo_indptr.to(torch.int32),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_indices=block_tables[rows, cols].to(torch.int32),
        kv_last_page_len=torch.tensor([(s - 1) % block_size + 1 for s in seq_lens], dtype=torch.int32),
    )


def flashinfer_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Conveyor's [2, N, block_size, Hkv, D] cache -> FlashInfer's NHD (k, v) pages, views."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"flashinfer_cache: expected [2, N, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    return kv_cache[0], kv_cache[1]
