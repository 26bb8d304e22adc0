"""IncrementalDetokenizer: one sequence's new token ids to the new text they add, as they arrive.

Decoding token by token is wrong in two ways: a character can span tokens (a byte-level BPE
splits an emoji into up to four), and some decoders change a token's text by its neighbours
(SentencePiece drops the leading space of the first token it decodes). So each step decodes a
short window, the tokens since the last emission plus the ones emitted last as context, and
emits what the window adds beyond its context. Where the window ends inside a character (the
decode ends in U+FFFD), the text stops before that character and its bytes wait for the tokens
that complete them, or for the end of the sequence.

tokenizers' own DecodeStream does the same, but it cannot flush bytes held at the end of a
sequence, and it completes a character begun in the prompt, which decode(output ids) does not.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"  # what a lossy UTF-8 decode shows for bytes that may yet become a character
_MAX_HELD = 3  # tokens to look back for the start of an unfinished character


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        """`prompt_tail`: the last few prompt ids, decoding context for the first output ids."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        tail = list(prompt_tail)
        if tail and self._decode(tail).endswith(_INCOMPLETE):
            # A prompt cut inside a character would have the output's first bytes complete it;
            # the output text is what the output ids decode to, so start without context.
            tail = []
        # The window: _ids[:_read_offset] is already emitted (or is prompt context), and the
        # text of _ids[:_read_offset] is the prefix to strip from the window's text.
        self._ids = tail
        self._read_offset = len(tail)

    def step(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """The text `token_ids` add; held back while they end inside a character. With `final`,
        the sequence is over: held bytes come out too, as U+FFFD, as decode() would show them."""
        self._ids.extend(token_ids)
        ids, start = self._ids, self._read_offset
        if len(ids) == start:
            return ""
        end, text = len(ids), self._decode(ids)
        if text.endswith(_INCOMPLETE) and not final:
            # Emit up to the unfinished character: an incomplete UTF-8 sequence is at most
            # three bytes, so it starts within the last three tokens or it is garbage that the
            # next tokens will show as such.
            for end in range(len(ids) - 1, max(start, len(ids) - _MAX_HELD) - 1, -1):
                text = self._decode(ids[:end])
                if not text.endswith(_INCOMPLETE):
                    break
            else:
                return ""
        prefix = self._decode(ids[:start])
        if len(text) <= len(prefix):
            return ""
        # Keep what was just emitted as the next window's context, and what is held after it.
        self._ids = ids[start:]
        self._read_offset = end - start
        return text[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
