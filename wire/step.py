"""A step: the plan the scheduler sends a worker and the result the worker returns.

The contract between the scheduler (stages/scheduler/) and the GPU workers (gpu/step/). A StepPlan
is one forward pass (or `num_steps` decode passes): a sequence the worker has not seen arrives once
in full (NewSeq); after that a step names only its rows (ScheduledSeq: how many tokens, which new
blocks) and what to do before the forward (block copies, adapter loads, KV tier moves). The worker
keeps each sequence's tokens, computed count and block table between steps. A StepResult is one
pass's draws keyed by sequence id, never by row position, with the logprobs, prompt logprobs and
embeddings its sequences asked for.

Which socket takes which message is in messages.py (SchedulerInbound, WorkerInbound), and its
wire rules hold here: tags share one number space with messages.py and never change or get
reused; new fields only ever go at the end of a struct.
"""

from __future__ import annotations

from conveyor.wire.images import ImageInput
from conveyor.wire.sampling_params import SamplingParams
from conveyor.wire.struct import Struct

# --- the plan: scheduler to worker ----------------------------------------------------------


NO_NAME = -1  # a saved block's name when it has none worth keeping (a swapped-out sequence's); no hash() is -1


class NewSeq(Struct):
    """A sequence the worker has not seen (or sees again after preemption), sent once in full."""

    seq_id: int
    token_ids: list[int]  # prompt, plus any outputs already generated (after preemption)
    params: SamplingParams
    num_prompt_tokens: int  # outputs start here: the seeded draw for output i uses index i
    index: int = 0  # choice index within its request: seeded draws mix it in, so samples differ
    # Leading tokens whose KV is already in the blocks its table will name (prefix-cache hit):
    # the worker starts computing after them.
    num_computed_tokens: int = 0
    lora_slot: int = -1  # the device slot holding its adapter (StepPlan.lora_loads); -1: the base weights
    images: list[ImageInput] = []  # its prompt's images: the vision tower embeds their placeholder tokens


class Fork(Struct):
    seq_id: int
    index: int  # choice index of the new sequence


class ScheduledSeq(Struct):
    """One row of a step: compute `num_tokens` more of the sequence's known tokens.

    Before the step, `replaced_blocks` (table position, new block id) rewrite entries of the
    block table (copy-on-write: the plan's copy_blocks filled the new block), then
    `new_block_ids` are appended. A sampling row with `forks` draws one token for itself and
    one per fork from the same logits; each fork starts as a copy of this sequence (tokens,
    computed count, block table) taken after the step, plus its own token.
    """

    seq_id: int
    num_tokens: int
    new_block_ids: list[int] = []
    replaced_blocks: list[tuple[int, int]] = []
    forks: list[Fork] = []
    # Speculative decoding: a one-token decode row may verify up to this many draft tokens the
    # worker proposes after its token (its table holds their slots); its draws then come back as
    # a run of 1 to 1 + num_lookahead draws of the sequence (StepResult).
    num_lookahead: int = 0


class StepPlan(Struct, tag=10):
    """One forward pass (or `num_steps` decode passes). The worker keeps each sequence's tokens, computed count and block table,
    appends what it samples, and drops a sequence when it appears in `finished_seq_ids`."""

    step: int
    new_seqs: list[NewSeq]
    scheduled: list[ScheduledSeq]
    finished_seq_ids: list[int] = []
    copy_blocks: list[tuple[int, int]] = []  # (src, dst) KV block copies, before the forward
    # The engine had nothing to run before this plan: the time since the last step is not a GPU
    # bubble (nobody was waiting), only the time from the plan's arrival on is.
    after_idle: bool = False
    # Multi-step: > 1 runs this many forward passes back to back. Only for plans whose every row
    # decodes (no prompt chunk, no new prompt, no fork): row r then decodes one token per pass in
    # passes 0 .. num_tokens - 1 (its new_block_ids hold all of them), each pass's input being the
    # token the pass before drew, on the device. One StepResult per pass.
    num_steps: int = 1
    # Adapters to place before the forward (a slot's previous adapter is evicted): the plan's
    # new sequences name these slots.
    lora_loads: list[LoraLoad] = []
    # The KV host tier (stages/scheduler/kv_tiers.py), applied before the plan's passes, saves
    # first: (device block, host slot) copies to host memory, then (host slot, device block)
    # copies back; a row of this plan reads only those its new_block_ids name (its pass waits
    # for them), the others are for the next plan's.
    kv_saves: list[tuple[int, int, int]] = []  # (device block, host slot, the block's name: its key on disk; NO_NAME)
    kv_loads: list[tuple[int, int]] = []
    # The KV disk tier (--kv-disk-dir): (block name, host slot) files to read into host slots, off
    # the step's path (a thread); each rank answers each with KvFetched (messages.py). The scheduler
    # keeps the slots out of the host tier's books until every rank has answered.
    kv_fetches: list[tuple[int, int]] = []


