"""Seeded draws come from a counter-based hash of (seed, output index, choice index): uniform on
[0, 1), a float32 exactly, and drawing by them follows the filtered distribution. Also the
`bench sampling` variants, each of which must draw from the same distribution."""

from __future__ import annotations

import pytest
import torch

from conveyor.bench.sampling import VARIANTS, time_shape, variants
from conveyor.gpu.sampling import sample
from conveyor.gpu.sampling.sampler import seeded_uniform
from conveyor.wire.messages import SamplingParams


def test_seeded_uniforms_are_float32_in_the_unit_interval_and_spread_evenly():
    values = torch.tensor([seeded_uniform(seed, index, choice) for seed in range(40) for index in range(50) for choice in range(2)])
    assert ((values >= 0) & (values < 1)).all()
    assert torch.equal(values.float().double(), values.double())  # 24 bits: exact in float32
    counts = torch.histc(values, bins=10, min=0, max=1)  # 400 expected per bin; 6 sigma is 114
    assert (counts - 400).abs().max() < 114, counts
    assert len(set(values.tolist())) > 0.99 * len(values)


def test_seeded_uniform_depends_on_each_index_only_through_the_hash():
    assert seeded_uniform(3, 4) == seeded_uniform(3, 4, 0)
    assert len({seeded_uniform(3, 4, c) for c in range(8)}) == 8
    assert len({seeded_uniform(s, 0) for s in range(64)}) == 64


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.7, top_p=0.9, seed=2)])
def test_seeded_draws_follow_the_distribution(params):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = torch.softmax(logits[0] / params.temperature, dim=-1)
    if params.top_p < 1:  # keep the shortest prefix of the sorted probabilities reaching top_p
        keep = (probs.cumsum(0) - probs) < params.top_p
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs /= probs.sum()
    num_draws = 3000
    ids = torch.cat([sample(logits, [params], [i])[0] for i in range(num_draws)])  # one output index per draw
    freq = torch.bincount(ids, minlength=6).float() / num_draws
    assert (freq - probs).abs().max() < 0.03, (freq, probs)


def test_bench_variants_draw_from_the_same_distribution():
    logits = torch.tensor([[1.5, 0.0, -1.0, 0.5]]).repeat(2000, 1)
    expected = torch.softmax(logits[0], dim=-1)
    for name, draw in variants(len(logits), torch.device("cpu")).items():
        freq = torch.bincount(draw(logits), minlength=4).float() / len(logits)
        assert (freq - expected).abs().max() < 0.04, (name, freq)
    assert set(time_shape(2, 64, torch.device("cpu"), rounds=1, repeats=1)) == set(VARIANTS)


@pytest.mark.cuda
def test_seeded_draws_on_cuda_ignore_the_batch_and_follow_the_cpu():
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 2
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    others = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    same_as_cpu = 0
    for index in range(50):
        alone = sample(x[2:3].cuda(), [seeded], [index])[0].item()
        batch = sample(x.cuda(), [others[0], others[1], seeded, others[2]], [3, 1, index, 0])[0][2].item()
        assert batch == alone
        same_as_cpu += alone == sample(x[2:3], [seeded], [index])[0].item()
    assert same_as_cpu >= 48  # the same u; exp and cumsum round differently only at a token's edge
    assert set(time_shape(2, 64, torch.device("cuda"), rounds=1, repeats=1)) == set(VARIANTS)
