"""`python -m conveyor.tiny.generate --shape llama3-8b --dtype bfloat16 OUT_DIR`: a random-weight
checkpoint of a real model's shape, for benchmarks on a GPU with nothing downloaded.

The weights and the tokenizer are conveyor/tiny/checkpoint.py's (deterministic per --seed; the
tokenizer is the tiny model's 4096-id BPE, which splits text more finely than Llama 3's). A shape
(SHAPES) sets the config.json fields that decide the cost of a step; a vocabulary larger than the
tokenizer's is padded as real checkpoints pad theirs: the model may emit ids the tokenizer has no
text for, which decode to nothing but count as tokens. Llama-3-8B in bfloat16 is 16 GB on disk,
twice that in host memory and minutes to write (docs/benchmarks.md has the measurements).

`--no-weights` writes everything but the weights, at once: what `conveyor serve --device
emulated` reads (it models the device and loads none). `--tokenizer-from DIR` takes another
checkpoint's tokenizer, chat template and special ids (config.json's bos/eos, its
generation_config.json) instead: a real 49k-id BPE such as SmolLM2's counts ShareGPT's tokens
much as Llama 3's does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from conveyor.tiny.checkpoint import DEFAULT_SHAPE, make_checkpoint, make_config

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


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


def generate(
    out_dir: str | Path, shape: str, dtype: str = "bfloat16", seed: int = 0, weights: bool = True, tokenizer_from: str | None = None
) -> Path:
    """Write the checkpoint of `shape` (a SHAPES key) in `dtype` into out_dir and return it."""
    if tokenizer_from is None:
        if weights:
            return make_checkpoint(out_dir, "LlamaForCausalLM", seed=seed, dtype=dtype, **SHAPES[shape])
        return make_config(out_dir, "LlamaForCausalLM", dtype=dtype, **SHAPES[shape])
    if weights:
        raise ValueError("--tokenizer-from writes no weights (the tiny tokenizer's ids size them): add --no-weights")
    source, root = Path(tokenizer_from), Path(out_dir)
    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {source / 'config.json'}: {e}") from None
    root.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, root / name)
    special = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    shaped = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": dtype, **SHAPES[shape], **special}
    (root / "config.json").write_text(json.dumps(shaped, indent=2) + "\n")
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m conveyor.tiny.generate", description=" ".join((__doc__ or "").split("\n\n")[0].split())
    )
    p.add_argument("out_dir", help="the checkpoint directory (created if missing)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="the model's shape (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the weights' dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights are a function of the seed (default: %(default)s)")
    p.add_argument("--no-weights", dest="weights", action="store_false", help="config and tokenizer only (for --device emulated)")
    p.add_argument("--tokenizer-from", metavar="DIR", help="another checkpoint's tokenizer and special ids (needs --no-weights)")
    args = p.parse_args(argv)
    try:
        path = generate(args.out_dir, args.shape, args.dtype, args.seed, args.weights, args.tokenizer_from)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {args.shape} ({args.dtype}{'' if args.weights else ', no weights'}) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
