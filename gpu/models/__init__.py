"""Model implementations, chosen by the checkpoint's architecture name.

One file per family (ModelConfig's ARCHITECTURE_FAMILIES table names them): llama.py (Llama,
Mistral, Qwen2, Qwen3), gemma.py (Gemma 2, Gemma 3 text), phi3.py (Phi-3), mixtral.py and
qwen3_moe.py (Mixtral, Qwen2-MoE, Qwen3-MoE: the experts in moe.py). ModelConfig carries
the differences inside a family. A new family registers its class in MODEL_CLASSES; every class
has LlamaForCausalLM's interface: (config, rope_device, backend) to build, `forward`,
`compute_logits`, `after_load`, and the `model.embed_tokens` / `lm_head` the loader ties.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import Backend
from conveyor.gpu.models.gemma import GemmaForCausalLM
from conveyor.gpu.models.llama import LlamaForCausalLM
from conveyor.gpu.models.mixtral import MixtralForCausalLM
from conveyor.gpu.models.phi3 import Phi3ForCausalLM
from conveyor.gpu.models.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def build_model(config: ModelConfig, rope_device: torch.device | str = "cpu", backend: Backend | None = None) -> LlamaForCausalLM:
    """An uninitialised model for `config` on `backend` (None: torch's); build it under
    `torch.device("meta")` to skip init."""
    try:
        cls = MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ConfigError(f"no implementation for architecture {config.architecture!r}") from None
    return cast(LlamaForCausalLM, cls(config, rope_device, backend))  # LlamaForCausalLM's interface, if not its subclass


__all__ = [
    "MODEL_CLASSES",
    "GemmaForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "build_model",
]
