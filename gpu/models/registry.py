"""The model registry: every architecture conveyor serves, one line each.

A line names the Hugging Face architecture (config.json's `architectures`), the CausalLM class
that runs it and the config adapter that reads its family's quirks (both in the family's file),
and, where llama.cpp writes the same weights, its GGUF `general.architecture`. Everything else is
derived from the table: the architectures `read_model_config` accepts (with the refusal's list),
the class `build_model` builds, and the GGUF files gpu/loading/gguf/ converts (GGUF_ARCHITECTURES).
Adding a family is its model file plus one line here (docs/models.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from conveyor.config.errors import ConfigError
from conveyor.config.model import ConfigAdapter, ModelConfig
from conveyor.gpu.backends.base import Backend
from conveyor.gpu.models.base import CausalLM
from conveyor.gpu.models.gemma import GemmaForCausalLM, gemma2_config, gemma3_config
from conveyor.gpu.models.gemma3_vl import Gemma3ForConditionalGeneration, gemma3_vl_config
from conveyor.gpu.models.llama import LlamaForCausalLM, llama_config, qwen2_config, qwen3_config
from conveyor.gpu.models.llava import LlavaForConditionalGeneration, llava_config
from conveyor.gpu.models.mixtral import MixtralForCausalLM, mixtral_config
from conveyor.gpu.models.phi3 import Phi3ForCausalLM, phi3_config
from conveyor.gpu.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration, qwen2_vl_config
from conveyor.gpu.models.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, qwen2_moe_config, qwen3_moe_config


@dataclasses.dataclass(frozen=True)
class Architecture:
    model: type[CausalLM]
    adapter: ConfigAdapter
    gguf: str | None = None  # the GGUF general.architecture holding this one's weights


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, llama_config, gguf="llama"),  # Mistral GGUF files too
    "MistralForCausalLM": Architecture(LlamaForCausalLM, llama_config),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, qwen2_config, gguf="qwen2"),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, qwen3_config),
    "Gemma2ForCausalLM": Architecture(GemmaForCausalLM, gemma2_config),
    "Gemma3ForCausalLM": Architecture(GemmaForCausalLM, gemma3_config),
    "Phi3ForCausalLM": Architecture(Phi3ForCausalLM, phi3_config),
    "MixtralForCausalLM": Architecture(MixtralForCausalLM, mixtral_config),
    "Qwen2MoeForCausalLM": Architecture(Qwen2MoeForCausalLM, qwen2_moe_config),
    "Qwen3MoeForCausalLM": Architecture(Qwen3MoeForCausalLM, qwen3_moe_config),
    "LlavaForConditionalGeneration": Architecture(LlavaForConditionalGeneration, llava_config),
    "Qwen2VLForConditionalGeneration": Architecture(Qwen2VLForConditionalGeneration, qwen2_vl_config),
    "Qwen2_5_VLForConditionalGeneration": Architecture(Qwen2_5_VLForConditionalGeneration, qwen2_vl_config),
    "Gemma3ForConditionalGeneration": Architecture(Gemma3ForConditionalGeneration, gemma3_vl_config),
}
ADAPTERS: dict[str, ConfigAdapter] = {name: arch.adapter for name, arch in ARCHITECTURES.items()}
GGUF_ARCHITECTURES: dict[str, str] = {arch.gguf: name for name, arch in ARCHITECTURES.items() if arch.gguf}


def read_model_config(
    path: str | Path,
    *,
    dtype: str | None = None,
    max_model_len: int | None = None,
    served_name: str | None = None,
    quantization: str | None = None,
) -> ModelConfig:
    """The ModelConfig of the checkpoint directory `path`, its family's quirks read by its adapter
    (config/model.py `ModelConfig.from_checkpoint`); the keywords override the file's values."""
    return ModelConfig.from_checkpoint(
        path, ADAPTERS, dtype=dtype, max_model_len=max_model_len, served_name=served_name, quantization=quantization
    )


def build_model(config: ModelConfig, rope_device: torch.device | str = "cpu", backend: Backend | None = None) -> CausalLM:
    """An uninitialised model for `config` on `backend` (None: torch's); build it under
    `torch.device("meta")` to skip init."""
    arch = ARCHITECTURES.get(config.architecture)
    if arch is None:
        raise ConfigError(f"no implementation for architecture {config.architecture!r}")
    return arch.model(config, rope_device, backend)
