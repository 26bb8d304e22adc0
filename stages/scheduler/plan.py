"""Translate between the scheduler's objects and the wire: requests in, step plans and tokens out.

Shared by the scheduler stage and the in-process Python API, so both drive the worker alike.
"""

from __future__ import annotations

from conveyor.stages.scheduler.scheduler import ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.sequence import Sequence
from conveyor.wire.messages import (
    DetokSeq,
    NewSeq,
    ScheduledSeq,
    ScheduleRequest,
    SeqTokens,
    StepPlan,
    TokenBatch,
)

PROMPT_TAIL_TOKENS = 6  # decoding context the detokenizer needs for the first output tokens


def sequences_for(request: ScheduleRequest, first_seq_id: int, num_detokenizers: int) -> list[Sequence]:
    return [
        Sequence(
            first_seq_id + i,
            request.request_id,
            request.prompt_token_ids,
            request.params,
            index=i,
            ingress=request.ingress,
            detokenizer=(first_seq_id + i) % num_detokenizers,
            arrival_time=request.arrival_time,
        )
        for i in range(request.params.n)
    ]


def step_plan(step: ScheduledStep) -> StepPlan:
    return StepPlan(
        step=step.step,
        new_seqs=[
            NewSeq(seq.seq_id, list(seq.token_ids), seq.params, seq.num_prompt_tokens)
            for seq in step.new_seqs
        ],
        scheduled=[
            ScheduledSeq(seq.seq_id, num, blocks)
            for (seq, num), blocks in zip(step.rows, step.new_block_ids)
        ],
        finished_seq_ids=step.finished_seq_ids,
    )


def token_batches(step: int, updates: list[SeqUpdate], num_detokenizers: int) -> list[TokenBatch | None]:
    """One TokenBatch per detokenizer (None where it has nothing this step)."""
    batches: list[TokenBatch | None] = [None] * num_detokenizers
    for update in updates:
        seq = update.seq
        batch = batches[seq.detokenizer]
        if batch is None:
            batch = batches[seq.detokenizer] = TokenBatch(step=step, new_seqs=[], updates=[])
        if not seq.known_by_detokenizer:
            seq.known_by_detokenizer = True
            batch.new_seqs.append(
                DetokSeq(
                    seq_id=seq.seq_id,
                    request_id=seq.request_id,
                    index=seq.index,
                    ingress=seq.ingress,
                    prompt_tail=seq.token_ids[max(0, seq.num_prompt_tokens - PROMPT_TAIL_TOKENS) : seq.num_prompt_tokens],
                    num_prompt_tokens=seq.num_prompt_tokens,
                    skip_special_tokens=seq.params.skip_special_tokens,
                )
            )
        batch.updates.append(SeqTokens(seq.seq_id, update.new_token_ids, update.finish_reason))
    return batches
