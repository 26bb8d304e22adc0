"""Pick one token per draw from logits [S, V] float32, each draw with its own SamplingParams.

The logits arrive already edited by penalties.py (penalties, bias, min_tokens), so greedy draws
(temperature 0) take their argmax; when every draw is greedy that is the whole job (one argmax
per row, no sort). Otherwise logits are divided by the temperature, filtered by top_k, top_p and
min_p (filters.py; one descending sort shared by the batch, only if a draw uses top_k or top_p),
and a token is drawn by the exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. per
vocabulary entry picks token t with probability probs[t]. A draw with a seed takes its E from a
generator seeded by mix(seed, output index, choice index) alone, so its token does not depend on
what else is in the batch while the n samples of one request differ; unseeded draws share one
default-generator draw.
"""

from __future__ import annotations

import torch

from conveyor.gpu.sampling.filters import filter_min_p, filter_top_k_top_p
from conveyor.gpu.sampling.transfer import to_device
from conveyor.wire.messages import SamplingParams

MASK64 = (1 << 64) - 1


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_indices: list[int],
    choice_indices: list[int] | None = None,
    logit_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [S, V] float32. Draw i reads logits row logit_rows[i] ([N] int64 on the logits'
    device; None: row i, N = S) with params[i]; output_indices[i] is which output token it draws
    (0 = first), choice_indices[i] its choice index in the request (None: all 0).

    Returns the chosen ids [N] int64 on the logits' device.
    """
    greedy = [p.temperature == 0 for p in params]
    if all(greedy):
        ids = logits.argmax(dim=-1)  # [S]: one argmax per row however many draws read it
        return ids if logit_rows is None else ids[logit_rows]
    if logit_rows is not None:
        logits = logits[logit_rows]  # [N, V]
    choice_indices = choice_indices or [0] * len(params)
    device = logits.device
    # Greedy rows run through the sampling math with temperature 1 and are replaced at the end.
    temps = to_device([p.temperature or 1.0 for p in params], torch.float32, device)
    logits = logits / temps[:, None]
    logits = filter_top_k_top_p(logits, params)
    probs = filter_min_p(torch.softmax(logits, dim=-1), params)  # [N, V]; filtered entries are 0
    race = probs / _exponential_noise(probs, params, output_indices, choice_indices)
    sampled = race.argmax(dim=-1)
    if any(greedy):
        is_greedy = to_device(greedy, torch.bool, device)
        sampled = torch.where(is_greedy, logits.argmax(dim=-1), sampled)
    return sampled


def seed_for(seed: int, output_index: int, choice_index: int = 0) -> int:
    """A 63-bit generator seed from (request seed, index of the output token, choice index within
    the request): splitmix64 of the seed, then of each index in turn, so that nearby values give
    unrelated streams. Choice 0 keeps the stream of a request with n = 1."""
    x = _mix(seed * 0x9E3779B97F4A7C15 + output_index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019)
    if choice_index:
        x = _mix(x + choice_index * 0x8CB92BA72F3D8DD7)
    return x >> 1


def _mix(x: int) -> int:
    """splitmix64's finalizer on x mod 2**64."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _exponential_noise(
    probs: torch.Tensor, params: list[SamplingParams], output_indices: list[int], choice_indices: list[int]
) -> torch.Tensor:
    """E [N, V] ~ Exp(1): seeded rows from their own generator, the rest from the default one."""
    noise = torch.empty_like(probs).exponential_()
    for row, (p, index, choice) in enumerate(zip(params, output_indices, choice_indices, strict=True)):
        if p.seed is not None and p.temperature != 0:
            generator = torch.Generator(device=probs.device).manual_seed(seed_for(p.seed, index, choice))
            noise[row].exponential_(generator=generator)
    # An exact 0 would turn a filtered entry's 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
