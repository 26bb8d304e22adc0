"""train_tokenizer: the embedded default model's byte-level BPE tokenizer, trained from corpus.txt.

The tokenizer copies Llama 3's shape at a small size: Llama 3's split regex over bytes mapped to
printable characters (so any UTF-8 text, emoji and CJK included, round-trips), 4096 ids in all,
the special tokens at the top of the vocabulary, and a post-processor that prepends
<|begin_of_text|>. Training is deterministic: the same corpus gives the same tokenizer.json on
every machine and every run, so checkpoints generated anywhere agree id for id.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
PAD_TOKEN = "<|finetune_right_pad_id|>"
# Llama 3.1's order; the reserved ones keep room for tests that need an unused special token.
SPECIAL_TOKENS = (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    PAD_TOKEN,
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    EOT_TOKEN,
    "<|python_tag|>",
    "<|reserved_special_token_3|>",
    "<|reserved_special_token_4|>",
    "<|reserved_special_token_5|>",
    "<|reserved_special_token_6|>",
    "<|reserved_special_token_7|>",
)
# Specials take the top ids in this order (bos 4080, eot 4089), whatever the corpus.
SPECIAL_TOKEN_IDS = {token: VOCAB_SIZE - len(SPECIAL_TOKENS) + i for i, token in enumerate(SPECIAL_TOKENS)}
DEFAULT_CORPUS = Path(__file__).with_name("corpus.txt")

# Llama 3's pre-tokenizer split: contractions, words with one leading non-letter, numbers in
# groups of up to three digits, punctuation runs, and whitespace runs.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: the same, but one digit per piece.
_QWEN2_SPLIT = _SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def train_tokenizer(corpus_path: str | Path = DEFAULT_CORPUS) -> Tokenizer:
    """Train the BPE on `corpus_path` (UTF-8 text) to exactly VOCAB_SIZE ids, specials last."""
    text = Path(corpus_path).read_text(encoding="utf-8")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer(_SPLIT)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        # All 256 byte symbols, so bytes the corpus never shows still have an id.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The whole corpus as one item, so the newline runs the split regex keeps are counted too.
    # Deterministic: word counts are sums (order-free), the byte alphabet is fixed, and the
    # result does not depend on hash seeds (tests compare runs across processes).
    tokenizer.train_from_iterator([text], trainer=trainer)
    num_trained = tokenizer.get_vocab_size(with_added_tokens=False)
    if num_trained != VOCAB_SIZE - len(SPECIAL_TOKENS):
        raise RuntimeError(f"{corpus_path} is too small: BPE stopped at {num_trained} tokens")

    # Added after training so they take the top ids, as in Llama 3 (bos 128000 there, 4080 here).
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    assert all(tokenizer.token_to_id(t) == i for t, i in SPECIAL_TOKEN_IDS.items())
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, SPECIAL_TOKEN_IDS[BOS_TOKEN])],
    )
    return tokenizer


def for_architecture(tokenizer: Tokenizer, architecture: str) -> Tokenizer:
    """The tokenizer a checkpoint of `architecture` ships: the one transformers would use.

    transformers 5 ignores tokenizer.json's normalizer and pre-tokenizer for Qwen2 checkpoints
    and rebuilds Qwen2's own (NFC, single digits), so a Qwen2 checkpoint ships exactly those,
    like the real ones do; the vocabulary and merges stay the same.
    """
    if architecture != "Qwen2ForCausalLM":
        return tokenizer
    qwen2 = Tokenizer.from_str(tokenizer.to_str())
    qwen2.normalizer = normalizers.NFC()
    qwen2.pre_tokenizer = _pre_tokenizer(_QWEN2_SPLIT)
    return qwen2


def _pre_tokenizer(split: str) -> pre_tokenizers.PreTokenizer:
    # Split on the regex first, then map each piece's bytes to printable symbols.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
