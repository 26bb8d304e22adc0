"""GGUF files (llama.cpp's format) served as ordinary checkpoints.

`ensure_checkpoint(file, dtype)` converts a .gguf once into a Hugging Face-layout directory in
the cache (convert.py) and returns it; every stage then reads that directory as it reads any
checkpoint, so nothing past model resolution knows the weights came from a GGUF file.

config.py     metadata -> config.json and generation_config.json (architecture, shapes, rope)
weights.py    tensors -> HF-named torch tensors: dequantized, llama.cpp's q/k row order undone
tokenizer.py  metadata -> tokenizer.json, tokenizer_config.json, chat_template.jinja
convert.py    the cache: one directory per (file, dtype), built aside and renamed into place
"""

from conveyor.gpu.loading.gguf.convert import ensure_checkpoint

__all__ = ["ensure_checkpoint"]
