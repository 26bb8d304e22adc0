"""The sampler: greedy, top-k, top-p, temperature, and per-request seeds."""

from __future__ import annotations

import torch

from conveyor.gpu.sampler import sample, seed_for
from conveyor.wire.messages import SamplingParams

V = 50


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax():
    x = logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    assert torch.equal(sample(x, params, [0] * 6), x.argmax(-1))


def test_top_k_one_equals_greedy():
    x = logits(8)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    for _ in range(5):
        assert torch.equal(sample(x, params, list(range(8))), x.argmax(-1))


def test_greedy_rows_mixed_with_sampled_rows():
    x = logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    out = sample(x, params, [0] * 4)
    assert out[0] == x[0].argmax() and out[2] == x[2].argmax()


def test_seeded_row_ignores_batch_composition():
    x = logits(5)
    seeded = SamplingParams(temperature=1.0, seed=42)
    for index in range(20):
        alone = sample(x[2:3], [seeded], [index])
        torch.manual_seed(index)  # whatever the default generator does to the other rows
        others = [SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=0.0)]
        batch = sample(x, [others[0], others[1], seeded, others[0], others[1]], [3, 1, index, 0, 9])
        assert batch[2] == alone[0]


def test_seeded_draw_depends_on_seed_and_index():
    x = torch.zeros(1, V)  # uniform: every token equally likely
    draws = {
        seed: [sample(x, [SamplingParams(temperature=1.0, seed=seed)], [i]).item() for i in range(40)]
        for seed in (1, 2)
    }
    assert draws[1] != draws[2]
    assert len(set(draws[1])) > 10  # the index moves the draw along
    assert draws[1] == [sample(x, [SamplingParams(temperature=1.0, seed=1)], [i]).item() for i in range(40)]
    assert len({seed_for(s, i) for s in range(30) for i in range(30)}) == 900


def test_small_top_p_keeps_only_the_argmax():
    x = logits(6, seed=1)
    params = [SamplingParams(temperature=1.0, top_p=0.01)] * 6
    for _ in range(5):
        assert torch.equal(sample(x, params, [0] * 6), x.argmax(-1))


def test_top_k_and_top_p_restrict_the_support():
    row = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0] + [-5.0] * (V - 5)])
    top_k = {sample(row, [SamplingParams(temperature=1.0, top_k=2)], [0]).item() for _ in range(200)}
    assert top_k == {0, 1}
    # probs of the first three are ~0.3 each: top_p 0.5 needs exactly the first two
    top_p = {sample(row, [SamplingParams(temperature=1.0, top_p=0.5)], [0]).item() for _ in range(200)}
    assert top_p == {0, 1}


def test_temperature_sampling_follows_softmax():
    torch.manual_seed(0)
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    temperature, draws = 0.8, 4000
    x = row.expand(draws, -1).contiguous()
    tokens = sample(x, [SamplingParams(temperature=temperature)] * draws, [0] * draws)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(row[0].double() / temperature, -1) * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0  # 5 degrees of freedom: p < 0.001 above ~20.5
    assert counts[0] > counts[1] > counts[2] > counts[3] > counts[4]
