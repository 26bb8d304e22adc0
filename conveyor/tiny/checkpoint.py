"""make_checkpoint / ensure_default_model: random-weight Hugging Face checkpoints, made locally.

A checkpoint directory here is what the Hub would hand out for a Llama, Mistral or Qwen2 model:
config.json, generation_config.json, model.safetensors (HF tensor names and shapes),
tokenizer.json, tokenizer_config.json and chat_template.jinja. transformers loads it as is, so
tests compare the worker against transformers on it, and `conveyor serve --model tiny` serves
the default one (`ensure_default_model`), with nothing to download.

Weights are random but deterministic (torch.Generator(seed)) and scaled so the model is
decisive, not HF's near-uniform std 0.02: see the gains above `_weights`.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from conveyor.config.cached_dir import build_cached
from conveyor.config.env import cache_dir
from conveyor.tiny.tokenizer import (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    EOT_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKEN_IDS,
    VOCAB_SIZE,
    for_architecture,
    train_tokenizer,
)

# Bump when anything that changes the generated default model changes (corpus, tokenizer,
# shapes, init): the cache directory is named after it, so old caches are simply not used.
TINY_MODEL_VERSION = "v1"

DEFAULT_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 2048,
}

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}

# Llama 3's format. transformers renders it with trim_blocks/lstrip_blocks, as our encoder does.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "{{- message['content'] + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Trained once per process; every checkpoint made in it shares the vocabulary."""
    return train_tokenizer().to_str()


@functools.cache
def _tokenizer_json(architecture: str) -> str:
    return for_architecture(Tokenizer.from_str(_trained_tokenizer_json()), architecture).to_str(pretty=True)


