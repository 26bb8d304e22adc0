"""One rank samples: rank 0 draws from the gathered logits, the other ranks take its ids.

Rank 0 alone holds the whole vocabulary's logits (the LM head gathers them there), so it alone
applies penalties, grammar masks and the sampler. Its ids and whether each draw was valid are
broadcast (one [2, N] int64 tensor per pass, on the device), and every other rank feeds them into
its persistent batch and its sequences' histories exactly as rank 0 does: the next pass's inputs
and every later decision (a sequence stopping on EOS, a failed draw) are then the same on all
ranks, which is what keeps their collectives in step. The other ranks' logprobs are zeros and
their top logprobs empty: only rank 0 sends StepResults.
"""

from __future__ import annotations

import torch

from conveyor.gpu.parallel.group import TensorParallel
from conveyor.gpu.sampling.draws import DeviceSamples, SamplingRow


def share_draws(tp: TensorParallel, samples: DeviceSamples | None, rows: list[SamplingRow], device: torch.device) -> DeviceSamples:
    """Rank 0 passes its draws over `rows` and gets them back; the others pass None and get the
    same ids and validity (draws in the same order: each row's own, then its forks')."""
    if tp.samples:
        assert samples is not None
        if tp.size > 1:
            tp.broadcast_first(torch.stack([samples.token_ids, samples.valid.to(torch.int64)]))  # [2, N]
        return samples
    num_draws = sum(len(row.choice_indices) for row in rows)
    shared = tp.broadcast_first(torch.empty(2, num_draws, dtype=torch.int64, device=device))
    wanted = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
    logprobs = torch.zeros(num_draws, dtype=torch.float32, device=device)
    return DeviceSamples(shared[0], logprobs, shared[1].bool(), None, None, rows, wanted)
