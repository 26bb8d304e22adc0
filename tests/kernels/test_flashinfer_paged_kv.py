"""FlashInfer's CSR pages built from conveyor's block tables (gpu/backends/triton/flashinfer_paged_kv.py).

CPU only, no FlashInfer needed: the test reads every row's keys back through the CSR form the
way FlashInfer's kernels walk it (pages in order, the last one cut at kv_last_page_len) and
compares them with the keys read through the block table, so a wrong page, order or length
changes the tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.gpu.backends.triton.flashinfer_paged_kv import flashinfer_cache, paged_kv_of


def tokens_through_table(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [N, bs, ...] -> the row's first seq_len entries, block by block."""
    block_size = cache.shape[1]
    return torch.cat([cache[int(table[pos // block_size]), pos % block_size][None] for pos in range(seq_len)])


def tokens_through_csr(cache: torch.Tensor, paged, row: int) -> torch.Tensor:
    lo, hi = int(paged.kv_indptr[row]), int(paged.kv_indptr[row + 1])
    pages = [cache[int(p)] for p in paged.kv_indices[lo:hi]]
    pages[-1] = pages[-1][: int(paged.kv_last_page_len[row])]
    return torch.cat(pages)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 5)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 16, 32]),
    padding=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_csr_reads_the_same_tokens_as_the_block_table(rows, block_size, padding, seed):
    """rows: (seq_len, tokens cached before the step) per row, the step's queries the rest (at
    least one); tables padded with random block ids past each row's blocks, never to be read."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in rows]
    query_lens = [max(1, s - c) for s, c in rows]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 4
    width = max(needed) + padding
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(rows), width), generator=gen, dtype=torch.int32)
    used = 0
    for r, n in enumerate(needed):
        tables[r, :n] = pool[used : used + n].to(torch.int32)
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, 2, 4, generator=gen)
    paged = paged_kv_of(tables, query_lens, seq_lens, block_size)
    assert paged.kv_indptr.tolist() == [sum(needed[:r]) for r in range(len(rows) + 1)]
    assert paged.qo_indptr.tolist() == [sum(query_lens[:r]) for r in range(len(rows) + 1)]
    assert all(t.dtype == torch.int32 for t in (paged.qo_indptr, paged.kv_indptr, paged.kv_indices, paged.kv_last_page_len))
    assert paged.num_pages == sum(needed) == paged.kv_indices.numel()
    k_pages, v_pages = flashinfer_cache(kv_cache)
    for r, seq_len in enumerate(seq_lens):
        assert 1 <= int(paged.kv_last_page_len[r]) <= block_size
        for pages, plane in ((k_pages, 0), (v_pages, 1)):
            want = tokens_through_table(kv_cache[plane], tables[r], seq_len)
            torch.testing.assert_close(tokens_through_csr(pages, paged, r), want, rtol=0, atol=0)


def test_a_full_last_page_and_a_one_token_page():
    tables = torch.tensor([[7, 3, 0], [5, 0, 0]], dtype=torch.int32)
    paged = paged_kv_of(tables, [1, 1], [32, 17], 16)
    assert paged.kv_indices.tolist() == [7, 3, 5, 0]
    assert paged.kv_last_page_len.tolist() == [16, 1]
    assert paged.kv_indptr.tolist() == [0, 2, 4]


def test_the_cache_pair_is_a_view():
    kv_cache = torch.zeros(2, 3, 16, 2, 8)
    k, v = flashinfer_cache(kv_cache)
    assert k.shape == (3, 16, 2, 8) and k.data_ptr() == kv_cache.data_ptr()
    assert v.data_ptr() == kv_cache[1].data_ptr()


def test_rejects_what_the_tables_cannot_hold():
    tables = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="more than 2 blocks"):
        paged_kv_of(tables, [1, 1], [33, 5], 16)
    with pytest.raises(ValueError, match="query_len"):
        paged_kv_of(tables, [0, 1], [3, 5], 16)
    with pytest.raises(ValueError, match="seq lens"):
        paged_kv_of(tables, [1], [3], 16)
    with pytest.raises(ValueError, match="expected"):
        flashinfer_cache(torch.zeros(3, 2, 16, 2, 8))
