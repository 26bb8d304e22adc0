"""A causal-LM checkpoint turned into an embedding checkpoint in sentence-transformers' layout, as
decoder embedding models ship (Qwen3-Embedding, gte-Qwen2): the same weights and tokenizer, plus
`modules.json` (Transformer, Pooling, optionally Normalize), `1_Pooling/config.json`,
`sentence_bert_config.json`, and `matryoshka_dimensions` in config.json when given. For tests:
sentence-transformers loads the result as its own reference.

    python -m conveyor.tiny.embedding SRC DST [--pooling last|mean|first] [--no-normalize] [--matryoshka 8,16]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from conveyor.config.pooling import MODES

ST = "sentence_transformers.models."


def make_embedding_checkpoint(
    src: Path, dst: Path, *, pooling: str = "last", normalize: bool = True, matryoshka: tuple[int, ...] = ()
) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if matryoshka:
        config["matryoshka_dimensions"] = list(matryoshka)
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
        (dst / "2_Normalize").mkdir()
    (dst / "modules.json").write_text(json.dumps(modules, indent=2))
    (dst / "1_Pooling").mkdir()
    modes = {key: mode == pooling for key, mode in MODES.items()}
    extra = dict.fromkeys(("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"), False)
    settings = {"word_embedding_dimension": config["hidden_size"], **modes, **extra, "include_prompt": True}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(settings, indent=2))
    (dst / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m conveyor.tiny.embedding", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a causal-LM checkpoint directory")
    parser.add_argument("dst", type=Path)
    parser.add_argument("--pooling", choices=sorted(set(MODES.values())), default="last")
    parser.add_argument("--no-normalize", action="store_true")
    parser.add_argument("--matryoshka", default="", help="comma-separated dimensions the vector may be cut to")
    args = parser.parse_args()
    dims = tuple(int(d) for d in args.matryoshka.split(",") if d)
    print(make_embedding_checkpoint(args.src, args.dst, pooling=args.pooling, normalize=not args.no_normalize, matryoshka=dims))


if __name__ == "__main__":
    main()
