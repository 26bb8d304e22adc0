"""Split-K (flash-decoding) paged attention: each tile's keys spread over several programs.

For steps with few rows and long contexts, where the plain kernel's (tiles, Hkv) grid would
leave most SMs idle (paged_attention.py's `choose_num_splits` decides). Same layout and tiles as
paged_attention.py; the keys a tile sees, [kv_lo, kv_hi), are cut into NUM_SPLITS runs of equal
length (a multiple of BLOCK_N, per row: a short row's splits are short too), and each program
runs the online softmax over one run and stores its unnormalised partial: o_part
[NUM_SPLITS, T, Hq, D], m_part and l_part [NUM_SPLITS, T, Hq], all float32. A run past the
row's keys stores m = -inf, l = 0. paged_attention_reduce.py then merges the splits into out.

Grid: (T // BLOCK_Q + B, Hkv, NUM_SPLITS). Tuned for: nothing yet; checked under
TRITON_INTERPRET=1 for correctness only (forced with num_splits), GPU tuning waits for a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from conveyor.gpu.backends.triton.paged_attention_launch import Tiling
from conveyor.gpu.backends.triton.paged_attention_reduce import reduce_splits
from conveyor.gpu.backends.triton.paged_attention_tile import attend_keys, find_tile, key_range, load_queries


@triton.jit
def _paged_attention_split_kernel(
    o_part_ptr,  # [NUM_SPLITS, T, Hq, D] float32, contiguous
    m_part_ptr,  # [NUM_SPLITS, T, Hq] float32, contiguous; l_part alike
    l_part_ptr,
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    v_scale,
    num_rows,
    num_tokens,
    num_heads,
    window,
    softcap_log2,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    DIRECT_DECODE: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row, q_start, q_len, tok0 = find_tile(query_start_loc_ptr, tl.program_id(0), num_rows, BLOCK_Q, DIRECT_DECODE)
    if tok0 >= q_len:
        return
    q, tok, head, row_valid = load_queries(
        q_ptr, stride_qt, stride_qh, q_start, q_len, tok0, kv_head, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D
    )
    if UPCAST:
        q = q.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + row)
    kv_lo, kv_hi = key_range(seq_len, q_len, tok0, window, BLOCK_Q, BLOCK_N, HAS_WINDOW)
    run = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N  # BLOCK_N-aligned: no key counted twice
    run_lo = kv_lo + split * run
    acc, m, denom = attend_keys(
        q,
        seq_len - q_len + tok,
        kv_ptr + kv_head * stride_kh,
        block_tables_ptr + row.to(tl.int64) * stride_bt,
        run_lo,
        tl.minimum(run_lo + run, kv_hi),
        window,
        softcap_log2,
        scale_log2,
        v_scale,
        stride_kv,
        stride_kb,
        stride_ks,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        BLOCK_SIZE,
        HAS_WINDOW,
        HAS_SOFTCAP,
        UPCAST,
        PRECISION,
        KV_FP8,
    )
    part = (split * num_tokens + q_start + tok).to(tl.int64) * num_heads + head  # [BLOCK_M] index into [S, T, Hq]
    tl.store(m_part_ptr + part, m, mask=row_valid)
    tl.store(l_part_ptr + part, denom, mask=row_valid)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :])


def paged_attention_split_k(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tiling: Tiling,
    num_splits: int,
    out: torch.Tensor,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """paged_attention.py's `paged_attention` with its checks done and tiling chosen (an fp8
    cache as its bytes, its key scale in `scale`): partials, then the reduce into out [T, Hq, D]."""
    num_tokens, num_heads, head_dim = q.shape
    o_part = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
    m_part = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    _paged_attention_split_kernel[(tiling.num_tiles, kv_cache.shape[3], num_splits)](
        o_part,
        m_part,
        l_part,
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * math.log2(math.e),
        v_scale,
        tiling.num_rows,
        num_tokens,
        num_heads,
        tiling.window,
        tiling.softcap * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        NUM_SPLITS=num_splits,
        **tiling.constexprs(),
    )
    reduce_splits(o_part, m_part, l_part, out)
    return out
