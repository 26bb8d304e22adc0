"""Sequence: the scheduler's state for one generated sequence (one sample of one request).

Tokens are known (prompt plus sampled outputs) or computed (their KV is in the cache). Each step
catches computed up to known; there is no separate prefill or decode phase. A token can be known
by count before its id is: a planned step draws it and the id comes with that step's result
(`num_pending_tokens`: at most two steps' draws, or two windows' passes under multi-step), which
is asynchronous scheduling, docs/architecture.md ("Overlap"). A request asking for several
samples starts as one sequence that forks when its prompt is done (`num_pending_forks`).
"""

from __future__ import annotations

import enum

from conveyor.stages.scheduler.block_manager import ROOT_HASH, chain_hash
from conveyor.wire.images import ImageInput
from conveyor.wire.messages import FinishReason, PromptTokens, SamplingParams, ScheduleRequest, TokenLogprob
from conveyor.wire.step import PromptLogprobs, TopLogprobs
from conveyor.wire.stop_rules import stop_reason


class SeqStatus(enum.Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


class Sequence:
    __slots__ = (
        "seq_id",
        "request_id",
        "index",
        "ingress",
        "detokenizer",
        "params",
        "arrival_time",
        "priority",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_ids",
        "block_hashes",
        "num_registered_blocks",
        "num_blocks_sent",
        "known_by_worker",
        "known_by_detokenizer",
        "status",
        "finish_reason",
        "num_preemptions",
        "num_swapped_tokens",
        "num_pending_forks",
        "num_pending_tokens",
        "num_pending_lookahead",
        "cumulative_logprob",
        "prompt_logprobs",
        "embedding",
        "lora_slot",
        "images",
        "enqueue_time",
        "first_scheduled_time",
        "first_token_time",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        ingress: int = 0,
        detokenizer: int = 0,
        arrival_time: float = 0.0,
        priority: int = 0,
        images: list[ImageInput] | None = None,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # sample index within the request
        self.ingress = ingress
        self.detokenizer = detokenizer
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache supplied at first admission
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.num_registered_blocks = 0  # prefix of block_ids already offered to the prefix cache
        self.num_blocks_sent = 0  # prefix of block_ids the worker already holds
        self.known_by_worker = False
        self.known_by_detokenizer = False
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.num_swapped_tokens = 0  # tokens whose KV the host tier holds while it is swapped out (kv_tiers.py)
        self.num_pending_forks = params.num_samples - 1
        self.num_pending_tokens = 0  # drawn by planned steps, ids not back yet (token_ids lacks them)
        # Draft tokens its planned steps may add beyond those draws (speculation.py): how far the
        # worker's copy may run ahead of num_tokens.
        self.num_pending_lookahead = 0
        self.cumulative_logprob = 0.0
        # params.prompt_logprobs: prompt tokens 1.. as the worker's passes predict them, until they
        # go out with the first update (then None, as for a sequence that did not ask).
        self.prompt_logprobs: list[TokenLogprob] | None = [] if params.prompt_logprobs is not None else None
        self.embedding: list[float] = []  # a pooling sequence's vector, once its prompt is done
        self.lora_slot = -1  # the worker's slot of its adapter (params.adapter) while it runs; -1: none
        self.images = images or []  # its prompt's images (wire/images.py), in prompt order
        # Wall-clock times (time.time(), comparable with arrival_time) for the metrics.
        self.enqueue_time = arrival_time  # reached the scheduler
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @classmethod
    def from_request(cls, seq_id: int, request: ScheduleRequest, detokenizer: int = 0) -> Sequence:
        """A request's first sequence (it forks later for several samples)."""
        return cls(
            seq_id,
            request.request_id,
            request.prompt_token_ids,
            request.params,
            ingress=request.ingress,
            detokenizer=detokenizer,
            arrival_time=request.arrival_time,
            priority=request.priority,
            images=request.images,
        )

    @property
    def num_tokens(self) -> int:
        """Known tokens, pending draws included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def num_chunk_tokens(self, start: int, num: int) -> int:
        """How many of `num` tokens from `start` a prompt chunk may compute: it never ends inside
        an image whose placeholders attend to each other (ImageInput.bidirectional, Gemma 3), whose
        first rows would miss its later ones; 0 when it starts inside one that does not fit."""
        end = start + num
        for image in self.images:  # in prompt order, not overlapping: at most one holds `end`
            if image.bidirectional and image.offset < end < image.offset + image.length:
                return max(0, image.offset - start)
        return num

    def take_draw(self, token: int, logprob: float, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
        """A pending draw's id arrived: it joins the known ids; why the sequence ends on it (the
        shared rule, wire/stop_rules.py, counting the known ids only: later draws are pending)."""
        self.token_ids.append(token)
        self.num_pending_tokens -= 1
        self.cumulative_logprob += logprob
        return stop_reason(self.params, token, len(self.token_ids), self.num_prompt_tokens, eos_token_ids, max_model_len)

    def roll_back(self, num_tokens: int) -> None:
        """A window's last `num_tokens` passes never ran: those tokens were neither computed nor drawn."""
        self.num_computed_tokens -= num_tokens
        self.num_pending_tokens -= num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then arrival, then id."""
        return (self.priority, self.arrival_time, self.seq_id)

    def full_block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` blocks (all of whose tokens are known)."""
        hashes = self.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root_hash()
            tokens = self.token_ids[i * block_size : (i + 1) * block_size]
            if self.images:  # an image's placeholder ids are all alike: its pixels name the block
                tokens = [*tokens, *image_keys(self.images, i * block_size, (i + 1) * block_size)]
            hashes.append(chain_hash(parent, tokens))
        return hashes[:num_blocks]

    def _root_hash(self) -> int:
        """The prefix cache's key before the first block: an adapter's prompts never share blocks
        with the base model's or another adapter's (-1 is no token id)."""
        adapter = self.params.adapter
        return ROOT_HASH if adapter is None else chain_hash(ROOT_HASH, [-1, *adapter.encode()])

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A sibling sharing everything computed so far (BlockManager.fork shares the blocks)."""
        child = Sequence.__new__(Sequence)
        for name in Sequence.__slots__:
            setattr(child, name, getattr(self, name))
        child.seq_id, child.index = seq_id, index
        child.token_ids = list(self.token_ids)
        child.block_ids = list(self.block_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_pending_forks = 0
        child.known_by_detokenizer = False
        child.prompt_logprobs = None  # the prompt's, which its parent reports
        return child

    def take_prompt_logprobs(self, entry: PromptLogprobs) -> None:
        """Join a pass's prompt logprobs: tokens from `entry.start` on, past what it holds (a
        sequence computed again after preemption predicts its prompt again)."""
        held = self.prompt_logprobs
        if held is None:
            return
        skip = len(held) + 1 - entry.start
        if skip < 0:
            raise ValueError(f"sequence {self.seq_id}: prompt logprobs from token {entry.start}, {len(held)} held")
        tops: list[TopLogprobs | None] = [*entry.top] if entry.top else [None] * len(entry.logprobs)
        for logprob, rank, top in list(zip(entry.logprobs, entry.ranks, tops))[skip:]:
            if top is None:
                held.append(TokenLogprob(logprob, rank=rank))
            else:
                held.append(TokenLogprob(logprob, top.token_ids, top.logprobs, rank))

    def take_prompt_tokens(self) -> PromptTokens | None:
        """Its prompt with every token's logprob, once (for its first update); None otherwise."""
        held = self.prompt_logprobs
        if held is None or len(held) < self.num_prompt_tokens - 1:
            return None
        self.prompt_logprobs = None
        return PromptTokens(self.token_ids[: self.num_prompt_tokens], held)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )


IMAGE_MARK = -2  # no token id: what sets an image's key apart from the block's tokens


def image_keys(images: list[ImageInput], start: int, end: int) -> list[int]:
    """What a block of tokens [start, end) adds to its name for the images whose placeholder
    tokens it holds: each one's hash and how far into it the block starts."""
    keys: list[int] = []
    for image in images:
        if image.offset < end and image.offset + image.length > start:
            keys += [IMAGE_MARK, image.hash, start - image.offset]
    return keys
