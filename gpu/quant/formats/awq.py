"""AWQ checkpoints (AutoAWQ's GEMM layout, which vLLM's `awq` reads) -> QuantizedWeight.

A quantized linear layer `prefix.` of N outputs and K inputs, in groups of G inputs, carries
- qweight int32 [K, N / 8]: 8 outputs' 4-bit codes per word, in AWQ's interleaved order: bits
  4i..4i+3 of word c hold output 8c + ORDER[i], ORDER = (0, 2, 4, 6, 1, 3, 5, 7);
- qzeros int32 [K / G, N / 8]: the zero points, packed the same way;
- scales fp16 [K / G, N];
and w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]. A bias stays float, loaded as usual.
quantization_config: bits / w_bit (4), group_size / q_group_size (-1: G = K), zero_point (true),
version ("gemm"; GEMV, Marlin and the other kernels' own layouts are refused), backend
("autoawq"), modules_to_not_convert (layers whose name contains one stay float).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from conveyor.config.errors import ConfigError
from conveyor.config.quant import QuantConfig
from conveyor.gpu.quant.formats.packed_int import SCALE_DTYPES, field, group_of, grouped_weight, layer_group, refuse, skipped, unpack
from conveyor.gpu.quant.scheme import QuantScheme, expect
from conveyor.gpu.quant.weight import QuantizedWeight

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of a word holds output ORDER[i] of its 8
NATURAL = [ORDER.index(n) for n in range(8)]  # output n of the 8 is field NATURAL[n]
PER_WORD = 8


class AwqScheme(QuantScheme):
    required = ("qweight", "qzeros", "scales")

    def __init__(self, config: QuantConfig) -> None:
        super().__init__(config)
        spec = self.spec
        bits = field(spec, ("bits", "w_bit"), 4)
        if bits != 4:
            raise refuse("AWQ", "bits", bits, "4")
        self.group_size = group_of("AWQ", field(spec, ("group_size", "q_group_size"), 128))
        version = str(field(spec, ("version",), "gemm")).lower()
        if version != "gemm":
            raise refuse("AWQ", "version", version, "'gemm' (AutoAWQ's GEMM layout)")
        if field(spec, ("zero_point",), True) is not True:
            raise refuse("AWQ", "zero_point", spec["zero_point"], "true (the GEMM layout's zero points)")
        backend = str(field(spec, ("backend",), "autoawq")).lower()
        if backend != "autoawq":
            raise refuse("AWQ", "backend", backend, "'autoawq'")
        self.skip = tuple(spec.get("modules_to_not_convert") or ())

    def quantized_layers(self, tensors: Mapping[str, torch.dtype], candidates: set[str]) -> set[str]:
        return {p for p in super().quantized_layers(tensors, candidates) if not skipped(p, self.skip)}

    def convert(self, prefix: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        n, k = shape
        if n % PER_WORD:
            raise ConfigError(f"tensor {prefix}.qweight: {n} outputs do not pack {PER_WORD} to an int32")
        group = layer_group(prefix, self.group_size, k)
        expect(prefix, "qweight", parts["qweight"], (k, n // PER_WORD), (torch.int32,))
        expect(prefix, "qzeros", parts["qzeros"], (k // group, n // PER_WORD), (torch.int32,))
        expect(prefix, "scales", parts["scales"], (k // group, n), SCALE_DTYPES)
        q, z = (_natural(parts[name]) for name in ("qweight", "qzeros"))  # [K, N], [K / G, N]
        return grouped_weight(q.T, z.T, parts["scales"].T, 4, group)

    def describe(self) -> str:
        groups = "whole rows" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"AWQ 4-bit GEMM, {groups}"


def _natural(words: torch.Tensor) -> torch.Tensor:
    """[R, N / 8] int32 words in AWQ's order -> [R, N] codes, outputs in their natural order."""
    fields = unpack(words, 4, 1)  # [R, N]: field i of word c at 8c + i
    return fields.view(words.shape[0], -1, PER_WORD)[:, :, NATURAL].reshape(words.shape[0], -1)
