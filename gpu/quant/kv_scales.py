"""An fp8 KV cache's per-layer scales (gpu/kv/kv_fp8.py), read from the checkpoint as vLLM reads them.

With P an attention module's name (model.layers.3.self_attn), the checkpoint may carry:
  P.k_scale, P.v_scale                         HF FP8 / ModelOpt / llm-compressor checkpoints
  P.kv_scale                                   older ones: one scale for keys and values
  P.k_proj.output_scale, P.v_proj.output_scale compressed-tensors with a kv_cache_scheme
each one positive, finite number (a per-tensor scale; per-head ones are refused, naming the
tensor). `KVScaleLoad(model).route(tensors)` takes them out of the checkpoint's stream, before
the quantized-layer routing and the name lookup, and sets the module's `kv_scales`
(gpu/models/llama.py Attention); a layer without one keeps 1.0. A float cache ignores them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.gpu.kv.kv_fp8 import KVScales

# checkpoint suffix -> (the attention module's name less this many trailing parts, KVScales fields)
SUFFIXES = {
    "k_scale": (1, ("k",)),
    "v_scale": (1, ("v",)),
    "kv_scale": (1, ("k", "v")),
    "k_proj.output_scale": (2, ("k",)),
    "v_proj.output_scale": (2, ("v",)),
}


class KVScaleLoad:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers: set[str] = set()  # attention modules that got a scale

    def route(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's stream less its KV cache scales, which are set on their layers."""
        for name, tensor in tensors:
            if not self.take(name, tensor):
                yield name, tensor

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `name` is a KV cache scale (then set on its attention module)."""
        match = next(((s, how) for s, how in SUFFIXES.items() if name.endswith("." + s)), None)
        if match is None:
            return False
        suffix, (parts, fields) = match
        prefix = name.rsplit(".", parts)[0]
        try:
            module = self.model.get_submodule(prefix)
        except AttributeError:
            module = None
        scales = getattr(module, "kv_scales", None)
        if not isinstance(scales, KVScales):
            raise ConfigError(f"checkpoint tensor {name}: a KV cache scale for {prefix}, which is no attention layer")
        if tensor.numel() != 1:
            raise ConfigError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}: the fp8 KV cache takes one scale per layer")
        value = float(tensor.float().item())
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"checkpoint tensor {name} is {value}: a KV cache scale must be positive and finite")
        # setattr: nn.Module types its attributes as tensors and modules, which this is neither
        setattr(module, "kv_scales", dataclasses.replace(scales, **dict.fromkeys(fields, value)))  # noqa: B010
        self.layers.add(prefix)
        return True
