"""Pick one token per draw from logits [S, V] (float32, or the model dtype), each draw with its own SamplingParams.

draws.py calls `sample` with logits already edited by penalties.py (penalties, bias, min_tokens).
Greedy draws (temperature 0) take their argmax; the others are divided by the temperature,
filtered (filters.py) and drawn by inverting the CDF with one uniform per draw.

Invariants:
- a seeded draw's token depends only on (seed, output index, choice index) and the logits, never
  on the rest of the batch or the device (`seed_for`, `seeded_uniform`), while the n samples of
  one request differ; unseeded draws share one default-generator draw of the device;
- a draw is valid when its row leaves something to draw: no NaN, no +inf, some entry above -inf
  (a subnormal temperature or an extreme penalty overflows; min_tokens with every id a stop id
  masks the whole row). An invalid draw returns id 0, never an id outside [0, V): the caller
  fails its request, the other draws stand. No device sync: seeded uniforms are host arithmetic.
"""

from __future__ import annotations

import torch

from conveyor.gpu.sampling.argmax import argmax_rows
from conveyor.gpu.sampling.filters import filter_min_p, filter_top_k, filter_top_p
from conveyor.gpu.sampling.params_table import DrawParams
from conveyor.gpu.sampling.transfer import to_device
from conveyor.wire.messages import SamplingParams

MASK64 = (1 << 64) - 1


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_indices: list[int],
    choice_indices: list[int] | None = None,
    logit_rows: torch.Tensor | None = None,
    draw_params: DrawParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 or the model dtype (greedy batches read it as it is; sampled rows'
    temperature makes a float32 copy, the only one). Draw i reads logits row logit_rows[i] ([N] int64 on the logits'
    device; None: row i, N = S) with params[i]; output_indices[i] is which output token it draws
    (0 = first), choice_indices[i] its choice index in the request (None: all 0). draw_params:
    the same parameters already on the device (the persistent batch's ParamsTable), so nothing
    of them goes up this step; None: copied up from `params`.

    Returns (ids [N] int64, valid [N] bool) on the logits' device; an invalid draw's id is 0.

    When every draw is greedy that is the whole job: one argmax per row (argmax.py). Otherwise the
    filters run, none of them a sort (filters.py), and a token is drawn by inverting the CDF: one
    uniform u per draw, and the first token whose running sum of probabilities exceeds u times the
    row's total. That is one random number per draw rather than
    one per vocabulary entry (the exponential race's noise, [N, V] logarithms, cost more than the
    rest of sampling together on a CPU). Filtered tokens have probability 0, so the running sum
    never steps past u on them. Validity comes for free: softmax turns NaN, +inf or a row of
    -inf into NaN, so the row's total says it, and greedy rows get it from the max that their
    argmax comes with.
    """
    greedy = [p.greedy for p in params]
    if all(greedy):
        ids, valid = argmax_rows(logits)  # [S]: one pass per row however many draws read it
        return (ids, valid) if logit_rows is None else (ids[logit_rows], valid[logit_rows])
    choice_indices = choice_indices or [0] * len(params)
    device = logits.device
    # Greedy rows run through the sampling math with temperature 1 and are replaced at the end.
    if draw_params is not None:
        temps = draw_params.temperature[:, None]
    else:
        temps = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)[:, None]
    # [N, V] float32, a fresh tensor either way, so everything below may work in place (the caller's
    # logits still give the logprobs); each [N, V] temporary costs a pass over memory at 128k
    # vocabularies. A gathered float32 copy is divided in place; model-dtype rows upcast in the division.
    picked = logits if logit_rows is None else logits[logit_rows]
    in_place = picked is not logits and picked.dtype == torch.float32
    logits = filter_top_k(picked.div_(temps) if in_place else picked / temps, params, draw_params)
    greedy_ids = logits.argmax(dim=-1) if any(greedy) else None  # before exp, which can tie near the max
    # Unnormalised probabilities exp(x - row max): the draw compares the running sum with u times the
    # total, so softmax's division is not needed, and NaN, +inf or a row of -inf still give NaN.
    probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    probs = filter_min_p(filter_top_p(probs, params, draw_params), params, draw_params)  # filtered entries are 0
    cdf = probs.cumsum_(dim=-1)  # [N, V], non-decreasing (sums of non-negative floats)
    total = cdf[:, -1:]  # [N, 1]; at least the row max's own 1 (every filter keeps it); NaN: nothing to draw
    valid = (total > 0).squeeze(1)  # [N]; False for NaN
    u = _uniforms(params, output_indices, choice_indices, device)[:, None]  # [N, 1] in [0, 1)
    # Strictly below the total, so some token's running sum exceeds it whatever the rounding.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)  # first index with cdf > target
    if greedy_ids is not None:
        sampled = torch.where(to_device(greedy, torch.bool, device), greedy_ids, sampled)
    return sampled.masked_fill(~valid, 0), valid  # NaN searches land on V: never let one out


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


def seeded_uniform(seed: int, output_index: int, choice_index: int = 0) -> float:
    """u in [0, 1) from (request seed, output index, choice index) alone: the top 24 bits of
    seed_for's hash, a float32 exactly (as torch.rand's), so u * total never rounds up to 1."""
    return (seed_for(seed, output_index, choice_index) >> 39) * 2.0**-24


def _uniforms(
    params: list[SamplingParams], output_indices: list[int], choice_indices: list[int], device: torch.device
) -> torch.Tensor:
    """u [N] ~ U[0, 1): seeded draws from their hash (host integers, so a seed gives the same token
    on any device), the rest from the default generator of the device. The hash is about a
    microsecond of host arithmetic per seeded draw (a torch.Generator per draw cost ten times
    that), with no device sync: its values go up with the step's other small inputs (transfer.py)."""
    u = torch.rand(len(params), device=device)
    seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]  # draw indices
    if seeded:
        values = [seeded_uniform(params[i].seed or 0, output_indices[i], choice_indices[i]) for i in seeded]
        u[to_device(seeded, torch.int64, device)] = to_device(values, torch.float32, device)
    return u
