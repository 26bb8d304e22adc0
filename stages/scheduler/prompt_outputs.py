"""What a prompt's passes compute beside their draws, held on its sequence until an update carries
it to the detokenizer: prompt logprobs (SamplingParams.prompt_logprobs) and a pooling sequence's
embedding.

The worker reports both with the pass that computed them (StepResult.prompt_logprobs and
.embeddings), keyed by sequence id. Prompt logprobs come a chunk at a time and are joined by
position (`Sequence.take_prompt_logprobs`, which drops what a preempted sequence's recomputation
sends again); they go out once, with the first update after every prompt token's logprob is in
(`Sequence.take_prompt_tokens`). The vector comes whole with the pass that ends the prompt and goes
out with that pass's draw. Pure Python: no torch, no zmq.
"""

from __future__ import annotations

from conveyor.stages.scheduler.scheduled_step import ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.sequence import SeqStatus
from conveyor.wire.step import StepResult


def take_prompt_outputs(step: ScheduledStep, result: StepResult) -> None:
    """Hold a pass's prompt logprobs on the step's running sequences that asked, its embeddings on
    their pooling sequences (an id with no row in the step is ignored)."""
    if not (result.prompt_logprobs or result.embeddings):
        return
    of_row = {row.seq.seq_id: row.seq for row in step.rows}
    for entry in result.prompt_logprobs:
        asking = of_row.get(entry.seq_id)
        if asking is not None and asking.status is SeqStatus.RUNNING:
            asking.take_prompt_logprobs(entry)
    for embedding in result.embeddings:
        if (pooling := of_row.get(embedding.seq_id)) is not None:
            pooling.embedding = embedding.values


def attach_prompt_outputs(update: SeqUpdate) -> None:
    """Give an update the prompt outputs its sequence holds, complete: each goes out once."""
    seq = update.seq
    if seq.prompt_logprobs is not None:
        update.prompt = seq.take_prompt_tokens()
    if seq.embedding:
        update.embedding, seq.embedding = seq.embedding, []
