"""A GGUF file's tensors as Hugging Face-named torch tensors: packed, or in the serving dtype.

With `packed`, a tensor of one of PACKED_TYPES is kept as its raw blocks, one row of blocks per
output row: `<layer>.gguf_blocks` [N, bytes per row] uint8 and `<layer>.gguf_type` [1] int64,
which gpu/quant/formats/gguf.py reads into the kernels' form at load. Every other tensor (and
every tensor without `packed`) is dequantized to float32 with the `gguf` package, reshaped from
ggml's dimension order (innermost first) to torch's, and cast. llama.cpp stores a Llama model's q and k
projections with the rows of each head reordered for its rotary kernel (the two halves of a
head interleaved pair by pair); `unpermute` restores transformers' order. Qwen2 files are not
reordered (llama.cpp runs them with the half-split rotary that transformers uses).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from conveyor.config.errors import ConfigError

# The GGML types whose blocks the kernels read (gpu/quant/formats/gguf.py).
PACKED_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Read into the config instead (config.py: Llama 3.1's rope scaling).
CONFIG_TENSORS = ("rope_freqs.weight",)
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a tensor we have no
    place for is a ConfigError naming it."""
    if m := _LAYER.fullmatch(name):
        layer, part, kind = m.groups()
        if part in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    else:
        base, _, kind = name.rpartition(".")
        if base in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[base]}.{kind}"
    raise ConfigError(f"unsupported tensor {name!r} in the GGUF file")


def read_weights(reader: GGUFReader, config: dict[str, Any], packed: bool = False) -> dict[str, torch.Tensor]:
    """{HF name: tensor in config["dtype"]} for every tensor of the file; with `packed`, a
    PACKED_TYPES tensor as its blocks (module docstring)."""
    dtype = getattr(torch, config["dtype"])
    llama_order = config["model_type"] == "llama"
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:
            continue
        name = hf_name(t.name)
        keep = packed and int(t.tensor_type) in PACKED_TYPES and len(t.shape) == 2
        w = torch.from_numpy(np.array(t.data)) if keep else torch.from_numpy(dequantized(t))  # blocks: [N, bytes per row]
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if llama_order and part in heads:  # whole rows move, so a row of blocks moves as one
            w = unpermute(w, heads[part])
        if keep:
            prefix = name.removesuffix(".weight")
            out[f"{prefix}.gguf_blocks"] = w.contiguous()
            out[f"{prefix}.gguf_type"] = torch.tensor([int(t.tensor_type)])
        else:
            out[name] = w.to(dtype)
    return out


def dequantized(t: ReaderTensor) -> np.ndarray:
    """The tensor as float32 in torch's dimension order; a type the gguf package cannot
    dequantize is a ConfigError naming it."""
    try:
        qtype = GGMLQuantizationType(int(t.tensor_type))
    except ValueError:
        raise ConfigError(f"tensor {t.name!r} has unknown GGML type {int(t.tensor_type)}") from None
    try:
        array = dequantize(t.data, qtype)
    except NotImplementedError:
        raise ConfigError(f"cannot dequantize {qtype.name} (tensor {t.name!r}): the gguf package has no dequantizer for it") from None
    shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists the innermost dimension first
    return np.array(array.reshape(shape), dtype=np.float32)  # a copy: the file is mapped read-only


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. Rows of a head there: pairs (i, i + d/2) side by side,
    [h, d/2, 2, ...]; in transformers: the first halves, then the second halves, [h, 2, d/2, ...]."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
