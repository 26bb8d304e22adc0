"""encode_within: encode a text, or refuse it as too long having encoded about a limit's worth.

A prompt's length is known only once it is encoded, and encoding is the costly part: a 4 MB
one-line prompt is seconds of BPE, all of it wasted when the prompt is then refused for length,
while the tokenizer process it runs in serves nobody else. So a text much longer than the limit
could need is first counted in chunks, from the start, and refused (PromptTooLong) as soon as
the chunks hold more tokens than the limit: the work is bounded by the limit, not by the text.

encoder.py's PromptEncoder calls it for what it encodes. Invariants: no prompt that fits
is refused (why counting chunks is sound: `_cut`); a text that passes is encoded whole, exactly
as without a limit, and the caller still checks its length.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Texts up to this many characters per token of the limit are encoded directly: a prompt that
# fits is seldom longer (English is ~4 characters a token), and refusing one costs no more.
DIRECT_CHARS_PER_TOKEN = 6
CHUNK_CHARS = 8192  # what one counting step encodes: ~2,000 tokens, a millisecond or two
SLACK_PER_CUT = 4  # tokens a cut inside a word may add


class PromptTooLong(Exception):
    """The text has more than the limit's tokens; `num_tokens` of them were counted."""

    def __init__(self, num_tokens: int):
        super().__init__(f"the prompt has at least {num_tokens} tokens")
        self.num_tokens = num_tokens


def encode_within(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool, limit: int | None) -> list[int]:
    """`tokenizer`'s ids for `text`; with a `limit`, PromptTooLong instead when counting shows
    more than `limit` tokens. A text that is not refused may still have more: the caller checks.

    A text that passes is encoded whole, exactly as without a limit (a chunked encoding could
    differ at the cuts), and is short by then: every chunk but the last counted, it has about
    `limit` tokens, so at most `limit` times the longest token's characters."""
    if limit is not None and len(text) > max(limit, 1) * DIRECT_CHARS_PER_TOKEN:
        num_tokens, start = 0, 0
        while len(text) - start > CHUNK_CHARS:
            end = _cut(text, start + CHUNK_CHARS // 2, start + CHUNK_CHARS)
            num_tokens += max(0, len(_ids(tokenizer, text[start:end], False)) - SLACK_PER_CUT)
            if num_tokens > limit:
                raise PromptTooLong(num_tokens)
            start = end
    return _ids(tokenizer, text, add_special_tokens)


def _cut(text: str, low: int, high: int) -> int:
    """The last word end in text[low:high] (before a space, after a non-space), else `high`.

    Why counting chunks is sound: a cut just before a space that follows a non-space character is
    a pre-tokenizer boundary for the GPT-2/Llama 3/Qwen2 split rules and for Metaspace, so the
    chunks' tokens are exactly the whole text's. Where the chunk has no such space the cut falls
    anywhere, and the word it splits may encode to a few more tokens than it would whole:
    SLACK_PER_CUT tokens a chunk are not counted, so no prompt that fits is refused."""
    i = text.rfind(" ", low, high)
    return i if i > low and not text[i - 1].isspace() else high


def _ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch_fast skips the character offsets `encode` computes and nothing here reads:
    # the same ids in about 0.7 of the time (a 200-token prompt: 0.36 -> 0.24 ms).
    return tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
