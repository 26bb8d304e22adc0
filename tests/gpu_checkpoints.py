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
import json
import tempfile
from pathlib import Path
from typing import TypedDict

import torch
import transformers

from conveyor.config import CacheConfig, EngineConfig, ParallelConfig
from conveyor.gpu.models.registry import read_model_config

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

THREE_LAYERS = COMMON_FIELDS.copy()  # Gemma: windowed, global, windowed
THREE_LAYERS["num_hidden_layers"] = 3


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
        # a window of 16 on the layers from max_window_layers (1) on: the first layer is global.
        "qwen2_swa": transformers.Qwen2Config(**COMMON_FIELDS, use_sliding_window=True, sliding_window=16, max_window_layers=1),
        # q/k RMSNorm per head, biases on q/k/v/o, head_dim 32 != hidden / heads.
        "qwen3": transformers.Qwen3Config(**COMMON_FIELDS, head_dim=32, attention_bias=True),
        # windowed (8), global, windowed layers; GeGLU; small soft-caps so that they bind;
        # query_pre_attn_scalar != head_dim.
        "gemma2": transformers.Gemma2Config(
            **THREE_LAYERS,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=4.0,
        ),
        # q/k norms, local (base 100) and global (base 10000, linear x2) rope, no soft-caps.
        "gemma3": transformers.Gemma3TextConfig(
            **THREE_LAYERS,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        # fused qkv_proj / gate_up_proj; longrope whose original context is the whole table, so
        # only short_factor applies (the prompt-logit tests run 488-token prompts: see phi3_long).
        "phi3": transformers.Phi3Config(
            **COMMON_FIELDS,
            original_max_position_embeddings=512,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **LONGROPE_FACTORS},
        ),
    }


# Phi-3's LongRoPE factors for head_dim 16: one per rotated pair.
LONGROPE_FACTORS = {
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
}


def _long_context_configs() -> dict[str, transformers.PretrainedConfig]:
    """Variants whose behaviour changes past a short original context, so HF's whole-prompt
    choice differs from ours on prompts longer than it: tests keep prompts inside it and
    generate past it."""
    return {
        # original context 32 of 512: factor 16, long factors and attention factor past 32 tokens.
        "phi3_long": transformers.Phi3Config(
            **COMMON_FIELDS,
            original_max_position_embeddings=32,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **LONGROPE_FACTORS},
        ),
    }


ARCHS = tuple(_configs())
_MODEL_CLASSES: dict[str, type[transformers.PreTrainedModel]] = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "mistral_swa": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen2_swa": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "phi3_long": transformers.Phi3ForCausalLM,
}


@functools.cache
def checkpoint(name: str) -> Path:
    """Path of the saved checkpoint `name` (one of ARCHS, or of _long_context_configs)."""
    torch.manual_seed(1234)
    model = _MODEL_CLASSES[name]({**_configs(), **_long_context_configs()}[name])
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, INITIALIZER_RANGE)
            elif "norm" in pname:  # Gemma's norms scale by 1 + weight: centred on 0 there
                param.uniform_(-0.5, 0.5) if name.startswith("gemma") else param.uniform_(0.5, 1.5)
    path = Path(_ROOT.name) / name
    model.save_pretrained(path)
    return path


def hf_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> transformers.PreTrainedModel:
    """The HF reference model for `name`, in eval mode. Soft-capped attention (Gemma 2) runs HF's
    eager attention: its sdpa path, the default in some releases (transformers 5.17), drops the cap."""
    path = checkpoint(name)
    capped = json.loads((path / "config.json").read_text()).get("attn_logit_softcapping") is not None
    model = _MODEL_CLASSES[name].from_pretrained(path, dtype=dtype, attn_implementation="eager" if capped else None)
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as unbound.
    model = model.to(device)  # type: ignore[arg-type]
    return model.eval()


def engine_config(
    name: str, *, block_size: int = 4, num_blocks: int = 512, device: str = "cpu", dtype: str | None = None
) -> EngineConfig:
    return EngineConfig(
        model=read_model_config(checkpoint(name), dtype=dtype),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks),
        parallel=ParallelConfig(device=device),
    )
