"""Tiny random mixture-of-experts checkpoints, built and saved with transformers itself.

Variants (the dense fields of tests/gpu_checkpoints.py; intermediate_size 128 is Mixtral's expert
size and the Qwen dense layers'): Mixtral (8 experts, top 2, renormalised); Qwen3-MoE with norm_topk_prob off and on
(4 and 8 experts; the norm-on one makes layer 0 dense through mlp_only_layers); Qwen2-MoE (a
shared expert, dense and sparse layers by decoder_sparse_step 2). Every parameter is drawn again
after construction: biases and norms too (HF initialises them to 0 and 1), and routers at a larger
scale so the top-k choices have clear margins (a near tie could flip between two correct
implementations).

`model_config` reads a saved checkpoint through the model registry, MoE fields included
(ModelConfig.moe).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from conveyor.config import ModelConfig
from conveyor.gpu.models.registry import read_model_config
from conveyor.tiny.checkpoint import make_checkpoint
from conveyor.tiny.tokenizer import VOCAB_SIZE
from tests.gpu_checkpoints import COMMON_FIELDS, INITIALIZER_RANGE

_ROOT = tempfile.TemporaryDirectory(prefix="conveyor-moe-ckpt-")


def _configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        "mixtral": transformers.MixtralConfig(**COMMON_FIELDS, num_local_experts=8, num_experts_per_tok=2),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **COMMON_FIELDS, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False
        ),
        "qwen3_moe_norm": transformers.Qwen3MoeConfig(
            **COMMON_FIELDS,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **COMMON_FIELDS,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
    }


MOE_ARCHS = tuple(_configs())
_CONFIGS_WITH_TOKENIZER = {"mixtral_tokenizer": "mixtral"}  # vocab 4096: conveyor.tiny's tokenizer fits it
_MODEL_CLASSES: dict[str, type[transformers.PreTrainedModel]] = {
    "mixtral": transformers.MixtralForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "qwen3_moe_norm": transformers.Qwen3MoeForCausalLM,
    "qwen2_moe": transformers.Qwen2MoeForCausalLM,
}


@functools.cache
def checkpoint(name: str) -> Path:
    """Path of the saved checkpoint `name`: one of MOE_ARCHS, or "mixtral_tokenizer" (Mixtral with
    a 4096-token vocabulary and conveyor.tiny's tokenizer files, for the Python API)."""
    base = _CONFIGS_WITH_TOKENIZER.get(name, name)
    config = _configs()[base]
    if name in _CONFIGS_WITH_TOKENIZER:
        config.vocab_size = VOCAB_SIZE
    torch.manual_seed(4321)
    model = _MODEL_CLASSES[base](config)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
            elif pname.endswith("gate.weight"):  # routers (and Qwen2-MoE's shared-expert gate)
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, INITIALIZER_RANGE)
    path = Path(_ROOT.name) / name
    model.save_pretrained(path)
    if name in _CONFIGS_WITH_TOKENIZER:
        tiny = make_checkpoint(Path(_ROOT.name) / "tiny-tokenizer", hidden_size=32, intermediate_size=32, num_hidden_layers=1)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / file, path / file)
    return path


def hf_model(name: str) -> transformers.PreTrainedModel:
    return _MODEL_CLASSES[_CONFIGS_WITH_TOKENIZER.get(name, name)].from_pretrained(checkpoint(name), dtype=torch.float32).eval()


def model_config(name: str) -> ModelConfig:
    return read_model_config(checkpoint(name))


def checkpoint_tensors(name: str) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(checkpoint(name) / "model.safetensors").items())
