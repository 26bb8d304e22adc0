"""`--quantization int8 | fp8`: a float checkpoint's linear weights quantized as they load.

Every linear layer but the LM head takes its float `weight` and keeps only the quantized form
(the head's logits decide every token, and vLLM leaves it float too); embeddings and norms stay
in the model dtype.
- int8: weight-only, each group of 128 inputs (the whole row where K is not a multiple of 128)
  mapped min..max onto 0..255; any device.
- fp8: e4m3 codes with one absmax scale per output row (per channel), as vLLM's dynamic FP8; on
  CUDA the triton ops multiply them in FP8 (`torch._scaled_mm`), elsewhere they are read as
  weight-only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from conveyor.gpu.quant.scheme import QuantScheme
from conveyor.gpu.quant.weight import QuantizedWeight, quantize_groups

INT8_GROUP = 128


class _Online(QuantScheme):
    required = ("weight",)

    def quantized_layers(self, tensors: Mapping[str, torch.dtype], candidates: set[str]) -> set[str]:
        return {p for p in candidates if p != "lm_head" and f"{p}.weight" in tensors}


class OnlineInt8(_Online):
    def convert(self, prefix: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        k = shape[1]
        return quantize_groups(parts["weight"], "u8", INT8_GROUP if k % INT8_GROUP == 0 else k)

    def describe(self) -> str:
        return f"int8 weight-only, groups of {INT8_GROUP}, quantized at load"


class OnlineFp8(_Online):
    def convert(self, prefix: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        return quantize_groups(parts["weight"], "e4m3", shape[1])

    def describe(self) -> str:
        return "fp8 e4m3, a scale per output channel, quantized at load"
