"""The emulated device's model and attention backend: no weights, no KV, only time.

EmulatedModel is what the runner calls as its model. A pass's forward queues the pass's modelled
time on the virtual stream (its cost for the pass's shape, from the calibration table or the
roofline, read from the attention metadata the runner built: rows, new tokens and context per
row) and returns once a GPU host would have launched it: at once for a graph replay, after the
table's eager host time for an eager forward (a graph's metadata is a GraphMetadata). Its hidden
states and logits are placeholders with the right number of rows and no columns: nothing reads
them but the emulated draws (draws.py), which need only the rows.

EmulatedAttention holds no KV: each layer's cache is a [2, num_blocks, 0] placeholder, so the
runner's block copies and CUDA-graph buffers work on it unchanged, while `bytes_per_block` is the
real layout's, which sizes the pool. It supports the CUDA-graph path, as the triton backend does,
so a decode step's host work is the graphed one (no metadata built per step).
"""

from __future__ import annotations

import dataclasses

import torch

from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata
from conveyor.gpu.emulated.costmodel import PassCost, StepShape
from conveyor.gpu.emulated.stream import VirtualStream


class EmulatedModel:
    def __init__(self, cost: PassCost, stream: VirtualStream) -> None:
        self.cost, self.stream = cost, stream
        self.host_seconds = getattr(cost, "host_seconds", None)  # a calibrated cost's host side (sim/calibrated.py)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list) -> torch.Tensor:
        """input_ids [T] -> hidden [T, 0], after queueing the pass's time and holding the host as
        long as a GPU host takes to launch it (an eager forward: its Python, layer by layer)."""
        shape = pass_shape(meta)
        host = 0.0 if self.host_seconds is None else self.host_seconds(shape, isinstance(meta, GraphMetadata))
        self.stream.launch(self.cost.latency(shape), host)
        self.stream.hold(host)
        return torch.empty((input_ids.shape[0], 0))

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [S, 0] -> logits [S, 0]: sampled within the pass's time already queued."""
        return hidden

    def compute_greedy(self, hidden: torch.Tensor) -> None:
        """No shortcut: the emulated draw reads no logits (compute_logits)."""
        return None


def pass_shape(meta: AttentionMetadata) -> StepShape:
    """The cost model's view of a pass, from its metadata's per-row tensors (a CUDA graph's
    metadata has no host lists: its padding rows count, as they compute on a GPU)."""
    new = meta.query_lens.long()  # [B]
    context = meta.seq_lens.long()  # [B], new tokens included
    cached = context - new
    pairs = new * cached + new * (new + 1) // 2
    return StepShape(int(new.sum()), int(new.shape[0]), int(context.sum()), int(pairs.sum()))


@dataclasses.dataclass
class GraphMetadata(AttentionMetadata):
    """A decode graph's static metadata: a pass given it replays a graph (its host cost is a
    replay's, not an eager forward's)."""


class EmulatedAttention(AttentionBackend):
    supports_decode_graphs = True
    kv_layout = "none held (sized as [2, num_blocks, block_size, Hkv, D])"

    def build_graph_metadata(self, **kw) -> AttentionMetadata:
        meta = super().build_graph_metadata(**kw)
        return GraphMetadata(**{f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)})

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        return [torch.empty((2, num_blocks, 0), dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv_scales=None) -> None:
        raise AssertionError("the emulated model computes no keys")

    def attend(self, q, k, v, kv_cache, meta, scale, kv_scales=None):
        raise AssertionError("the emulated model computes no attention")
