"""One race configuration, measured: a fresh `conveyor serve`, the ShareGPT burst, the daemon stopped.

`measure(config)` starts the daemon (its log to a file, in its own process group so that every
stage can be stopped together), waits for GET /health, and runs conveyor's client inside
`conveyor bench cpu`, which reads the worker's busy and idle counters from /metrics before and
after (the bubble: idle / (busy + idle) over the run) and each stage's CPU from /proc. It then
sends SIGTERM (the daemon drains and exits) and returns the figures: req/s, output tok/s, TTFT
p50/p99, TPOT p50 and mean, ITL p50/p99 (ms; from bench serve's result JSON, see
conveyor/bench/results.py), the bubble, CPU per stage, the start-up time and the worker's
backend and CUDA-graph log lines.
A failure (the daemon exits or never answers, the client fails, a request fails, the call's
time runs out) raises RaceFailed with the exit status and the last lines of both logs.
Stdlib only: conveyor runs in the subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TAIL_LINES = 40
# The worker's start-up lines worth keeping: backend, CUDA graphs (probe and capture), KV pool, emulation.
LOG_LINES = re.compile(r"attention backend:|CUDA graphs|KV pool:|EMULATED device")
CAPTURED = re.compile(r"captured (\d+) decode CUDA graphs \(batch sizes (\d+)\.\.(\d+)\) in ([\d.]+) s, (\d+) MiB")


@dataclasses.dataclass(frozen=True)
class RaceConfig:
    label: str  # "K = 1, CUDA graphs"
    model: Path
    serve_args: tuple[str, ...]  # device, backend, --num-scheduler-steps, --enforce-eager
    sharegpt: Path
    num_prompts: int
    log_dir: Path
    deadline: float  # time.monotonic() by which everything must be over
    start_timeout_s: float  # loading 16 GB and capturing graphs on the GPU
    reserve_s: float  # of the time left, kept for the client and the stop when waiting for /health
    daemon_tree: Path | None = None  # another checkout's root: the daemon's (ab_race.py), not the client's


class RaceFailed(Exception):
    def __init__(self, what: str, exit_status: int | None):
        super().__init__(what)
        self.record: dict = {"what": what, "exit_status": exit_status}


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(daemon: subprocess.Popen, url: str, timeout_s: float) -> float:
    """Seconds until GET /health answered 200; raises if the daemon exits or the time runs out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if daemon.poll() is not None:
            raise RaceFailed(f"the daemon exited with {daemon.returncode} before answering /health", daemon.returncode)
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except OSError:  # not listening yet
            pass
        time.sleep(0.5)
    raise RaceFailed(f"/health did not answer 200 within {timeout_s:.0f} s", None)


