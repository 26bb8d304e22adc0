"""The worker's LoRA slots: `--max-loras` adapters resident on the device at once, in stacks
preallocated at `--max-lora-rank` for every projection an adapter may target, so placing an
adapter copies into them and a step never allocates.

Shapes, per projection on this rank: A [S, R, in] and B [S, out, R], stored as Ops.lora_b says (S slots,
R the max rank; a slot's adapter of rank r fills A's first r rows and B's first r columns, zeros elsewhere, and a
projection it does not target stays zero), with one scale per slot (lora_alpha / r, or rsLoRA's /
sqrt(r)). Under tensor parallelism each rank holds what its layer's split gives it: a
column-parallel layer (q/k/v, gate/up) its rows of B, A whole; a row-parallel one (o, down) its
columns of A, B whole, so its partial delta joins the layer's partial sum before the all-reduce.

A pass's rows name their slot (NewSeq.lora_slot); `begin_pass` turns them into one slot per token
[T] (-1: the base weights), which every projection reads (`LoraProjection.add`: the backend's
lora_add, its lora_shrink then lora_expand unless it fuses them), with what the backend derives
from them once a pass (`Ops.lora_groups`: the Triton backend's tokens grouped by slot, at the row
counts where it multiplies them so). A pass with no adapter row sets none, and the layers add nothing.
A decode step replayed from a CUDA graph reads the slots from a static buffer instead (the graph's
input, `graph_model`), its padding rows -1: no host sync in the kernels, so they were captured.
Adapters read from disk are kept in host memory, `--max-cpu-loras` of them, least recently used
out first.
"""

from __future__ import annotations

import collections
import re

import torch
from torch import nn

from conveyor.config.engine import EngineConfig
from conveyor.config.lora_adapter import LORA_TARGETS, AdapterInfo, read_adapter_info
from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.lora.weights import load_adapter
from conveyor.gpu.models.layers import Linear, RowParallelLinear
from conveyor.gpu.parallel.group import TensorParallel
from conveyor.gpu.parallel.shard import cut
from conveyor.gpu.step.cuda_graphs import DecodeModel
from conveyor.wire.step import LoraLoad

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> (A, B): gpu/lora/weights.py
NOT_TARGETED: tuple[None, None] = (None, None)
_PROJECTION = re.compile(rf"layers\.(\d+)\.(?:self_attn|mlp)\.({'|'.join(LORA_TARGETS)})$")


class LoraPass:
    """What every projection of one pass reads: each token's slot, and each slot's scale."""

    def __init__(self, ops: Ops, num_slots: int, device: torch.device) -> None:
        self.ops = ops
        self.slots: torch.Tensor | None = None  # [T'] int64, the adapter tokens' slots; None: no adapter row in the pass
        self.rows: torch.Tensor | None = None  # [T'] int64: which tokens of the pass those are; None: all of them
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.groups: torch.Tensor | None = None  # ops.lora_groups(slots): once a pass, for every projection

    def set_slots(self, slots: torch.Tensor | None, rows: torch.Tensor | None) -> None:
        """The pass's adapter tokens' slots and rows (as the fields say), and the backend's groups of them."""
        self.slots, self.rows = slots, rows
        self.groups = None if slots is None else self.ops.lora_groups(slots, self.scales.shape[0])


