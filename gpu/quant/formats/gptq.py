"""GPTQ checkpoints (AutoGPTQ, GPTQModel and optimum's layout, which vLLM's `gptq` reads) ->
QuantizedWeight.

A quantized linear layer `prefix.` of N outputs and K inputs, in groups of G inputs, b bits a
code, p = 32 / b codes a word, carries
- qweight int32 [K / p, N]: packed along the inputs, bits b*i.. of word r holding input r*p + i;
- qzeros int32 [K / G, N / p]: packed along the outputs the same way;
- scales fp16 [K / G, N];
- g_idx int32 [K]: the group of each input (read where desc_act is set);
and w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]. checkpoint_format (GPTQModel also
writes it as `format`) "gptq" stores each zero point minus 1 (AutoGPTQ's off-by-one, which every
reader adds back); "gptq_v2" stores it exact.
desc_act (act-order) quantized the inputs in another order, so a group's inputs are scattered:
the weight's `perm` sorts them by group (stably), and the kernel reads x[:, perm] against
contiguous groups (gpu/quant/weight.py). Without desc_act, g_idx is k // G and is not read, as
vLLM does. bits 4 -> u4 (u8 where G is not a multiple of 32), 8 -> u8; 2 and 3, per-module
`dynamic` overrides and other packings are refused in one line; modules_to_not_convert stay float.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from conveyor.config.errors import ConfigError
from conveyor.config.quant import QuantConfig
from conveyor.gpu.quant.formats.packed_int import SCALE_DTYPES, field, group_of, grouped_weight, layer_group, refuse, skipped, unpack
from conveyor.gpu.quant.scheme import QuantScheme, expect
from conveyor.gpu.quant.weight import QuantizedWeight

BITS = (4, 8)
FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to a stored zero point


class GptqScheme(QuantScheme):
    optional = ("g_idx",)

    def __init__(self, config: QuantConfig) -> None:
        super().__init__(config)
        spec = self.spec
        self.bits = field(spec, ("bits",), 4)
        if self.bits not in BITS:
            raise refuse("GPTQ", "bits", self.bits, " or ".join(map(str, BITS)))
        self.group_size = group_of("GPTQ", field(spec, ("group_size",), 128))
        self.format = str(field(spec, ("checkpoint_format", "format"), "gptq")).lower()
        if self.format not in FORMATS:
            raise refuse("GPTQ", "checkpoint_format", self.format, " or ".join(FORMATS))
        if spec.get("dynamic"):
            raise refuse("GPTQ", "dynamic", "(per-module overrides)", "none: one bits and group_size for every layer")
        pack_dtype = str(field(spec, ("pack_dtype",), "int32")).removeprefix("torch.")
        if pack_dtype != "int32":
            raise refuse("GPTQ", "pack_dtype", pack_dtype, "int32")
        self.desc_act = bool(field(spec, ("desc_act",), False))
        self.required = ("qweight", "qzeros", "scales") + (("g_idx",) if self.desc_act else ())
        self.skip = tuple(spec.get("modules_to_not_convert") or ())

    def quantized_layers(self, tensors: Mapping[str, torch.dtype], candidates: set[str]) -> set[str]:
        return {p for p in super().quantized_layers(tensors, candidates) if not skipped(p, self.skip)}

    def convert(self, prefix: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        n, k = shape
        per = 32 // self.bits
        for name, size in (("qweight", k), ("qzeros", n)):
            if size % per:
                raise ConfigError(f"tensor {prefix}.{name}: {size} codes do not pack {per} to an int32")
        group = layer_group(prefix, self.group_size, k)
        expect(prefix, "qweight", parts["qweight"], (k // per, n), (torch.int32,))
        expect(prefix, "qzeros", parts["qzeros"], (k // group, n // per), (torch.int32,))
        expect(prefix, "scales", parts["scales"], (k // group, n), SCALE_DTYPES)
        q = unpack(parts["qweight"], self.bits, 0)  # [K, N]
        zeros = unpack(parts["qzeros"], self.bits, 1) + FORMATS[self.format]  # [K / G, N]
        perm = None
        if self.desc_act:
            expect(prefix, "g_idx", parts["g_idx"], (k,), (torch.int32, torch.int64))
            perm = act_order(prefix, parts["g_idx"], group)
            q = q if perm is None else q[perm]
        return grouped_weight(q.T, zeros.T, parts["scales"].T, self.bits, group, perm)

    def describe(self) -> str:
        groups = "whole rows" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"GPTQ {self.bits}-bit ({self.format}), {groups}{', act-order' if self.desc_act else ''}"


def act_order(prefix: str, g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """g_idx [K] -> perm [K] int64 that sorts the inputs by group (None where they already are),
    or a ConfigError unless every group holds exactly `group` inputs."""
    g = g_idx.long()
    perm = torch.sort(g, stable=True).indices
    k = g.numel()
    if not torch.equal(g[perm], torch.arange(k) // group):
        raise ConfigError(f"tensor {prefix}.g_idx: its inputs do not fall {group} to each of {k // group} groups")
    return None if torch.equal(perm, torch.arange(k)) else perm
