"""A GGUF file's tokenizer as tokenizer.json, tokenizer_config.json and chat_template.jinja.

The vocabulary, merges, special tokens, BOS/EOS and chat template live in the file's
`tokenizer.*` metadata. transformers already rebuilds a fast tokenizer from them for its own GGUF
loading (per tokenizer model: byte-level BPE, sentencepiece, ...); we save what it builds, so the
tokenizer stage encodes exactly as transformers does on the same file.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.config.errors import ConfigError


def write_tokenizer(gguf_file: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except (ValueError, KeyError) as e:  # a tokenizer model transformers cannot build
        raise ConfigError(f"cannot build the tokenizer of {gguf_file.name}: {str(e).splitlines()[0]}") from None
    tokenizer.save_pretrained(str(out_dir))
    if not (out_dir / "tokenizer.json").is_file():
        raise ConfigError(f"cannot build the tokenizer of {gguf_file.name}: transformers gave no fast tokenizer")
