"""The sampler: greedy, top-k, top-p, temperature, per-request seeds, draws sharing a row, logprobs,
and rows with nothing to draw from (NaN, +inf, every token masked) failing alone; which draws may
take their argmax without logits (only_argmax), and what those draws carry."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.gpu.sampling import SamplingRow, sample, sampled_logprobs, seed_for
from conveyor.gpu.sampling.draws import argmax_draws, only_argmax
from conveyor.wire.messages import SamplingParams, StructuredOutput

V = 50


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def sample_ids(*args, **kwargs) -> torch.Tensor:
    """The sampler's ids [N], where every draw had finite logits to draw from."""
    ids, valid = sample(*args, **kwargs)
    assert valid.all()
    return ids


def test_greedy_is_argmax():
    x = logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    assert torch.equal(sample_ids(x, params, [0] * 6), x.argmax(-1))


def test_top_k_one_equals_greedy():
    x = logits(8)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    for _ in range(5):
        assert torch.equal(sample_ids(x, params, list(range(8))), x.argmax(-1))


def test_greedy_rows_mixed_with_sampled_rows():
    x = logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    out = sample_ids(x, params, [0] * 4)
    assert out[0] == x[0].argmax() and out[2] == x[2].argmax()


def test_seeded_row_ignores_batch_composition():
    x = logits(5)
    seeded = SamplingParams(temperature=1.0, seed=42)
    for index in range(20):
        alone = sample_ids(x[2:3], [seeded], [index])
        torch.manual_seed(index)  # whatever the default generator does to the other rows
        others = [SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=0.0)]
        batch = sample_ids(x, [others[0], others[1], seeded, others[0], others[1]], [3, 1, index, 0, 9])
        assert batch[2] == alone[0]


def test_seeded_draw_depends_on_seed_and_index():
    x = torch.zeros(1, V)  # uniform: every token equally likely
    draws = {seed: [sample_ids(x, [SamplingParams(temperature=1.0, seed=seed)], [i]).item() for i in range(40)] for seed in (1, 2)}
    assert draws[1] != draws[2]
    assert len(set(draws[1])) > 10  # the index moves the draw along
    assert draws[1] == [sample_ids(x, [SamplingParams(temperature=1.0, seed=1)], [i]).item() for i in range(40)]
    assert len({seed_for(s, i) for s in range(30) for i in range(30)}) == 900


def test_small_top_p_keeps_only_the_argmax():
    x = logits(6, seed=1)
    params = [SamplingParams(temperature=1.0, top_p=0.01)] * 6
    for _ in range(5):
        assert torch.equal(sample_ids(x, params, [0] * 6), x.argmax(-1))


def test_top_k_and_top_p_restrict_the_support():
    row = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0] + [-5.0] * (V - 5)])
    top_k = {sample_ids(row, [SamplingParams(temperature=1.0, top_k=2)], [0]).item() for _ in range(200)}
    assert top_k == {0, 1}
    # probs of the first three are ~0.3 each: top_p 0.5 needs exactly the first two
    top_p = {sample_ids(row, [SamplingParams(temperature=1.0, top_p=0.5)], [0]).item() for _ in range(200)}
    assert top_p == {0, 1}


def test_temperature_sampling_follows_softmax():
    torch.manual_seed(0)
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    temperature, draws = 0.8, 4000
    x = row.expand(draws, -1).contiguous()
    tokens = sample_ids(x, [SamplingParams(temperature=temperature)] * draws, [0] * draws)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(row[0].double() / temperature, -1) * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0  # 5 degrees of freedom: p < 0.001 above ~20.5
    assert counts[0] > counts[1] > counts[2] > counts[3] > counts[4]


def test_draws_sharing_a_row():
    x = logits(3)
    rows = torch.tensor([0, 0, 0, 1, 2, 2])
    greedy = [SamplingParams(temperature=0.0)] * 6
    assert torch.equal(sample_ids(x, greedy, [0] * 6, logit_rows=rows), x.argmax(-1)[rows])
    top1 = [SamplingParams(temperature=1.0, top_k=1)] * 6
    assert torch.equal(sample_ids(x, top1, [0] * 6, list(range(6)), rows), x.argmax(-1)[rows])
    # unseeded draws of one row get their own noise: 40 draws from a uniform row are not all equal
    uniform = torch.zeros(1, V)
    one_row = torch.zeros(40, dtype=torch.long)
    draws = sample_ids(uniform, [SamplingParams(temperature=1.0)] * 40, [0] * 40, logit_rows=one_row)
    assert len(set(draws.tolist())) > 10


def test_seeded_choices_differ_reproducibly():
    x = torch.zeros(2, V)  # uniform
    seeded = SamplingParams(temperature=1.0, seed=5)
    rows = torch.zeros(8, dtype=torch.long)
    first = sample_ids(x, [seeded] * 8, [3] * 8, list(range(8)), rows).tolist()
    assert len(set(first)) > 3
    # each draw depends on (seed, output index, choice index) only, not on its neighbours
    other = SamplingParams(temperature=0.5)
    mixed = sample_ids(x, [other, seeded, seeded], [0, 3, 3], [0, 5, 0], torch.tensor([1, 0, 0])).tolist()
    assert mixed[1:] == [first[5], first[0]]
    assert sample_ids(x[:1], [seeded], [3]).item() == first[0]  # choice 0 is the n = 1 stream
    assert seed_for(9, 4) == seed_for(9, 4, 0)
    assert len({seed_for(s, i, c) for s in range(20) for i in range(20) for c in range(5)}) == 2000


