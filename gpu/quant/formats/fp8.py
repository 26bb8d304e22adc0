"""Hugging Face FP8 checkpoints (quant_method "fp8": transformers' FineGrainedFP8, DeepSeek-V3's
layout, AutoFP8's per-tensor one) -> QuantizedWeight of kind e4m3, w = code * scale.

A quantized linear layer stores `weight`, float8_e4m3fn codes [N, K], and its scales:
- block-wise (`weight_block_size` [bn, bk], DeepSeek's [128, 128]): `weight_scale_inv`
  [ceil(N / bn), ceil(K / bk)], one per bn x bk tile (a multiplier, despite its name). It becomes
  one scale per row and group of G = gcd(K, bk) inputs: the bn rows of a tile share its scale.
- per-tensor (no `weight_block_size`): one scale, `weight_scale_inv` (transformers) or
  `weight_scale` (AutoFP8), repeated per row (G = K).
The quantized layers are those whose `weight` the checkpoint stores in float8_e4m3fn: the file's
dtype decides, so `modules_to_not_convert` (the LM head, routers: stored in float) needs no matcher.
Activations are not quantized here: `activation_scheme` dynamic or static alike serves weight-only
on the torch ops (the CUDA ops may multiply e4m3 weights in FP8), and a static checkpoint's
`input_scale` / `activation_scale` tensors are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from conveyor.config.errors import ConfigError
from conveyor.config.quant import QuantConfig
from conveyor.gpu.quant.scheme import QuantScheme, expect
from conveyor.gpu.quant.weight import QuantizedWeight

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# quantization_config fields with a choice: the values served, the default first. (scale_fmt
# "ue8m0" is MXFP8's power-of-two scales, stored as bytes.)
CHOICES = {"fmt": ("e4m3",), "scale_fmt": ("float",), "activation_scheme": ("dynamic", "static")}


class Fp8Scheme(QuantScheme):
    required = ("weight", "weight_scale_inv")
    optional = ("input_scale", "activation_scale")

    def __init__(self, config: QuantConfig) -> None:
        super().__init__(config)
        spec = self.spec
        for key, served in CHOICES.items():
            value = str(spec.get(key) or served[0]).lower()
            if value not in served:
                raise ConfigError(f"fp8 quantization_config {key} {value!r} is not served; served: {', '.join(served)}")
        if spec.get("modules_to_convert"):
            raise ConfigError("fp8 quantization_config modules_to_convert (FP8 embeddings) is not served")
        block = spec.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"fp8 quantization_config weight_block_size {block!r}: two positive integers")
        self.block: tuple[int, int] | None = None if block is None else (block[0], block[1])

    def quantized_layers(self, tensors: Mapping[str, torch.dtype], candidates: set[str]) -> set[str]:
        """Those whose weight is FP8. Per-tensor checkpoints name their scale either way: the one
        these carry becomes `required` (QuantLoad reads it after this call)."""
        layers = {p for p in candidates if tensors.get(f"{p}.weight") == torch.float8_e4m3fn}
        if self.block is None and layers and not any(f"{p}.weight_scale_inv" in tensors for p in layers):
            self.required = ("weight", "weight_scale")
        return layers

    def convert(self, prefix: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        n, k = shape
        weight, name = parts["weight"], self.required[1]
        expect(prefix, "weight", weight, shape, (torch.float8_e4m3fn,))
        scale = parts[name]
        if self.block is None:
            if scale.numel() != 1:
                raise ConfigError(f"tensor {prefix}.{name} has shape {tuple(scale.shape)}, expected one per-tensor scale")
            expect(prefix, name, scale, tuple(scale.shape), SCALE_DTYPES)
            return QuantizedWeight("e4m3", k, weight, scale.float().reshape(1, 1).repeat(n, 1), None)
        scales, group = expand_blocks(prefix, name, scale, self.block, shape)
        return QuantizedWeight("e4m3", group, weight, scales, None)

    def describe(self) -> str:
        tiles = "per tensor" if self.block is None else f"in {self.block[0]}x{self.block[1]} blocks"
        return f"fp8 e4m3, scaled {tiles}, activations not quantized"


def expand_blocks(
    prefix: str, name: str, scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]
) -> tuple[torch.Tensor, int]:
    """A scale per bn x bk tile, [ceil(N / bn), ceil(K / bk)] -> (scales [N, K / G] float32, G):
    one per row and group of G = gcd(K, bk) inputs, so a last partial tile needs no padding."""
    (bn, bk), (n, k) = block, shape
    expect(prefix, name, scale, (-(-n // bn), -(-k // bk)), SCALE_DTYPES)
    group = math.gcd(k, bk)
    rows = scale.float().repeat_interleave(bn, dim=0)[:n]  # [N, ceil(K / bk)]
    return rows.repeat_interleave(bk // group, dim=1)[:, : k // group].contiguous(), group
