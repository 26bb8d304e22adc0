"""The GPU runs' records (ops/gpu/runs/*.json, issue 48's schema) and ops/gpu/run_record.py, which
writes the next one from a session's reports."""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ops" / "gpu"))

run_record = importlib.import_module("run_record")  # a script beside ops/gpu/run.sh, not a package

RECORDS = sorted((ROOT / "ops" / "gpu" / "runs").glob("*.json"))


def test_there_is_a_record_for_each_of_the_three_h200_runs():
    assert [p.name for p in RECORDS] == [
        "2026-11-27-080cdcf-h200.json",
        "2026-11-27-ba23234-h200.json",
        "2026-11-27-f904d43-h200.json",
    ]


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.name)
def test_every_record_holds_the_schema_and_is_named_for_itself(path):
    record = json.loads(path.read_text())
    assert run_record.check(record) == []
    assert run_record.file_name(record) == path.name and record["device"] == "NVIDIA H200"
    # The old runs raced the runbook's generated BPE, not sharegpt-500.
    assert {race["workload"] for race in record["races"]} == {"runbook-bpe4096-500"}


def test_the_check_finds_what_is_wrong():
    record = json.loads(RECORDS[0].read_text())
    assert run_record.check(record) == []
    broken = copy.deepcopy(record)
    broken["commit"] = "HEAD"
    del broken["races"][0]["itl_p50_ms"]
    broken["gemms"][0]["kind"] = "int3"
    broken["races"][0]["req_s"] = "fast"
    problems = run_record.check(broken)
    assert any("commit 'HEAD'" in p for p in problems) and any("no itl_p50_ms" in p for p in problems)
    assert any("gemm 0" in p for p in problems) and any("req_s 'fast'" in p for p in problems)
    del broken["gemms"]
    assert any("no gemms" in p for p in run_record.check(broken))


def race_figures(req_s: float) -> dict:
    return {
        "ok": True,
        "completed": 500,
        "failed": 0,
        "req_per_s": req_s,
        "output_tok_per_s": 8000.0,
        "ttft_p50_ms": 900.0,
        "ttft_p99_ms": 9000.0,
        "itl_p50_ms": 13.7,
        "itl_p99_ms": 50.0,
        "tpot_p50_ms": 22.0,
        "bubble": 0.05,
        "host_us_per_output_token": 178.0,
        "stage_ms_per_1000_output_tokens": {"worker": 106.0},
    }


def test_a_sessions_reports_make_a_record_that_holds_the_schema(tmp_path):
    runbook = {
        "device": "NVIDIA H200",
        "commit": "1234abcd (as packed)",
        "steps": {
            "setup": {"figures": {"torch": "2.11.0", "triton": "3.6.0"}},
            "kernels": {
                "figures": {
                    "device": "NVIDIA H200",
                    "qkv 6144x4096 M=1 bf16": "21.5 us (1200 GB/s; eager 22.1 us; estimate 11 us)",
                    "o 4096x4096 M=16 W4A16 g128": {"graph_us": 27.6},
                    "o 4096x4096 M=64 FP8 W8A8": "nan us (...)",
                }
            },
            "race-k1": {
                "figures": {"K = 1, CUDA graphs": {**race_figures(19.0), "workload": "sharegpt-500"}, "K = 1, eager": {"ok": False}}
            },
        },
    }
    ab = {
        "commits": {"this": "1234abcd", "baseline": "f904d43"},
        "runs": {"this": [race_figures(19.5)], "baseline": [race_figures(19.2)]},
    }
    (tmp_path / "gpu-runbook.json").write_text(json.dumps(runbook))
    (tmp_path / "ab-race.json").write_text(json.dumps(ab))
    (tmp_path / "step.log").write_text('device: NVIDIA H200\n{"device": "NVIDIA H200", "layers": 4, "results": []}\n')
    args = ["--runbook", str(tmp_path / "gpu-runbook.json"), "--ab-race", str(tmp_path / "ab-race.json")]
    args += ["--step", str(tmp_path / "step.log"), "--date", "2027-01-02", "--out", str(tmp_path / "runs")]
    assert run_record.main(args) == 0
    record = json.loads((tmp_path / "runs" / "2027-01-02-1234abc-h200.json").read_text())
    assert run_record.check(record) == [] and record["baseline"] == "f904d43" and record["step"]["layers"] == 4
    assert [(r["commit"], r["req_s"], r["workload"]) for r in record["races"]] == [
        ("1234abc", 19.0, "sharegpt-500"),
        ("1234abc", 19.5, "sharegpt-500"),
        ("f904d43", 19.2, "sharegpt-500"),
    ]
    assert [(g["layer"], g["m"], g["kind"], g["us"]) for g in record["gemms"]] == [("qkv", 1, "bf16", 21.5), ("o", 16, "w4a16", 27.6)]