class LoraProjection:
    def __init__(self, layer: Linear, lora_pass: LoraPass, num_slots: int, rank: int, dtype: torch.dtype) -> None:
        device = lora_pass.scales.device
        self.layer = layer
        self.lora_pass = lora_pass
        # [S, R, in] and [S, out, R]: a row-parallel layer's in and a column-parallel one's out are this rank's.
        # B is stored as the backend's expand reads it best (Ops.lora_b: [S, R, out] by default).
        self.a = torch.zeros(num_slots, rank, layer.in_features, dtype=dtype, device=device)
        self.b = lora_pass.ops.lora_b(num_slots, layer.out_features, rank, dtype, device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the layer's product of x [T, in]) plus scale * x A^T B^T for each adapter
        token; the base rows of a mixed pass are left out of the products (LoraPass.rows)."""
        lora_pass = self.lora_pass
        slots, rows, ops = lora_pass.slots, lora_pass.rows, lora_pass.ops
        if slots is None:
            return y
        if rows is None:  # every token has an adapter
            return ops.lora_add(x, y, self.a, self.b, lora_pass.scales, slots, lora_pass.groups)
        delta = y.new_zeros(rows.shape[0], y.shape[1])
        delta = ops.lora_add(x.index_select(0, rows), delta, self.a, self.b, lora_pass.scales, slots, lora_pass.groups)
        return y.index_add_(0, rows, delta)

    def place(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, tp: TensorParallel) -> None:
        """Slot `slot` <- the adapter's whole A [r, in] and B [out, r] (None: not a target), cut to this rank."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if a is None or b is None:
            return
        split = self.layer.splits.get("weight")
        if isinstance(self.layer, RowParallelLinear):
            a = cut(a, split, tp.rank, tp.size)  # A's columns are the layer's input: split as its weight's
        else:
            b = cut(b, split, tp.rank, tp.size)  # B's rows are the layer's output: split as its weight's
        r = a.shape[0]
        self.a[slot, :r].copy_(a)
        self.b[slot, :, :r].copy_(b)


class LoraSlots:
    def __init__(self, model: nn.Module, config: EngineConfig, ops: Ops, tp: TensorParallel, device: torch.device) -> None:
        lora = config.lora
        self.config = config
        self.tp = tp
        self.pass_ = LoraPass(ops, lora.max_loras, device)
        self.dtype: torch.dtype = getattr(torch, config.model.dtype)
        self.projections: dict[tuple[int, str], LoraProjection] = {}
        for name, module in model.named_modules():
            match = _PROJECTION.search(name)
            if match and isinstance(module, Linear):
                projection = LoraProjection(module, self.pass_, lora.max_loras, lora.max_lora_rank, self.dtype)
                module.lora = projection
                self.projections[(int(match.group(1)), match.group(2))] = projection
        # A captured decode graph's input: each row's slot, -1 past the pass's rows (buckets up to max_num_seqs).
        self.graph_slots = torch.full((config.scheduler.max_num_seqs,), -1, dtype=torch.int64, device=device)
        # (name, path) -> (its AdapterInfo, its weights): read from disk once while held, LRU first
        self._host: collections.OrderedDict[tuple[str, str], tuple[AdapterInfo, Weights]] = collections.OrderedDict()
        self._host_capacity = lora.host_capacity

    @property
    def bytes(self) -> int:
        """Device memory the slots hold (the KV pool is sized after them)."""
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in self.projections.values())

    def load(self, load: LoraLoad) -> None:
        """Place an adapter in a slot (the one there before, if any, is gone from the device)."""
        model, source = self.config.model, (load.name, load.path)  # a name unloaded and loaded again may name another path
        held = self._host.pop(source, None)
        if held is None:
            info = read_adapter_info(load.name, load.path, model, self.config.lora.max_lora_rank)
            held = info, load_adapter(info, model.num_layers, self.dtype, torch.device("cpu"))
        self._host[source] = held
        info, weights = held
        while len(self._host) > self._host_capacity:
            self._host.popitem(last=False)
        for key, projection in self.projections.items():
            a, b = weights.get(key, NOT_TARGETED)
            projection.place(load.slot, a, b, self.tp)
        self.pass_.scales[load.slot] = info.scaling

    def graph_model(self, model: DecodeModel) -> DecodeModel:
        """`model` as a decode graph runs it (gpu/step/cuda_graphs.py): every projection reads the
        static `graph_slots` of the bucket's rows, so a captured graph's kernels read the slots
        `begin_pass(..., graphed=True)` writes there before each replay."""

        def decode(input_ids, positions, meta, kv_caches):
            self.pass_.set_slots(self.graph_slots[: input_ids.shape[0]], None)  # groups captured too: replays regroup
            return model(input_ids, positions, meta, kv_caches)

        return decode

    def begin_pass(self, row_slots: list[int], row_tokens: list[int] | None = None, graphed: bool = False) -> None:
        """The next pass's rows' slots (-1: the base weights) and tokens (None: one each);
        `graphed`: the pass replays a decode graph, whose rows read `graph_slots` (padding rows -1)."""
        device = self.pass_.scales.device
        if not graphed and max(row_slots, default=-1) < 0:  # base rows only: nothing per token
            self.pass_.set_slots(None, None)
            return
        token_slots = row_slots if row_tokens is None else [s for s, n in zip(row_slots, row_tokens) for _ in range(n)]
        if graphed:
            self.graph_slots.fill_(-1)
            self.graph_slots[: len(token_slots)].copy_(torch.tensor(token_slots, dtype=torch.int64), non_blocking=True)
            return
        rows = [t for t, s in enumerate(token_slots) if s >= 0]
        if len(rows) == len(token_slots):
            self.pass_.set_slots(torch.tensor(token_slots, dtype=torch.int64).to(device, non_blocking=True), None)
            return
        self.pass_.set_slots(
            torch.tensor([token_slots[t] for t in rows], dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
        )
