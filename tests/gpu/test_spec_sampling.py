"""Speculative decoding keeps the target distribution exactly: sampled rows verifying drafts,
against the exact distribution of the tiny model, by a chi-square test with enough draws that
planted bugs fail it.

Setting: one prompt, top_k 4 at temperature 1 with a repetition penalty of 0.5 (below 1 it favours
ids already seen, so a verified position that does not see the drafts before it in its history
draws visibly otherwise; at 1.3 that bug changed no draw), seeded per request; the first output is
drawn at the prompt's end, then a fixed proposer offers 2 drafts (the greedy continuation, so
they are accepted often and rejected often). The joint law of outputs 1-3, 64 cells, is compared
with the product of the exact conditionals computed from transformers' logits on the same weights.

The planted bugs (each must fail): accepting every draft; drawing every verified position with
the same output index (one uniform for the run); leaving the drafts out of the penalised history.
"""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM
from conveyor.gpu.sampling.draws import SamplingRow
from conveyor.gpu.step import pass_sampler, passes
from conveyor.gpu.step.features.speculation import SpeculationStep
from conveyor.wire.messages import SamplingParams


def _spec(llm) -> SpeculationStep:
    """The LLM's speculation feature (gpu/step/features/speculation.py)."""
    spec = llm.runner.feature(SpeculationStep)
    assert spec is not None
    return spec


PROMPT = [11, 42, 7, 300, 42, 19]
TOP_K, PENALTY = 4, 0.5
NUM_DRAWS = 2000


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=TOP_K, repetition_penalty=PENALTY, max_tokens=4, ignore_eos=True, seed=seed)


class Exact:
    """The target's conditionals, p(next | history), from transformers' logits."""

    def __init__(self, reference) -> None:
        self.model = reference.model

    @torch.inference_mode()
    def __call__(self, history: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([history])).logits[0, -1].double()
        seen = torch.tensor(sorted(set(history)))
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / PENALTY, picked * PENALTY)
        top = logits.topk(TOP_K)
        probs = torch.zeros_like(logits)
        probs[top.indices] = top.values.softmax(-1)
        return probs


class FixedDrafts:
    """Proposes the greedy continuation after each first output (a table by that output)."""

    def __init__(self, table: dict[int, list[int]]) -> None:
        self.table = table

    def propose(self, seqs, slots, max_drafts):
        histories = [seq.token_ids for seq in seqs]
        return [self.table.get(h[len(PROMPT)], [])[:k] if len(h) > len(PROMPT) else [] for h, k in zip(histories, max_drafts)]


def joint(exact: Exact) -> tuple[dict[tuple[int, int, int], float], dict[int, list[int]]]:
    """P(o1, o2, o3) over every cell with mass, and the drafts table."""
    cells: dict[tuple[int, int, int], float] = {}
    table = {}
    p1 = exact(PROMPT)
    for o1 in p1.nonzero().flatten().tolist():
        p2 = exact([*PROMPT, o1])
        table[o1] = [int(p2.argmax()), int(exact([*PROMPT, o1, int(p2.argmax())]).argmax())]
        for o2 in p2.nonzero().flatten().tolist():
            p3 = exact([*PROMPT, o1, o2])
            for o3 in p3.nonzero().flatten().tolist():
                cells[(o1, o2, o3)] = float(p1[o1] * p2[o2] * p3[o3])
    return cells, table


def p_value(counts: dict, cells: dict[tuple[int, int, int], float], n: int) -> float:
    """Pearson's chi-square over the cells (those expecting fewer than 5 draws pooled into one)."""
    observed, expected = [], []
    pooled_o, pooled_e = 0.0, 0.0
    for cell, p in cells.items():
        if p * n < 5:
            pooled_o, pooled_e = pooled_o + counts.get(cell, 0), pooled_e + p * n
        else:
            observed.append(counts.get(cell, 0))
            expected.append(p * n)
    outside = n - sum(counts.get(cell, 0) for cell in cells)  # draws no cell of the target allows
    observed.append(pooled_o + outside)
    expected.append(max(pooled_e, 1e-9))
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = float(((o - e) ** 2 / e).sum())
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


@pytest.fixture(scope="module")
def target(checkpoints, reference):
    path = checkpoints["LlamaForCausalLM"]
    cells, table = joint(Exact(reference(path)))
    return path, cells, table


def draw(path, table) -> tuple[dict, int]:
    llm = LLM(str(path), device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2}, max_num_seqs=512)
    _spec(llm).proposer = FixedDrafts(table)  # the Proposer protocol
    outputs = llm.generate([PROMPT] * NUM_DRAWS, [params(seed) for seed in range(NUM_DRAWS)])
    counts: dict = {}
    for out in outputs:
        cell = tuple(out.outputs[0].token_ids[:3])
        counts[cell] = counts.get(cell, 0) + 1
    return counts, llm.core.scheduler.num_steps


def test_sampled_rows_keep_the_target_distribution(target):
    path, cells, table = target
    counts, _ = draw(path, table)
    assert sum(cells.values()) == pytest.approx(1.0)
    assert p_value(counts, cells, NUM_DRAWS) > 1e-4


def _accepting_everything(real):
    """accepted_length that first overwrites the draws at the drafts' positions with the drafts:
    what accepting with the draft's own probability (1 for a deterministic draft) does."""

    def accepted_length(drafts: list[int], drawn: list[int]) -> int:
        drawn[: len(drafts)] = drafts
        return real(drafts, drawn)

    return accepted_length


@pytest.mark.parametrize("bug", ["accept_everything", "one_uniform_per_run", "drafts_not_in_history"])
def test_planted_bugs_fail_it(target, monkeypatch, bug):
    path, cells, table = target
    if bug == "accept_everything":
        monkeypatch.setattr(passes, "accepted_length", _accepting_everything(passes.accepted_length))
    else:
        real_row = SamplingRow

        class Planted(real_row):
            def __init__(self, params, token_ids, num_prompt_tokens, choice_indices, num_output_tokens=-1):
                if num_output_tokens > 1 and len(token_ids) > num_prompt_tokens:
                    if bug == "one_uniform_per_run":
                        num_output_tokens = 1  # every position of the run draws with output 1's uniform
                    else:
                        token_ids = token_ids[: num_prompt_tokens + 1]  # the history without the drafts
                super().__init__(params, token_ids, num_prompt_tokens, choice_indices, num_output_tokens)

        monkeypatch.setattr(pass_sampler, "SamplingRow", Planted)
    counts, _ = draw(path, table)
    assert p_value(counts, cells, NUM_DRAWS) < 1e-6
