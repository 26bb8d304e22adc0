"""A GGUF file's metadata as config.json and generation_config.json.

llama.cpp names hyperparameters `<arch>.<name>` (`llama.block_count`); this maps the ones our
decoder reads onto transformers' config fields. An architecture the model registry has no GGUF
name for (gpu/models/registry.py GGUF_ARCHITECTURES), or a rope scaling we cannot express, is a
ConfigError naming it, at conversion, before any weight is read.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import GGUFReader

from conveyor.config.errors import ConfigError
from conveyor.gpu.models.registry import GGUF_ARCHITECTURES

# Llama 3.1's rope scaling, which llama.cpp stores as a `rope_freqs` tensor of per-frequency
# divisors instead of parameters: we check the tensor against these and recover the factor.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python object (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(reader: GGUFReader, dtype: str) -> dict[str, Any]:
    """config.json for the file, with `dtype` as the checkpoint's dtype (its weights are written in it)."""
    arch = value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:  # general.architecture -> the transformers class with the same weights
        raise ConfigError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError("malformed GGUF file: no token_embd.weight tensor")

    def need(name: str) -> Any:
        v = value(reader, f"{arch}.{name}")
        if v is None:
            raise ConfigError(f"malformed GGUF file: no {arch}.{name} in its metadata")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    max_pos = int(value(reader, f"{arch}.context_length", 2048))
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # ggml order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(value(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(value(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": max_pos,
        "rope_parameters": {"rope_theta": float(value(reader, f"{arch}.rope.freq_base", 10000.0)), **_rope(reader, arch, tensors)},
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "dtype": dtype,
        **_special_ids(reader),
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    else:  # Qwen2: biases on q/k/v always; no sliding window in what llama.cpp converts
        config["use_sliding_window"] = False
    return config


def generation_config(config: dict[str, Any], reader: GGUFReader) -> dict[str, Any]:
    """Stop ids: the tokenizer's EOS plus the end-of-turn tokens a chat model ends its reply with."""
    eos = [config["eos_token_id"]] if config.get("eos_token_id") is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = value(reader, key)
        if extra is not None and int(extra) not in eos:
            eos.append(int(extra))
    return {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos, "do_sample": False}


def _special_ids(reader: GGUFReader) -> dict[str, int]:
    ids = {"bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id"}
    return {name: int(v) for name, key in ids.items() if (v := value(reader, key)) is not None}


def _rope(reader: GGUFReader, arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """rope_type and its parameters, as transformers spells them."""
    if "rope_freqs.weight" in tensors:
        return _llama3_rope(np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64), reader, arch)
    kind = value(reader, f"{arch}.rope.scaling.type", "none")
    factor = value(reader, f"{arch}.rope.scaling.factor")
    if kind == "none" or factor in (None, 0.0, 1.0):
        return {"rope_type": "default"}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = value(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    raise ConfigError(f"unsupported rope scaling {kind!r} in the GGUF file; supported: linear, yarn, llama3")


def _llama3_rope(divisors: np.ndarray, reader: GGUFReader, arch: str) -> dict[str, Any]:
    """Llama 3.1's scaling from the divisors llama.cpp wrote: the largest divisor is the factor;
    the other parameters are Llama 3's, checked by recomputing every divisor from them."""
    theta = float(value(reader, f"{arch}.rope.freq_base", 10000.0))
    head_dim = 2 * len(divisors)
    factor, low, high = float(divisors.max()), LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"]
    original = LLAMA3_ROPE["original_max_position_embeddings"]
    expected = []
    for i in range(len(divisors)):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < original / high:
            expected.append(1.0)
        elif wavelen > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected.append(1.0 / ((1 - smooth) / factor + smooth))
    if not np.allclose(divisors, expected, rtol=1e-3):
        raise ConfigError("unsupported rope_freqs tensor in the GGUF file: not Llama 3.1's rope scaling")
    return {"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE}