def make_checkpoint(path: str | Path, architecture: str = "LlamaForCausalLM", *, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a complete checkpoint into `path` (created if missing) and return it.

    `config_overrides` are config.json fields (hidden_size=64, num_hidden_layers=2,
    tie_word_embeddings=True, rope_theta=..., rope_scaling={...}, dtype="bfloat16", ...); the
    tensor shapes follow them.
    """
    return _write(Path(path), architecture, seed, config_overrides, weights=True)


def make_config(path: str | Path, architecture: str = "LlamaForCausalLM", **config_overrides: Any) -> Path:
    """make_checkpoint's files but the weights: what an emulated device (--device emulated) reads."""
    return _write(Path(path), architecture, 0, config_overrides, weights=False)


def _write(root: Path, architecture: str, seed: int, config_overrides: dict[str, Any], *, weights: bool) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = _config(architecture, config_overrides)
    tokenizer_json = _tokenizer_json(architecture)
    eos_ids = config["eos_token_id"]

    if weights:
        tensors = _weights(config, seed, getattr(torch, config["dtype"]))
        save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    _write_json(root / "config.json", config)
    _write_json(
        root / "generation_config.json",
        {"bos_token_id": SPECIAL_TOKEN_IDS[BOS_TOKEN], "eos_token_id": eos_ids, "do_sample": False},
    )
    (root / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(
        root / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOT_TOKEN,
            # Named so that no tokenizer class adds defaults of its own (Qwen2's <|endoftext|>).
            "pad_token": PAD_TOKEN,
            "unk_token": None,
            "model_max_length": config["max_position_embeddings"],
            # Off so transformers' decode equals the tokenizers library's, byte for byte.
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return root


def ensure_default_model() -> Path:
    """The generated tiny model (`--model tiny`), generated into the cache on first use (built
    beside its place and renamed into it: config/cached_dir.py)."""
    return build_cached(cache_dir() / "models" / f"tiny-llama-{TINY_MODEL_VERSION}", make_checkpoint)


def _config(architecture: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if architecture not in _MODEL_TYPES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {', '.join(_MODEL_TYPES)}")
    overrides = dict(overrides)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    rope.update(overrides.pop("rope_parameters", None) or {})
    rope.update(overrides.pop("rope_scaling", None) or {})
    if "type" in rope:  # the transformers 4 spelling
        rope["rope_type"] = rope.pop("type")
    if "rope_theta" in overrides:
        rope["rope_theta"] = float(overrides.pop("rope_theta"))

    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        **DEFAULT_SHAPE,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6 if architecture == "Qwen2ForCausalLM" else 1e-5,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "float32",
        "bos_token_id": SPECIAL_TOKEN_IDS[BOS_TOKEN],
        "eos_token_id": [SPECIAL_TOKEN_IDS[END_OF_TEXT_TOKEN], SPECIAL_TOKEN_IDS[EOT_TOKEN]],
    }
    if architecture == "LlamaForCausalLM":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif architecture == "MistralForCausalLM":
        config.update(sliding_window=None)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    config.update(overrides)
    if architecture == "Qwen2ForCausalLM":
        config.setdefault("max_window_layers", config["num_hidden_layers"])
    if architecture != "Qwen2ForCausalLM":  # Qwen2 has no head_dim field; it is always hidden / heads
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    if config["vocab_size"] < VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least the tokenizer's {VOCAB_SIZE}")
    return config


# Standard deviations, as multiples of 1/sqrt(fan_in). HF's 0.02 makes every logit nearly equal,
# so greedy decoding is a coin toss between float rounding errors and no two implementations
# agree. Here every sublayer writes about unit RMS into the residual stream, so each layer
# matters; attention is sharpened (QK) so the context matters; logits get a std of about
# LOGIT_GAIN, which sets top-1 and top-2 apart (median gap ~0.7 for the default model).
# Embeddings are small (RMS 1/sqrt(hidden)) so the residual stream is mostly layer output: with
# tied embeddings a large current-token component would make the model repeat its input.
EMBED_GAIN = 1.0
QK_GAIN = 2.0
OUT_GAIN = 1.0
LOGIT_GAIN = 4.0
NORM_JITTER = 0.1  # norm weights 1 +- this, so an implementation that ignores them is caught
BIAS_STD = 0.1


def _weights(config: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors in `dtype`, drawn in float32 in a fixed order from one generator. Each is
    cast as it is drawn, so a Llama-3-8B shape in bfloat16 peaks near its 16 GB, not 32 GB more."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    qwen2 = config["architectures"][0] == "Qwen2ForCausalLM"
    qkv_bias = qwen2 or config.get("attention_bias", False)
    o_bias = not qwen2 and config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(name: str, out_f: int, in_f: int, gain: float, bias: bool) -> None:
        tensors[f"{name}.weight"] = normal(out_f, in_f, std=gain / math.sqrt(in_f)).to(dtype)
        if bias:
            tensors[f"{name}.bias"] = normal(out_f, std=BIAS_STD).to(dtype)

    def norm(name: str, scale: float = 1.0) -> None:
        tensors[f"{name}.weight"] = (scale * (1.0 + normal(hidden, std=NORM_JITTER))).to(dtype)

    embed = normal(vocab, hidden, std=EMBED_GAIN / math.sqrt(hidden))
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed.to(dtype)}
    del embed  # 2 GB in float32 at Llama-3-8B's vocabulary
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm")
        linear(f"{p}.self_attn.q_proj", heads * head_dim, hidden, QK_GAIN, qkv_bias)
        linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden, QK_GAIN, qkv_bias)
        linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden, 1.0, qkv_bias)
        linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim, OUT_GAIN, o_bias)
        norm(f"{p}.post_attention_layernorm")
        linear(f"{p}.mlp.gate_proj", inter, hidden, 1.0, mlp_bias)
        linear(f"{p}.mlp.up_proj", inter, hidden, 1.0, mlp_bias)
        linear(f"{p}.mlp.down_proj", hidden, inter, OUT_GAIN, mlp_bias)
    if config["tie_word_embeddings"]:
        # HF leaves lm_head out of tied checkpoints: the small embedding matrix serves, and the
        # final norm makes up the logit scale.
        norm("model.norm", scale=LOGIT_GAIN / EMBED_GAIN)
    else:
        norm("model.norm")
        linear("lm_head", vocab, hidden, LOGIT_GAIN, False)
    return tensors


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
