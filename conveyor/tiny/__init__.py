"""conveyor/tiny: the generated test model (`--model tiny`), made locally so nothing is downloaded.

tokenizer.py trains a Llama 3-style byte-level BPE (4096 ids) from corpus.txt; checkpoint.py
writes random-weight Llama / Mistral / Qwen2 checkpoints in Hugging Face format, and caches the
default one (`ensure_default_model`); truncate.py cuts any checkpoint to its first layers (a
self-speculation draft).

corpus.txt is a fixed file, generated once and committed so that training never depends on the
machine: about 17 KB of everyday English prose written for this project (emails, recipes,
questions and answers, stories, a few numbers, accents, emoji and CJK), then the module
docstrings of CPython 3.11's standard library, then the sources of its colorsys, bisect,
fnmatch, graphlib and textwrap modules (both under the PSF License).
"""
