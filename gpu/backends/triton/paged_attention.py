"""Paged attention over a whole mixed step (decode rows and prompt chunks) in one Triton launch.

`paged_attention(q [T, Hq, D], kv_cache [2, num_blocks, block_size, Hkv, D], block_tables [B,
max_blocks] int32, query_start_loc [B + 1] int32, seq_lens [B] int32, ...)` -> [T, Hq, D], for
the triton backend's `attend`. The step's K/V are already in the cache (kv_write.py); q holds its
rotated queries, rows' tokens concatenated ("varlen", gpu/backends/base.py), and seq_lens each
row's context after the step. With a soft-cap C, a scaled score s becomes C * tanh(s / C) first.
The cache is q's dtype, or float8_e4m3fn codes read as code * k_scale, code * v_scale.

Invariants: unit stride along D (other strides are free: q may be a view into a fused qkv
buffer; `check_inputs` says what else); keys and values are read in place through the block
table, never gathered; the grid and the split-K choice (`choose_num_splits`, which hands steps of
few rows with long contexts to paged_attention_split_k.py) come from shapes alone, so a decode
step captures in a CUDA graph. The tile this kernel shares with split-K is paged_attention_tile.py's.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from conveyor.gpu.backends.triton.paged_attention_launch import DEFAULT_VARIANT, Tiling, Variant, check_inputs
from conveyor.gpu.backends.triton.paged_attention_split_k import paged_attention_split_k
from conveyor.gpu.backends.triton.paged_attention_tile import attend_keys, find_tile, key_range, load_queries
from conveyor.gpu.kv.kv_fp8 import as_bytes

# Split-K heuristic (only on CUDA, and only for steps where every row decodes): split when the
# rows x kv heads programs would fill less than half the SMs, into as many splits as fill them,
# at most MAX_SPLITS, each covering at least MIN_KEYS_PER_SPLIT keys of the padded table width.
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    v_scale,
    num_rows,
    window,
    softcap_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
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
    # Grid: (T // BLOCK_Q + B, Hkv). A program owns one tile: BLOCK_Q tokens of one row times the
    # Hq / Hkv query heads of one kv head, and runs the online softmax over the keys its tile can
    # see, BLOCK_N at a time, accumulating in float32 whatever the input dtype. Programs whose tile
    # lies past their row's end return at once.
    #
    # Tuned for: nothing yet. The tile sizes (BLOCK_M 16 for decode-only steps, 64 with chunks;
    # BLOCK_N = block size; 4 warps, 8 at D = 256) were checked under TRITON_INTERPRET=1 for
    # correctness only, over head dims 16, 32, 64, 80, 128 and 256 and block sizes 16 and 32.
    # Timing and tuning on a GPU (Llama-3-8B shapes: Hq 32, Hkv 8, D 128, block 16) wait for one.
    kv_head = tl.program_id(1)
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
    acc, m, denom = attend_keys(
        q,
        seq_len - q_len + tok,
        kv_ptr + kv_head * stride_kh,
        block_tables_ptr + row.to(tl.int64) * stride_bt,
        kv_lo,
        kv_hi,
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
    acc = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]  # every valid query sees itself: denom > 0 there
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :])


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    variant: Variant = DEFAULT_VARIANT,
) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D] (written into `out` when given). num_splits: None lets
    `choose_num_splits` decide; 1 forces this kernel, more forces split-K with that many splits.
    softcap: scores -> softcap * tanh(scores / softcap) after the scale (Gemma 2); None: none.
    k_scale, v_scale: an fp8 cache's (gpu/kv/kv_fp8.py); a float cache takes 1.0. variant: launch
    choices (paged_attention_launch.py), the same result whatever they are."""
    check_inputs(q, kv_cache, block_tables, query_start_loc, seq_lens, sliding_window, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    tiling = Tiling.of(q, kv_cache, block_tables, sliding_window, softcap, variant)
    if not tiling.kv_fp8 and (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError("paged_attention: KV scales are for an fp8 cache")
    if num_splits is None:
        num_splits = choose_num_splits(q, kv_cache, block_tables)
    scale, kv_cache = scale * k_scale, as_bytes(kv_cache)  # q . (code * k_scale) = (q * k_scale) . code
    if num_splits > 1:
        return paged_attention_split_k(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, tiling, num_splits, out, v_scale)
    _paged_attention_kernel[(tiling.num_tiles, kv_cache.shape[3])](
        out,
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * math.log2(math.e),
        v_scale,
        tiling.num_rows,
        tiling.window,
        tiling.softcap * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        **tiling.constexprs(),
    )
    return out


def choose_num_splits(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor) -> int:
    """Split-K or not, from shapes alone (no device sync, so it holds under CUDA graphs). Only
    on CUDA: the interpreter gains nothing from more programs."""
    if q.device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    num_rows, max_blocks = block_tables.shape
    return num_splits_for(num_rows, q.shape[0], kv_cache.shape[3], max_blocks * kv_cache.shape[2], num_sms)


def num_splits_for(num_rows: int, num_tokens: int, num_kv_heads: int, max_keys: int, num_sms: int) -> int:
    """Only when every row decodes (T = B) and the B x Hkv programs of the plain kernel would
    leave more than half the SMs idle: as many splits as fill the SMs, at most MAX_SPLITS, each
    covering at least MIN_KEYS_PER_SPLIT of the max_keys the padded block table can hold."""
    programs = num_rows * num_kv_heads
    if num_tokens != num_rows or 2 * programs > num_sms:
        return 1
    return max(1, min(MAX_SPLITS, num_sms // programs, max_keys // MIN_KEYS_PER_SPLIT))
