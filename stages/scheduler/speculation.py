"""Which rows of a step verify draft tokens, and the KV slots they may write (speculative
decoding; the proposers and the verification are the worker's, gpu/spec/).

The worker proposes the drafts, from the ids it holds, so the scheduler never waits for them: it
grants a decoding row a lookahead of up to k extra tokens (StepPlan's `num_lookahead`), charges
them to the step's token budget and reserves blocks for them, and learns from the result how
many the worker accepted (StepResult: one draw per emitted token, a row's in a run;
`settle_lookahead` counts them).

Reservation. A row's worker-side length may run ahead of the scheduler's by the lookahead of its
steps still in flight (a step n + 1 planned under asynchronous scheduling before step n's
result told how many drafts were accepted): `Sequence.num_pending_lookahead`. Every row of such
a sequence gets slots for its own token and that much more, or is not planned until the result
comes (`reserve_ahead`; nor when those drafts may have reached its length limit); a row granted
a lookahead gets slots for that too, from the free pool without preempting anyone (a lookahead
is a bonus: when the pool is short, the row decodes plainly). Rejected
drafts' slots stay in the table and are written again by the next step (the sequence's length
rolls back, not its blocks); the prefix cache names only blocks of accepted ids
(BlockManager.register_full_blocks reads the known ids).

Which rows: none past `disable_by_batch_size` running sequences; otherwise each decoding row
(its prompt done and a token drawn, no fork pending) whose request may still produce more than
one token (a grammar's row too: the worker cuts its drafts where the grammar refuses them).
Pure Python: no torch, no zmq.
"""

from __future__ import annotations

from conveyor.config.speculative import SpeculativeConfig
from conveyor.stages.scheduler.block_manager import BlockManager
from conveyor.stages.scheduler.scheduled_step import Row
from conveyor.stages.scheduler.sequence import Sequence
from conveyor.stages.scheduler.windows import is_decoding
from conveyor.wire.stop_rules import tokens_left


def speculates(config: SpeculativeConfig, num_running: int) -> bool:
    """Whether any row of a step with this many running sequences may speculate."""
    limit = config.disable_by_batch_size
    return limit is None or num_running <= limit


def reserve_ahead(seq: Sequence, blocks: BlockManager) -> Row | None:
    """A decode row for a sequence whose verifying step is still in flight: slots for its token
    and for the drafts that step may yet accept, from the free pool; None when the pool cannot
    hold them without preempting (the sequence then waits for that result, a step)."""
    need = 1 + seq.num_pending_lookahead
    if blocks.num_appendable(seq) < need:
        return None
    copy = blocks.append(seq, need)
    assert copy is None, "a verifying sequence's last block is its own"
    return Row(seq, 1, [], [])


def grant_lookahead(row: Row, config: SpeculativeConfig, blocks: BlockManager, budget: int, max_model_len: int) -> int:
    """Give a one-token decode row (its one token reserved already) up to k lookahead tokens,
    within `budget` and what the pool holds without preempting; the lookahead granted (0: it
    decodes plainly). The row's sequence has not counted its token as computed yet."""
    seq = row.seq
    if row.num_tokens != 1 or not is_decoding(seq):
        return 0
    # Drafts past the token this step draws, within the sequence's limits as the scheduler counts
    # them (the worker, which knows the in-flight steps' acceptance, caps its drafts again).
    left = tokens_left(seq.params, seq.num_tokens, seq.num_prompt_tokens, max_model_len) - 1
    k = min(config.num_speculative_tokens, budget, left)
    if k < 1:
        return 0
    ahead = seq.num_pending_lookahead
    k = min(k, blocks.num_appendable(seq) - 1 - ahead)
    if k < 1:
        return 0
    copy = blocks.append(seq, 1 + ahead + k)
    assert copy is None, "a decode row's last block is its own after its token's reservation"
    row.lookahead = k
    return k


def settle_lookahead(row: Row, seq: Sequence, in_run: bool) -> None:
    """Count one of a row's draws before its id joins the sequence: a run's first draw ends the
    row's lookahead in flight; each later one is an accepted draft, its KV computed by this step
    and its id one more draw than the plan counted."""
    if in_run:
        seq.num_computed_tokens += 1
        seq.num_pending_tokens += 1
    elif row.lookahead:
        seq.num_pending_lookahead -= row.lookahead
