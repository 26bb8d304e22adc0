"""The grammar engine's view of the vocabulary: xgrammar's TokenizerInfo for a checkpoint.

Built from the checkpoint directory's tokenizer.json (the file PromptEncoder reads) through
transformers' fast-tokenizer wrapper, which xgrammar knows how to read (byte-level BPE,
SentencePiece byte fallback, a prefix space). The mask is as wide as the model's logits
(config vocab_size), which may exceed the tokenizer's ids (padded LM heads): the ids past the
tokenizer's are never allowed. The stop ids are the model's EOS ids: a grammar that is complete
allows exactly those.
"""

from __future__ import annotations

from pathlib import Path

import xgrammar as xgr

from conveyor.config.model import ModelConfig


def tokenizer_info(model: ModelConfig) -> xgr.TokenizerInfo:
    from transformers import PreTrainedTokenizerFast  # a second or so to import: only once a spec arrives

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(model.path) / "tokenizer.json"))
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.vocab_size, stop_token_ids=list(model.eos_token_ids) or None)
