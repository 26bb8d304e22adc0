"""conveyor bench's metrics on a hand-made schedule: throughputs, TTFT, ITL, TPOT and end-to-end
percentiles, and the effective throughput under each SLA."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conveyor.bench.client import RequestResult
from conveyor.bench.results import compute


def _result(ttft: float, gaps: list[float], prompt_len: int = 100, start: float = 0.0) -> RequestResult:
    times = list(start + ttft + np.concatenate([[0.0], np.cumsum(gaps)]))
    return RequestResult(prompt_len, len(times), start, end=times[-1] + 0.001, chunk_times=times, chunk_tokens=[1] * len(times))


def test_metrics_on_a_hand_made_schedule():
    results = [
        _result(0.1, [0.01, 0.01, 0.01]),
        _result(0.2, [0.02, 0.02, 0.02]),
        _result(0.3, [0.03, 0.03, 0.03]),
        _result(0.4, [0.6, 0.6, 0.6], prompt_len=512),  # generation at 1.7 tokens/s misses every SLA
        RequestResult(50, 0, 0.0, end=0.5, error="HTTP 500: boom"),
    ]
    m = compute(results, 10.0, label="known", num_clients=4)
    assert m.num_completed == 4 and m.num_failed == 1 and m.errors == {"HTTP 500: boom": 1}
    assert m.request_throughput == pytest.approx(0.4)
    assert m.input_throughput == pytest.approx((3 * 100 + 512) / 10)
    assert m.output_throughput == pytest.approx(16 / 10)
    assert m.ttft["mean"] == pytest.approx(0.25) and m.ttft["p50"] == pytest.approx(0.25)
    assert m.ttft["p90"] == pytest.approx(0.37)  # linear interpolation between 0.3 and 0.4
    gaps = [0.01] * 3 + [0.02] * 3 + [0.03] * 3 + [0.6] * 3
    assert m.itl["mean"] == pytest.approx(np.mean(gaps)) and m.itl["p50"] == pytest.approx(0.025)
    assert m.itl["p99"] == pytest.approx(0.6)
    assert m.tpot["p50"] == pytest.approx(0.025)
    assert m.e2e["mean"] == pytest.approx(np.mean([0.131, 0.261, 0.391, 2.201]))
    # TTFT within prompt / 512 tokens/s: 100 tokens allow 0.195 s, so the first request alone
    # meets it among the 100-token ones; the 512-token one fails on its generation rate.
    assert m.effective_throughput == {2.0: pytest.approx(0.1), 4.0: pytest.approx(0.1), 6.0: pytest.approx(0.1)}
    as_json = json.loads(json.dumps(m.as_dict()))
    assert as_json["effective_throughput"]["4"] == pytest.approx(0.1)
