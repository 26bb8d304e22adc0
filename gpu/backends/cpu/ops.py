"""The cpu ops: gpu/backends/cpu/kernels' fused elementwise kernels and narrow-linear paths for float32
CPU tensors, torch's (TorchOps) for anything else.

- RMSNorm (+ residual add), rotary, SiLU * up: one C++ pass each (fused_ops.cpp), where every
  tensor is float32, contiguous and on the CPU (`supports`).
- quant_linear: a quantized layer's product read packed by quant_linear.cpp where it takes the
  weight (`CpuQuantLinear.supports`); `prepare` gives each such QuantizedWeight its C arguments
  as `prepared`. Otherwise the reference (dequantize + F.linear).
- linear: for the layers small_linear.cpp supports (at most 1024 input features: small models),
  `prepare` moves each weight's storage to [in, out] (the kernel reads it transposed), leaving
  `weight` a transposed view of it so torch's GEMM serves what the kernel does not take, and
  keeps oneDNN's blocked copy (packed_linear.py) for steps of many rows in multiples of 64. A
  weight tied to the embedding keeps its layout: the embedding's row lookups need it.
Which rows go where is decided per call by the row count, as measured in those files.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.gpu.backends.base import LinearLayer
from conveyor.gpu.backends.cpu.kernels import packed_linear as packed
from conveyor.gpu.backends.cpu.kernels.fused_ops import CpuFusedOps, supports
from conveyor.gpu.backends.cpu.kernels.quant_linear import MAX_ROWS as QUANT_MAX_ROWS
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear, QuantArgs
from conveyor.gpu.backends.cpu.kernels.small_linear import CpuSmallLinear
from conveyor.gpu.backends.torch.ops import TorchOps
from conveyor.gpu.models.llama import Linear
from conveyor.gpu.quant.weight import QuantizedWeight


@dataclasses.dataclass
class SmallLinearWeight:
    """A Linear's prepared form: its weight's storage is [in, out] (weight.t() is contiguous)."""

    packed: torch.Tensor | None  # oneDNN's blocked copy, for steps of many rows; None: unavailable


class CpuOps(TorchOps):
    """fused: the C++ elementwise ops (None: torch's); small_linear: the narrow-linear kernel
    (None: every linear is torch's GEMM on the weight as loaded); quant: the quantized-linear
    kernel (None: the reference)."""

    name = "cpu"

    def __init__(self, fused: CpuFusedOps | None, small_linear: CpuSmallLinear | None, quant: CpuQuantLinear | None = None) -> None:
        self.fused = fused
        self.small_linear = small_linear
        self.quant = quant

    def prepare(self, model: nn.Module) -> None:
        small, quant = self.small_linear, self.quant
        tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not None}
        for layer in model.modules():
            weight = getattr(layer, "quantized", None)
            if isinstance(weight, QuantizedWeight) and quant is not None and quant.supports(weight):
                weight.prepared = quant.prepare(weight)  # a tied head's is its embedding's: prepared twice, alike
            if not isinstance(layer, Linear) or layer.weight is None or id(layer.weight) in tied:
                continue  # a quantized layer (weight None) is read packed by quant_linear
            weight_t = layer.weight.data.t().contiguous()  # no copy when already moved
            if small is not None and small.supports_weight(weight_t):
                layer.weight.data = weight_t.t()  # [out, in] view of [in, out] storage
                pack = packed.pack_linear_weight(layer.weight.data) if small.packs and packed.packed_linear_available() else None
                layer.prepared = SmallLinearWeight(pack)
            else:
                layer.weight.data = layer.weight.data.contiguous()
                layer.prepared = None

    def linear(self, x: torch.Tensor, layer: LinearLayer) -> torch.Tensor:
        prepared, small = layer.prepared, self.small_linear
        if isinstance(prepared, SmallLinearWeight) and small is not None and x.dim() == 2 and supports(x):
            if prepared.packed is not None and packed.use_packed(x.shape[0]):
                return packed.packed_linear(x, prepared.packed, layer.bias)
            if x.shape[0] <= small.max_rows:
                return small(x, layer.weight.t(), layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def quant_linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        # prepared: the kernel takes the weight (on the CPU, see prepare)
        if (
            self.quant is not None
            and isinstance(weight.prepared, QuantArgs)
            and x.dim() == 2
            and x.shape[0] <= QUANT_MAX_ROWS
            and supports(x)
            and (bias is None or supports(bias))
        ):
            return self.quant(x, weight, bias)
        return super().quant_linear(x, weight, bias)

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
