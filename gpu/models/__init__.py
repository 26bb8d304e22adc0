"""Model implementations, chosen by the checkpoint's architecture name.

All supported architectures share one decoder; ModelConfig carries their differences.
"""

from __future__ import annotations

import torch

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import Backend
from conveyor.gpu.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(config: ModelConfig, rope_device: torch.device | str = "cpu", backend: Backend | None = None) -> LlamaForCausalLM:
    """An uninitialised model for `config` on `backend` (None: torch's); build it under
    `torch.device("meta")` to skip init."""
    try:
        cls = MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ConfigError(f"no implementation for architecture {config.architecture!r}") from None
    return cls(config, rope_device, backend)


__all__ = ["MODEL_CLASSES", "LlamaForCausalLM", "build_model"]
