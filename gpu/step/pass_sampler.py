"""A pass's draws: its sampling rows' hidden states -> token ids on every rank, where drafts meet
the sampler's other inputs.

Each drawing row draws once per choice (a forking row for itself and each fork), and a row
verifying drafts draws once more per draft (gpu/spec/verify.py). Position j of a verifying row
draws output n + j as if its first j drafts were drawn: its penalties read those drafts as
history (`pass_draws`), and a mask's row is the one after them (passes.py `PassWork.logit_rows`,
read by the features that mask: features/grammars.py). Draws wanting only an argmax skip the logits.

Invariant (tensor parallelism): every rank computes the logits (a collective), rank 0 alone draws,
and its ids reach every rank (gpu/parallel/sampling.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from conveyor.gpu.parallel.group import TensorParallel
from conveyor.gpu.parallel.sampling import share_draws
from conveyor.gpu.sampling import SamplingRow
from conveyor.gpu.sampling.draws import DeviceSamples, argmax_draws, only_argmax
from conveyor.gpu.sampling.penalties import penalises_repeats
from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.step.in_flight import InFlight
from conveyor.gpu.step.passes import PassWork, Window
from conveyor.gpu.step.persistent_batch import PersistentBatch
from conveyor.gpu.step.platform import Platform
from conveyor.gpu.structured import combined

if TYPE_CHECKING:
    from conveyor.gpu.step.features.base import Hooks


@dataclasses.dataclass
class PassDraws:
    rows: list[SamplingRow]  # one per draw, in draw order
    param_slots: list[int]  # per draw: the batch slot of its parameters (a fork draws with its parent's)


def pass_draws(work: PassWork, slots: dict[int, int]) -> PassDraws:
    """The draws of `work`'s sampling rows; `slots`: each sequence's batch slot."""
    out = PassDraws([], [])
    for i, forks in zip(work.sampling, work.forks):
        seq = work.rows[i]
        choices = [seq.index, *(f.index for f in forks)] if forks else [seq.index]
        slot = slots[seq.seq_id]
        out.rows.append(SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, choices, seq.num_output_tokens))
        out.param_slots += [slot] * len(choices)
        drafts = work.drafts.get(i, [])
        if drafts:
            reads = penalises_repeats(seq.params)
            for j in range(1, len(drafts) + 1):
                history = seq.token_ids + drafts[:j] if reads else seq.token_ids
                out.rows.append(SamplingRow(seq.params, history, seq.num_prompt_tokens, choices, seq.num_output_tokens + j))
            out.param_slots += [slot] * len(drafts)
    return out


@dataclasses.dataclass(frozen=True)
class PassSampler:
    model: Any  # the CausalLM (or the emulated device's model): compute_logits, compute_greedy
    platform: Platform
    batch: PersistentBatch
    tp: TensorParallel
    eos_token_ids: tuple[int, ...]
    hooks: Hooks  # the features' (features/base.py)
    in_flight: InFlight

    def sample(self, work: PassWork, hidden: torch.Tensor, window: Window, k: int) -> tuple[DeviceSamples, torch.Tensor] | None:
        """hidden [S, H] of the sampling rows -> (the pass's draws, on every rank; each draw's
        parameters' slot [D]). None: the pass turned void while a mask waited for the ids in flight."""
        greedy: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, valid) [S], no logits: draws wanting only an argmax
        if not any(work.forks) and all(only_argmax(work.rows[i].params, work.rows[i].num_output_tokens) for i in work.sampling):
            greedy = self.model.compute_greedy(hidden)
        # [S, V] in the model dtype (other ranks: [S, 0]): the sampler upcasts only what its math needs
        logits = self.model.compute_logits(hidden, upcast=False) if greedy is None else None
        settled = []

        def settle() -> None:
            settled.append(True)
            self.in_flight.settle()

        masks = [m for mask in self.hooks.mask if (m := mask(work, settle)) is not None]  # the host works while the device computes
        if settled and k > 0 and not window.active(k):
            return None
        draws = pass_draws(work, self.batch.slots)
        device = self.batch.device
        param_slots = to_device(draws.param_slots, torch.int64, device)
        drawn = None
        if greedy is not None:
            drawn = argmax_draws(*greedy, draws.rows)
        elif self.tp.samples:
            assert logits is not None
            draw_params = self.batch.params.gather(param_slots)
            drawn = self.platform.draw(logits, draws.rows, self.eos_token_ids, draw_params, combined(masks))
        return share_draws(self.tp, drawn, draws.rows, device), param_slots  # rank 0's ids on every rank
