"""Tiny random Hugging Face checkpoints for the GPU-side tests, built with transformers itself.

Each variant is saved once per test session (safetensors, float32) into a temporary directory and
reused. INITIALIZER_RANGE is 0.1 rather than HF's 0.02: at 0.02 the logits are nearly uniform, and
at 0.3-1.0 they grow so sharp that float32 rounding differences get amplified; measured over 12
seeds, 0.1 kept every greedy top-1/top-2 margin at least ~100x the float32-vs-float64 logit error.
Biases and norm weights are randomised too (HF initialises them to 0 and 1), so their loading and
use are actually checked.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import TypedDict

import torch
import transformers

from conveyor.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

INITIALIZER_RANGE = 0.1
VOCAB = 512
_ROOT = tempfile.TemporaryDirectory(prefix="conveyor-gpu-ckpt-")


class _Common(TypedDict):
    """The config fields every variant shares (typed, so mypy checks them against each config class)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    initializer_range: float
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int


COMMON_FIELDS = _Common(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=INITIALIZER_RANGE,
    bos_token_id=None,
    eos_token_id=None,  # no early stop in hf generate: compare a fixed number of tokens
    pad_token_id=0,
)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        # llama3 rope whose original context (64) is shorter than our prompts; biases everywhere.
        "llama": transformers.LlamaConfig(
            **COMMON_FIELDS,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        # head_dim 32 != hidden / heads (16), no sliding window.
        "mistral": transformers.MistralConfig(**COMMON_FIELDS, head_dim=32, sliding_window=None),
        "mistral_swa": transformers.MistralConfig(**COMMON_FIELDS, sliding_window=32),
        # q/k/v biases, tied embeddings, linear rope scaling.
        "qwen2": transformers.Qwen2Config(
            **COMMON_FIELDS,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    }


ARCHS = tuple(_configs())
_MODEL_CLASSES: dict[str, type[transformers.PreTrainedModel]] = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "mistral_swa": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
}


@functools.cache
def checkpoint(name: str) -> Path:
    """Path of the saved checkpoint `name` (one of ARCHS)."""
    torch.manual_seed(1234)
    model = _MODEL_CLASSES[name](_configs()[name])
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, INITIALIZER_RANGE)
            elif "norm" in pname:
                param.uniform_(0.5, 1.5)
    path = Path(_ROOT.name) / name
    model.save_pretrained(path)
    return path


def hf_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> transformers.PreTrainedModel:
    """The HF reference model for `name`, in eval mode."""
    model = _MODEL_CLASSES[name].from_pretrained(checkpoint(name), dtype=dtype)
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as unbound.
    model = model.to(device)  # type: ignore[arg-type]
    return model.eval()


def engine_config(
    name: str, *, block_size: int = 4, num_blocks: int = 512, device: str = "cpu", dtype: str | None = None
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig.from_pretrained(checkpoint(name), dtype=dtype),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks),
        parallel=ParallelConfig(device=device),
    )
