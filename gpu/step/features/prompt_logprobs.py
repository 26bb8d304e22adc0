"""Prompt logprobs as the step meets them (a StepFeature): read from the hidden states of the
passes that compute a prompt, for the rows whose request asks (gpu/sampling/prompt_logprobs.py
computes them), with no pass of their own."""

from __future__ import annotations

from collections.abc import Callable

import torch

from conveyor.gpu.sampling.prompt_logprobs import PromptLogprobsOnDevice, compute_prompt_logprobs, prompt_rows
from conveyor.gpu.step.features.base import StepFeature
from conveyor.gpu.step.passes import PassWork


class PromptLogprobsStep(StepFeature):
    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compute_logits = compute_logits  # [N, H] -> [N, V] float32 (a collective under tensor parallelism)

    def after_forward(self, work: PassWork, hidden: torch.Tensor, first: bool) -> PromptLogprobsOnDevice | None:
        """The prompt logprobs of the pass's rows that ask (a plan's first pass: later ones decode);
        the rows' counts are still those before the pass."""
        if not first or not any(seq.params.prompt_logprobs is not None for seq in work.rows):
            return None
        specs = [
            (seq.seq_id, seq.num_computed, n, seq.num_prompt_tokens, seq.token_ids, seq.params.prompt_logprobs)
            for seq, n in zip(work.rows, work.num_new)
        ]
        wanted = prompt_rows(specs)
        return compute_prompt_logprobs(wanted, hidden, self.compute_logits) if wanted else None
