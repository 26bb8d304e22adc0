"""ops/gpu/ab_race.py, rehearsed without a GPU: this checkout's daemon raced against another tree's,
the daemon run in the other tree (race.RaceConfig.daemon_tree; from here, `python -m conveyor` would
import this checkout whatever PYTHONPATH says) and the client this one's."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time

import pytest

from tests.ops.test_gpu_runbook import REPO, sharegpt


def test_the_daemon_runs_from_the_tree_it_is_given(tmp_path, monkeypatch):
    """A tree whose `python -m conveyor` only says where it is: the daemon is that one, not this
    checkout's (which would start and serve)."""
    monkeypatch.syspath_prepend(str(REPO / "ops/gpu"))
    race = importlib.import_module("race")  # a script beside ops/gpu/run.sh, not a package
    (tmp_path / "tree" / "conveyor").mkdir(parents=True)
    (tmp_path / "tree" / "conveyor" / "__init__.py").write_text("")
    (tmp_path / "tree" / "conveyor" / "__main__.py").write_text("print('the other tree'); raise SystemExit(3)\n")
    deadline = time.monotonic() + 60
    tree = tmp_path / "tree"
    config = race.RaceConfig("other", tmp_path, ("--device", "cpu"), tmp_path / "x.json", 1, tmp_path, deadline, 30, 5, tree)
    with pytest.raises(race.RaceFailed) as failed:
        race.measure(config)
    assert "the other tree" in failed.value.record["output_tail"]


@pytest.mark.slow  # three daemons on an emulated GPU, the checkpoint first: half a minute (-m slow)
def test_ab_race_races_both_trees_emulated(tmp_path):
    work, out, base = tmp_path / "work", tmp_path / "out", tmp_path / "baseline"
    step = ["bash", "ops/gpu/run.sh", "checkpoint", "--emulated", "--out", str(out), "--work", str(work)]
    subprocess.run(step + ["--resume", str(tmp_path / "none.json")], cwd=REPO, check=True, capture_output=True, timeout=120)
    base.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    (base / "commit.txt").write_text("0123456789abcdef\n")
    cmd = [sys.executable, "ops/gpu/ab_race.py", "--emulated", "--model", str(work / "tiny-emulated"), "--baseline", str(base)]
    cmd += ["--rounds", "1", "--num-prompts", "6", "--warmup-prompts", "2", "--out", str(out)]
    cmd += ["--sharegpt", str(sharegpt(tmp_path / "sharegpt.json")), "--budget-s", "200"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((out / "ab-race.json").read_text())
    assert report["commits"]["baseline"] == "0123456789" and report["failures"] == []
    assert report["workload"] == "sharegpt-500" and all(run["workload"] == "sharegpt-500" for run in report["runs"]["this"])
    assert [len(report["runs"][side]) for side in ("this", "baseline")] == [1, 1]  # the warm-up is not among them
    assert all(run["completed"] == 6 for runs in report["runs"].values() for run in runs)
    assert report["ratios"]["req_per_s"] > 0 and "| req_per_s |" in done.stdout
    assert (out / "ab-race" / "warm-up.daemon.log").is_file()
