"""`python -m conveyor.tiny.generate --shape llama3-8b --dtype bfloat16 OUT_DIR`: a random-weight
checkpoint of a real model's shape, for benchmarks on a GPU with nothing downloaded.

The weights and the tokenizer are conveyor/tiny/checkpoint.py's (deterministic per --seed; the
tokenizer is the tiny model's 4096-id BPE). A shape sets the config.json fields that decide the
cost of a step; a vocabulary larger than the tokenizer's is padded the way real checkpoints pad
theirs: the model may emit ids the tokenizer has no text for, which decode to nothing but count
as tokens. Prompts are tokenized by the tiny tokenizer, which splits text more finely than Llama 3's
128k-id one: 2.7 characters a token over the first 300 ShareGPT conversations of the shared sample.

Llama-3-8B in bfloat16 is 16 GB on disk; generating it needs about twice that in host memory
(the tensors, then safetensors' buffer) and minutes: a 4-layer cut of the shape (3.6 GiB) peaked
at 6.9 GiB resident and took 55 s on a 2-core development machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from conveyor.tiny.checkpoint import DEFAULT_SHAPE, make_checkpoint

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": DEFAULT_SHAPE,
    # meta-llama/Meta-Llama-3-8B's config.json: 8.03e9 parameters.
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
}
DTYPES = ("float32", "bfloat16", "float16")


def generate(out_dir: str | Path, shape: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write the checkpoint of `shape` (a SHAPES key) in `dtype` into out_dir and return it."""
    return make_checkpoint(out_dir, "LlamaForCausalLM", seed=seed, dtype=dtype, **SHAPES[shape])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conveyor.tiny.generate", description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="the checkpoint directory (created if missing)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="the model's shape (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the weights' dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights are a function of the seed (default: %(default)s)")
    args = p.parse_args(argv)
    path = generate(args.out_dir, args.shape, args.dtype, args.seed)
    print(f"wrote {args.shape} ({args.dtype}) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
