"""attend_extents: attention for a pass whose rows may see past themselves (AttentionMetadata.extents).

Gemma 3's image tokens attend to every token of their own image, earlier ones causally
(transformers' token_type_ids mask): row t of a sequence attends to the keys at positions
[lo, extents[t]), where extents[t] is position + 1 for a causal row and its image's end for an
image row, and lo is position - window + 1 on a sliding-window layer (the window bounds a row from
below only, as transformers' sliding overlay does), else 0. Such a row's later keys are in the
cache when it attends because the scheduler never ends a prompt chunk inside such an image, and
`write_kv` runs before `attend`.

This is the one generic path every backend falls back to (AttentionBackend.forward): each row's
keys and values read back through its block table (`read_kv`, the backend's layout), one masked
scaled_dot_product_attention per row, the logit soft-cap (Gemma 2's) in HF's eager order where
the backend has one. Correct before fast: passes without extents (every other family's, and
Gemma 3's text-only and decode passes) never come here; the C++ and Triton kernels could take an
extent per row later.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from conveyor.gpu.kv.kv_fp8 import UNIT_SCALES, KVScales


class KvReader(Protocol):
    """What this path needs of an AttentionBackend (gpu/backends/base.py, which calls it: a
    protocol, so that the two modules do not import each other)."""

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def softcap(self) -> float | None: ...

    def read_kv(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype, kv_scales: KVScales
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ExtentsMeta(Protocol):
    """What this path reads of an AttentionMetadata."""

    @property
    def extents(self) -> torch.Tensor | None: ...

    @property
    def sliding_window(self) -> int | None: ...

    @property
    def host_query_lens(self) -> list[int]: ...

    @property
    def host_seq_lens(self) -> list[int]: ...

    @property
    def block_tables(self) -> torch.Tensor: ...

    @property
    def block_size(self) -> int: ...

    @property
    def positions(self) -> torch.Tensor: ...


def attend_extents(
    backend: KvReader,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: ExtentsMeta,
    scale: float,
    kv_scales: KVScales = UNIT_SCALES,
) -> torch.Tensor:
    """q [T, Hq, D] (this pass's k/v already written) -> [T, Hq, D], row t over keys [lo, extents[t])."""
    assert meta.extents is not None
    out = torch.empty_like(q)
    group = q.shape[1] // backend.num_kv_heads
    window = meta.sliding_window
    start = 0
    for row, (q_len, seq_len) in enumerate(zip(meta.host_query_lens, meta.host_seq_lens, strict=True)):
        end = start + q_len
        block_ids = meta.block_tables[row, : -(-seq_len // meta.block_size)].long()
        keys, values = backend.read_kv(kv_cache, block_ids, seq_len, q.dtype, kv_scales)  # [L, Hkv, D]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
        mask = key_pos < meta.extents[start:end, None]  # [q_len, L]
        if window is not None:
            mask &= key_pos > meta.positions[start:end, None] - window
        qr, kr, vr = q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # [H, q_len | L, D]
        if backend.softcap is None:
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        else:
            o = _capped(qr, kr.repeat_interleave(group, 0), vr.repeat_interleave(group, 0), mask, scale, backend.softcap)
        out[start:end] = o.transpose(0, 1)
        start = end
    return out


def _capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Scores in the model dtype, capped, masked, softmax in float32 (HF's eager order)."""
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
