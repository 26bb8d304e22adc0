"""ops/bench/spec_replay.py replays n-gram speculation the way the worker runs it (the proposer's
drafts, the speculator's limit at the answer's end, the prefix that holds), and
ops/bench/spec_table.py pairs each speculative run with the run without of the same suffix."""

from __future__ import annotations

import importlib
import json

import pytest

from tests.ops.test_gpu_runbook import REPO


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "ops/bench"))  # scripts, not a package
    return importlib.import_module


def test_a_copied_answer_takes_every_draft_until_its_end(bench):
    """The answer copies the prompt's first 20 tokens and stops at max_tokens: the first pass has
    no 2-gram to match (the answer's first token follows the prompt's end), then every pass
    verifies k = 4 drafts that all hold, and the last only the 2 max_tokens leaves."""
    replay = bench("spec_replay")
    prompt, answer = [*range(1, 21), 100, 101], list(range(1, 21))
    for policy in ("fixed", "oracle"):
        row = {"prompt": prompt, "output": answer, "max_tokens": 20}
        spent, passes, drafted, accepted = replay.replay([row], 4, policy, lambda d: 1 + 0.2 * d)
        assert (passes, drafted, accepted) == (5, 14, 14)  # passes drawing 2; 3-7; 8-12; 13-17; 18-20
        assert spent == [pytest.approx(1 + 3 * 1.8 + 1.4)]


def test_the_oracle_verifies_only_what_holds_and_costs_least(bench):
    replay = bench("spec_replay")
    # An answer that copies, then writes its own words, then copies again.
    prompt = [*range(1, 41), 100, 101]
    answer = [*range(1, 15), 200, 201, 202, *range(18, 41)]
    cost = {
        policy: replay.replay([{"prompt": prompt, "output": answer}], 8, policy, lambda d: 1 + 0.2 * d)
        for policy in ("adaptive", "fixed", "oracle")
    }
    spent = {policy: sum(result[0]) for policy, result in cost.items()}
    assert cost["oracle"][2] == cost["oracle"][3]  # drafted == accepted
    assert cost["fixed"][2] > cost["fixed"][3]  # the copy's edit costs fixed drafts
    assert spent["oracle"] < spent["adaptive"] and spent["oracle"] < spent["fixed"]
    assert replay.held([5, 6, 9], [4, 5, 6, 7], 1) == 2


def test_an_answer_that_ended_on_its_own_is_drafted_past_as_the_engine_does(bench):
    """Without max_tokens (256 by default) the engine cannot know the answer's end: the last
    pass drafts past it, and the drafts past the end do not hold."""
    replay = bench("spec_replay")
    _, passes, drafted, accepted = replay.replay(
        [{"prompt": [*range(1, 21), 100, 101], "output": list(range(1, 21))}], 4, "fixed", lambda d: 1.0
    )
    assert (passes, drafted, accepted) == (5, 16, 15)  # the last pass drafts 18, 19, 20, 100: three hold


def test_each_speculative_run_is_measured_against_the_plain_run_of_its_suffix(bench, tmp_path, capsys):
    table = bench("spec_table")
    for name, tok_s in (("none-r1a", 50.0), ("k8-r1a", 80.0), ("k8-r1b", 90.0), ("none-r1b", 60.0), ("none", 40.0), ("k4", 70.0)):
        result = {"output_throughput": tok_s, "median_tpot_ms": 10.0, "median_ttft_ms": 100.0}
        (tmp_path / f"grounded-{name}-c1.json").write_text(json.dumps(result))
    table.main(tmp_path)
    rows = {line.split("|")[3].strip(): line.split("|")[5].strip() for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows == {"k4": "1.75x", "k8-r1a": "1.60x", "k8-r1b": "1.50x", "none": "1.00x", "none-r1a": "1.00x", "none-r1b": "1.00x"}
