"""TokenTexts: token ids to the TextLogprobs a client sees (token text, UTF-8 bytes, logprob).

A token alone is not always text: a byte-level BPE splits an emoji into up to four tokens of one
byte each. So each token gets its exact bytes, and its text is those bytes decoded as UTF-8 with
every byte that is not part of a complete character written as `\\xNN` (OpenAI's convention), so
the text never shows U+FFFD and `bytes` of a sequence's tokens, concatenated, are the UTF-8 of
its text.

Where the bytes come from:
- byte-level tokenizers (GPT-2, Llama 3, Qwen2: the decoder is ByteLevel): the token string maps
  back to bytes through the inverse of GPT-2's byte-to-unicode table;
- added tokens (specials like <|eot_id|>): their content, as written;
- others (SentencePiece style): `<0xNN>` byte-fallback tokens are that byte, any other token is
  its string with the word-boundary mark U+2581 read as a space.
Results are cached per token id: a vocabulary is small, a stream asks for the same ids often.
"""

from __future__ import annotations

import json
import math
import re

from tokenizers import Tokenizer

from conveyor.wire.messages import PromptTokens, TextLogprob, TokenLogprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_decoding_table() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: printable Latin-1 bytes stand for themselves,
    the other 68 bytes (controls, space, ...) for U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in parts)


class TokenTexts:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_table = byte_level_decoding_table() if _is_byte_level(tokenizer) else None
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._bytes(token_id)
            cached = self._cache[token_id] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return cached

    def logprobs(self, token_ids: list[int], entries: list[TokenLogprob]) -> list[TextLogprob]:
        """One TextLogprob per (sampled id, its TokenLogprob), alternatives included."""
        out = []
        for token_id, entry in zip(token_ids, entries):
            top = [TextLogprob(*self.text_and_bytes(i), lp) for i, lp in zip(entry.top_token_ids, entry.top_logprobs)]
            out.append(TextLogprob(*self.text_and_bytes(token_id), entry.logprob, top))
        return out

    def prompt_logprobs(self, prompt: PromptTokens) -> list[TextLogprob]:
        """One TextLogprob per prompt token, ids and ranks kept (vLLM's prompt_logprobs keys them
        by id; the alternatives rank 1, 2, ...). The first token's carries its text alone: nothing
        predicts it, so its logprob is NaN and its rank 0 (TextDelta.prompt_logprobs)."""
        first = prompt.token_ids[0]
        out = [TextLogprob(*self.text_and_bytes(first), math.nan, token_id=first)]
        for token_id, entry in zip(prompt.token_ids[1:], prompt.logprobs):
            top = [
                TextLogprob(*self.text_and_bytes(i), lp, token_id=i, rank=r)
                for r, (i, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), 1)
            ]
            out.append(TextLogprob(*self.text_and_bytes(token_id), entry.logprob, top, token_id, entry.rank))
        return out

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        token = self.tokenizer.id_to_token(token_id)
        if token is None:  # outside the vocabulary (a model whose embedding is padded)
            return b""
        if self._byte_table is not None:
            table = self._byte_table
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode()  # not a byte-level string after all
        fallback = _BYTE_FALLBACK.fullmatch(token)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return token.replace("\u2581", " ").encode()
