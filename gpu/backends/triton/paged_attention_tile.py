"""The device functions both paged attention kernels share; no kernel, no host code.

paged_attention.py and paged_attention_split_k.py call them: `find_tile`, `load_queries`,
`key_range`, `attend_keys`, `e4m3_to_float`. The launch shape they run under (`Tiling`) is
paged_attention_launch.py's.

An fp8 cache (--kv-cache-dtype fp8) reaches the kernels as its bytes (uint8 e4m3 codes, KV_FP8):
`e4m3_to_float` widens them in registers, the key scale comes folded into the score scale and
the value scale multiplies the accumulator. Bits rather than tl.float8e4nv loads: those compile
only for sm_89 and newer, and the interpreter reads them wrong (its NaN codes aside, it was
right; its float -> e4m3 store truncated and overflowed, so codes are written by torch).

A step's query tokens are cut into tiles per row and kv head: one tile is BLOCK_Q consecutive
tokens of one row times the GROUP query heads that share one kv head, BLOCK_M = BLOCK_Q * GROUP
rows of a [BLOCK_M, D] matrix (row m is token m // GROUP, head m % GROUP of the group), padded
to a power of two >= 16 (what tl.dot needs). So GQA/MQA read each key once per tile, and a
decode row's GROUP heads make up one tile. Tiles are numbered without a host sync, at most
T // BLOCK_Q + B of them (`find_tile`); tiles past their row's end are empty.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def find_tile(query_start_loc_ptr, tile, num_rows, BLOCK_Q: tl.constexpr, DIRECT_DECODE: tl.constexpr = False):
    """-> (row, q_start, q_len, tok0): the tile's row, the row's first token in the step, its
    query count, and the tile's first token within the row (>= q_len: an empty tile). Tiles are
    numbered row by row: row r's first tile is query_start_loc[r] // BLOCK_Q + r (vLLM's
    numbering), which never overlaps the next row's and bounds the count by T // BLOCK_Q + B;
    this inverts it by binary search. DIRECT_DECODE (a step of T = B tokens, so every row holds
    exactly one: query_lens >= 1): tile r is row r and its token r, with no load at all."""
    if DIRECT_DECODE:
        lo, q_start, q_len, tok0 = tile, tile, tile * 0 + 1, tile * 0
    else:
        lo = tile * 0  # the largest row whose first tile is <= tile lies in [lo, hi)
        hi = lo + num_rows
        while hi - lo > 1:
            mid = (lo + hi) // 2
            first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(first <= tile, mid, lo)
            hi = tl.where(first <= tile, hi, mid)
        q_start = tl.load(query_start_loc_ptr + lo)
        q_len = tl.load(query_start_loc_ptr + lo + 1) - q_start
        tok0 = (tile - (q_start // BLOCK_Q + lo)) * BLOCK_Q
    return lo, q_start, q_len, tok0


@triton.jit
def load_queries(
    q_ptr,
    stride_qt,
    stride_qh,
    q_start,
    q_len,
    tok0,
    kv_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """-> (q [BLOCK_M, BLOCK_D], tok [BLOCK_M] token within the row, head [BLOCK_M], row_valid)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tok0 + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < (BLOCK_M // GROUP) * GROUP) & (tok < q_len)
    ptrs = q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(ptrs, mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    return q, tok, head, row_valid


@triton.jit
def key_range(seq_len, q_len, tok0, window, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """-> (kv_lo, kv_hi): the keys any query of the tile sees, kv_lo rounded down to BLOCK_N."""
    context = seq_len - q_len  # cached positions before this step's tokens
    kv_hi = context + tl.minimum(q_len, tok0 + BLOCK_Q)  # the tile's last query sees up to itself
    kv_lo = kv_hi * 0
    if HAS_WINDOW:  # the tile's first query sees `window` positions ending at its own
        kv_lo = tl.maximum(context + tok0 - window + 1, 0)
    return kv_lo // BLOCK_N * BLOCK_N, kv_hi


@triton.jit
def e4m3_to_float(codes):
    """uint8 e4m3fn codes -> their values in float32: the bits moved into a half (sign to bit 15,
    exponent and mantissa to bits 14..7, the number 2^-8 times the code's value: the biases differ
    by 8), widened exactly (subnormals too), times 2^8. A NaN code (never written) reads 480."""
    c = codes.to(tl.uint16)
    half = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def attend_keys(
    q,  # [BLOCK_M, BLOCK_D] queries, their dtype (or float32 when UPCAST)
    q_pos,  # [BLOCK_M] each query's position in its sequence
    k_base,  # kv_cache[0, 0, 0, kv_head] pointer; values are stride_kv further
    table_ptr,  # this row's block table
    kv_lo,
    kv_hi,
    window,
    softcap_log2,  # softcap * log2(e): scores are in base 2 here
    scale_log2,  # an fp8 cache's key scale folded in
    v_scale,  # an fp8 cache's value scale (1.0 for a float cache)
    stride_kv,
    stride_kb,
    stride_ks,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """The online softmax over keys [kv_lo, kv_hi) of one row, in base 2 (the scale arrives as
    scale * log2(e)), reading each key's block through the block table: no
    gather copy. -> (acc [BLOCK_M, BLOCK_D] float32 unnormalised, m [BLOCK_M] running max in base
    2 (-inf where a query saw no key), denom [BLOCK_M] denominator), which the plain kernel
    divides out and the split-K kernel stores for its reduce."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] key positions
        key_valid = pos < kv_hi
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks  # [BLOCK_N]
        load_mask = key_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + slot[:, None] + offs_d[None, :], mask=load_mask, other=0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(k_base + stride_kv + slot[:, None] + offs_d[None, :], mask=load_mask, other=0)
        if KV_FP8:  # e4m3 codes -> q's dtype: exact (3 mantissa bits fit bf16 and fp16)
            k = e4m3_to_float(k).to(q.dtype)
            v = e4m3_to_float(v).to(q.dtype)
        if UPCAST:  # the interpreter's bf16 arithmetic is wrong: compute in float32 there
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:  # C * tanh(s / C) in base 2, tanh(y) as 1 - 2 / (e^2y + 1): saturates, no NaN
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap_log2) + 1.0))
        visible = key_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key yet: keep p = 0, not NaN
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if KV_FP8:
        acc = acc * v_scale
    return acc, m, denom
