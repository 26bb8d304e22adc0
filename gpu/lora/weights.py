"""load_adapter: a checked PEFT adapter's tensors, by (layer, target), in the model's dtype.

The adapter was read and checked first (config/lora_adapter.py `read_adapter_info`: names,
shapes, rank), so here each tensor only has its key parsed and is cast. The caller copies them
into its slot stacks (zero-padded to the maximum rank) and applies `info.scaling`; a module the
adapter does not cover (layers_to_transform, a target only some layers match) has no entry, and
its slot rows stay zero.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from conveyor.config.lora_adapter import WEIGHTS_FILE, AdapterInfo, LoraError

_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")


def load_adapter(
    info: AdapterInfo, num_layers: int, dtype: torch.dtype, device: torch.device | str
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, target) -> (A [r, in], B [out, r]) in `dtype` on `device`, for every module the
    adapter covers (layers below num_layers)."""
    tensors = load_file(Path(info.path) / WEIGHTS_FILE, device="cpu")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.fullmatch(key)
        if match is None or int(match.group(1)) >= num_layers:
            raise LoraError(f"LoRA adapter {info.name!r} ({info.path}): tensor {key} is not one of a layer's targets")
        halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor.to(device=device, dtype=dtype)
    for (layer, target), half in halves.items():
        if len(half) != 2:
            raise LoraError(f"LoRA adapter {info.name!r} ({info.path}): layer {layer}'s {target} lacks lora_A or lora_B")
    return {pair: (half["A"], half["B"]) for pair, half in halves.items()}
