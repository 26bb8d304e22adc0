"""Split-K's second kernel: merge the per-split softmax partials of paged_attention_split_k.py.

Layout: o_part [S, T, Hq, D] (unnormalised sums of p * v), m_part and l_part [S, T, Hq] (each
split's running max, in base 2, and denominator), all float32 and contiguous; out [T, Hq, D] in
the activation dtype, unit stride along D. out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s
with M = max_s m_s; a split that saw no key (m_s = -inf, l_s = 0) weighs nothing.

Grid: (T, Hq), one program per query head, holding [S, D] in registers (S <= 16 in practice).
Tuned for: nothing yet; checked under TRITON_INTERPRET=1 for correctness only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    o_part_ptr,
    m_part_ptr,
    l_part_ptr,
    num_tokens,
    num_heads,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < NUM_SPLITS
    part = (offs_s * num_tokens + token) * num_heads + head  # [BLOCK_S] index into [S, T, Hq]
    m = tl.load(m_part_ptr + part, mask=s_valid, other=float("-inf"))
    denom = tl.load(l_part_ptr + part, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)  # finite: the query sees itself in some split
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # [BLOCK_S]
    o = tl.load(
        o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0
    )
    acc = tl.sum(o * weight[:, None], 0) / tl.sum(denom * weight, 0)  # [BLOCK_D]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, acc.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def reduce_splits(o_part: torch.Tensor, m_part: torch.Tensor, l_part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """o_part [S, T, Hq, D], m_part/l_part [S, T, Hq] float32 -> out [T, Hq, D], written in place."""
    num_splits, num_tokens, num_heads, head_dim = o_part.shape
    if m_part.shape != o_part.shape[:3] or l_part.shape != m_part.shape or out.shape != o_part.shape[1:]:
        raise ValueError(
            f"reduce_splits: partials {tuple(o_part.shape)}, {tuple(m_part.shape)}, {tuple(l_part.shape)}; out {tuple(out.shape)}"
        )
    if not (o_part.is_contiguous() and m_part.is_contiguous() and l_part.is_contiguous()) or out.stride(2) != 1:
        raise ValueError("reduce_splits: partials must be contiguous and out have unit stride along D")
    _reduce_splits_kernel[(num_tokens, num_heads)](
        out,
        o_part,
        m_part,
        l_part,
        num_tokens,
        num_heads,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out
