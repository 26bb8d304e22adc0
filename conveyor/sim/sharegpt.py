"""ShareGPT requests picked as vLLM's serving benchmark picks them (`vllm bench serve --dataset-name
sharegpt`, vLLM 0.32's ShareGPTDataset), so that conveyor's client and vLLM's, given the same file,
tokenizer, seed and count, send the same prompts in the same order with the same max_tokens.

The rule, read from vLLM's code (tests/ops/vllm_sharegpt_picks.json holds its picks, its test compares):
- an entry counts if it has a "conversations" list of at least two turns; its prompt is turn 0's
  text and its completion turn 1's, whatever their roles;
- those entries are shuffled by Python's `random` seeded with the seed (Mersenne Twister: the
  same order on every CPython), then walked in that order;
- prompt and completion are counted by the tokenizer as a client calls it, special tokens
  included (a BOS counts in both); the output length is the completion's count;
- a pair is kept if both counts are at least 4, the prompt at most 1024 and the two at most 2048,
  until `num` are kept;
- if the file runs out first, the kept ones are drawn again at random (`random.Random(seed).choice`)
  until there are `num`.
Counting is the caller's (the simulator encodes, the benchmark client may ask the server), so
the Picker hands out indices to count, a chunk at a time, and takes the counts back.
"""

from __future__ import annotations

import dataclasses
import json
import random

MIN_LEN = 4  # tokens, prompt and output each
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


@dataclasses.dataclass(frozen=True)
class Pick:
    index: int  # into sharegpt_pairs(path)
    prompt_len: int  # tokens, special tokens included
    output_len: int  # the completion's tokens: the request's max_tokens


def sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(turn 0, turn 1) of each entry with at least two turns, in file order."""
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    return [(e["conversations"][0]["value"], e["conversations"][1]["value"]) for e in entries if len(e.get("conversations", [])) >= 2]


def keeps_pair(prompt_len: int, output_len: int, max_prompt_len: int = MAX_PROMPT_LEN, max_total_len: int = MAX_TOTAL_LEN) -> bool:
    """vLLM's filter: both at least MIN_LEN tokens, the prompt and the total not too long."""
    if prompt_len < MIN_LEN or output_len < MIN_LEN:
        return False
    return prompt_len <= max_prompt_len and prompt_len + output_len <= max_total_len


class Picker:
    """Walks the shuffled pairs: `while chunk := picker.next_chunk(): picker.offer(chunk, counts)`,
    then `picks()`. Chunks are about twice what is still needed, so a small pick counts little
    more than it keeps and a large file is never counted whole."""

    def __init__(self, num_pairs: int, num: int, seed: int, max_prompt_len: int = MAX_PROMPT_LEN, max_total_len: int = MAX_TOTAL_LEN):
        self.num, self.seed = num, seed
        self.limits = (max_prompt_len, max_total_len)
        self._order = list(range(num_pairs))
        random.Random(seed).shuffle(self._order)
        self._next = 0  # position in _order of the first pair not yet handed out
        self._kept: list[Pick] = []

    def next_chunk(self) -> list[int]:
        """Indices of the next pairs to count (their order matters); empty when done."""
        needed = self.num - len(self._kept)
        if needed <= 0:
            return []
        chunk = self._order[self._next : self._next + 2 * needed + 16]
        self._next += len(chunk)
        return chunk

    def offer(self, chunk: list[int], counts: list[tuple[int, int]]) -> None:
        """(prompt, completion) token counts of next_chunk()'s pairs, in its order."""
        for index, (prompt_len, output_len) in zip(chunk, counts, strict=True):
            if len(self._kept) < self.num and keeps_pair(prompt_len, output_len, *self.limits):
                self._kept.append(Pick(index, prompt_len, output_len))

    def picks(self) -> list[Pick]:
        """The `num` picks in request order, the kept ones drawn again if the file ran short
        (none if nothing was kept)."""
        if not self._kept:
            return []
        rng = random.Random(self.seed)
        return self._kept + [rng.choice(self._kept) for _ in range(self.num - len(self._kept))]