class LoraLoad(Struct):
    slot: int
    name: str
    path: str  # a PEFT adapter directory, read and checked by the scheduler (config/lora_adapter.py)


# --- the result: worker to scheduler ------------------------------------------------------


class StepResult(Struct, tag=5):
    """One forward pass's draws, keyed by sequence: draw d is sequence seq_ids[d]'s token
    sampled_token_ids[d] (a forking row's own draw and each fork's are draws of their own
    sequences). The scheduler matches them to the pass's rows by id, never by position."""

    step: int
    sampled_token_ids: list[int]
    busy_time: float = 0.0  # seconds the device computed this step
    idle_time: float = 0.0  # seconds it waited on the host since the last step ended
    # log p(id) under the model's own distribution (log_softmax of the raw logits, before
    # temperature or filters), one per draw: ranks best_of candidates.
    sampled_logprobs: list[float] = []
    # Empty when no draw's sequence asked for logprobs; else one per draw, the top alternatives
    # under the same raw distribution (empty lists for a draw whose sequence did not ask).
    top_logprobs: list[TopLogprobs] = []
    # Draws whose logits were not finite (NaN, +inf, or every token masked), as indices into
    # the draws: their id is a placeholder 0, and the scheduler ends their sequence with
    # FinishReason.ERROR. The step and the other draws go on.
    failed_draws: list[int] = []
    # Multi-step plans (StepPlan.num_steps > 1) send one result per pass, as each pass ends:
    # `pass_index` is its pass (0-based), `last_pass` True on the plan's final result (which may
    # come early: every row stopped). Pass k's draws are the rows whose num_tokens > k.
    # `masked_draws`: draws the worker skipped because their sequence already stopped inside the
    # window (EOS, a stop token, a failed draw); their id is a placeholder 0.
    pass_index: int = 0
    last_pass: bool = True
    masked_draws: list[int] = []
    seq_ids: list[int] = []  # one per draw: whose token it is (last, as new fields go)
    # Speculative decoding: a row that verified drafts reports a run of consecutive draws of its
    # sequence, the accepted drafts then the token drawn after them, and here (seq_id, drafts
    # verified, drafts accepted) once per such row; a draw after a stopping token is not sent.
    spec_rows: list[tuple[int, int, int]] = []
    # Sequences asking for prompt_logprobs whose prompt tokens this pass predicted (last, as new fields go).
    prompt_logprobs: list[PromptLogprobs] = []
    # Pooling sequences (SamplingParams.pooling) whose prompt this pass finished: their vectors.
    embeddings: list[SeqEmbedding] = []


class SeqEmbedding(Struct):
    seq_id: int
    values: list[float]  # pooled, cut to the request's dimensions, normalized where the model is


class PromptLogprobs(Struct):
    """Prompt tokens [start, start + len(logprobs)) of a sequence, each's log p under the model's
    raw distribution at the position before it (as sampled_logprobs), its rank there (1: the most
    likely), and the params.prompt_logprobs most likely alternatives. start >= 1."""

    seq_id: int
    start: int
    logprobs: list[float]
    ranks: list[int]
    top: list[TopLogprobs] = []  # one per token where params.prompt_logprobs > 0


class TopLogprobs(Struct):
    token_ids: list[int]  # the params.logprobs most likely ids, most likely first
    logprobs: list[float]
