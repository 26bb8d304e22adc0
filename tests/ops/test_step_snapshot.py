"""ops/bench/step_snapshot.py's compare: two dumps are the same only bit for bit (a one-ulp logit,
a sign of zero, one token id), NaN matches NaN, and each difference names its item, request and
field; the exit status is 1 on any difference."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.ops.test_gpu_runbook import REPO


@pytest.fixture
def snapshot(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "ops/bench"))  # scripts, not a package
    return importlib.import_module("step_snapshot")


def _items() -> dict:
    logits = torch.tensor([[0.5, -1.25, float("nan")], [2.0, 0.0, 3.0]])
    request = {"choices": [{"ids": [5, 6, 7], "text": "abc", "cum_lp": -1.5, "lp": None}], "embedding": None, "cached": 0}
    return {
        "logits/llama/float32": logits,
        "plain/llama/float32": {"requests": {"0:greedy": request, "1:rich@a": request}, "num_steps": 4},
    }


def _dump(path, items) -> None:
    torch.save({"meta": {"conveyor": "x", "label": "x", "torch": "x", "threads": 2}, "items": items}, path)


def test_equal_dumps_pass_and_nan_matches_nan(snapshot, tmp_path, capsys):
    _dump(tmp_path / "a.pt", _items())
    _dump(tmp_path / "b.pt", _items())
    assert snapshot.compare(tmp_path / "a.pt", tmp_path / "b.pt") == 0
    out = capsys.readouterr().out
    assert "same logits/llama/float32" in out and "2 same, 0 different" in out


@pytest.mark.parametrize("change", ["ulp", "signed_zero", "token", "missing"])
def test_any_difference_fails_and_is_named(snapshot, tmp_path, capsys, change):
    changed = _items()
    if change == "ulp":
        changed["logits/llama/float32"][1, 0] = torch.nextafter(torch.tensor(2.0), torch.tensor(3.0))
    elif change == "signed_zero":
        changed["logits/llama/float32"][1, 1] = -0.0
    elif change == "token":
        plain = changed["plain/llama/float32"]
        plain["requests"]["1:rich@a"] = {
            **plain["requests"]["1:rich@a"],
            "choices": [{"ids": [5, 6, 8], "text": "abd", "cum_lp": -1.5, "lp": None}],
        }
    else:
        del changed["plain/llama/float32"]
    _dump(tmp_path / "a.pt", _items())
    _dump(tmp_path / "b.pt", changed)
    assert snapshot.compare(tmp_path / "a.pt", tmp_path / "b.pt") == 1
    out = capsys.readouterr().out
    expected = {
        "ulp": "DIFF logits/llama/float32: 1 leaves differ",
        "signed_zero": "DIFF logits/llama/float32: 1 leaves differ",
        "token": "DIFF plain/llama/float32: 2 leaves differ (fields: ids, text; requests 1:rich@a)",
        "missing": "DIFF plain/llama/float32: only in A",
    }[change]
    assert expected in out, out
    assert "1 different" in out
    if change == "ulp":
        assert "1 of 6 elements in 1 rows differ, max |d| 2.38e-07" in out
