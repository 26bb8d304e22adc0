"""Observability end to end: a real Prometheus scrapes the daemon on loopback while load runs,
then every PromQL expression of the dashboard and of the alert rules must return a series; the
/metrics text passes `promtool check metrics`; the GPU bubble fraction lies in (0, 1) and rises
when the worker is made to wait for its host."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.conftest import Daemon, free_port

OPS = Path(__file__).resolve().parents[2] / "ops"
SLOW_SCHEDULER = Path(__file__).resolve().parent / "slow_scheduler"  # its sitecustomize delays each plan
needs_prometheus = pytest.mark.skipif(
    not (shutil.which("prometheus") and shutil.which("promtool")), reason="Debian's prometheus package is not installed"
)


def drive_load(daemon: Daemon, seconds: float = 6.0) -> None:
    """Everything the dashboard shows: finished requests, errors, 429s, aborts, prefix hits,
    preemptions (the daemon runs with a small pool and queue)."""
    url = f"{daemon.url}/v1/completions"
    shared = "A shared prefix that several requests repeat word for word. " * 4

    def one(i: int) -> None:
        body: dict[str, Any] = {"prompt": shared + f"request {i}", "max_tokens": 24 + i % 16, "ignore_eos": True, "stream": i % 2 == 0}
        _ = requests.post(url, json=body, timeout=60).content  # read the whole body, streamed or not

    deadline = time.monotonic() + seconds
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        i = 0
        while time.monotonic() < deadline:
            list(pool.map(one, range(i, i + 12)))
            i += 12
    requests.post(url, json={"prompt": "x", "temperature": -1}, timeout=10)  # an error
    with requests.post(url, json={"prompt": "go", "max_tokens": 500, "stream": True}, stream=True, timeout=30) as r:
        next(r.iter_lines())  # then hang up: an abort


@pytest.fixture(scope="module")
def loaded_daemon(daemon_factory):
    daemon = daemon_factory("--num-kv-blocks", "40", "--max-num-seqs", "4", "--max-queued-requests", "4")
    drive_load(daemon)
    return daemon


# Metrics only a daemon with several engines records (the router's), or one that speculates: the
# default deployment has neither, and its panels on them fall back to a 0 (`or vector(0)`) so that
# they show data there too. tests/daemon/test_spec_daemon.py reads speculation's from a daemon that
# speculates, without the fallback; tests/daemon/test_data_parallel.py the router's.
SPECULATION_ONLY = ("conveyor_spec_decode_",)
FALLBACK = re.compile(r"\s+or\s+vector\([0-9.]+\)")


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) for every query of every panel, those in collapsed rows too."""
    found = []

    def walk(panels):
        for panel in panels:
            found.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(json.loads((OPS / "grafana/dashboards/conveyor.json").read_text())["panels"])
    return found


def expressions(*, speculation: bool = False) -> list[str]:
    """The dashboard's and the alert rules' expressions, which a one-engine daemon must feed, or
    with `speculation` those of speculative decoding without their fallback."""
    found = [expr for _, expr in dashboard_exprs()]
    for group in yaml.safe_load((OPS / "prometheus/alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            # An alert's condition is false while all is well; its expression must still have data.
            found.append(re.sub(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.e+-]+\s*$", "", rule["expr"].strip()))
    if speculation:
        return sorted(FALLBACK.sub("", e) for e in set(found) if any(name in e for name in SPECULATION_ONLY))
    return sorted(set(found))


def test_every_panel_has_a_series_on_one_engine(loaded_daemon):
    """The default deployment (one engine, no speculation) exports a series for every metric a
    panel's query names, or the query falls back to a 0: no panel says "no data" there. (Whether
    each query's value is a number, not NaN, takes a Prometheus: the slow test below.)"""
    from tests.ops.test_ops_assets import promql_names

    text = requests.get(f"{loaded_daemon.url}/metrics", timeout=10).text
    exported = {"up"} | {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    without = [
        (title, expr) for title, expr in dashboard_exprs() if not FALLBACK.search(expr) and not set(promql_names(expr)[0]) <= exported
    ]
    assert not without, without


@pytest.mark.slow  # a minute of Prometheus scraping load (-m slow)
@needs_prometheus
def test_every_dashboard_and_alert_expression_has_data(loaded_daemon, tmp_path):
    assert not expressions_without_data(loaded_daemon, expressions(), tmp_path)


def expressions_without_data(daemon: Daemon, exprs: list[str], tmp_path: Path) -> list[str]:
    """A Prometheus of its own scrapes `daemon` every second while drive_load runs, for up to a
    minute: the expressions that still return no series (or only NaN)."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "conveyor", "static_configs": [{"targets": [f"127.0.0.1:{daemon.port}"]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        api = f"http://127.0.0.1:{port}/api/v1/query"
        # Keep load going while Prometheus collects enough samples for rate() over [1m].
        deadline = time.monotonic() + 60
        missing = list(exprs)
        while missing and time.monotonic() < deadline:
            drive_load(daemon, seconds=2)
            still = []
            for expr in missing:
                try:
                    result = requests.get(api, params={"query": expr}, timeout=5).json()
                except requests.ConnectionError:
                    still.append(expr)
                    continue
                assert result["status"] == "success", (expr, result)
                if not [s for s in result["data"]["result"] if s["value"][1] not in ("NaN",)]:
                    still.append(expr)
            missing = still
        return missing
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=10)


@needs_prometheus
def test_promtool_accepts_the_metrics_text(loaded_daemon):
    text = requests.get(f"{loaded_daemon.url}/metrics", timeout=10).text
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def bubble_fraction(daemon: Daemon) -> float:
    idle0, busy0 = daemon.metric("conveyor_worker_idle_seconds_total"), daemon.metric("conveyor_worker_busy_seconds_total")
    drive_load(daemon, seconds=4)
    idle = daemon.metric("conveyor_worker_idle_seconds_total") - idle0
    busy = daemon.metric("conveyor_worker_busy_seconds_total") - busy0
    return idle / (idle + busy)


@pytest.mark.slow  # two daemons under load, 30 s
def test_the_bubble_rises_when_the_worker_waits_for_its_host(daemon_factory, monkeypatch):
    steady = bubble_fraction(daemon_factory("--num-kv-blocks", "256"))
    # The delay (0.1 s) is longer than a step of this load on a slow CPU (~30-60 ms without
    # AVX-512), so async scheduling cannot hide it behind the step in flight.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SLOW_SCHEDULER), os.environ.get("PYTHONPATH")])))
    delayed = bubble_fraction(daemon_factory("--num-kv-blocks", "256"))
    assert 0 < steady < 1 and 0 < delayed < 1
    assert delayed > steady + 0.1, (steady, delayed)
