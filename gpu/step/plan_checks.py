"""The worker's checks on a StepPlan, before the plan changes anything: a bad plan (a token id
outside the vocabulary, a block outside the pool, a row past its sequence or its table, a
malformed multi-step window or fork) raises ValueError and the runner goes on as it was. The CPU
kernels write through block tables without bounds checks, so a bad block id would corrupt
memory instead of raising.
"""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.config.model import ModelConfig
from conveyor.gpu.step.passes import WorkerSeq
from conveyor.wire.step import StepPlan


def check_plan(
    plan: StepPlan, seqs: Mapping[int, WorkerSeq], model: ModelConfig, num_blocks: int, block_size: int, max_blocks_per_seq: int
) -> None:
    """Raise ValueError for a plan the runner cannot run. `seqs`: the sequences the worker holds
    (by seq_id); num_blocks: the pool the plan's block ids must lie in."""
    vocab, max_len = model.vocab_size, model.max_model_len
    for new in plan.new_seqs:
        if new.token_ids and not 0 <= min(new.token_ids) <= max(new.token_ids) < vocab:
            raise ValueError(f"seq {new.seq_id}: token id out of range [0, {vocab})")
        if not 0 <= new.num_computed_tokens <= len(new.token_ids):
            raise ValueError(f"seq {new.seq_id}: {new.num_computed_tokens} cached of {len(new.token_ids)} tokens")
        if new.params.logit_bias and not all(0 <= t < vocab for t in new.params.logit_bias):
            raise ValueError(f"seq {new.seq_id}: logit_bias token id out of range [0, {vocab})")
    finished = set(plan.finished_seq_ids)
    new_seqs = {new.seq_id: new for new in plan.new_seqs}

    def live(seq_id: int) -> bool:
        return seq_id in new_seqs or (seq_id in seqs and seq_id not in finished)

    multi = plan.num_steps > 1
    if plan.num_steps < 1:
        raise ValueError(f"a plan of {plan.num_steps} steps")
    forks: list[int] = []
    for row in plan.scheduled:  # per row of every step: the common decode row takes the short way through
        if not live(row.seq_id):
            raise ValueError(f"seq {row.seq_id} is not live on this worker")
        if row.new_block_ids or row.replaced_blocks:
            ids = [*row.new_block_ids, *(block for _, block in row.replaced_blocks)]
            if not 0 <= min(ids) <= max(ids) < num_blocks:
                raise ValueError(f"seq {row.seq_id}: block ids {ids} outside the pool [0, {num_blocks})")
        registering = new_seqs.get(row.seq_id)
        if registering is not None:
            table_len, num_tokens, computed = 0, len(registering.token_ids), registering.num_computed_tokens
        else:
            seq = seqs[row.seq_id]
            table_len, num_tokens, computed = len(seq.block_table), seq.num_tokens, seq.num_computed
        if row.replaced_blocks and any(not 0 <= pos < table_len for pos, _ in row.replaced_blocks):
            raise ValueError(f"seq {row.seq_id}: replaced block position outside its {table_len} blocks")
        end = computed + row.num_tokens
        if row.num_tokens < 1 or end > max_len or (not multi and end > num_tokens):
            raise ValueError(f"row computes tokens [{computed}, {end}) of a {num_tokens}-token sequence")
        table_blocks = table_len + len(row.new_block_ids)
        if table_blocks * block_size < end or table_blocks > max_blocks_per_seq:
            raise ValueError(f"block table of {table_blocks} blocks cannot hold {end} tokens")
        if multi and (row.forks or computed != num_tokens - 1 or row.num_tokens > plan.num_steps):
            raise ValueError(f"seq {row.seq_id}: a multi-step row must decode, without forks, for at most num_steps passes")
        if row.num_lookahead and (multi or row.num_lookahead < 0 or row.forks or end != num_tokens or computed != num_tokens - 1):
            raise ValueError(f"seq {row.seq_id}: only a single step's one-token decode row may verify drafts")
        if row.forks:
            if end != num_tokens:
                raise ValueError("a row that does not sample cannot fork")
            forks += [f.seq_id for f in row.forks]
    if len(set(forks)) != len(forks) or any(live(f) for f in forks):
        raise ValueError(f"fork seq_ids {forks} repeat or are already live")
