"""Multi-step windows: a step that would only decode becomes up to K decode passes in one plan.

K is SchedulerConfig.num_scheduler_steps. A window (StepPlan.num_steps > 1) is planned only when
every running sequence is decoding (its prompt done, its first token drawn, no fork pending) and
nothing waits. A waiting request gets a single step instead, so that its time to first token
never waits behind K passes; a prompt chunk under way likewise, so that it is not held back.

Row r of a window decodes one token per pass in passes 0 .. n_r - 1, where n_r = min(K, the
tokens left before max_tokens or the model's length, pending draws counted), and fewer when the
pool runs short. Blocks for all n_r tokens are taken when the window is planned; the window
never preempts anyone: `StepBuilder.run_running` first reserves one token per row exactly as a
single step would (copy-on-write and preemption included), then `extend_rows` grows each row
into what the pool has left. A window the worker ends early (every row stopped, as it sees them)
rolls back the rows still running by the passes that never ran (`roll_back_unrun`). Pure Python:
no torch, no zmq.
"""

from __future__ import annotations

from collections.abc import Iterable

from conveyor.stages.scheduler.block_manager import BlockManager
from conveyor.stages.scheduler.scheduled_step import Row, ScheduledStep
from conveyor.stages.scheduler.sequence import SeqStatus, Sequence
from conveyor.wire.step import StepResult
from conveyor.wire.stop_rules import tokens_left


def is_decoding(seq: Sequence) -> bool:
    """Whether the sequence's next step only decodes: one uncomputed token, at least one output
    drawn (the draw that ends a prompt stays a single step), no fork pending."""
    return seq.num_uncomputed_tokens == 1 and seq.num_output_tokens >= 1 and not seq.num_pending_forks


def may_extend(running: Iterable[Sequence], rows: list[Row]) -> bool:
    """Whether a step whose rows were planned one token each may become a window: every row is a
    decode of a running sequence, and no running sequence was left out with prompt work to do.
    (The caller checks that nothing waits, before admission and after preemption.)"""
    if not rows or not all(row.num_tokens == 1 and row.seq.known_by_worker and is_decoding(row.seq) for row in rows):
        return False
    return all(is_decoding(s) for s in running if s.status is SeqStatus.RUNNING)


def passes_left(seq: Sequence, max_passes: int, max_model_len: int) -> int:
    """Decode passes the sequence may still take part in, at most `max_passes`: each draws one
    token, and the last draw may reach max_tokens or the model's length but not pass them."""
    left = tokens_left(seq.params, seq.num_tokens, seq.num_prompt_tokens, max_model_len)
    return max(1, min(max_passes, left))


def extend_rows(rows: list[Row], blocks: BlockManager, max_passes: int, max_model_len: int) -> int:
    """Grow each one-token decode row to its passes, in plan order, shrinking a row to what the
    pool still holds; the number of passes of the window (its longest row).

    Each row's first token is reserved already: its last block is the sequence's own (any
    copy-on-write happened then), so extending only appends fresh blocks. The rows' sequences
    have not counted their first token as computed yet (the caller does, by row.num_tokens)."""
    num_steps = 1
    for row in rows:
        seq = row.seq
        num = min(passes_left(seq, max_passes, max_model_len), blocks.num_appendable(seq))
        if num > 1:
            copy = blocks.append(seq, num)
            assert copy is None, "a window row's last block is its own after its first token's reservation"
            row.num_tokens = num
            num_steps = max(num_steps, num)
    return num_steps


def roll_back_unrun(step: ScheduledStep, result: StepResult, row: Row, seq: Sequence) -> None:
    """On a window's last pass (the caller asks then), a row planned for passes beyond it (the
    worker ended the window early) never ran those: it keeps their blocks (the worker's table
    holds them too) and is planned again from here."""
    num_unrun = row.num_tokens - result.pass_index - 1
    if result.last_pass and step.num_steps > 1 and num_unrun > 0:
        seq.roll_back(num_unrun)
