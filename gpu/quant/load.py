"""Loading a quantized checkpoint's layers: the float layers it replaces, and the routing of its
tensors to its scheme.

`QuantLoad(model, scheme, header)` is made after the model is built on the meta device and
before it is materialised: it drops the float weight of every layer the checkpoint stores
quantized (so none is ever allocated). During
`CausalLM.load_weights`, `take(name, tensor)` keeps each such layer's tensors until its scheme's
required ones are all there, then converts them (gpu/quant/scheme.py), cuts this rank's slice
along the layer's own Split, and sets the layer's `quantized` on the model's device; `finish()`
ties a quantized lm_head to its embedding and names the first tensor that never came. A
quantized layer's `weight` is None from then on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from conveyor.config.errors import ConfigError
from conveyor.gpu.models.base import CausalLM
from conveyor.gpu.models.layers import Linear, VocabParallelEmbedding
from conveyor.gpu.parallel.group import TensorParallel
from conveyor.gpu.quant.scheme import QuantScheme
from conveyor.gpu.quant.weight import QuantizedWeight

Quantizable = Linear | VocabParallelEmbedding


def full_shape(layer: Quantizable) -> tuple[int, int]:
    """The whole checkpoint weight's (N, K), before any tensor-parallel cut."""
    split = layer.splits.get("weight")
    if isinstance(layer, VocabParallelEmbedding):
        n, k = layer.num_embeddings, layer.embedding_dim
    else:
        n, k = layer.out_features, layer.in_features
    if split is None:
        return n, k
    whole = split.parts[0][0] if split.pad else sum(units * unit for units, unit in split.parts)
    return (whole, k) if split.dim == 0 else (n, whole)


class QuantLoad:
    def __init__(self, model: CausalLM, scheme: QuantScheme, header: Mapping[str, torch.dtype], tp: TensorParallel) -> None:
        self.scheme, self.tp = scheme, tp
        modules = dict(model.named_modules())
        candidates = {p for p, m in modules.items() if isinstance(m, Linear)}
        if scheme.quantizes_embedding:
            candidates |= {p for p, m in modules.items() if isinstance(m, VocabParallelEmbedding)}
        tied = model.config.tie_word_embeddings
        if tied:
            candidates.discard("lm_head")  # it shares the embedding's weight, whichever form
        self.layers: dict[str, Quantizable] = {}
        for prefix in sorted(scheme.quantized_layers(header, candidates)):
            layer = modules[prefix]
            assert isinstance(layer, (Linear, VocabParallelEmbedding))  # a candidate
            self.layers[prefix] = layer
        if self.layers and model.config.moe is not None:
            raise ConfigError("quantized mixture-of-experts checkpoints are not served yet")
        self.tied = tied and "model.embed_tokens" in self.layers
        head = modules.get("lm_head") if self.tied else None
        self.head = head if isinstance(head, Linear) else None
        for layer in [*self.layers.values(), *([self.head] if self.head is not None else [])]:
            layer.register_parameter("weight", None)
        embedding = modules["model.embed_tokens"]
        if isinstance(embedding, VocabParallelEmbedding):  # a quantized table's rows come out in the model dtype
            embedding.dtype = getattr(torch, model.config.dtype)
        self.parts: dict[str, dict[str, torch.Tensor]] = {}
        self.suffixes = set(scheme.required) | set(scheme.optional)

    def route(self, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's stream less the quantized layers' tensors, which `take` keeps."""
        for name, tensor in tensors:
            if not self.take(name, tensor, device):
                yield name, tensor

    def take(self, name: str, tensor: torch.Tensor, device: torch.device) -> bool:
        """Whether `name` is one of a quantized layer's tensors (kept, and the layer converted once
        it has them all)."""
        prefix, _, suffix = name.rpartition(".")
        layer = self.layers.get(prefix)
        if layer is None or suffix not in self.suffixes or layer.quantized is not None:
            return False
        parts = self.parts.setdefault(prefix, {})
        parts[suffix] = tensor
        if all(s in parts for s in self.scheme.required):
            weight = self.scheme.convert(prefix, self.parts.pop(prefix), full_shape(layer))
            layer.quantized = weight.cut(layer.splits.get("weight"), self.tp.rank, self.tp.size, prefix).to(device)
        return True

    def finish(self) -> None:
        """After the last tensor: tie the head, or name what never came."""
        for prefix, layer in self.layers.items():
            if layer.quantized is None:
                have = self.parts.get(prefix, {})
                absent = next(s for s in self.scheme.required if s not in have)
                raise ConfigError(f"quantized layer {prefix} lacks tensor {prefix}.{absent}")
        if self.head is not None:
            self.head.quantized = self.layers["model.embed_tokens"].quantized

    def quantized_weights(self) -> list[QuantizedWeight]:
        return [layer.quantized for layer in self.layers.values() if layer.quantized is not None]