def test_sampled_logprobs_are_raw_log_softmax():
    x = logits(3)
    ids = torch.tensor([4, 7, 7, 0])
    rows = torch.tensor([0, 0, 1, 2])
    expected = torch.log_softmax(x, -1)[rows, ids]
    assert torch.equal(sampled_logprobs(x, ids, rows), expected)
    assert torch.equal(sampled_logprobs(x, ids[:3]), torch.log_softmax(x, -1)[[0, 1, 2], ids[:3]])
    tokens = sample_ids(x, [SamplingParams(temperature=0.3, top_k=3)] * 3, [0] * 3)
    got = sampled_logprobs(x, tokens)
    assert (got <= 0).all() and torch.equal(got, torch.log_softmax(x, -1)[[0, 1, 2], tokens])  # not x / 0.3


@pytest.mark.parametrize("u", [0.0, 0.3, 0.9, 1.0 - 2**-24, 1.0])  # 1.0: a uniform that rounded up
def test_inverse_cdf_never_lands_on_a_filtered_token(monkeypatch, u):
    from conveyor.gpu.sampling import sampler as sampler_module

    # min_p 0.2 zeroes tokens 0 and 3..V-1 (the last ones too: the running sum stops growing early)
    row = torch.full((1, V), -30.0)
    row[0, 1], row[0, 2], row[0, 0] = 2.0, 1.9, -5.0
    monkeypatch.setattr(sampler_module, "_uniforms", lambda *args: torch.tensor([u]))
    token = sample_ids(row, [SamplingParams(temperature=1.0, min_p=0.2)], [0]).item()
    assert token == (1 if u < 0.5 else 2)  # p = 0.52, 0.48 for tokens 1 and 2


# --- rows with nothing to draw from ---------------------------------------------------------


def broken_rows() -> torch.Tensor:
    """[6, V]: rows 1 (a NaN), 3 (a +inf) and 4 (every token masked) have no distribution."""
    x = logits(6, seed=3)
    x[1, 7] = float("nan")
    x[3, 2] = float("inf")
    x[4] = float("-inf")
    return x


BROKEN = [1, 3, 4]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, seed=7),
    ],
    ids=["greedy", "sampled", "filtered", "seeded"],
)
def test_broken_rows_fail_alone_and_ids_stay_in_the_vocabulary(params):
    x = broken_rows()
    ids, valid = sample(x, [params] * 6, [0] * 6)
    assert valid.tolist() == [i not in BROKEN for i in range(6)]
    assert ((ids >= 0) & (ids < V)).all()
    assert ids[BROKEN].tolist() == [0, 0, 0]  # a placeholder, never V (what a NaN search returns)
    good = [0, 2, 5]
    alone, alone_valid = sample(x[good], [params] * 3, [0] * 3)
    assert alone_valid.all()
    if params.greedy or params.seed is not None:  # deterministic: the neighbours change nothing
        assert torch.equal(ids[good], alone)


def test_broken_rows_fail_every_draw_reading_them():
    x = broken_rows()
    rows = torch.tensor([0, 1, 1, 4, 5, 5])  # forks share their row's fate
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        ids, valid = sample(x, [params] * 6, [0] * 6, list(range(6)), rows)
        assert valid.tolist() == [True, False, False, False, True, True]
        assert ((ids >= 0) & (ids < V)).all()
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    ids, valid = sample(x, mixed, [0] * 6, list(range(6)), rows)
    assert valid.tolist() == [True, False, False, False, True, True]
    assert ids[0] == x[0].argmax()


def test_subnormal_temperature_is_greedy():
    """1e-46 rounds to 0 in float32: dividing by it made every probability NaN and the sampler
    returned V. Below MIN_SAMPLING_TEMPERATURE a temperature means greedy."""
    x = logits(4)
    for temperature in (1e-46, 5e-324, 1e-6):
        params = SamplingParams(temperature=temperature, seed=3, top_p=0.5)
        assert params.greedy
        assert torch.equal(sample_ids(x, [params] * 4, [0] * 4), x.argmax(-1))
    assert not SamplingParams(temperature=1e-5).greedy
    assert sample_ids(x, [SamplingParams(temperature=1e-5)] * 4, [0] * 4).tolist() == x.argmax(-1).tolist()


@pytest.mark.parametrize(
    "changes,num_output,argmax_only",
    [
        ({}, 0, True),
        ({"temperature": 0.7}, 0, False),
        ({"logprobs": 0}, 0, False),  # the sampled token's logprob
        ({"n": 2, "best_of": 3}, 0, False),  # ranked by cumulative logprob
        ({"repetition_penalty": 1.2}, 0, False),
        ({"presence_penalty": 0.5}, 0, False),
        ({"logit_bias": {3: 2.0}}, 0, False),
        ({"min_tokens": 4}, 3, False),  # EOS still masked at this draw
        ({"min_tokens": 4}, 4, True),
        ({"structured": StructuredOutput("choice", '["a", "b"]')}, 0, False),
        ({"stop": ["x"], "max_tokens": 5, "seed": 3}, 0, True),  # stop strings and seeds read no logits
    ],
)
def test_only_argmax_is_a_greedy_draw_that_wants_nothing_else(changes, num_output, argmax_only):
    assert only_argmax(SamplingParams(**{"temperature": 0.0, **changes}), num_output) is argmax_only


def test_argmax_draws_carry_the_ids_and_no_logprobs():
    ids, valid = torch.tensor([4, 0, 7]), torch.tensor([True, False, True])
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1, 2], 1, [0]) for _ in range(3)]
    samples = argmax_draws(ids, valid, rows)
    host = samples.on_host([t if t is None else t.clone() for t in samples.tensors()])
    assert host.token_ids == [4, 0, 7] and host.failed_draws == [1] and host.top_logprobs == []
    assert all(math.isnan(lp) for lp in host.logprobs)
