"""The cpu ops: gpu/backends/cpu/kernels' fused elementwise kernels and narrow-linear paths for float32
CPU tensors, torch's (TorchOps) for anything else.

- RMSNorm (+ residual add), rotary, SiLU * up: one C++ pass each (fused_ops.cpp), where every
  tensor is float32, contiguous and on the CPU (`supports`).
- quant_linear: a quantized layer's product read packed by quant_linear.cpp where it takes the
  weight (`CpuQuantLinear.supports`); `prepare` gives each such QuantizedWeight its C arguments
  as `prepared`. Otherwise the reference (dequantize + F.linear).
- linears: quantized layers that read one input (q/k/v, gate/up) multiply as one weight, their
  rows stacked (one call, x quantized once: a one-row step of SmolLM2 makes 121 calls instead of
  211). The stacked weight is built at a group's first call (gpu/backends/column_groups.py's
  `stack`) and each layer's QuantizedWeight becomes a view of its rows, so no byte is stored
  twice. Float groups stay apart: their narrow kernels and fused ops take contiguous outputs.
- argmax_product: the LM head's argmax for greedy draws that want nothing else, by one plane of
  x, a bound and the few candidates in three (quant_argmax.py), from ARGMAX_MIN_ROWS rows; the
  head's `prepared` is its bound table.
- lora_add: lora.cpp's products, a projection's update in one call, each token reading only its
  own slot's matrices, where `CpuLora.supports` the call; torch's otherwise (and for lora_shrink
  and lora_expand alone, which the layers do not call).
- linear: for the layers small_linear.cpp supports (at most 1024 input features: small models),
  `prepare` moves each weight's storage to [in, out] (the kernel reads it transposed), leaving
  `weight` a transposed view of it so a GEMM serves what the kernel does not take, and keeps
  oneDNN's blocked copy (onednn_linear.py) for steps of many rows (from 512, x padded to a
  multiple of 64). A weight tied to the embedding keeps its layout: the embedding's row lookups
  need it. The other float32 products (wide layers, the tied head) are small_linear.cpp's row
  kernel on the weight as stored for steps of few rows (decode: so that those steps record),
  oneDNN's past them.
- embedding: the table's rows by one C call, a float32 table's gathered (fused_ops.cpp), a
  quantized one's decoded from its codes (quant_linear.cpp, the weight `prepared` as for its
  product; not act-order), where the activations are float32; torch's otherwise. An id outside
  the table gives zeros there, where torch raises (ids come from the model's own vocabulary).
- record: a forward's kernel calls as a program replayed from one C call (kernels/program.py),
  for the decode graphs of gpu/step/cuda_graphs.py; a stacked group's outputs of several rows are
  split by a kernel (`CpuFusedOps.columns`), not torch, so that such steps record too.
Which rows go where is decided per call by the row count, as measured in those files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from conveyor.gpu.backends.column_groups import ColumnGroup, stack
from conveyor.gpu.backends.cpu.kernels import onednn_linear as onednn
from conveyor.gpu.backends.cpu.kernels import program
from conveyor.gpu.backends.cpu.kernels.fused_ops import CpuFusedOps, supports
from conveyor.gpu.backends.cpu.kernels.lora import CpuLora
from conveyor.gpu.backends.cpu.kernels.quant_argmax import ArgmaxTable, QuantArgmax
from conveyor.gpu.backends.cpu.kernels.quant_linear import MAX_ROWS as QUANT_MAX_ROWS
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear, QuantArgs
from conveyor.gpu.backends.cpu.kernels.small_linear import CpuSmallLinear
from conveyor.gpu.backends.ops import LinearLayer, NotRecordable, Replay
from conveyor.gpu.backends.prepared_layers import is_lm_head, is_ops_linear
from conveyor.gpu.backends.torch.ops import TorchOps
from conveyor.gpu.quant.weight import QuantizedWeight


def _lookup_ids(ids: torch.Tensor) -> bool:
    """Whether the embedding kernels take these ids: [T] int64, contiguous, on the CPU."""
    return ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous() and ids.device.type == "cpu"


@dataclasses.dataclass
class SmallLinearWeight:
    """A Linear's prepared form: its weight's storage is [in, out] (weight.t() is contiguous)."""

    packed: torch.Tensor | None  # oneDNN's blocked copy, for steps of many rows; None: unavailable


# From this many rows the head's argmax costs less than its product (SmolLM2's u8 head [49152,
# 576] over its real decode rows, ops/bench/head_argmax.py, ms: 1 row 0.81 product and argmax,
# 0.81 one-plane argmax; 2 rows 1.30, 1.11; 4 rows 2.21, 1.65; 9 rows 5.93, 3.72): a verifying
# pass's rows and small batches, not a one-row decode step (no gain there).
ARGMAX_MIN_ROWS = 2


class CpuOps(TorchOps):
    """fused: the C++ elementwise ops (None: torch's); small_linear: the narrow-linear kernel
    (None: every linear is torch's GEMM on the weight as loaded); quant: the quantized-linear
    kernel (None: the reference); lora: the LoRA kernels (None: torch's path); argmax: the
    quantized head's argmax (None: the product's)."""

    name = "cpu"

    def __init__(
        self,
        fused: CpuFusedOps | None,
        small_linear: CpuSmallLinear | None,
        quant: CpuQuantLinear | None = None,
        lora: CpuLora | None = None,
        argmax: QuantArgmax | None = None,
    ) -> None:
        super().__init__()  # TorchOps' stacks stay empty: prepare below stacks only quantized groups (linears)
        self.fused = fused
        self.small_linear = small_linear
        self.quant = quant
        self.lora = lora
        self.argmax = argmax
        self._groups: dict[tuple[int, ...], ColumnGroup | None] = {}  # by the layers' ids; None: not fusable
        self._arena = program.Arena()  # what recorded forwards allocate (`record`): its programs never run at once

    def prepare(self, model: nn.Module) -> None:
        small, quant = self.small_linear, self.quant
        tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not None}
        for layer in model.modules():
            weight = getattr(layer, "quantized", None)
            if isinstance(weight, QuantizedWeight) and quant is not None and quant.supports(weight):
                weight.compact()  # float16 scales where exact: fewer bytes per step
                weight.prepared = quant.prepare(weight)  # a tied head's is its embedding's: prepared twice, alike
                if is_lm_head(layer) and self.argmax is not None and self.argmax.supports(weight):
                    layer.prepared = self.argmax.table(weight)  # the head's product stays quant_linear's
            if not is_ops_linear(layer) or layer.weight is None or id(layer.weight) in tied:
                continue  # a quantized layer (weight None) is read packed by quant_linear
            weight_t = layer.weight.data.t().contiguous()  # no copy when already moved
            if small is not None and small.supports_weight(weight_t):
                layer.weight.data = weight_t.t()  # [out, in] view of [in, out] storage
                pack = onednn.pack_linear_weight(layer.weight.data) if small.packs and onednn.onednn_available() else None
                layer.prepared = SmallLinearWeight(pack)
            else:
                layer.weight.data = layer.weight.data.contiguous()
                layer.prepared = None

    def linear(self, x: torch.Tensor, layer: LinearLayer) -> torch.Tensor:
        prepared, small = layer.prepared, self.small_linear
        if isinstance(prepared, SmallLinearWeight) and small is not None and x.dim() == 2 and supports(x):
            if prepared.packed is not None and onednn.use_packed(x.shape[0]):
                return onednn.packed_linear(x, prepared.packed, layer.bias)
            if x.shape[0] <= small.max_rows:
                return small(x, layer.weight.t(), layer.bias)
        elif small is not None and small.takes_rows(x, layer.weight, layer.bias):
            return small.rows(x, layer.weight, layer.bias)
        return onednn.linear(x, layer.weight, layer.bias)

    @property
    def records(self) -> bool:  # type: ignore[override]
        return program.available()

    def record(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Replay]:
        if not program.available():
            raise NotRecordable("the kernel programs' replay library could not be built")
        with program.record(self._arena) as found:
            out = forward()
        return out, found[0].keeping(out)

    def argmax_product(self, x: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        table, weight = getattr(layer, "prepared", None), getattr(layer, "quantized", None)
        if self.argmax is None or not isinstance(table, ArgmaxTable) or not isinstance(weight, QuantizedWeight):
            return None
        if x.dim() != 2 or x.shape[0] < ARGMAX_MIN_ROWS or not supports(x):
            return None
        return self.argmax(x, weight, table)

    def lora_add(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        scales: torch.Tensor,
        slots: torch.Tensor,
        groups: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.lora is not None and self.lora.supports(slots, x, a, y, scales, b=b):
            return self.lora.add(x, y, a, b, scales, slots)
        return super().lora_add(x, y, a, b, scales, slots)

    def quant_linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None and self._kernel_takes(x, weight, bias):
            return self.quant(x, weight, bias)
        return super().quant_linear(x, weight, bias)

    def linears(self, x: torch.Tensor, layers: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        key = tuple(map(id, layers))
        if key not in self._groups:
            self._groups[key] = self._fuse(layers)
        group = self._groups[key]
        weight = None if group is None else group.quantized
        if group is None or weight is None or self.quant is None or not self._kernel_takes(x, weight, group.bias):
            return super().linears(x, layers)
        y = self.quant(x, weight, group.bias)  # [T, sum N_i]
        b = group.bounds
        if y.shape[0] == 1 or self.fused is None:  # one row: views, no copy
            return [y[:, b[i] : b[i + 1]].contiguous() for i in range(len(layers))]
        return [self.fused.columns(y, b[i], b[i + 1]) for i in range(len(layers))]  # a kernel's copies: recordable

    def embedding(self, ids: torch.Tensor, table: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        if _lookup_ids(ids):
            if isinstance(table, QuantizedWeight):
                prepared = table.prepared
                if self.quant is not None and dtype == torch.float32 and isinstance(prepared, QuantArgs) and prepared.perm is None:
                    return self.quant.rows(ids, table)
            elif self.fused is not None and supports(table) and table.dim() == 2:
                return self.fused.embedding(ids, table)
        return super().embedding(ids, table, dtype)

    @staticmethod
    def _kernel_takes(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> bool:
        # prepared: the kernel takes the weight (on the CPU, see prepare)
        return (
            isinstance(weight.prepared, QuantArgs)
            and x.dim() == 2
            and x.shape[0] <= QUANT_MAX_ROWS
            and supports(x)
            and (bias is None or supports(bias))
        )

    def _fuse(self, layers: tuple[nn.Module, ...]) -> ColumnGroup | None:
        """The layers' weights stacked (column_groups.py `stack`: each layer's weight then a view of
        its rows), each with the kernel's arguments; None where they are not all quantized weights
        the kernel takes (`prepared`), or cannot stack (float, kinds, group sizes, act-order, ...)."""
        weights = [w for w in (getattr(layer, "quantized", None) for layer in layers) if isinstance(w, QuantizedWeight)]
        if self.quant is None or len(weights) < len(layers) or not all(isinstance(w.prepared, QuantArgs) for w in weights):
            return None
        group = stack(layers)
        if group is None or group.quantized is None:
            return None
        for weight in [group.quantized, *weights]:
            weight.prepared = self.quant.prepare(weight)
        return group

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fused is not None and supports(x):
            return self.fused.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and supports(x) and supports(residual):
            return self.fused.rms_norm(x, weight, eps, residual), residual  # residual += x in place
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions, q, k, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and supports(q) and supports(k) and supports(cos_sin):
            self.fused.rotary(q, k, positions, cos_sin)  # in place
            return q, k
        return super().rotary(positions, q, k, cos_sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and supports(gate) and supports(up):
            return self.fused.silu_mul(gate, up)
        return super().silu_mul(gate, up)
