"""FP8 W8A8: an e4m3 weight with one scale per output channel, multiplied in FP8 by the tensor
cores through `torch._scaled_mm` (CUDA compute capability 8.9 and up).

Each step quantizes its activations per token, dynamically: row t's scale is amax|x[t]| / 448
(448: e4m3's largest finite value), x[t] / scale rounded to e4m3, in one Triton launch
(fp8_quant_rows.py; `quantize_per_token` is its torch reference, five launches). Then y = (xq @ wq^T) * x_scale
* w_scale (+ bias), accumulated in float32 by cuBLAS (or CUTLASS) and written in x's dtype:
vLLM's dynamic per-token FP8. Its reference is `fp8_reference` (the same rounding of x, then a
float32 product), which the cuda-marked tests compare with; against the weight-only reference
(QuantizedWeight.dequantize) it differs by x's rounding to 4 significant bits.

Invariants: takes what `can_multiply_in_fp8` allows (e4m3, group = K, N and K multiples of 16:
cuBLASLt's FP8 alignment); the activation scale is computed on the device, so nothing syncs
with the host and a decode step captures in a CUDA graph. The weight is read as stored: wq^T is
a view of its [N, K] codes, which is the column-major operand _scaled_mm takes.
"""

from __future__ import annotations

import dataclasses

import torch

from conveyor.gpu.backends.triton.fp8_quant_rows import quantize_rows
from conveyor.gpu.quant.weight import QuantizedWeight

E4M3_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A per-channel e4m3 QuantizedWeight as _scaled_mm reads it (TritonOps.prepare sets one)."""

    codes_t: torch.Tensor  # [K, N] float8_e4m3fn: a view of the weight's [N, K] codes
    scale: torch.Tensor  # [1, N] float32: each output channel's scale


def can_multiply_in_fp8(weight: QuantizedWeight) -> bool:
    n, k = weight.shape
    device = weight.qweight.device
    return (
        weight.kind == "e4m3"
        and weight.group_size == k
        and weight.perm is None
        and n % 16 == 0
        and k % 16 == 0
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def fp8_weight(weight: QuantizedWeight) -> Fp8Weight:
    n, _ = weight.shape
    return Fp8Weight(weight.qweight.t(), weight.scales.reshape(1, n).contiguous())


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] float8_e4m3fn, scale [M, 1] float32), x ~= xq * scale."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> x @ W^T + bias [M, N] in x's dtype."""
    xq, x_scale = quantize_rows(x if x.shape[1] < 2 or x.stride(1) == 1 else x.contiguous())
    # _scaled_mm adds a bias of the output's 16-bit dtype itself; any other is added after.
    fused = bias is not None and bias.dtype == x.dtype and x.dtype in (torch.float16, torch.bfloat16)
    y = torch._scaled_mm(xq, weight.codes_t, scale_a=x_scale, scale_b=weight.scale, bias=bias if fused else None, out_dtype=x.dtype)
    return y if bias is None or fused else y + bias.to(y.dtype)


def fp8_reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What fp8_linear computes, before its rounding to x's dtype: [M, N] float32, on any device."""
    xq, x_scale = quantize_per_token(x)
    y = (xq.float() * x_scale) @ weight.dequantize().t()
    return y if bias is None else y + bias.float()
