"""The seam between the model and the device: an `AttentionBackend` and an `Ops` object (ops.py),
bundled as a `Backend` chosen once at start-up (gpu/backends/__init__.py `select`). The model calls only
these and never asks which device it runs on. Implementations: gpu/backends/torch (the reference,
any device), gpu/backends/cpu (C++ kernels and oneDNN, float32 CPU), gpu/backends/triton (CUDA;
CPU tensors under TRITON_INTERPRET=1). Who calls which method, when: `AttentionBackend`.

Invariants every implementation keeps:
- tokens are flattened across rows ("varlen"): a step of B rows has T = sum(query_lens) tokens;
  row r owns tokens [query_start_loc[r], query_start_loc[r + 1]); its query j sits at position
  seq_lens[r] - query_lens[r] + j and attends causally to positions <= its own, and with a
  sliding window W only to the W positions ending at its own (itself included);
- the KV cache is one tensor per layer, [2 (keys, values), num_blocks, ...] in the backend's
  `kv_dtype` (the model's, or fp8 e4m3 codes with the layer's KVScales: gpu/kv/kv_fp8.py); the
  layout inside a block is the backend's own (`kv_layout`) and only it reads or writes it;
  block b of every layer belongs to the same sequence.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.extents import attend_extents
from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.kv.kv_cache import copy_blocks
from conveyor.gpu.kv.kv_fp8 import UNIT_SCALES, KVScales, as_bytes, dequantize_kv, is_fp8
from conveyor.gpu.parallel.group import SINGLE, TensorParallel


@dataclasses.dataclass(kw_only=True)
class AttentionMetadata:
    """Per-step inputs every layer's attention shares, built once per step by
    `AttentionBackend.build_metadata`. Tensors are on the model's device; the host ints let a
    backend size grids or pick paths without a device sync. A backend may subclass it with its
    own fields (masks, split-K plans, ...) and build that with `build_common(..., **its_fields)`."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: row r's tokens are [qsl[r], qsl[r + 1])
    seq_lens: torch.Tensor  # [B] int32: context length after this step, new tokens included
    query_lens: torch.Tensor  # [B] int32: new tokens of each row this step (>= 1)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0 (never read past seq_len)
    positions: torch.Tensor  # [T] int64: each new token's position in its sequence
    block_size: int
    sliding_window: int | None  # None: full causal attention
    num_tokens: int  # T
    max_query_len: int  # 1: every row decodes
    max_seq_len: int
    host_query_lens: list[int]  # the same as query_lens, on the host
    host_seq_lens: list[int]
    # The same step's metadata for the other windows its layers use, filled by
    # AttentionBackend.for_window on first use; a CUDA graph's static metadata keeps its own.
    by_window: dict[int | None, AttentionMetadata] = dataclasses.field(default_factory=dict)
    # [T] int32: how many of its sequence's tokens each row attends to (keys at positions below
    # it; a window still bounds them from below), where some row sees past itself: Gemma 3's image
    # tokens see their whole image (gpu/step/features/vision.py sets it). None: causal, position + 1
    # (every pass of every other family). A pass with extents runs gpu/backends/extents.py.
    extents: torch.Tensor | None = None

    @classmethod
    def build_common(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
        sliding_window: int | None,
        **fields,
    ):
        """The fields above from host lists and device tensors (block_tables [B, max_blocks]
        int32, positions [T] int64, already on the device), plus a subclass's `fields`."""
        device = block_tables.device
        num_rows = len(query_lens)
        starts = [0] * (num_rows + 1)
        for i, q_len in enumerate(query_lens):
            starts[i + 1] = starts[i] + q_len
        q_lens_t = torch.tensor(query_lens, dtype=torch.int32).to(device, non_blocking=True)
        # slot of each new token: its row's block table entry for the position, plus the offset.
        row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=device), q_lens_t, output_size=starts[-1])
        block_ids = block_tables[row_of_token, positions // block_size].long()
        return cls(
            slot_mapping=block_ids * block_size + positions % block_size,
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            query_lens=q_lens_t,
            block_tables=block_tables,
            positions=positions,
            block_size=block_size,
            sliding_window=sliding_window,
            num_tokens=starts[-1],
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            host_query_lens=list(query_lens),
            host_seq_lens=list(seq_lens),
            **fields,
        )


class AttentionBackend(abc.ABC):
    """Owns the paged KV cache in its own layout and attention over it. Built by `select` with
    the model's config, device and KV dtype; `num_kv_heads`, `head_dim`, `dtype` come from that
    config, and `kv_dtype` (what the cache stores: a torch dtype name, None for the model's) from
    CacheConfig.kv_dtype. An fp8 cache stores e4m3 codes: write_kv quantizes with the layer's
    KVScales, attend reads code * scale (gpu/kv/kv_fp8.py); a float cache ignores the scales.

    Who calls what (gpu/step/runner.py, then the model):
    1. runner, once: `allocate_kv_caches(num_blocks, block_size)` (sized with
       `bytes_per_block(block_size)`), and `ops.prepare(model)` after the weights are loaded;
    2. runner, per plan: `copy_blocks(kv_caches, pairs)` (copy-on-write), then
       `meta = build_metadata(query_lens, seq_lens, block_tables, positions, block_size, sliding_window)`;
    3. each layer: `forward(q, k, v, kv_caches[layer], for_window(meta, window), scale, kv_scales)`, which
       writes the step's new k/v (`write_kv`) and attends (`attend`) over a mixed step: decode
       rows (one query) and prompt chunks (several, possibly after cached context) in one call.
       `for_window` is `meta` itself for a layer whose window is the step's; a model whose layers
       differ (Gemma 2/3, Qwen2 with max_window_layers) gets each other window's metadata built
       once per step, on its first layer's call, and kept on `meta` (`by_window`).
    A decode step replayed from a decode graph (gpu/step/cuda_graphs.py: a CUDA graph, or the cpu
    ops' recorded kernel program) skips 2's build_metadata: its metadata is built once per graph
    by `build_graph_metadata` over static buffers, and only where `supports_decode_graphs` (the
    triton and cpu backends)."""

    def __init__(self, model: ModelConfig, device: torch.device, kv_dtype: str | None = None) -> None:
        self.model_config = model
        self.device = device
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.dtype: torch.dtype = getattr(torch, model.dtype)
        self.kv_dtype: torch.dtype = getattr(torch, kv_dtype or model.dtype)
        # The attention logit soft-cap (Gemma 2): scores -> cap * tanh(scores / cap) after the scale,
        # before the mask and softmax. Every backend reads it from here.
        self.softcap: float | None = model.attn_logit_softcap

    kv_layout: str = "[2, num_blocks, block_size, Hkv, D]"  # for docs and logs; the backend's own

    @property
    def kv_fp8(self) -> bool:
        """The cache holds e4m3 codes (--kv-cache-dtype fp8)."""
        return is_fp8(self.kv_dtype)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes across all layers, keys and values (for sizing the pool)."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    @abc.abstractmethod
    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One zeroed cache per layer, [2, num_blocks, ...] in this backend's layout. Zeroed:
        padded block-table entries point at block 0, and NaN there would leak through 0 * NaN."""

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """For each (src, dst): block dst := block src, keys and values, every layer. All sources
        are read before any destination is written; destinations are distinct. Layout-blind:
        whole blocks along dim 1."""
        copy_blocks(kv_caches, pairs)

    # True where every kernel of the decode path reads only tensors and shapes (no host list, no
    # sync), so a decode step can be captured in a CUDA graph, or recorded as a CPU kernel program,
    # over static buffers (gpu/step/cuda_graphs.py). The torch backend plans its work from host
    # lists: False.
    supports_decode_graphs: bool = False

    def build_graph_metadata(
        self,
        *,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
        sliding_window: int | None,
    ) -> AttentionMetadata:
        """The metadata of a decode step of B rows (one query each) that a CUDA graph captures:
        views of static buffers (slot_mapping [B] int64, seq_lens [B] int32, block_tables
        [B, max_blocks] int32, positions [B] int64), refilled before each replay. Host fields
        hold no step's data: max_seq_len is what the table can hold, host_seq_lens repeat it.
        Only for a backend with supports_decode_graphs; override to add fields, as build_metadata."""
        num_rows, max_blocks = block_tables.shape
        max_seq_len = max_blocks * block_size
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, device=block_tables.device),
            seq_lens=seq_lens,
            query_lens=torch.ones(num_rows, dtype=torch.int32, device=block_tables.device),
            block_tables=block_tables,
            positions=positions,
            block_size=block_size,
            sliding_window=sliding_window,
            num_tokens=num_rows,
            max_query_len=1,
            max_seq_len=max_seq_len,
            host_query_lens=[1] * num_rows,
            host_seq_lens=[max_seq_len] * num_rows,
        )

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
        sliding_window: int | None,
    ) -> AttentionMetadata:
        """A step plan -> metadata. query_lens, seq_lens: one int per row (host); block_tables
        [B, max_blocks] int32 and positions [T] int64 on the device. Override to add fields."""
        return AttentionMetadata.build_common(query_lens, seq_lens, block_tables, positions, block_size, sliding_window)

    def for_window(self, meta: AttentionMetadata, window: int | None) -> AttentionMetadata:
        """`meta` for a layer with sliding window `window` (None: full attention): `meta` itself
        when the windows agree, else its variant, built on the step's first call and kept."""
        if window == meta.sliding_window:
            return meta
        if window not in meta.by_window:
            meta.by_window[window] = self.with_window(meta, window)
        return meta.by_window[window]

    def with_window(self, meta: AttentionMetadata, window: int | None) -> AttentionMetadata:
        """The step of `meta` with another window. Here only the field changes (the kernels read
        the window as an argument; views of the same tensors, so a graph's static buffers stay
        shared); override where the metadata holds masks."""
        return dataclasses.replace(meta, sliding_window=window, by_window={})

    @abc.abstractmethod
    def write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv_scales: KVScales = UNIT_SCALES
    ) -> None:
        """k, v [T, Hkv, D] (rotated, model dtype) -> this layer's cache at meta.slot_mapping
        (an fp8 cache: quantized with kv_scales)."""

    @abc.abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> out [T, Hq, D], after write_kv of this step's k, v [T, Hkv, D] (given
        too, for a backend that reads fresh chunks' keys directly). Hq is a multiple of Hkv. An
        fp8 cache is read as code * kv_scales."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        """What a layer calls: write this step's k/v, then attend. q [T, Hq, D] -> [T, Hq, D].
        A pass with `meta.extents` attends through the generic masked path (no backend's kernel
        takes extents yet), reading the cache back with `read_kv`."""
        self.write_kv(kv_cache, k, v, meta, kv_scales)
        if meta.extents is not None:
            return attend_extents(self, q, kv_cache, meta, scale, kv_scales)
        return self.attend(q, k, v, kv_cache, meta, scale, kv_scales)

    def read_kv(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype, kv_scales: KVScales = UNIT_SCALES
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `seq_len` keys and values, each [seq_len, Hkv, D] in `dtype`, read
        through its blocks `block_ids` [>= ceil(seq_len / block_size)] (an fp8 cache as code *
        scale). Here for gpu/kv/kv_cache.py's layout [2, num_blocks, block_size, Hkv, D] (the
        torch and triton backends'); a backend with its own layout overrides it."""
        blocks = as_bytes(kv_cache)[:, block_ids].view(kv_cache.dtype)  # [2, nb, bs, Hkv, D]
        kv = blocks.flatten(1, 2)[:, :seq_len]
        if is_fp8(kv.dtype):
            return dequantize_kv(kv[0], kv_scales.k, dtype), dequantize_kv(kv[1], kv_scales.v, dtype)
        return kv[0].to(dtype), kv[1].to(dtype)


class BackendUnavailable(RuntimeError):
    """A backend cannot run here (device, dtype, no compiler): the message says why."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """What `select` returns: the attention backend and ops the model runs on, and a line for
    the start-up log (and, set by the runner, the tensor-parallel group)."""

    name: str  # "torch", "cpu" or "triton"
    attn: AttentionBackend
    ops: Ops
    description: str  # "cpu (C++ paged attention, fused ops, ...)"
    # The tensor-parallel ranks the model is split over (gpu/parallel/); one rank by default. The
    # runner sets it; the model's layers take it at construction (gpu/models/layers.py).
    tp: TensorParallel = SINGLE
