"""What AWQ and GPTQ checkpoints share: integer codes packed in int32 words, a zero point and a
scale per group of inputs, w = (q - z) * s, and the reading of their config.json fields.

- `unpack` splits int32 words into their 32 / bits fields, lowest bits first, along the packed
  axis; a format's own reordering (AWQ's interleave) is applied by its reader after.
- `grouped_weight` makes the QuantizedWeight: kind u4 for 4-bit codes whose groups are whole u4
  chunks (G % 32 == 0), else u8 (one code a byte, any G); scales widened to float32 and
  mins = -(z * s), so code * s + min equals (q - z) * s exactly in float32 (a code or zero of at
  most 9 bits times an fp16 or bf16 scale of at most 11 significant bits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from conveyor.config.errors import ConfigError
from conveyor.gpu.quant.weight import CHUNK, QuantizedWeight, pack_u4

# The dtypes a published scale comes in (fp16 as AutoAWQ and AutoGPTQ write it; others widen too).
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words, M of them along `dim` (0 or 1 of a 2-D tensor) -> int32 fields, M * 32 / bits
    along `dim`: field i of word m (bits i * b .. i * b + b - 1) lands at m * 32 / b + i."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    shape = [1, 1, 1]
    shape[dim + 1] = shifts.numel()
    fields = (words.unsqueeze(dim + 1) >> shifts.view(shape)) & ((1 << bits) - 1)  # >> sign-extends; & drops it
    return fields.flatten(dim, dim + 1)


def grouped_weight(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, perm: torch.Tensor | None = None
) -> QuantizedWeight:
    """codes [N, K] in 0..2^bits - 1 (in the kernel's input order, `perm` applied), zeros [N, K / G]
    integers, scales [N, K / G] floats -> w[n, k] = (codes - zeros) * scales, as QuantizedWeight."""
    s = scales.float().contiguous()
    kind = "u4" if bits == 4 and group_size % CHUNK == 0 else "u8"
    q = codes.to(torch.uint8).contiguous()  # [N, K]: the readers pass transposed views
    return QuantizedWeight(kind, group_size, pack_u4(q) if kind == "u4" else q, s, -(zeros.float() * s).contiguous(), perm)


def field(spec: Mapping[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """The value of the first of `keys` (a field's spellings) that the quantization_config has."""
    return next((spec[key] for key in keys if spec.get(key) is not None), default)


def refuse(method: str, key: str, value: Any, served: str) -> ConfigError:
    return ConfigError(f"{method} checkpoint: quantization_config {key} {value!r} is not served; served: {served}")


def group_of(method: str, value: Any) -> int:
    """A group_size field: a positive number of inputs, or -1 (one group per row)."""
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise refuse(method, "group_size", value, "a positive number of inputs, or -1 for whole rows")
    return value


def layer_group(prefix: str, group_size: int, k: int) -> int:
    """The group size of a layer of `k` inputs, or a ConfigError naming its qweight."""
    group = k if group_size == -1 else group_size
    if k % group:
        raise ConfigError(f"tensor {prefix}.qweight: groups of {group} inputs do not divide its {k} inputs")
    return group


def skipped(prefix: str, modules: tuple[str, ...]) -> bool:
    """Whether modules_to_not_convert keeps the layer float (a name it contains, as vLLM reads it)."""
    return any(module in prefix for module in modules)
