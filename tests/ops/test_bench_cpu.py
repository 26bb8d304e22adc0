"""`conveyor bench cpu`: which processes count as the daemon's, and the figures it derives."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.bench.stage_cpu import TICKS, HostCost, process_cpu, serves_port, stage_of


def fake_proc(root: Path, pid: int, ppid: int, cmdline: list[str], ticks: int) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "cmdline").write_bytes("\0".join(cmdline).encode() + b"\0")
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    (d / "stat").write_text(f"{pid} (py thon) S {ppid} 0 0 0 0 0 0 0 0 0 {ticks} {ticks} 0 0 20 0 1 0\n")


def test_stage_names_come_from_the_command_line():
    assert stage_of(["python", "-m", "conveyor.stages", "worker", "0", "/run/config.json"]) == "worker"
    assert stage_of(["python", "-m", "conveyor", "serve", "--port", "9"]) == "launcher"
    assert stage_of(["/usr/bin/conveyor", "serve"]) == "launcher"
    assert stage_of(["python", "-m", "conveyor", "bench", "serve"]) is None
    assert stage_of(["python", "-c", "pass"]) is None


def test_only_the_daemon_on_the_port_counts(tmp_path):
    fake_proc(tmp_path, 10, 1, ["python", "-m", "conveyor", "serve", "--port", "8011"], 5)
    fake_proc(tmp_path, 11, 10, ["python", "-m", "conveyor.stages", "worker", "0", "c"], 100)
    fake_proc(tmp_path, 12, 10, ["python", "-m", "conveyor.stages", "ingress", "0", "c"], 50)
    fake_proc(tmp_path, 20, 1, ["python", "-m", "conveyor", "serve", "--port=9000"], 7)  # another daemon
    fake_proc(tmp_path, 21, 20, ["python", "-m", "conveyor.stages", "worker", "0", "c"], 999)
    (tmp_path / "self").mkdir()
    found = process_cpu(8011, tmp_path)
    assert found == {10: ("launcher", 10 / TICKS), 11: ("worker", 200 / TICKS), 12: ("ingress", 100 / TICKS)}
    assert set(process_cpu(9000, tmp_path)) == {20, 21}
    assert serves_port(["conveyor", "serve"], 8000) and not serves_port(["conveyor", "serve"], 8011)


def test_per_token_figures_and_the_bubble():
    cost = HostCost(
        wall_s=10.0, output_tokens=20_000, stage_cpu_s={"ingress": 0.5, "worker": 0.3}, client_cpu_s=0.4, busy_s=9.0, idle_s=1.0
    )
    figures = cost.as_dict()
    assert figures["host_us_per_output_token"] == pytest.approx(40.0)
    assert figures["stage_ms_per_1000_output_tokens"] == pytest.approx({"ingress": 25.0, "worker": 15.0})
    assert figures["client_ms_per_1000_output_tokens"] == pytest.approx(20.0) and figures["bubble"] == pytest.approx(0.1)
    assert "| all stages (the host) | 0.80 | 40.0 |" in cost.table()
