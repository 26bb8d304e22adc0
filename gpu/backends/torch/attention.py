"""The torch attention backend: paged attention in plain torch, on any device (the reference).

Cache: one tensor per layer, [2, num_blocks, block_size, Hkv, D] in the KV dtype (index 0
keys, 1 values); token p of a sequence lives in block block_table[p // block_size] at offset
p % block_size. `write_kv` scatters the step's k/v at the slot mapping; `attend` lets every row
attend to its whole context read back through its block table. An fp8 cache holds e4m3 codes
(gpu/kv/kv_fp8.py): written quantized with the layer's scales, read back as code * scale in float32
and cast to the model dtype before attention; its fresh prompt chunks read the cache too, so a
prompt attends to the same keys however it is chunked or cached.

Rows with one query (decodes, or a prompt's last chunk of one token) are batched by context
length, each bucket one padded gather and one scaled_dot_product_attention call; longer rows
(prompt chunks) run one call each. TorchMetadata is built once per step and holds the masks
every layer shares; a model with layers of another window gets that window's masks built once
more (`with_window`). With a logit soft-cap (Gemma 2), which scaled_dot_product_attention cannot
apply, the same calls run as explicit products with the cap between them (`_sdpa`), in HF's
eager order: scores in the model dtype, softmax in float32.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata
from conveyor.gpu.kv.kv_fp8 import UNIT_SCALES, KVScales, as_bytes, dequantize_kv, is_fp8, quantize_kv


@dataclasses.dataclass
class DecodeBatch:
    """The single-query rows of a step, attended to in one call."""

    token_index: torch.Tensor | None  # [Bd] int64 rows' tokens in the step; None: every token
    block_tables: torch.Tensor  # [Bd, nb] int64, padded with block 0 (masked out)
    mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] bool, True where a key is visible


@dataclasses.dataclass
class PrefillChunk:
    """One multi-query row: tokens [start, end) of the step, context seq_len."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None: plain causal over fresh tokens only

    @property
    def is_fresh(self) -> bool:
        """No earlier context: the keys are exactly this chunk's own new k/v."""
        return self.seq_len == self.end - self.start


@dataclasses.dataclass(kw_only=True)
class TorchMetadata(AttentionMetadata):
    decodes: list[DecodeBatch]  # single-query rows, bucketed by context length
    prefills: list[PrefillChunk]


BUCKET_SPREAD = 1.3  # a decode bucket's longest context is at most this times its shortest


class TorchAttention(AttentionBackend):
    kv_layout = "[2, num_blocks, block_size, Hkv, D]"

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]

    def build_metadata(self, query_lens, seq_lens, block_tables, positions, block_size, sliding_window) -> TorchMetadata:
        decodes, prefills = _plan(query_lens, seq_lens, block_tables, block_size, sliding_window)
        return TorchMetadata.build_common(
            query_lens, seq_lens, block_tables, positions, block_size, sliding_window, decodes=decodes, prefills=prefills
        )

    def with_window(self, meta: AttentionMetadata, window: int | None) -> TorchMetadata:
        assert isinstance(meta, TorchMetadata), "metadata from another backend"
        decodes, prefills = _plan(meta.host_query_lens, meta.host_seq_lens, meta.block_tables, meta.block_size, window)
        return dataclasses.replace(meta, sliding_window=window, decodes=decodes, prefills=prefills, by_window={})

    def write_kv(self, kv_cache, k, v, meta: AttentionMetadata, kv_scales: KVScales = UNIT_SCALES) -> None:
        write_kv(kv_cache, k, v, meta.slot_mapping, kv_scales)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, kv_scales: KVScales = UNIT_SCALES) -> torch.Tensor:
        assert isinstance(meta, TorchMetadata), "metadata from another backend"
        return attend(q, k, v, kv_cache, meta, scale, self.softcap, kv_scales)


def _plan(query_lens, seq_lens, block_tables, block_size, sliding_window) -> tuple[list[DecodeBatch], list[PrefillChunk]]:
    """The step's decode buckets and prompt chunks, with their masks for `sliding_window`."""
    num_rows = len(query_lens)
    starts = [0] * (num_rows + 1)
    for i, q_len in enumerate(query_lens):
        starts[i + 1] = starts[i] + q_len
    decode_rows = [i for i, q_len in enumerate(query_lens) if q_len == 1]
    decodes = [
        _decode_batch(rows, starts, seq_lens, block_tables, block_size, sliding_window)
        for rows in _length_buckets(decode_rows, seq_lens, num_rows)
    ]
    prefills = [
        _prefill_chunk(i, starts, seq_lens[i], block_tables, block_size, sliding_window)
        for i, q_len in enumerate(query_lens)
        if q_len > 1
    ]
    return decodes, prefills


def _length_buckets(rows: list[int], seq_lens: list[int], num_rows: int) -> list[list[int]]:
    """Group decode rows so that padding each group to its longest context wastes little: one
    padded gather over contexts of 20 and 2000 tokens would copy 100x the KV of the short one.
    A step whose rows all decode with similar lengths stays one bucket in plan order (no
    gathers of q or scatters of the output)."""
    if not rows:
        return []
    lens = [seq_lens[i] for i in rows]
    if len(rows) == num_rows and max(lens) <= BUCKET_SPREAD * min(lens) + 16:
        return [rows]
    buckets: list[list[int]] = []
    shortest = 0
    for i in sorted(rows, key=seq_lens.__getitem__):
        if not buckets or seq_lens[i] > BUCKET_SPREAD * shortest + 16:
            buckets.append([])
            shortest = seq_lens[i]
        buckets[-1].append(i)
    return buckets


