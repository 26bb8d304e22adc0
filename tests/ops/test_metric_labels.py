"""Labelled metrics show a 0 series for every known label value from the first scrape.

Run in a fresh interpreter (with and without prometheus-client's multiprocess directory, as the
stages run) so no other test's events hide a missing zero.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from conveyor.stages import metrics
from conveyor.wire.messages import FinishReason

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRAPE = """
import sys
import conveyor.stages.ingress.errors  # the ingress imports it: it adds the error types
from prometheus_client import generate_latest
from conveyor.stages.ingress.metrics_route import make_registry
sys.stdout.write(generate_latest(make_registry()).decode())
"""


def scrape(env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", SCRAPE], capture_output=True, text=True, env=env, check=True)
    return done.stdout


def zero_series_missing(text: str) -> list[str]:
    from conveyor.stages.ingress.errors import _TYPES, SERVER_ERROR

    wanted = [f'conveyor_errors_total{{type="{t}"}} 0.0' for t in set(_TYPES.values()) | {SERVER_ERROR}]
    wanted += [f'conveyor_requests_finished_total{{finish_reason="{r.openai}"}} 0.0' for r in FinishReason]
    wanted += [f'conveyor_stage_latency_seconds_count{{stage="{hop}"}} 0.0' for hop in metrics.STAGE_HOPS]
    return [line for line in wanted if line not in text.splitlines()]


def test_a_fresh_process_shows_zero_series():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    assert zero_series_missing(scrape(env)) == []


def test_the_multiprocess_view_shows_zero_series(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    assert zero_series_missing(scrape(env)) == []


def test_every_recorded_stage_hop_is_a_known_label():
    """A hop recorded under a new name would have no zero series: name it in STAGE_HOPS."""
    recorded = set()
    for path in (ROOT / "stages").rglob("*.py"):
        recorded |= set(re.findall(r'stage_latency\.labels\("([a-z_]+)"\)', path.read_text()))
    assert recorded and recorded <= set(metrics.STAGE_HOPS)
