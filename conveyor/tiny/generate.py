"""`python -m conveyor.tiny.generate --shape llama3-8b --dtype bfloat16 OUT_DIR`: a random-weight
checkpoint of a real model's shape, for benchmarks on a GPU with nothing downloaded.

The weights are conveyor/tiny/checkpoint.py's (deterministic per --seed). A shape (SHAPES) sets
the config.json fields that decide the cost of a step. The tokenizer is the tiny model's 4096-id
BPE, or with `--tokenizer-from DIR` another checkpoint's (tokenizer files, chat template, the
bos/eos/pad ids of its config.json): a real BPE such as SmolLM2's 49,152 ids counts ShareGPT's
tokens much as Llama 3's does, and the runbook's `sharegpt-500` race takes it. A vocabulary larger
than the tokenizer's is padded as real checkpoints pad theirs: random weights emit ids the
tokenizer has no text for, which decode to nothing but count as tokens. Llama-3-8B in bfloat16
is 16 GB on disk, twice that in host memory and minutes to write (docs/benchmarks.md).

`--shape llava-tiny` writes a tiny LLaVA-1.5 (conveyor/tiny/vision.py) with its image processor;
`qwen2-vl-tiny` and `qwen2.5-vl-tiny` a tiny Qwen2-VL / Qwen2.5-VL (conveyor/tiny/qwen2_vl.py);
`gemma3-vl-tiny` a tiny Gemma 3 with images (conveyor/tiny/gemma3_vl.py).

`--no-weights` writes everything but the weights, at once: what `conveyor serve --device
emulated` reads (it models the device and loads none).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from conveyor.tiny.checkpoint import DEFAULT_SHAPE, make_checkpoint, make_config
from conveyor.tiny.gemma3_vl import make_gemma3_vl
from conveyor.tiny.qwen2_vl import make_qwen2_vl
from conveyor.tiny.vision import make_llava

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
# Vision-language checkpoints (conveyor/tiny/vision.py): tiny, in real HF layout with processors
# transformers loads offline, for tests and benchmarks of images.
VISION_SHAPES: dict[str, Callable[..., Path]] = {
    "llava-tiny": make_llava,
    "qwen2-vl-tiny": make_qwen2_vl,
    "qwen2.5-vl-tiny": functools.partial(make_qwen2_vl, version="2.5"),
    "gemma3-vl-tiny": make_gemma3_vl,
}


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
    """Write the checkpoint of `shape` (a SHAPES key, or VISION_SHAPES') in `dtype` into out_dir and return it."""
    if shape in VISION_SHAPES:
        if not weights or tokenizer_from is not None:
            raise ValueError(f"--shape {shape} writes its own weights and tokenizer (no --no-weights, no --tokenizer-from)")
        return VISION_SHAPES[shape](out_dir, seed=seed, dtype=dtype)
    source = None if tokenizer_from is None else _tokenizer_source(Path(tokenizer_from), SHAPES[shape]["vocab_size"])
    if weights:
        root = make_checkpoint(out_dir, "LlamaForCausalLM", seed=seed, dtype=dtype, **SHAPES[shape])
    else:
        root = make_config(out_dir, "LlamaForCausalLM", dtype=dtype, **SHAPES[shape])
    if source is not None:
        _take_tokenizer(root, *source)
    return root


def _tokenizer_source(source: Path, vocab_size: int) -> tuple[Path, dict[str, Any]]:
    """(the folder, its special ids) after checking that the model's vocabulary holds every id of
    its tokenizer; checked before minutes of weights are written."""
    try:
        config = json.loads((source / "config.json").read_text())
        num_ids = Tokenizer.from_file(str(source / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # a missing file, bad JSON, a tokenizer the library cannot read
        raise ValueError(f"cannot read the tokenizer in {source}: {e}") from None
    if num_ids > vocab_size:
        raise ValueError(f"{source}'s tokenizer has {num_ids} ids, more than the shape's vocabulary of {vocab_size}")
    return source, {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}


def _take_tokenizer(root: Path, source: Path, special: dict[str, Any]) -> None:
    """Replace the tiny tokenizer's files and special ids with the source's: the weights are random,
    so any tokenizer whose ids fit the vocabulary serves; ids past it decode to nothing."""
    for name in TOKENIZER_FILES:
        (root / name).unlink(missing_ok=True)
        if (source / name).is_file():
            shutil.copyfile(source / name, root / name)
    config = json.loads((root / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (root / "config.json").write_text(json.dumps({**config, **special}, indent=2) + "\n")
    if not (root / "generation_config.json").is_file():
        (root / "generation_config.json").write_text(json.dumps({**special, "do_sample": False}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m conveyor.tiny.generate", description=" ".join((__doc__ or "").split("\n\n")[0].split())
    )
    p.add_argument("out_dir", help="the checkpoint directory (created if missing)")
    p.add_argument(
        "--shape", choices=sorted([*SHAPES, *VISION_SHAPES]), default="llama3-8b", help="the model's shape (default: %(default)s)"
    )
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the weights' dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights are a function of the seed (default: %(default)s)")
    p.add_argument("--no-weights", dest="weights", action="store_false", help="config and tokenizer only (for --device emulated)")
    p.add_argument("--tokenizer-from", metavar="DIR", help="another checkpoint's tokenizer and special ids (its config.json's)")
    args = p.parse_args(argv)
    try:
        path = generate(args.out_dir, args.shape, args.dtype, args.seed, args.weights, args.tokenizer_from)
    except ValueError as e:
        p.error(str(e))
    tokenizer = f", {args.tokenizer_from}'s tokenizer" if args.tokenizer_from else ""
    print(f"wrote {args.shape} ({args.dtype}{'' if args.weights else ', no weights'}{tokenizer}) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
