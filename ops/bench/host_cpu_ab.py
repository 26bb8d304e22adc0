"""Host CPU per output token of two source trees, interleaved: issue 27's emulated-race measurement
(docs/benchmarks/gpu-host.md) run as A/B pairs, so the shared machine's drift falls on both.

    python ops/bench/host_cpu_ab.py OUT TREE_A TREE_B [--rounds 4] [--num-prompts 500] [-- SERVE_OPTIONS...]

Each run is a fresh daemon (`python -m conveyor serve --device emulated`) started from its tree
(cwd and PYTHONPATH = the tree, which every stage inherits; checked in /proc), warmed by
--warm-up ShareGPT requests, then a burst of --num-prompts at once under `conveyor bench cpu`.
The client and the measuring tool are this script's tree's, the same for A and B. Rounds run
A then B, then B then A (ABBA), so neither side always goes first.

Per run: all stages' CPU in us per output token, the worker's, req/s. The modelled host CPU of a
calibrated emulated device (`emulated_host_cpu_s`, only from dc3cb0d on, and only with --emulate
h200) is taken out: only CPU spent here counts. At the end the median of the per-round ratios B/A.
--model defaults to /tmp/l3e, made if missing as gpu-host.md makes it (Llama-3-8B's shape, no
weights, SmolLM2's tokenizer where the GGUF cache has it). Writes OUT/<round>-<A|B>.{cpu,serve}.json
and the daemon logs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHAREGPT = REPO.parent / "shared" / "workloads" / "sharegpt_sample.json"


def ensure_model(path: Path) -> None:
    if (path / "config.json").exists():
        return
    smollm2 = sorted((Path.home() / ".cache/conveyor/gguf").glob("SmolLM2-135M-Instruct.Q4_1-float32-[0-9a-f]*"))
    tokenizer = ["--tokenizer-from", str(smollm2[0])] if smollm2 else []
    cmd = [sys.executable, "-m", "conveyor.tiny.generate", "--shape", "llama3-8b", "--no-weights", *tokenizer, str(path)]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def _wait_healthy(url: str, daemon: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited ({daemon.returncode}) before it was healthy: see its log in OUT")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"no health from {url} in {timeout_s:.0f} s")


def _check_tree(daemon_pid: int, tree: Path) -> int:
    """Every process under the daemon runs with cwd and PYTHONPATH = tree; how many there are."""
    pids, found = [daemon_pid], 0
    while pids:
        pid = pids.pop()
        proc = Path(f"/proc/{pid}")
        try:
            cwd = Path(os.readlink(proc / "cwd")).resolve()
            environ = dict(e.split("=", 1) for e in (proc / "environ").read_text().split("\0") if "=" in e)
            children = (proc / "task" / str(pid) / "children").read_text().split()
        except OSError:
            continue  # gone meanwhile
        if cwd != tree or environ.get("PYTHONPATH") != str(tree):
            raise SystemExit(f"process {pid} runs from {cwd} with PYTHONPATH={environ.get('PYTHONPATH')}, not {tree}")
        found += 1
        pids += map(int, children)
    return found


def _bench(url: str, model: Path, num_prompts: int, seed: int, result: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "conveyor", "bench", "serve", "--base-url", url, "--tokenizer", str(model)]
    cmd += ["--request-rate", "inf", "--ignore-eos", "--seed", str(seed), "--disable-tqdm", "--dataset", "sharegpt"]
    cmd += ["--dataset-path", str(SHAREGPT), "--num-prompts", str(num_prompts)]
    return cmd + (["--result-json", str(result)] if result is not None else [])


def run_one(tree: Path, out: Path, name: str, args: argparse.Namespace) -> dict:
    """One fresh daemon from `tree`: warm-up, then the measured burst; its figures."""
    url = f"http://127.0.0.1:{args.port}"
    serve = [sys.executable, "-m", "conveyor", "serve", "--model", str(args.model), "--device", "emulated"]
    serve += ["--port", str(args.port), *args.serve_options]
    with open(out / f"{name}.daemon.log", "w") as log:
        daemon = subprocess.Popen(serve, cwd=tree, env=_env(tree), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(url, daemon)
        num_processes = _check_tree(daemon.pid, tree)
        client = {"cwd": REPO, "env": _env(REPO), "check": True, "stdout": subprocess.DEVNULL}
        subprocess.run(_bench(url, args.model, args.warm_up, 1, None), **client)  # type: ignore[call-overload]
        cpu_json, serve_json = out / f"{name}.cpu.json", out / f"{name}.serve.json"
        measured = [sys.executable, "-m", "conveyor", "bench", "cpu", "--base-url", url, "--json", str(cpu_json), "--"]
        with open(out / f"{name}.log", "w") as log:
            client.update(stdout=log, stderr=subprocess.STDOUT)
            subprocess.run(measured + _bench(url, args.model, args.num_prompts, 0, serve_json), **client)  # type: ignore[call-overload]
    finally:
        try:
            os.killpg(daemon.pid, 15)  # the daemon's own session: its stages, nothing else
        except ProcessLookupError:
            pass  # it had exited: _wait_healthy says so, its log says why
        daemon.wait(timeout=60)
    cpu, (point,) = json.loads(cpu_json.read_text()), json.loads(serve_json.read_text())["points"]
    if point["num_failed"]:
        raise SystemExit(f"{name}: {point['num_failed']} requests failed ({out / (name + '.log')})")
    tokens = cpu["output_tokens"]
    modelled = cpu.get("emulated_host_cpu_s", 0.0)
    host = cpu["host_cpu_s"] - modelled
    worker = cpu["stage_cpu_s"].get("worker", 0.0) - modelled
    return {
        "host_us_per_token": 1e6 * host / tokens,
        "worker_us_per_token": 1e6 * worker / tokens,
        "req_s": point["request_throughput"],
        "bubble": cpu.get("bubble"),
        "tokens": tokens,
        "processes": num_processes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("tree_a", type=Path)
    parser.add_argument("tree_b", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--warm-up", type=int, default=50)
    parser.add_argument("--model", type=Path, default=Path("/tmp/l3e"))
    parser.add_argument("--port", type=int, default=8057)
    parser.add_argument("serve_options", nargs="*", help="after --: passed to `conveyor serve` (both trees must know them)")
    args = parser.parse_args()
    trees = {"A": args.tree_a.resolve(), "B": args.tree_b.resolve()}
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_model(args.model)
    print(f"A = {trees['A']}\nB = {trees['B']}\n{args.num_prompts} prompts at once, {args.rounds} rounds, ABBA order", flush=True)
    print("round | side | host us/token | worker us/token | req/s | bubble")
    ratios, worker_ratios = [], []
    for r in range(args.rounds):
        got = {}
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            got[side] = m = run_one(trees[side], args.out, f"{r}-{side}", args)
            bubble = "n/a" if m["bubble"] is None else f"{100 * m['bubble']:.1f}%"
            figures = f"{m['host_us_per_token']:.1f} | {m['worker_us_per_token']:.1f} | {m['req_s']:.2f} | {bubble}"
            print(f"{r} | {side} | {figures}", flush=True)
        ratios.append(got["B"]["host_us_per_token"] / got["A"]["host_us_per_token"])
        worker_ratios.append(got["B"]["worker_us_per_token"] / got["A"]["worker_us_per_token"])
        print(f"{r} | B/A | {ratios[-1]:.3f} | {worker_ratios[-1]:.3f} | |", flush=True)
    print(f"median B/A over {len(ratios)} rounds: host {statistics.median(ratios):.3f}, worker {statistics.median(worker_ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
