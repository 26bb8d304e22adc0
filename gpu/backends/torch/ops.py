"""The torch ops: the reference elementwise and linear work, any device, any dtype.

Each method computes what Hugging Face's Llama computes, in the same order of roundings (RMSNorm
in float32 then cast back before the weight; cos/sin cast to the activation dtype before the
rotation), so logits match transformers in bf16 too. q/k/v and gate/up are one product each:
`prepare` stacks each group's weights (gpu/backends/column_groups.py), `linears` multiplies the stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.gpu.backends.column_groups import ColumnGroups
from conveyor.gpu.backends.ops import LinearLayer, Ops


class TorchOps(Ops):
    name = "torch"

    def __init__(self) -> None:
        self.columns = ColumnGroups()  # the stacks prepare makes; none: each layer multiplied apart

    def prepare(self, model: nn.Module) -> None:
        self.columns.prepare(model)

    def linears(self, x: torch.Tensor, layers: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        group = self.columns.get(layers)
        return super().linears(x, layers) if group is None else group.products(self, x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return rms_norm(residual, weight, eps), residual

    def rotary(self, positions, q, k, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, q, k, cos_sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # In place: on a CPU each [T, intermediate] temporary is megabytes of memory traffic.
        return F.silu(gate, inplace=True).mul_(up)

    def linear(self, x: torch.Tensor, layer: LinearLayer) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype. As HF: normalise in float32; then a weight in x's dtype
    scales the normalised x cast back (Llama), a float32 weight scales it before the one cast
    (Gemma). The order matters in bf16."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (weight * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64; q [T, Hq, D], k [T, Hkv, D]; cos_sin [P, D] -> rotated (q, k), new tensors."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
    # HF casts cos/sin to the activation dtype before rotating; so do we (matters in bf16).
    cos = cos.to(q.dtype)[:, None, :]
    sin = sin.to(q.dtype)[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Equal, bit for bit, to HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
