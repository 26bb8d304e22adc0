"""ops/gpu/attention_bench.py (issue 48) rehearsed without a GPU: its --dry-run runs every case and
candidate under Triton's interpreter on tiny shapes and checks each output against the torch
reference; the roofline arithmetic is checked at the GPU's shapes. Times here mean nothing; what
waits for a GPU (graph replay, FlashInfer) is skipped with its reason in the output.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_the_dry_run_times_and_checks_every_candidate():
    done = subprocess.run(
        [sys.executable, "ops/gpu/attention_bench.py", "--dry-run", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    cases = figures["cases"]
    assert all(f["marginal_tb_s"] > 0 for f in figures["fits"])  # interpreter times: present where they grow
    assert {(c["kind"], c["rows"], c["context"]) for c in cases} == {
        (k, r, c) for k in ("decode", "mixed") for r in (2, 3) for c in (20, 40)
    }
    for case in cases:
        by_name = {r["candidate"]: r for r in case["candidates"]}
        timed = [r for r in case["candidates"] if "skipped" not in r]
        assert all(r["ok"] and r["us"] > 0 for r in timed), case
        assert "triton (backend's pick)" in {r["candidate"] for r in timed}
        assert "torch SDPA, dense K/V (sanity)" in {r["candidate"] for r in timed}
        assert by_name["flashinfer decode"]["skipped"] == "no CUDA device"
        split_k = by_name["triton, split-K 4"]
        assert ("skipped" in split_k) == (case["kind"] == "mixed")  # split-K is forced on decode steps only
        assert case["tokens"] == case["rows"] + (12 if case["kind"] == "mixed" else 0)


def test_the_roofline_counts_every_byte_once(monkeypatch):
    """64 decode rows at 512 tokens, Llama-3-8B's heads in bf16, against an H100's 3.35 TB/s."""
    monkeypatch.syspath_prepend(str(REPO / "ops/gpu"))
    bench = importlib.import_module("attention_bench")  # a script beside kernel_bench.py, not a package
    shape = bench.GPU_SHAPE
    query_lens, seq_lens = bench.Case("decode", 64, 512).lens(shape)
    q = torch.empty(64, shape.num_heads, shape.head_dim, dtype=shape.dtype)
    step = bench.Step(q, None, None, None, None, query_lens, seq_lens, 1.0)
    roof = bench.roofline(step, shape, bench.DEVICES["h100"])
    kv = 64 * 512 * 2 * 8 * 128 * 2  # rows x keys x (K, V) x Hkv x D x bytes
    assert roof["bytes"] == kv + 2 * 64 * 32 * 128 * 2 + 64 * 32 * 4  # + q and out + 32 table entries a row
    assert roof["bound"] == "bytes"
    assert abs(roof["roofline_us"] - roof["bytes"] / 3.35e12 * 1e6) < 1e-9
    mixed_q, mixed_s = bench.Case("mixed", 64, 512).lens(shape)
    assert mixed_q[-1] == mixed_s[-1] == 512  # one fresh chunk after the decode rows
