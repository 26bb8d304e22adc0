"""The fp8 KV cache (--kv-cache-dtype fp8): e4m3 codes (torch.float8_e4m3fn) and per-layer scales.

A layer's keys are stored as code = clamp(k / k_scale, +-448) rounded to e4m3 (torch's `.to`,
round to nearest even), and read back as code * k_scale in float32; values alike with v_scale.
`KVScales` holds one layer's two scales: 1.0 unless the checkpoint gives them (gpu/quant/kv_scales.py),
and a float cache ignores them. Every backend writes with `quantize_kv`; readers may fold the
scales into their arithmetic instead of multiplying each element (scores = q . (code * k_scale) =
(q * k_scale) . code, and out = v_scale * sum(p * code) / sum(p)), which is the same number.

e4m3 keeps 3 mantissa bits: a stored normal value is within 2^-4 of the input, relatively (half
an ulp of 2^-3), a subnormal one (|x / scale| < 2^-6) within 2^-10 * scale absolutely; 448 is the
largest finite code, and the two NaN codes (0x7f, 0xff) are never written from finite inputs.
"""

from __future__ import annotations

import dataclasses

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


@dataclasses.dataclass(frozen=True)
class KVScales:
    """One layer's fp8 KV cache scales: stored code = x / scale, read x = code * scale."""

    k: float = 1.0
    v: float = 1.0


UNIT_SCALES = KVScales()


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x [...] float -> e4m3 codes [...] (torch.float8_e4m3fn): x / scale, clamped to +-448, rounded."""
    x = x.float()  # x itself when float32: nothing below writes in place
    if scale != 1.0:
        x = x / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 codes [...] -> code * scale [...] (in float32), cast to `dtype`."""
    x = codes.float()
    if scale != 1.0:
        x = x * scale
    return x.to(dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache viewed as uint8, for the ops torch has no float8 kernel for on a CPU
    (index_copy_, index_select) and for kernels that read the codes as bytes; others as they are."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
