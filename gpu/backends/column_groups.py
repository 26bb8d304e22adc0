"""Sibling projections as one weight: the layers a model multiplies through `Ops.linears` (q/k/v,
gate/up: column-parallel layers that read one input, as each module declares them with
`sibling_projections()`: llama.py's Attention and MLP) stacked once, after loading, so a step issues one product per
group where it issued two or three. The torch and triton ops use it; the cpu ops stack their
quantized groups their own way (cpu/ops.py), and leave float ones apart for their narrow kernels.

`ColumnGroups.prepare(model)` (an ops' `prepare`) stacks each group's weights by rows into one
[sum N_i, K] tensor: float, or a QuantizedWeight whose codes, scales and mins stack as its rows do
(W4A16 / W8A16 groups, FP8 per channel or per group: every scale belongs to one output row), and
their biases into one [sum N_i]. Each layer's `weight` (`quantized`) and `bias` then become views of
its rows. `ColumnGroup.products` multiplies x by the stack through the ops' own `linear` or
`quant_linear` and hands each layer its columns.

Invariants:
- no byte is stored twice: the stack is the layers' storage (their own tensors are freed), so a
  read of `layer.weight`, a copy_ into it (`load_weights`), a state dict, a layer's product alone,
  LoRA per projection and tensor-parallel shards (each rank stacks its own rows) keep working;
- the outputs are column views of one [T, sum N_i] product: unit stride along each layer's
  outputs, rows strided, which every ops method takes (Phi-3's fused layers give such views too);
- stacked once, on the weights' device, when they are final (`Ops.prepare`), before any CUDA graph
  is captured; moving the model afterwards would give each layer a copy of its own again;
- a group that cannot stack is multiplied layer by layer, as before: float and quantized layers
  mixed, quantized ones of different kinds, group sizes or scale dtypes, an act-order `perm`,
  biases on some layers only, or weights of different dtypes, devices or input widths.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from conveyor.gpu.backends.ops import LinearLayer, Ops
from conveyor.gpu.quant.weight import QuantizedWeight

Layers = tuple[nn.Module, ...]


def sibling_groups(model: nn.Module) -> list[Layers]:
    """Every group of layers that `model`'s modules multiply through `Ops.linears`, as each module
    declares them (`sibling_projections()`), found by name so that the backends import no model module."""
    groups: list[Layers] = []
    for module in model.modules():
        declared = getattr(module, "sibling_projections", None)
        if callable(declared):
            groups.extend(cast(tuple[Layers, ...], declared()))
    return groups


@dataclasses.dataclass(frozen=True)
class ColumnGroup:
    """One group's stack, in the shape of a Linear: `weight` [sum N_i, K] (None where quantized) or
    `quantized`, `bias` [sum N_i] or None; layer i owns output columns [bounds[i], bounds[i + 1])."""

    weight: torch.Tensor | None
    quantized: QuantizedWeight | None
    bias: torch.Tensor | None
    bounds: tuple[int, ...]
    prepared: None = None  # LinearLayer's: no ops form of a float stack

    def products(self, ops: Ops, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, K] -> each layer's x W_i^T (+ b_i) [T, N_i]: column views of one product."""
        if self.quantized is not None:
            y = ops.quant_linear(x, self.quantized, self.bias)
        else:
            y = ops.linear(x, cast(LinearLayer, self))
        b = self.bounds
        return [y[:, b[i] : b[i + 1]] for i in range(len(b) - 1)]

    def rows(self) -> list[slice]:
        """Each layer's rows of the stack."""
        return [slice(self.bounds[i], self.bounds[i + 1]) for i in range(len(self.bounds) - 1)]


class ColumnGroups:
    """An ops object's stacks, by the layers `Ops.linears` is called with."""

    def __init__(self) -> None:
        self._stacks: dict[Layers, ColumnGroup] = {}

    def prepare(self, model: nn.Module) -> list[tuple[ColumnGroup, Layers]]:
        """Stack every group `model` declares that can stack and is not stacked yet (an EAGLE-3
        head is prepared after its target, by the same ops); returns the new ones."""
        made: list[tuple[ColumnGroup, Layers]] = []
        for layers in sibling_groups(model):
            if layers not in self._stacks and (group := stack(layers)) is not None:
                self._stacks[layers] = group
                made.append((group, layers))
        return made

    def get(self, layers: Sequence[nn.Module]) -> ColumnGroup | None:
        """The stack of exactly these layers, in this order; None: multiply them apart."""
        return self._stacks.get(tuple(layers))


def stack(layers: Sequence[nn.Module]) -> ColumnGroup | None:
    """The layers' weights and biases stacked by rows, each layer's then a view of its rows; None,
    the layers untouched, where they cannot stack (the module docstring's last invariant)."""
    biases = [cast(torch.Tensor | None, getattr(layer, "bias", None)) for layer in layers]
    if len(layers) < 2 or len({None if b is None else (b.dtype, b.device) for b in biases}) != 1:
        return None
    weights = [getattr(layer, "weight", None) for layer in layers]
    quantized = [getattr(layer, "quantized", None) for layer in layers]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
    if all(isinstance(w, torch.Tensor) and q is None for w, q in zip(weights, quantized)):
        return _stack_float(layers, [cast(torch.Tensor, w) for w in weights], bias)
    if all(isinstance(q, QuantizedWeight) for q in quantized):
        return _stack_quantized(layers, [cast(QuantizedWeight, q) for q in quantized], bias)
    return None


def _stack_float(layers: Sequence[nn.Module], weights: list[torch.Tensor], bias: torch.Tensor | None) -> ColumnGroup | None:
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    group = ColumnGroup(torch.cat([w.detach() for w in weights]), None, bias, _bounds([w.shape[0] for w in weights]))
    for layer, rows in zip(layers, group.rows()):
        cast(nn.Parameter, layer.weight).data = cast(torch.Tensor, group.weight)[rows]
        _view_bias(layer, bias, rows)
    return group


def _stack_quantized(layers: Sequence[nn.Module], weights: list[QuantizedWeight], bias: torch.Tensor | None) -> ColumnGroup | None:
    def form(w: QuantizedWeight) -> tuple[object, ...]:
        mins = None if w.mins is None else w.mins.dtype
        return (w.kind, w.group_size, w.shape[1], w.qweight.dtype, w.qweight.device, w.scales.dtype, mins, w.perm is None)

    if len({form(w) for w in weights}) != 1 or weights[0].perm is not None or len({id(w) for w in weights}) < len(weights):
        return None
    mins = None if weights[0].mins is None else torch.cat([cast(torch.Tensor, w.mins) for w in weights])
    whole = dataclasses.replace(
        weights[0],
        qweight=torch.cat([w.qweight for w in weights]),
        scales=torch.cat([w.scales for w in weights]),
        mins=mins,
        prepared=None,
    )
    group = ColumnGroup(None, whole, bias, _bounds([w.shape[0] for w in weights]))
    for layer, w, rows in zip(layers, weights, group.rows()):
        # In place, so whoever else holds this QuantizedWeight reads the stack's rows too.
        w.qweight, w.scales, w.mins = whole.qweight[rows], whole.scales[rows], None if mins is None else mins[rows]
        w.prepared = None  # the ops set the form their kernels read, from the stack's
        _view_bias(layer, bias, rows)
    return group


def _bounds(sizes: list[int]) -> tuple[int, ...]:
    return tuple(itertools.accumulate(sizes, initial=0))


def _view_bias(layer: nn.Module, bias: torch.Tensor | None, rows: slice) -> None:
    if bias is not None:
        cast(nn.Parameter, layer.bias).data = bias[rows]
