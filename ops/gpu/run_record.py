"""A GPU run's record, `ops/gpu/runs/<date>-<commit>-<device kind>.json`: what the session measured,
committed as it is, and what conveyor/sim/calibrate.py builds the emulated device's table from.

    python3 ops/gpu/run_record.py --runbook gpu-runbook.json [--ab-race ab-race.json]
        [--step step.json] [--lora lora.json] [--workload NAME] --out ops/gpu/runs/

`build` reads the session's reports (runbook.py's state: setup, kernels, race-k1/k8; ab_race.py's
JSON; the last JSON line of `step_profile.py --json` and `lora_bench.py --json`) and `check`
holds a record to the schema (issue 48), which every committed record passes
(tests/ops/test_gpu_run_records.py):

    {"date": "YYYY-MM-DD", "device": "NVIDIA H200", "commit": "<7+ hex>",
     "races": [{"workload", "commit", "req_s", "output_tok_s", "ttft_p50_ms", "itl_p50_ms", "completed"}, ...],
     "gemms": [{"layer": "qkv|o|gate_up|down", "n", "k", "m", "kind": "bf16|w4a16|w8a16|fp8", "us"}, ...] | null,
     "step": {...} | null}

A figure a run did not measure is null, never guessed; more keys may follow (each race's config,
TPOT, bubble, host CPU per output token). Stdlib only, as the runbook.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

RACE_KEYS = ("workload", "commit", "req_s", "output_tok_s", "ttft_p50_ms", "itl_p50_ms", "completed")
GEMM_KEYS = ("layer", "n", "k", "m", "kind", "us")
LAYERS = ("qkv", "o", "gate_up", "down")
KINDS = {"bf16": "bf16", "W4A16 g128": "w4a16", "W8A16 g128": "w8a16", "FP8 W8A8": "fp8"}  # kernel_bench's names
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
DEVICE_KIND = re.compile(r"\b([AHB]\d{2,3})\b")
# kernel_bench.py's figure: "qkv 6144x4096 M=1 bf16" -> "21.5 us (...)"
GEMM_FIGURE = re.compile(r"^(\w+) (\d+)x(\d+) M=(\d+) (.+)$")


def check(record: dict) -> list[str]:
    """What is wrong with a record (nothing: [])."""
    problems = []
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(record.get("date"))):
        problems.append(f"date {record.get('date')!r} is not YYYY-MM-DD")
    if not isinstance(record.get("device"), str) or not record["device"]:
        problems.append("no device")
    if not COMMIT.match(str(record.get("commit"))):
        problems.append(f"commit {record.get('commit')!r} is not 7+ hex digits")
    races = record.get("races")
    if not isinstance(races, list):
        problems.append("races is not a list")
        races = []
    for i, race in enumerate(races):
        missing = [k for k in RACE_KEYS if k not in race]
        if missing:
            problems.append(f"race {i}: no {', '.join(missing)}")
        if not COMMIT.match(str(race.get("commit"))):
            problems.append(f"race {i}: commit {race.get('commit')!r}")
        for key in RACE_KEYS[2:]:
            value = race.get(key)
            if value is not None and (not isinstance(value, int | float) or value < 0):
                problems.append(f"race {i}: {key} {value!r} is not a figure or null")
    gemms = record.get("gemms", "missing")
    if gemms == "missing":
        problems.append("no gemms (null where the run timed none from graphs)")
    for i, gemm in enumerate(gemms if isinstance(gemms, list) else []):
        if any(k not in gemm for k in GEMM_KEYS):
            problems.append(f"gemm {i}: needs {', '.join(GEMM_KEYS)}")
        elif gemm["layer"] not in LAYERS or gemm["kind"] not in KINDS.values() or not gemm["us"] > 0:
            problems.append(f"gemm {i}: layer {gemm['layer']!r}, kind {gemm['kind']!r}, us {gemm['us']!r}")
    if "step" not in record or not (record["step"] is None or isinstance(record["step"], dict)):
        problems.append("step is neither a decode-step profile nor null")
    return problems


def file_name(record: dict) -> str:
    return f"{record['date']}-{record['commit'][:7]}-{record.get('device_kind') or device_kind(record['device'])}.json"


def device_kind(name: str) -> str:
    """ "NVIDIA H200" -> "h200"; "NVIDIA H100 80GB HBM3" -> "h100"."""
    match = DEVICE_KIND.search(name)
    return match.group(1).lower() if match else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _commit(text: str | None) -> str | None:
    word = (text or "").split()[0] if text else ""
    return word[:7] if COMMIT.match(word) else None


def race_entry(figures: dict, commit: str, workload: str, config: str) -> dict:
    """One race of race.py's figures, in the record's keys."""
    return {
        "workload": figures.get("workload", workload),
        "commit": commit,
        "req_s": figures.get("req_per_s"),
        "output_tok_s": figures.get("output_tok_per_s"),
        "ttft_p50_ms": figures.get("ttft_p50_ms"),
        "itl_p50_ms": figures.get("itl_p50_ms"),
        "completed": figures.get("completed"),
        "config": config,
        "ttft_p99_ms": figures.get("ttft_p99_ms"),
        "itl_p99_ms": figures.get("itl_p99_ms"),
        "tpot_p50_ms": figures.get("tpot_p50_ms"),
        "bubble": figures.get("bubble"),
        "host_us_per_output_token": figures.get("host_us_per_output_token"),
        "stage_ms_per_1000_output_tokens": figures.get("stage_ms_per_1000_output_tokens"),
    }


def gemm_entries(kernels: dict) -> list[dict] | None:
    """kernel_bench.py's figures -> the record's gemms (graph-replayed times; a figure may be the
    printed string or a dict with graph_us)."""
    found = []
    for key, value in kernels.items():
        match = GEMM_FIGURE.match(key)
        if match is None or match.group(5) not in KINDS:
            continue
        layer, n, k, m, path = match.groups()
        us = value.get("graph_us") if isinstance(value, dict) else float(str(value).split()[0])
        if us is not None and us == us:  # NaN: no graph
            found.append({"layer": layer, "n": int(n), "k": int(k), "m": int(m), "kind": KINDS[path], "us": us, "mode": "graph"})
    return found or None


def build(runbook: dict, ab_race: dict | None, step: dict | None, lora: dict | None, workload: str, date: str) -> dict:
    steps = runbook.get("steps", {})
    commit = _commit(runbook.get("commit")) or _commit((ab_race or {}).get("commits", {}).get("this")) or "0000000"
    setup = steps.get("setup", {}).get("figures", {})
    races = []
    for name in ("race-k1", "race-k8", "race-defaults"):
        for config, figures in steps.get(name, {}).get("figures", {}).items():
            if figures.get("ok"):
                races.append(race_entry(figures, commit, workload, config))
    baseline = None
    if ab_race:
        sides = ab_race.get("commits", {})
        baseline = _commit(sides.get("baseline"))
        for side in ("this", "baseline"):
            for i, figures in enumerate(ab_race.get("runs", {}).get(side, [])):
                entry = race_entry(figures, _commit(sides.get(side)) or commit, workload, f"ab_race {side} {i + 1}")
                races.append(entry)
    kernels = steps.get("kernels", {}).get("figures", {})
    record = {
        "date": date,
        "device": runbook.get("device") or setup.get("name") or "unknown",
        "commit": commit,
        "races": races,
        "gemms": gemm_entries(kernels),
        "step": step,
        "baseline": baseline,
        "versions": {k: setup[k] for k in ("torch", "cuda", "triton", "transformers", "python") if k in setup} or None,
    }
    record["device_kind"] = device_kind(record["device"])
    if lora is not None:
        record["lora"] = lora
    return record


def _json(path: Path | None) -> dict | None:
    """A report: a JSON file, or a log whose last JSON line is it (the --json scripts)."""
    if path is None:
        return None
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ops/gpu/run_record.py", description=__doc__.splitlines()[0])
    p.add_argument("--runbook", type=Path, required=True, help="gpu-runbook.json of the session's last call")
    p.add_argument("--ab-race", type=Path, help="ab_race.py's ab-race.json")
    p.add_argument("--step", type=Path, help="step_profile.py --json's output")
    p.add_argument("--lora", type=Path, help="lora_bench.py --json's output")
    p.add_argument("--workload", default="sharegpt-500", help="the races' workload where their figures do not name it")
    p.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "runs")
    args = p.parse_args(argv)
    record = build(_json(args.runbook) or {}, _json(args.ab_race), _json(args.step), _json(args.lora), args.workload, args.date)
    problems = check(record)
    for problem in problems:
        print(f"run_record.py: {problem}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / file_name(record)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(path)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
