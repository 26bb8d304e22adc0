"""A random EAGLE-3 head for a Llama-family checkpoint, in the published layout (the names, shapes
and config.json keys gpu/spec/eagle3_head.py reads): what the tests and a cost measurement
serve, with no trained head to download.

    python -m conveyor.tiny.eagle3 TARGET DST [--draft-vocab N] [--seed S] [--torch-file]

config.json is a one-layer Llama config of the target's width, heads and rope, with
`architectures` ["LlamaForCausalLMEagle3"], `draft_vocab_size` and, where asked,
`eagle_config.eagle_aux_hidden_state_layer_ids`. The draft vocabulary is a seeded subset of the
target's ids (d2t: their offsets; t2d: their mask); the weights are seeded normals scaled as the
tiny checkpoints' are, so the head is decisive. Deterministic: the same inputs give the same files.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

NORM_JITTER = 0.1  # as conveyor/tiny/checkpoint.py: an implementation that ignores a norm is caught
LOGIT_GAIN = 4.0


def make_eagle3_head(
    target: Path,
    dst: Path,
    *,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    aux_layers: tuple[int, int, int] | None = None,
    embed: bool = False,
    torch_file: bool = False,
) -> Path:
    """Write a random head for the checkpoint `target` into `dst` (created); `dst`. `embed`: the
    head ships its own embedding table; `torch_file`: pytorch_model.bin, as the first published
    heads, instead of model.safetensors."""
    hf = json.loads((target / "config.json").read_text())
    vocab, hidden = hf["vocab_size"], hf["hidden_size"]
    draft_vocab = draft_vocab_size or vocab
    config: dict[str, Any] = {
        key: hf[key]
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps")
        if key in hf
    }
    config |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
        "rope_theta": hf.get("rope_theta", 10000.0),
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if hf.get("head_dim"):
        config["head_dim"] = hf["head_dim"]
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    tensors: dict[str, torch.Tensor] = {}

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0) -> None:
        tensors[f"{name}.weight"] = torch.randn(out_f, in_f, generator=gen) * (gain / math.sqrt(in_f))

    def norm(name: str) -> None:
        tensors[f"{name}.weight"] = 1.0 + torch.randn(hidden, generator=gen) * NORM_JITTER

    linear("fc", hidden, 3 * hidden)
    norm("midlayer.input_layernorm")
    norm("midlayer.hidden_norm")
    linear("midlayer.self_attn.q_proj", heads * head_dim, 2 * hidden, 2.0)
    linear("midlayer.self_attn.k_proj", kv_heads * head_dim, 2 * hidden, 2.0)
    linear("midlayer.self_attn.v_proj", kv_heads * head_dim, 2 * hidden)
    linear("midlayer.self_attn.o_proj", hidden, heads * head_dim)
    norm("midlayer.post_attention_layernorm")
    linear("midlayer.mlp.gate_proj", config["intermediate_size"], hidden)
    linear("midlayer.mlp.up_proj", config["intermediate_size"], hidden)
    linear("midlayer.mlp.down_proj", hidden, config["intermediate_size"])
    norm("norm")
    linear("lm_head", draft_vocab, hidden, LOGIT_GAIN)
    if embed:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen) / math.sqrt(hidden)
    ids = torch.arange(vocab) if draft_vocab == vocab else torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors["d2t"] = ids - torch.arange(draft_vocab)  # draft id d is target id d + d2t[d]
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    dst.mkdir(parents=True, exist_ok=True)
    if torch_file:
        torch.save(tensors, dst / "pytorch_model.bin")
    else:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m conveyor.tiny.eagle3", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--draft-vocab", type=int, default=None, help="the head's vocabulary (default: the target's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-file", action="store_true", help="write pytorch_model.bin instead of model.safetensors")
    args = parser.parse_args()
    make_eagle3_head(args.target, args.dst, seed=args.seed, draft_vocab_size=args.draft_vocab, torch_file=args.torch_file)


if __name__ == "__main__":
    main()