def _decode_batch(rows, starts, seq_lens, block_tables, block_size, sliding_window) -> DecodeBatch:
    device = block_tables.device
    lens = [seq_lens[i] for i in rows]
    num_blocks = -(-max(lens) // block_size)
    if len(rows) == block_tables.shape[0]:  # every row decodes: no gathers needed
        token_index, tables = None, block_tables[:, :num_blocks]
    else:
        rows_t = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        token_index = torch.tensor([starts[i] for i in rows], dtype=torch.int64).to(device, non_blocking=True)
        tables = block_tables[rows_t, :num_blocks]
    lens_t = torch.tensor(lens, dtype=torch.int64).to(device, non_blocking=True)[:, None]  # [Bd, 1]
    key_pos = torch.arange(num_blocks * block_size, device=device)[None, :]  # [1, L]
    mask = key_pos < lens_t  # the query sits at lens - 1
    if sliding_window is not None:
        mask &= key_pos >= lens_t - sliding_window
    return DecodeBatch(token_index, tables.long(), mask[:, None, None, :])


def _prefill_chunk(row, starts, seq_len, block_tables, block_size, sliding_window) -> PrefillChunk:
    device = block_tables.device
    start, end = starts[row], starts[row + 1]
    q_len = end - start
    block_ids = block_tables[row, : -(-seq_len // block_size)].long()
    mask = None
    if q_len != seq_len or (sliding_window is not None and seq_len > sliding_window):
        query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]  # [q_len, 1]
        key_pos = torch.arange(seq_len, device=device)[None, :]  # [1, seq_len]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
    return PrefillChunk(start, end, seq_len, block_ids, mask)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: KVScales = UNIT_SCALES
) -> None:
    """kv_cache [2, N, bs, Hkv, D]; k, v [T, Hkv, D]; slot_mapping [T] int64. An fp8 cache gets
    the e4m3 codes of k / kv_scales.k and v / kv_scales.v (copied as bytes: no float8 index_copy_ on a CPU)."""
    if is_fp8(kv_cache.dtype):
        k, v = as_bytes(quantize_kv(k, kv_scales.k)), as_bytes(quantize_kv(v, kv_scales.v))
    flat = as_bytes(kv_cache).view(2, -1, *kv_cache.shape[-2:])  # [2, N * bs, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def attend(
    q, k, v, kv_cache: torch.Tensor, meta: TorchMetadata, scale: float, softcap: float | None = None, kv_scales: KVScales = UNIT_SCALES
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (rotated, already written) -> attention output [T, Hq, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    decodes = meta.decodes
    if len(decodes) == 1 and decodes[0].token_index is None:  # every row decodes, one bucket
        return _attend_decodes(q, kv_cache, decodes[0], num_kv_heads, group, scale, softcap, kv_scales)
    out = torch.empty_like(q)
    for decode in decodes:
        rows = q[decode.token_index]
        out[decode.token_index] = _attend_decodes(rows, kv_cache, decode, num_kv_heads, group, scale, softcap, kv_scales)
    for chunk in meta.prefills:
        qc = q[chunk.start : chunk.end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        if chunk.is_fresh and not is_fp8(kv_cache.dtype):  # the new k/v are the whole context: skip the gather
            kc, vc = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
        else:  # [nb, bs, Hkv, D] -> [seq_len, Hkv, D]
            kv = _blocks(kv_cache, chunk.block_ids).view(2, -1, num_kv_heads, head_dim)[:, : chunk.seq_len]
            kc, vc = _keys_values(kv, q.dtype, kv_scales)
        kc, vc = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]  # [1, Hkv, seq_len, D]
        if softcap is None:
            o = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=group > 1
            )
        else:
            mask = (
                chunk.mask
                if chunk.mask is not None
                else torch.ones(qc.shape[2], kc.shape[2], dtype=torch.bool, device=q.device).tril()
            )
            kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)  # [1, Hq, seq_len, D]
            o = _capped_attention(qc, kc, vc, mask, scale, softcap)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


def _attend_decodes(q, kv_cache, decode: DecodeBatch, num_kv_heads, group, scale, softcap=None, kv_scales=UNIT_SCALES) -> torch.Tensor:
    """q [Bd, Hq, D] -> [Bd, Hq, D]. The `group` query heads sharing a kv head are laid out as
    that head's query rows, [Bd, Hkv, group, D], so GQA needs no repeated keys."""
    num_rows, num_heads, head_dim = q.shape
    kv = _blocks(kv_cache, decode.block_tables)  # [2, Bd, nb, bs, Hkv, D]
    kv = kv.view(2, num_rows, -1, num_kv_heads, head_dim).transpose(2, 3)  # [2, Bd, Hkv, L, D]
    keys, values = _keys_values(kv, q.dtype, kv_scales)
    qg = q.view(num_rows, num_kv_heads, group, head_dim)
    if softcap is None:
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=decode.mask, scale=scale)
    else:
        o = _capped_attention(qg, keys, values, decode.mask, scale, softcap)
    return o.reshape(num_rows, num_heads, head_dim)


def _blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """kv_cache[:, block_ids], fp8 codes gathered as bytes (float8 indexing kernels vary by device)."""
    return as_bytes(kv_cache)[:, block_ids].view(kv_cache.dtype)


def _keys_values(kv: torch.Tensor, dtype: torch.dtype, kv_scales: KVScales) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [2, ...] as the cache stores it -> (keys, values) [...] in `dtype`: fp8 codes as code * scale."""
    if not is_fp8(kv.dtype):
        return kv[0], kv[1]
    return dequantize_kv(kv[0], kv_scales.k, dtype), dequantize_kv(kv[1], kv_scales.v, dtype)


def _capped_attention(q, k, v, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """q [..., Q, D], k/v [..., L, D], mask broadcasting to [..., Q, L] (True: visible) -> [..., Q, D],
    with scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2; HF's eager order)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
