"""The torch reference the paged attention kernels are tested against: the same function, written
the plain way (a per-row gather through the block table, a full mask, softmax in float32).

Same arguments and layout as paged_attention.py's `paged_attention`; slow, for tests only.
"""

from __future__ import annotations

import torch


def reference_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], kv_cache [2, N, bs, Hkv, D] -> [T, Hq, D] in q's dtype."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for row, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[row], starts[row + 1]
        if start == end:
            continue
        blocks = block_tables[row, : -(-seq_len // block_size)].long()
        kv = kv_cache[:, blocks].reshape(2, -1, num_kv_heads, head_dim)[:, :seq_len].float()  # [2, L, Hkv, D]
        k, v = kv[0].repeat_interleave(group, 1), kv[1].repeat_interleave(group, 1)  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale  # [Hq, q_len, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]  # [q_len, 1]
        key_pos = torch.arange(seq_len)[None, :]  # [1, L]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        probs = scores.masked_fill(~visible.to(scores.device), float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