def stop(daemon: subprocess.Popen) -> int:
    """SIGTERM drains; a second one stops at once; then the whole group is killed."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if daemon.poll() is not None:
            break
        if sig == signal.SIGKILL:
            os.killpg(daemon.pid, sig)
        else:
            daemon.send_signal(sig)
        try:
            daemon.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # stages that outlived the launcher hold the GPU's memory for the next configuration
        os.killpg(daemon.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return daemon.returncode


def figures(serve_json: Path, cpu_json: Path) -> dict:
    (point,) = json.loads(serve_json.read_text())["points"]
    cpu = json.loads(cpu_json.read_text())
    ms = 1e3
    return {
        "completed": point["num_completed"],
        "failed": point["num_failed"],
        "req_per_s": point["request_throughput"],
        "output_tok_per_s": point["output_throughput"],
        "mean_prompt_tokens": point["mean_input_len"],  # the workload's, as the server counted them
        "mean_output_tokens": point["mean_output_len"],
        "ttft_p50_ms": point["ttft"]["p50"] * ms,
        "ttft_p99_ms": point["ttft"]["p99"] * ms,
        "tpot_p50_ms": point["tpot"]["p50"] * ms,
        "tpot_mean_ms": point["tpot"]["mean"] * ms,
        "itl_p50_ms": point["itl"]["p50"] * ms,
        "itl_p99_ms": point["itl"]["p99"] * ms,
        "bubble": cpu["bubble"],
        "busy_s": cpu["busy_s"],
        "idle_s": cpu["idle_s"],
        "stage_cpu_s": cpu["stage_cpu_s"],
        "stage_ms_per_1000_output_tokens": cpu["stage_ms_per_1000_output_tokens"],
        "host_us_per_output_token": cpu["host_us_per_output_token"],
        "client_cpu_s": cpu["client_cpu_s"],
    }


def graph_capture(log: str) -> dict | None:
    match = CAPTURED.search(log)
    if match is None:
        return None
    num, smallest, largest, seconds, mib = match.groups()
    return {"num_graphs": int(num), "batch_sizes": f"{smallest}..{largest}", "seconds": float(seconds), "mib": int(mib)}


def measure(config: RaceConfig) -> dict:
    name = re.sub(r"[^A-Za-z0-9]+", "-", config.label).strip("-").lower()
    daemon_log, client_log = config.log_dir / f"{name}.daemon.log", config.log_dir / f"{name}.client.log"
    serve_json, cpu_json = config.log_dir / f"{name}.serve.json", config.log_dir / f"{name}.cpu.json"
    for stale in (serve_json, cpu_json, client_log):
        stale.unlink(missing_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "conveyor", "serve", "--model", str(config.model), "--port", str(port), *config.serve_args]
    client = [sys.executable, "-m", "conveyor", "bench", "cpu", "--base-url", url, "--json", str(cpu_json), "--"]
    client += [sys.executable, "-m", "conveyor", "bench", "serve", "--base-url", url, "--tokenizer", str(config.model)]
    client += ["--request-rate", "inf", "--ignore-eos", "--seed", "0", "--disable-tqdm", "--dataset", "sharegpt"]
    client += ["--dataset-path", str(config.sharegpt), "--num-prompts", str(config.num_prompts), "--result-json", str(serve_json)]
    result: dict = {"command": " ".join(serve[1:])}
    failure: RaceFailed | None = None
    env, cwd = None, None
    if config.daemon_tree is not None:  # run from there too: `python -m` puts its working directory first
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(config.daemon_tree), os.environ.get("PYTHONPATH"))))}
        cwd = config.daemon_tree
    with daemon_log.open("wb") as log:
        daemon = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=cwd)
    try:
        left = config.deadline - time.monotonic()
        result["startup_s"] = wait_healthy(daemon, url, max(min(config.start_timeout_s, left - config.reserve_s), 1))
        left = config.deadline - time.monotonic() - 10  # the stop's
        with client_log.open("wb") as out:
            try:
                status = subprocess.run(client, stdout=out, stderr=subprocess.STDOUT, timeout=max(left, 1)).returncode
            except subprocess.TimeoutExpired:
                raise RaceFailed(f"the client ran past this call's time ({left:.0f} s left for it)", None) from None
        if status != 0 or not serve_json.exists() or not cpu_json.exists():
            raise RaceFailed(f"the client exited with {status}", status)
        result |= figures(serve_json, cpu_json)
        if result["failed"]:
            raise RaceFailed(f"{result['failed']} of {config.num_prompts} requests failed", status)
    except RaceFailed as e:
        failure = e
    finally:
        exit_status = stop(daemon)
    text = daemon_log.read_text(errors="replace")
    result["log_lines"] = [line for line in text.splitlines() if LOG_LINES.search(line)]
    result["graph_capture"] = graph_capture(text)
    if failure is None and exit_status != 0:
        failure = RaceFailed(f"the daemon exited with {exit_status} after SIGTERM", exit_status)
    if failure is not None:
        logs = f"--- daemon log\n{tail(daemon_log)}" + (f"\n--- client log\n{tail(client_log, 15)}" if client_log.exists() else "")
        failure.record |= {"output_tail": logs, "figures": result}
        raise failure
    return result
