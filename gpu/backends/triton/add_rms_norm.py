"""Fused residual add + RMSNorm, and plain RMSNorm, as one Triton kernel.

Layout: x, residual and out are [T, H] with unit stride along H (rows may be strided, so a view
into a larger buffer works); weight is [H]. Grid: (T,), one program per row; the whole row sits in
registers (BLOCK_H = next power of two >= H), which is what a decoder's hidden sizes (up to 8192)
fit. Tuned for: nothing yet measured; num_warps grows with H so a program keeps ~8 elements per
thread at H = 4096 (the Llama-3-8B shape this is meant for).

The rounding follows the torch model (gpu/models/llama.py's RMSNorm, itself HF's) step by step, so
bf16 and fp16 results match it bit for bit up to the reduction order: x + residual is rounded to
the activation dtype (and stored, residual updated in place), normalised in float32, then either
cast back to the activation dtype and only then multiplied by a weight in that dtype (Llama's
order), or multiplied by a float32 weight before the one cast (Gemma's). The output is in the
activation dtype. Every load is upcast to float32 at once, so the Triton interpreter's broken bf16
arithmetic is never used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.gpu.backends.torch.ops import rms_norm as torch_rms_norm


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK_H], activation dtype
    act_dtype = x.dtype
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_residual + cols
        summed = (h + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(act_dtype)  # rounded as torch's add
        tl.store(r_ptrs, summed, mask=mask)
        h = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)  # padding lanes are 0: they add nothing
    normed = h * inv_rms
    if weight_ptr.dtype.element_ty != tl.float32:
        normed = normed.to(act_dtype).to(tl.float32)  # cast back before the weight, as HF's Llama
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(act_dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, residual [T, H] (same dtype), weight [H] -> out [T, H] = rms_norm(x + residual) * weight.
    residual is updated in place to x + residual, ready for the next layer's add."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} != x {tuple(x.shape)} {x.dtype}")
    _check_row_major(residual, "residual")
    return _launch(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> out [T, H] = rms_norm(x) * weight (a new tensor)."""
    return _launch(x, None, weight, eps)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x must be [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    _check_row_major(x, "x")
    weight = weight.contiguous()
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x,
        x if residual is None else residual,  # unused without HAS_RESIDUAL
        weight,
        out,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out


def _check_row_major(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"rms_norm: {name} must be [T, H] with unit stride along H, got strides {t.stride()}")


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch backend's RMSNorm, for tests: (out, x + residual) without touching the inputs."""
    h = x if residual is None else x + residual
    return torch_rms_norm(h, weight, eps), (None if residual is None else h)
