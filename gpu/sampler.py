"""Pick one token per draw from logits [S, V] float32, each draw with its own SamplingParams.

A draw reads one logits row; several draws may read the same row (the forks of an n > 1 request
all sample from their parent's logits). Greedy draws (temperature 0) take the argmax; when every
draw is greedy that is the whole job (one argmax per row, no sort). Otherwise logits are divided
by the temperature, filtered by top_k then top_p (HF's order) with one descending sort shared by
the batch, and a token is drawn by the exponential race: argmax(probs / E) with E ~ Exp(1)
i.i.d. per vocabulary entry picks token t with probability probs[t]. A draw with a seed takes
its E from a generator seeded by mix(seed, output index, choice index) alone, so its token does
not depend on what else is in the batch while the n samples of one request differ; unseeded
draws share one default-generator draw.

`sampled_logprobs` gives log p(token) under the raw logits (before temperature and filters).
"""

from __future__ import annotations

import torch

from conveyor.wire.messages import SamplingParams

MASK64 = (1 << 64) - 1


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
    temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32)
    logits = logits / temps.to(device, non_blocking=True)[:, None]
    logits = _filter_top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)  # [N, V]; filtered entries are exactly 0
    race = probs / _exponential_noise(probs, params, output_indices, choice_indices)
    sampled = race.argmax(dim=-1)
    if any(greedy):
        is_greedy = torch.tensor(greedy).to(device, non_blocking=True)
        sampled = torch.where(is_greedy, logits.argmax(dim=-1), sampled)
    return sampled


def sampled_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, logit_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """log_softmax(logits)[logit_rows[i], token_ids[i]]: logits [S, V] float32 as the model gave
    them, token_ids [N] int64, logit_rows [N] int64 (None: row i) -> [N] float32."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, V]
    rows = torch.arange(len(token_ids), device=logits.device) if logit_rows is None else logit_rows
    return logprobs[rows, token_ids]


def _filter_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf what top_k / top_p exclude; rows without either pass unchanged."""
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    use_k, use_p = any(k < vocab for k in top_ks), any(p < 1.0 for p in top_ps)
    if not (use_k or use_p):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab, device=device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.tensor(top_ks).to(device, non_blocking=True)[:, None]
        drop |= rank >= k
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if use_p:
        p = torch.tensor(top_ps, dtype=torch.float32).to(device, non_blocking=True)[:, None]
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the shortest prefix whose mass reaches top_p: drop a token when the mass before it
        # already does. The first token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= (mass_before >= p) & (rank > 0)
    dropped = torch.zeros_like(drop).scatter_(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(dropped, float("-inf"))


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
