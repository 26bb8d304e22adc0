"""Embeddings on the worker (a StepFeature): a pooling sequence's (SamplingParams.pooling) hidden states become
one vector in the passes that compute its prompt, no pass of their own.

The model's final-norm hidden states of each prompt chunk are read as the pass computes them
(config/pooling.py says which): the last prompt token's, the first's, or their mean, summed chunk
by chunk (a sequence's running sum lives here until its prompt is done). The pass that computes
the last prompt token gives the vector: cut to the request's `dimensions`, then scaled to unit
length where the model normalizes. Its row still draws a token, which the scheduler discards
(max_tokens 1): the sequence then ends and its blocks go back.
"""

from __future__ import annotations

import dataclasses

import torch

from conveyor.config.pooling import PoolingConfig
from conveyor.gpu.step.features.base import StepFeature
from conveyor.gpu.step.passes import PassWork
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import SeqEmbedding, StepResult


@dataclasses.dataclass
class PooledOnDevice:
    seq_ids: list[int]
    vectors: list[torch.Tensor]  # each [D] float32, D its request's dimensions or the width

    def fill(self, result: StepResult) -> None:
        result.embeddings = [SeqEmbedding(seq_id, v.tolist()) for seq_id, v in zip(self.seq_ids, self.vectors)]


class PoolingStep(StepFeature):
    def __init__(self, config: PoolingConfig) -> None:
        self.config = config
        self._partial: dict[int, torch.Tensor] = {}  # seq_id -> [H] float32: the mean's sum, or the first token's state

    def drop(self, seq_id: int) -> None:
        """A sequence the worker forgets (finished, preempted): its partial state with it."""
        self._partial.pop(seq_id, None)

    def after_forward(self, work: PassWork, hidden: torch.Tensor, first: bool) -> PooledOnDevice | None:
        """The vectors of the pass's pooling rows whose prompt it finished (a plan's first pass:
        a window's later passes decode)."""
        if not first:
            return None
        rows = [(seq.seq_id, seq.num_computed, n, seq.num_prompt_tokens, seq.params) for seq, n in zip(work.rows, work.num_new)]
        return self.pool(rows, hidden)

    def pool(self, rows: list[tuple[int, int, int, int, SamplingParams]], hidden: torch.Tensor) -> PooledOnDevice | None:
        """rows: (seq_id, chunk start, chunk length, prompt length, params) of each row of a
        pass, in pass order; hidden [T, H] -> the vectors of the pooling rows whose prompt the
        pass finished."""
        mode, done_ids, vectors, offset = self.config.mode, [], [], 0
        for seq_id, start, length, num_prompt, params in rows:
            chunk = hidden[offset : offset + length]
            offset += length
            if params.pooling is None or start >= num_prompt:
                continue
            chunk = chunk[: num_prompt - start].float()  # prompt positions only
            if mode == "mean":
                total = chunk.sum(dim=0)
                self._partial[seq_id] = self._partial[seq_id] + total if seq_id in self._partial else total
            elif mode == "first" and start == 0:
                self._partial[seq_id] = chunk[0].clone()  # hidden may be a CUDA graph's buffer, replayed next pass
            if start + length < num_prompt:
                continue
            if mode == "last":
                vector = chunk[-1].clone()  # read on the host after later passes (a graph's buffer is reused)
            else:
                vector = self._partial.pop(seq_id)
                if mode == "mean":
                    vector = vector / num_prompt
            done_ids.append(seq_id)
            vectors.append(self._finish(vector, params.pooling.dimensions))
        return PooledOnDevice(done_ids, vectors) if done_ids else None

    def _finish(self, vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        if dimensions is not None:
            vector = vector[:dimensions]
        if self.config.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector
