"""ops/gpu/column_bench.py (issue 48: q/k/v and gate/up apart or stacked) rehearsed under Triton's
interpreter on shapes cut to 1/64 (its times mean nothing): every group, M and path the GPU will
time has a row, and both forms' outputs agreed (the script asserts it before timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_column_benchmark_runs_every_case():
    done = subprocess.run([sys.executable, "ops/gpu/column_bench.py", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures.pop("device").startswith("no CUDA device")
    assert len(figures) == 2 * 3 * 3  # groups x M x (bf16, W4A16, W8A16); FP8 needs a GPU
    assert all(row.startswith("apart ") and "stacked" in row for row in figures.values())
    assert {key.split()[0] for key in figures} == {"qkv", "gate_up"}
