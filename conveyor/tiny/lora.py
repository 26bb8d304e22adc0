"""A random LoRA adapter for a checkpoint, written as PEFT saves one (adapter_config.json,
adapter_model.safetensors): for benchmarks on models peft has no tiny twin of, such as the default
SmolLM2 (the tests make theirs with peft itself).

    python -m conveyor.tiny.lora MODEL DST [--rank 16] [--targets q_proj,v_proj] [--seed 0]

MODEL is a checkpoint directory (config.json gives the shapes); the targets default to all seven
projections. B is random too (PEFT's own initialisation zeroes it): the adapter changes the text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from conveyor.config.lora_adapter import LORA_TARGETS


def make_random_adapter(model: Path, dst: Path, *, rank: int = 16, targets: tuple[str, ...] = LORA_TARGETS, seed: int = 0) -> Path:
    config = json.loads((model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {  # (in, out)
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            n_in, n_out = shapes[target]
            group = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) / n_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * 0.02
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}
    (dst / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m conveyor.tiny.lora", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(LORA_TARGETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_random_adapter(args.model, args.dst, rank=args.rank, targets=tuple(args.targets.split(",")), seed=args.seed))


if __name__ == "__main__":
    main()
