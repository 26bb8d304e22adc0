"""The steps the KV sizing profile runs (CUDA): the worst the scheduler can plan, not only a
fresh prefill.

Before the KV pool is sized, `ModelRunner._profile_run` runs each of these on a scratch cache so
that torch's allocator holds the largest activation peak any step will need; the pool then gets
what is left. Three shapes, each at the full token budget:
- fresh prefill: prompts of max_model_len tokens (the last one shorter) filling the budget;
- decode: min(max_num_seqs, budget) rows of one query each, at the longest context (attention
  that gathers contexts, as the torch backend's does, peaks here);
- a chunk after a long cached prefix: min(budget, max_model_len - 1) queries ending at
  max_model_len (a [q_len, seq_len] score matrix per head).
Rows that only read the scratch cache share blocks: the decode rows all read one context's
blocks, so the scratch cache is one longest context, not max_num_seqs of them. Pure: no torch.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ProfileStep:
    name: str
    query_lens: list[int]  # new tokens per row
    seq_lens: list[int]  # context per row after the step
    block_tables: list[list[int]]  # per row, into a scratch pool of num_blocks

    @property
    def num_blocks(self) -> int:
        return 1 + max(max(table) for table in self.block_tables)


def profile_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> list[ProfileStep]:
    total, longest = max_num_batched_tokens, max(max_model_len, 1)

    def blocks(n: int, first: int = 0) -> list[int]:
        return list(range(first, first + -(-n // block_size)))

    lens = [min(longest, total - i) for i in range(0, total, longest)]
    tables, next_block = [], 0
    for n in lens:
        tables.append(blocks(n, next_block))
        next_block += len(tables[-1])
    steps = [ProfileStep("prefill", lens, lens, tables)]
    num_rows = min(max_num_seqs, total)
    steps.append(ProfileStep("decode", [1] * num_rows, [longest] * num_rows, [blocks(longest)] * num_rows))
    if longest > 1:
        chunk = min(total, longest - 1)
        steps.append(ProfileStep("chunk after cached prefix", [chunk], [longest], [blocks(longest)]))
    return steps
