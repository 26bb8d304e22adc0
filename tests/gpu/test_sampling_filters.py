"""The sort-free filters (gpu/sampling/filters.py, top_p.py) against the sort-based reference
(sorted_filters.py, the filters before issue 48): the same kept set on random, peaked, flat and
mixed rows, ties at a cut all kept where the sort kept some; draws that follow the distribution;
and a planted off-by-one that the comparison catches."""

from __future__ import annotations

import pytest
import torch

from conveyor.gpu.sampling import sample
from conveyor.gpu.sampling import top_p as top_p_module
from conveyor.gpu.sampling.argmax import argmax_rows
from conveyor.gpu.sampling.filters import filter_top_k, filter_top_p
from conveyor.gpu.sampling.sorted_filters import sorted_top_k_top_p
from conveyor.wire.messages import SamplingParams


def kept(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, V] float32 -> (new kept [N, V] bool, reference kept [N, V] bool), both among the
    tokens whose probability is not 0 (exp underflows far below the max either way)."""
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in zip(top_k, top_p, strict=True)]
    alive = (x - x.amax(-1, keepdim=True)).exp() > 0
    probs = filter_top_k(x.clone(), params)
    probs = filter_top_p(probs.sub_(probs.amax(-1, keepdim=True)).exp_(), params)
    # top_p 1 is no filter; the sorted filters still cut such a row's last tokens (mass ~1e-7) once
    # its float32 running sum reached 1.0, when another row of the batch used top_p: not any more.
    off = torch.tensor([p if p < 1.0 else float("inf") for p in top_p])
    reference = sorted_top_k_top_p(x, torch.tensor(top_k), off) > float("-inf")
    return (probs > 0) & alive, reference & alive


def rows(kind: str, n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g)
    if kind == "random":
        return x * 3
    if kind == "peaked":
        x[:, 7] += 25.0
        return x
    if kind == "flat":
        return x * 1e-3
    if kind == "bf16":  # bfloat16 logits, upcast: many equal values
        return (x * 4).bfloat16().float()
    raise ValueError(kind)


SETTINGS = [  # (top_k, top_p) per row: k = 1, k >= V, top_p = 1, each alone and mixed
    (0, 0.9),
    (0, 0.5),
    (0, 0.999),
    (40, 1.0),
    (1, 1.0),
    (1, 0.3),
    (5000, 0.95),
    (100, 0.7),
    (0, 1.0),
    (7, 0.05),
]


def near_the_cut(x: torch.Tensor, top_k: list[int], top_p: list[float], tol: float) -> torch.Tensor:
    """[N, V] bool: tokens whose exact (float64) mass before them, in the sorted top_k survivors,
    is within tol of top_p: where float32 rounding may put the cut either side (a sorted float32
    running sum over 128k tokens drifts by 1e-5; exp rounds flat rows' near-equal logits to ties)."""
    ordered, order = x.double().sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[-1])[None, :]
    ordered = ordered.masked_fill(rank >= torch.tensor([k if k > 0 else x.shape[-1] for k in top_k])[:, None], float("-inf"))
    probs = torch.softmax(ordered, -1)
    close = ((probs.cumsum(-1) - probs) - torch.tensor(top_p, dtype=torch.float64)[:, None]).abs() < tol
    return torch.zeros_like(close).scatter_(-1, order, close)


@pytest.mark.parametrize("kind", ["random", "peaked", "flat"])
@pytest.mark.parametrize("vocab", [1000, 128256])
def test_kept_set_equals_the_sorted_filters(kind, vocab):
    top_k, top_p = [k for k, _ in SETTINGS], [p for _, p in SETTINGS]
    x = rows(kind, len(SETTINGS), vocab, seed=vocab)
    new, reference = kept(x, top_k, top_p)
    differ = new != reference
    assert not (differ & ~near_the_cut(x, top_k, top_p, tol=1e-4)).any()  # only where rounding decides
    assert differ.sum() <= 200 and new.any(-1).all()
    if vocab == 1000:
        assert torch.equal(new, reference)


def test_ties_at_the_cut_are_all_kept():
    """bf16 rows tie often: the new set is the reference's plus the equals of its smallest kept value."""
    x = rows("bf16", len(SETTINGS), 4096, seed=5)
    new, reference = kept(x, [k for k, _ in SETTINGS], [p for _, p in SETTINGS])
    cut = x.masked_fill(~reference, float("inf")).amin(-1, keepdim=True)  # [N, 1] smallest kept value
    assert torch.equal(new, reference | (x == cut))
    assert (new != reference).any()  # the rows do tie at some cut: the case is exercised


def test_top_k_keeps_equals_of_the_kth_value():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    new, reference = kept(x, [2], [1.0])
    assert new[0].tolist() == [True, False, True, True, False] and reference[0].sum() == 2


@pytest.mark.parametrize("kind", ["random", "peaked", "flat"])
def test_a_planted_off_by_one_is_caught(monkeypatch, kind):
    x = rows(kind, len(SETTINGS), 1000, seed=11)
    crossing = top_p_module._crossing

    def one_bin_higher(*args):
        found, reached = crossing(*args)
        return found + 1, reached

    monkeypatch.setattr(top_p_module, "_crossing", one_bin_higher)
    new, reference = kept(x, [k for k, _ in SETTINGS], [p for _, p in SETTINGS])
    assert not torch.equal(new, reference)


def test_draws_follow_the_filtered_distribution():
    """Chi-square of 40,000 seeded draws of one row against the sorted filters' renormalised probabilities."""
    x = rows("random", 1, 64, seed=3) / 2
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=9)
    reference = sorted_top_k_top_p(x / 0.7, torch.tensor([20]), torch.tensor([0.8]))
    expected = torch.softmax(reference, -1)[0].double()
    n, chunk = 40_000, 4_000
    counts = torch.zeros(64, dtype=torch.float64)
    for at in range(0, n, chunk):
        ids, valid = sample(x.expand(chunk, -1), [params] * chunk, list(range(at, at + chunk)))
        assert valid.all()
        counts += torch.bincount(ids, minlength=64)
    support = expected > 0
    assert counts[~support].sum() == 0  # never a filtered token
    want = expected[support] / expected[support].sum() * n
    statistic = ((counts[support] - want) ** 2 / want).sum().item()
    df = int(support.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # Wilson-Hilferty: P(chi2_df > it) = 1e-3
    assert statistic < critical
    assert 3 <= df < 19  # top_k 20 then top_p 0.8: a real cut, several tokens left


def test_argmax_rows_in_bfloat16_match_the_float32_copy():
    x = rows("bf16", 6, 500, seed=2).bfloat16()
    x[1, 3] = x[1].max()  # a tie with an earlier max: the lowest id wins
    x[2, 9] = float("nan")
    x[3] = float("-inf")
    x[4, 0] = float("inf")
    ids, valid = argmax_rows(x)
    ref_ids, ref_valid = argmax_rows(x.float())
    assert torch.equal(ids, ref_ids) and torch.equal(valid, ref_valid)
    assert valid.tolist() == [True, True, False, False, False, True] and ids[3] == 0
