"""Sequence: the scheduler's state for one generated sequence (one choice of one request).

Tokens are known (prompt plus sampled outputs) or computed (their KV is in the cache). Each step
catches computed up to known; there is no separate prefill or decode phase.
"""

from __future__ import annotations

import enum

from conveyor.wire.messages import FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


class Sequence:
    __slots__ = (
        "seq_id", "request_id", "index", "ingress", "detokenizer", "params", "arrival_time",
        "token_ids", "num_prompt_tokens", "num_computed_tokens", "block_ids",
        "num_blocks_sent", "known_by_worker", "known_by_detokenizer", "status",
        "finish_reason", "num_preemptions",
    )  # fmt: skip

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
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.ingress = ingress
        self.detokenizer = detokenizer
        self.params = params
        self.arrival_time = arrival_time
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_blocks_sent = 0  # prefix of block_ids the worker already holds
        self.known_by_worker = False
        self.known_by_detokenizer = False
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
