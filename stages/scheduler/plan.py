"""Translate the scheduler's decisions into wire messages: step plans for the worker and token
batches for the detokenizers. Shared by the scheduler stage and the in-process Python API."""

from __future__ import annotations

from conveyor.stages.scheduler.scheduled_step import ScheduledStep, SeqUpdate
from conveyor.wire.messages import DetokSeq, SeqTokens, TokenBatch
from conveyor.wire.step import Fork, NewSeq, ScheduledSeq, StepPlan

PROMPT_TAIL_TOKENS = 6  # decoding context the detokenizer needs for the first output tokens


def step_plan(step: ScheduledStep) -> StepPlan:
    return StepPlan(
        step=step.step,
        new_seqs=[
            NewSeq(seq.seq_id, list(seq.token_ids), seq.params, seq.num_prompt_tokens, seq.index, computed, seq.lora_slot, seq.images)
            for seq, computed in zip(step.new_seqs, step.new_seqs_computed)
        ],
        scheduled=[
            ScheduledSeq(
                row.seq.seq_id,
                row.num_tokens,
                row.new_block_ids,
                row.replaced_blocks,
                [Fork(child.seq_id, child.index) for child in row.forks],
                row.lookahead,
            )
            for row in step.rows
        ],
        finished_seq_ids=step.finished_seq_ids,
        copy_blocks=step.copy_blocks,
        num_steps=step.num_steps,
        lora_loads=step.lora_loads,
        kv_saves=step.kv_saves,
        kv_loads=step.kv_loads,
        kv_fetches=step.kv_fetches,
    )


def token_batches(step: int, updates: list[SeqUpdate], num_detokenizers: int) -> list[TokenBatch | None]:
    """One TokenBatch per detokenizer (None where it has nothing this step)."""
    batches: list[TokenBatch | None] = [None] * num_detokenizers
    for update in updates:
        seq = update.seq
        batch = batches[seq.detokenizer]
        if batch is None:
            batch = batches[seq.detokenizer] = TokenBatch(step=step, new_seqs=[], updates=[])
        if update.new_to_detokenizer:
            tail_start = max(0, seq.num_prompt_tokens - PROMPT_TAIL_TOKENS)
            batch.new_seqs.append(
                DetokSeq(
                    seq_id=seq.seq_id,
                    request_id=seq.request_id,
                    index=seq.index,
                    ingress=seq.ingress,
                    prompt_tail=seq.token_ids[tail_start : seq.num_prompt_tokens],
                    num_prompt_tokens=seq.num_prompt_tokens,
                    skip_special_tokens=seq.params.skip_special_tokens,
                    num_cached_tokens=seq.num_cached_tokens,
                    stop=seq.params.stop,
                    include_stop_str_in_output=seq.params.include_stop_str_in_output,
                    min_tokens=seq.params.min_tokens,
                    logprobs=seq.params.logprobs is not None,
                )
            )
        tokens = SeqTokens(seq.seq_id, update.new_token_ids, update.finish_reason, seq.cumulative_logprob, update.logprobs)
        tokens.prompt, tokens.embedding = update.prompt, update.embedding
        if update.finish_reason is not None and seq.first_scheduled_time is not None:
            tokens.queue_time = max(0.0, seq.first_scheduled_time - seq.arrival_time)
        batch.updates.append(tokens)
    return batches
