"""`conveyor bench cpu -- CLIENT...`: the host's cost of a run, per stage and per output token.

Runs the client command (any benchmark client: conveyor's, vLLM's) and reads, before and after:
- the CPU time (user + system, /proc/PID/stat) of the daemon's processes, summed by stage
  (`python -m conveyor.stages STAGE ...`), and of its launcher (`conveyor serve`): the launcher
  serving --base-url's port and its children (another daemon on the machine is left out);
- the client's own CPU time (its process tree's, from the kernel's accounting of waited-for
  children);
- from the server's /metrics: the output tokens generated and the worker's busy and idle device
  time (the bubble: idle / (busy + idle)); on an emulated device, the CPU its calibration says a
  GPU host's driver would have spent (gpu/emulated/stream.py), added to the worker's and shown
  apart as `emulated_host_cpu_s`.
Each stage's CPU is reported in seconds and in ms per 1,000 output tokens; their sum, the host's
cost, also in us per output token. Only processes alive at both reads count wholly; one started
during the run (a restart) counts from its start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from conveyor.bench.server_metrics import sample_totals

TICKS = os.sysconf("SC_CLK_TCK")
COUNTERS = (
    "conveyor_generation_tokens_total",
    "conveyor_worker_busy_seconds_total",
    "conveyor_worker_idle_seconds_total",
    "conveyor_worker_emulated_host_cpu_seconds_total",
)


def stage_of(cmdline: list[str]) -> str | None:
    """`python -m conveyor.stages worker 0 ...` -> "worker"; the launcher -> "launcher"; else None."""
    if "conveyor.stages" in cmdline:
        i = cmdline.index("conveyor.stages")
        return cmdline[i + 1] if i + 1 < len(cmdline) else None
    for i, arg in enumerate(cmdline[:-1]):
        if (arg == "conveyor" or arg.endswith("/conveyor")) and cmdline[i + 1] == "serve":
            return "launcher"
    return None


def serves_port(cmdline: list[str], port: int) -> bool:
    """Whether a launcher's command line serves `port` (`--port N`, `--port=N`, or none and 8000)."""
    for i, arg in enumerate(cmdline):
        if arg == "--port" and i + 1 < len(cmdline):
            return cmdline[i + 1] == str(port)
        if arg.startswith("--port="):
            return arg.split("=", 1)[1] == str(port)
    return port == 8000


def process_cpu(port: int, proc: Path = Path("/proc")) -> dict[int, tuple[str, float]]:
    """pid -> (stage, CPU seconds so far) of the daemon serving `port`: its launcher and the
    stage processes it started."""
    found: dict[int, tuple[str, int, float, list[str]]] = {}  # pid -> (stage, parent, cpu, cmdline)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        stage = stage_of(cmdline)
        if stage is not None:
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
            found[int(entry.name)] = (stage, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, cmdline)  # utime, stime
    launchers = {pid for pid, (stage, _, _, cmdline) in found.items() if stage == "launcher" and serves_port(cmdline, port)}
    return {pid: (stage, cpu) for pid, (stage, parent, cpu, _) in found.items() if pid in launchers or parent in launchers}


def server_counters(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        totals = sample_totals(resp.read().decode())
    return {name: totals.get(name, 0.0) for name in COUNTERS}


@dataclasses.dataclass
class HostCost:
    wall_s: float
    output_tokens: float
    stage_cpu_s: dict[str, float]
    client_cpu_s: float
    busy_s: float
    idle_s: float
    emulated_host_cpu_s: float = 0.0  # within stage_cpu_s["worker"]: modelled, not spent here

    @property
    def host_cpu_s(self) -> float:
        return sum(self.stage_cpu_s.values())

    @property
    def bubble(self) -> float | None:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else None

    def per_1000(self, seconds: float) -> float:
        """ms of CPU per 1,000 output tokens."""
        return 1e6 * seconds / self.output_tokens if self.output_tokens else float("nan")

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "host_cpu_s": self.host_cpu_s,
            "host_us_per_output_token": 1e3 * self.per_1000(self.host_cpu_s) / 1000,
            "stage_ms_per_1000_output_tokens": {s: self.per_1000(c) for s, c in self.stage_cpu_s.items()},
            "client_ms_per_1000_output_tokens": self.per_1000(self.client_cpu_s),
            "bubble": self.bubble,
        }

    def table(self) -> str:
        rows = [f"| {stage} | {cpu:.2f} | {self.per_1000(cpu):.1f} |" for stage, cpu in sorted(self.stage_cpu_s.items())]
        bubble = "n/a" if self.bubble is None else f"{100 * self.bubble:.1f}%"
        return "\n".join(
            [
                f"{self.output_tokens:.0f} output tokens in {self.wall_s:.2f} s; bubble {bubble} "
                f"(device busy {self.busy_s:.2f} s, idle {self.idle_s:.2f} s)"
                + (f"; the worker's includes {self.emulated_host_cpu_s:.2f} s EMULATED host CPU" if self.emulated_host_cpu_s else ""),
                "| process | CPU s | ms per 1,000 output tokens |",
                "|---|---:|---:|",
                *rows,
                f"| all stages (the host) | {self.host_cpu_s:.2f} | {self.per_1000(self.host_cpu_s):.1f} |",
                f"| client | {self.client_cpu_s:.2f} | {self.per_1000(self.client_cpu_s):.1f} |",
            ]
        )


def measure(command: list[str], base_url: str) -> tuple[HostCost, int]:
    """Run `command` and measure around it; (the cost, its exit status)."""
    port = urllib.parse.urlsplit(base_url).port or 80
    counters0, cpu0 = server_counters(base_url), process_cpu(port)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    status = subprocess.run(command).returncode
    wall = time.perf_counter() - started
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu1, counters1 = process_cpu(port), server_counters(base_url)
    stages: dict[str, float] = {}
    for pid, (stage, seconds) in cpu1.items():
        before = cpu0.get(pid)
        stages[stage] = stages.get(stage, 0.0) + seconds - (before[1] if before and before[0] == stage else 0.0)
    client = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    delta = {name: counters1[name] - counters0[name] for name in COUNTERS}
    modelled = delta[COUNTERS[3]]
    if modelled:
        stages["worker"] = stages.get("worker", 0.0) + modelled
    cost = HostCost(wall, delta[COUNTERS[0]], stages, client, delta[COUNTERS[1]], delta[COUNTERS[2]], modelled)
    return cost, status


def main(args: argparse.Namespace) -> int:
    command = args.client[1:] if args.client[:1] == ["--"] else args.client
    if not command:
        print("conveyor: error: bench cpu needs a client command after --", file=sys.stderr)
        return 2
    cost, status = measure(command, args.base_url.rstrip("/"))
    print(cost.table())
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, **cost.as_dict()}, indent=2) + "\n")
    return status
