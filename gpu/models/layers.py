"""The model's layers that hold weights, whole or split over tensor-parallel ranks (Megatron).

Model code says which kind each projection is (nothing else decides it): `Linear` (whole on every
rank), `ColumnParallelLinear` (output rows split, no communication), `RowParallelLinear` (input
columns split, one all-reduce), `VocabParallelEmbedding`, `ParallelLMHead` and `RMSNorm` (whole,
its residual add folded in). Each class's docstring gives its shapes and its collective.

Invariants:
- each is built from the *whole* model's sizes (`parts`: (units, rows per unit) of each fused
  part, gpu/parallel/shard.py) and the TensorParallel it runs in, and declares in `splits` how
  each of its parameters is cut from the checkpoint, which the loader applies;
- with one rank every layer is nn.Linear / nn.Embedding with the checkpoint's names and shapes;
- every product goes through the backend's ops (`ops.linear`), never a device branch;
- a layer the checkpoint stores quantized (gpu/quant/load.py) has no float `weight`: its
  `quantized` (gpu/quant/weight.py) is that weight, cut along the same `splits`, and its product
  is the ops' `quant_linear`; which format it came from is not the layer's business.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.shard import Split
from conveyor.gpu.quant.weight import QuantizedWeight
from conveyor.gpu.sampling.argmax import argmax_rows

Parts = tuple[tuple[int, int], ...]


class Adapters(Protocol):
    """What a layer asks of the LoRA adapters set on it (gpu/lora/slots.py LoraProjection, which
    imports this module: the layer knows this one method, not the slots)."""

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...  # y [T, out] + x's adapter deltas


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) whose product is the ops' (`ops.linear`); as such,
    whole on every rank (an MoE router, the shared expert's gate).
    `prepared` is the ops' own form of the weight, set once by `ops.prepare(model)` (the cpu
    backend's narrow-linear re-layout); None: the weight as loaded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops
        self.prepared: object | None = None
        self.splits: dict[str, Split] = {}  # parameter name -> how it is cut; absent: whole on every rank
        self.quantized: QuantizedWeight | None = None  # set by the loader where the checkpoint stores it so
        self.lora: Adapters | None = None  # its LoRA adapters' slots, with --enable-lora (gpu/lora/slots.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(x, self.product(x))

    def with_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = this layer's product of x, plus the pass's adapter rows' deltas (none: y as it is)."""
        return y if self.lora is None else self.lora.add(x, y)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> x W^T (+ bias) [T, out], by the ops' kernel for the weight's form."""
        if self.quantized is not None:
            return self.ops.quant_linear(x, self.quantized, self.bias)
        return self.ops.linear(x, self)


def column_products(ops: Ops, x: torch.Tensor, layers: tuple[Linear, ...]) -> list[torch.Tensor]:
    """x through column-parallel layers that all read it (q/k/v, gate/up): `ops.linears`, which
    may multiply them as one weight, then each layer's adapter deltas."""
    return [layer.with_lora(x, y) for layer, y in zip(layers, ops.linears(x, layers))]


class ColumnParallelLinear(Linear):
    """[T, in] -> [T, this rank's rows of `parts`] (q/k/v, gate/up): each rank computes its own
    heads or intermediate rows from the whole input, no communication."""

    def __init__(self, in_features: int, parts: Parts, bias: bool, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        split = Split(0, parts)
        super().__init__(in_features, split.local_size(tp.size), bias, ops)
        self.splits = {"weight": split, "bias": split}


class RowParallelLinear(Linear):
    """[T, this rank's columns of `parts`] -> [T, out] (o_proj, down_proj): each rank's product is a
    partial sum, which one all-reduce makes whole unless reduce=False (an MoE block that sums its
    experts first). Its bias is added once, on rank 0 (the others have none)."""

    def __init__(
        self, parts: Parts, out_features: int, bias: bool, ops: Ops, tp: TensorParallel = SINGLE, reduce: bool = True
    ) -> None:
        split = Split(1, parts)
        super().__init__(split.local_size(tp.size), out_features, bias and tp.rank == 0, ops)
        self.splits = {"weight": split}
        self.tp, self.reduce = tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.with_lora(x, self.product(x))  # [T, out]: this rank's partial sum (an adapter's too: A is split as x is)
        return self.tp.all_reduce(out) if self.reduce else out


class VocabParallelEmbedding(nn.Embedding):
    """ids [T] -> [T, H]; this rank holds rows [rank * n, (rank + 1) * n) of the padded vocabulary.
    Ids outside it look up zeros, and an all-reduce sums the ranks' rows. The lookup of this
    rank's rows is the ops' (`ops.embedding`), from the float table or the packed one."""

    def __init__(self, vocab_size: int, hidden_size: int, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        split = Split(0, ((vocab_size, 1),), pad=True)
        super().__init__(split.local_size(tp.size), hidden_size)
        self.ops = ops
        self.splits = {"weight": split}
        self.tp, self.first = tp, tp.rank * split.local_size(tp.size)
        self.quantized: QuantizedWeight | None = None  # a GGUF table, kept packed (gpu/quant/load.py)
        self.dtype = torch.float32  # the activations', for a quantized table's rows: set by the loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)  # [T]: another rank's ids
        out = self.lookup(local.masked_fill(outside, 0))  # [T, H]
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] of this rank's rows -> [T, H]; a quantized table's rows are dequantized."""
        return self.ops.embedding(ids, self.weight if self.quantized is None else self.quantized, self.dtype)


class ParallelLMHead(Linear):
    """hidden [N, H] -> logits [N, V] on rank 0 (the rank that samples), column-parallel over the
    embedding's vocabulary ranges, gathered and the padding dropped; the other ranks compute their
    shard's logits for the gather and get [N, 0]. A tied head shares the embedding's shard."""

    def __init__(self, hidden_size: int, vocab_size: int, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        split = Split(0, ((vocab_size, 1),), pad=True)
        super().__init__(hidden_size, split.local_size(tp.size), False, ops)
        self.splits = {"weight": split}
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_first(self.product(hidden), dim=-1)  # [N, padded V] on rank 0
        return logits[:, : self.vocab_size] if logits.shape[-1] > self.vocab_size else logits

    def argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, H] -> (argmax of each row's logits [N] int64, valid [N] bool; sampling/argmax.py):
        without the logits where the ops can (Ops.argmax_product: one rank, unpadded), else from
        forward's logits in the model dtype (no float32 copy, no softmax). With several ranks every
        rank joins forward's gather; the ranks without logits get placeholders (share_draws)."""
        if self.tp.size == 1 and self.out_features == self.vocab_size:
            found = self.ops.argmax_product(hidden, self)
            if found is not None:
                return found
        return argmax_rows(self(hidden))


class RMSNorm(nn.Module):
    """x [T, H] -> norm(x); with `residual`, the pre-norm residual add is folded in: returns
    (norm(x + residual), x + residual); the ops may add into `residual` in place."""

    def __init__(self, hidden_size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


__all__ = ["ColumnParallelLinear", "Linear", "ParallelLMHead", "RMSNorm", "RowParallelLinear", "VocabParallelEmbedding"]
