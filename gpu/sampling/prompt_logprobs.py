"""Prompt logprobs (SamplingParams.prompt_logprobs), computed in the passes that compute the prompt:
no second forward pass.

A row computing tokens [start, end) of its sequence holds, at token i, the model's distribution of
token i + 1. For a sequence with P prompt tokens that gives prompt tokens start + 1 .. min(end, P - 1)
(token 0 has no logprob; the distribution after token P - 1 is the first output's, which the
sampler draws from). Each comes back as its log p under the raw logits (log_softmax, before
temperature or filters, as the sampled tokens' logprobs), its rank among all tokens (1: the most
likely) and the row's params.prompt_logprobs most likely alternatives. A chunked prompt yields its
logprobs chunk by chunk; the scheduler joins them by `start`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from conveyor.gpu.sampling.transfer import to_device
from conveyor.wire.step import PromptLogprobs, StepResult, TopLogprobs

# Positions whose logits are materialised at once: [SLICE, V] float32 (SmolLM2: 25 MiB).
SLICE = 128


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One row's part: its sequence, where its chunk starts in the pass's tokens (`offset`), the
    first prompt token it predicts (`start`), the prompt tokens it predicts, and how many
    alternatives it wants."""

    seq_id: int
    offset: int
    start: int
    targets: list[int]
    num_top: int


def prompt_rows(rows: list[tuple[int, int, int, int, list[int], int | None]]) -> list[PromptRow]:
    """(seq_id, chunk start, chunk length, prompt length, token ids, prompt_logprobs) of each row
    of a pass, in pass order -> the PromptRows of those that ask and predict a prompt token."""
    out, offset = [], 0
    for seq_id, begin, length, num_prompt, token_ids, num_top in rows:
        end = min(begin + length, num_prompt - 1)  # positions [begin, end) predict a prompt token
        if num_top is not None and end > begin:
            out.append(PromptRow(seq_id, offset, begin + 1, token_ids[begin + 1 : end + 1], num_top))
        offset += length
    return out


@dataclasses.dataclass
class PromptLogprobsOnDevice:
    rows: list[PromptRow]
    logprobs: torch.Tensor  # [N] float32: N prompt tokens, the rows' in order
    ranks: torch.Tensor  # [N] int64
    top_values: torch.Tensor | None  # [N, k] float32, k the rows' largest num_top (None: k = 0)
    top_ids: torch.Tensor | None  # [N, k] int64

    def on_host(self) -> list[PromptLogprobs]:
        """Waits for the device: called once the pass's draws reached the host (they come after)."""
        logprobs, ranks = self.logprobs.tolist(), self.ranks.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out, at = [], 0
        for row in self.rows:
            n = len(row.targets)
            top = []
            if row.num_top and values is not None and ids is not None:
                top = [TopLogprobs(ids[j][: row.num_top], values[j][: row.num_top]) for j in range(at, at + n)]
            out.append(PromptLogprobs(row.seq_id, row.start, logprobs[at : at + n], ranks[at : at + n], top))
            at += n
        return out

    def fill(self, result: StepResult) -> None:
        result.prompt_logprobs = self.on_host()


def compute_prompt_logprobs(
    rows: list[PromptRow], hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> PromptLogprobsOnDevice | None:
    """hidden [T, H] of the pass -> the rows' prompt logprobs on the device; None on a
    tensor-parallel rank that holds no logits (every rank calls compute_logits: it may gather)."""
    device = hidden.device
    index = to_device([row.offset + j for row in rows for j in range(len(row.targets))], torch.int64, device)
    targets = to_device([t for row in rows for t in row.targets], torch.int64, device)
    k = max(row.num_top for row in rows)
    parts: list[tuple[torch.Tensor, ...]] = []
    for at in range(0, index.numel(), SLICE):
        logits = compute_logits(hidden.index_select(0, index[at : at + SLICE]))  # [n, V] float32
        if logits.shape[-1] == 0:  # a rank without logits: it still joins every slice's gather
            continue
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, targets[at : at + SLICE, None])  # [n, 1]
        ranks = (logprobs > chosen).sum(dim=1) + 1
        part: tuple[torch.Tensor, ...] = (chosen[:, 0], ranks)
        if k:
            part += tuple(torch.topk(logprobs, k, dim=-1))
        parts.append(part)
    if not parts:
        return None
    cat = [torch.cat(column) for column in zip(*parts)]
    return PromptLogprobsOnDevice(rows, cat[0], cat[1], cat[2] if k else None, cat[3] if k else None)
