"""Constrained decoding: the only part of conveyor that imports xgrammar.

A StructuredOutput (SamplingParams.structured, on the wire) becomes a compiled grammar once per
distinct spec per process (`grammars_for(model).compile`, an LRU: compiler.py), over the
checkpoint's vocabulary as wide as the model's logits (vocabulary.py). Each constrained sequence of the
worker owns a `Matcher` (matcher.py) that takes its sampled ids in order and writes which ids may
come next; a pass's `TokenMask` (mask.py) carries those rows to the device and sets every other
logit of theirs to -inf before sampling. `check` compiles a spec for validation (the tokenizer
stage and the Python API refuse a bad one before it is scheduled).
"""

from conveyor.gpu.structured.compiler import Grammars, check, grammars_for
from conveyor.gpu.structured.mask import TokenMask, combined, token_mask
from conveyor.gpu.structured.matcher import Matcher

__all__ = ["Grammars", "Matcher", "TokenMask", "check", "combined", "grammars_for", "token_mask"]
