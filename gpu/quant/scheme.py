"""QuantScheme: one checkpoint format's reader, and `scheme_for`, the table of them.

A scheme answers two questions for the loader (gpu/quant/load.py):
- which layers the checkpoint stores quantized (`quantized_layers`), from its tensors' names and
  dtypes alone, before any weight is read, so those layers never hold a float weight;
- how one layer's published tensors (`suffixes`: `qweight`, `scales`, ...) become a
  QuantizedWeight (`convert`), in the checkpoint's whole [N, K] before any tensor-parallel cut.
A tensor that does not fit (a shape, a dtype, a scale that disagrees) is a ConfigError naming it.
Formats live in gpu/quant/formats/, one file each; adding one is its file plus a line in SCHEMES.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Mapping

import torch

from conveyor.config.errors import ConfigError
from conveyor.config.quant import QuantConfig
from conveyor.gpu.quant.weight import QuantizedWeight

# QuantConfig.method -> "module:class" under gpu/quant/formats/ (imported on use: a format's
# package, such as compressed-tensors, is needed only by its checkpoints).
SCHEMES = {
    "gguf": "gguf:GgufScheme",
    "awq": "awq:AwqScheme",
    "gptq": "gptq:GptqScheme",
    "online-int8": "online:OnlineInt8",
    "online-fp8": "online:OnlineFp8",
    "compressed-tensors": "compressed:CompressedTensors",
    "fp8": "fp8:Fp8Scheme",
}


class QuantScheme(abc.ABC):
    # The tensors a quantized layer's `prefix.` carries: each required one, and those it may.
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    # Whether the embedding's table may be stored quantized (GGUF); others keep it float.
    quantizes_embedding: bool = False

    def __init__(self, config: QuantConfig) -> None:
        self.config = config
        self.spec = config.spec

    def quantized_layers(self, tensors: Mapping[str, torch.dtype], candidates: set[str]) -> set[str]:
        """The layer prefixes (of `candidates`: the model's linear layers, and its embedding where
        `quantizes_embedding`) whose weights the checkpoint stores quantized; `tensors` is every
        checkpoint tensor's name and dtype. By default: those that carry the first required tensor."""
        return {prefix for prefix in candidates if f"{prefix}.{self.required[0]}" in tensors}

    @abc.abstractmethod
    def convert(self, prefix: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        """A layer's published tensors (by suffix; every required one present) -> its weight of
        logical `shape` (N, K), on the CPU."""

    def describe(self) -> str:
        """The start-up log's name for the format."""
        return self.config.method


def scheme_for(config: QuantConfig) -> QuantScheme:
    module, _, name = SCHEMES[config.method].partition(":")
    return getattr(importlib.import_module(f"conveyor.gpu.quant.formats.{module}"), name)(config)


def expect(prefix: str, suffix: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...] = ()) -> None:
    """A ConfigError naming `prefix.suffix` unless it has `shape` (and one of `dtypes`)."""
    if tuple(tensor.shape) != tuple(shape):
        raise ConfigError(f"tensor {prefix}.{suffix} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if dtypes and tensor.dtype not in dtypes:
        raise ConfigError(f"tensor {prefix}.{suffix} is {tensor.dtype}, expected {' or '.join(map(str, dtypes))}")
