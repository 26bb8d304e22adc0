"""This checkout raced against an older commit's tree on one machine in one call, alternating.

Not a runbook step: a regression check for a GPU session (the second GPU run measured 0.92x a
commit's req/s, one run each on two machines, which cannot tell a regression from two machines).
`BASELINE=COMMIT bash ops/gpu/pack.sh` puts that commit's tree into .gpu-pack/baseline/; there,
after `bash ops/gpu/run.sh checkpoint` (the served checkpoint of the workload, --workload,
sharegpt-500 by default: ops/gpu/workloads.py; the wheels on the path):

    PYTHONPATH=/tmp/gpu-site python3 ops/gpu/ab_race.py --rounds 2

Each round races both trees with race.measure (the runbook's race-k1 configuration with CUDA
graphs, or --steps K), in ABBA order across rounds so that neither side always runs on a warmer
machine, after a short race that is thrown away (--warmup-prompts): on a fresh machine the first
daemon compiles the Triton kernels, and the first run of the third GPU run lost 15% of its req/s
and tripled its TTFT p50 so (docs/benchmarks.md). Only the daemon comes from the baseline tree
(run there, the tree first on its PYTHONPATH: `python -m` puts its working directory before
PYTHONPATH, so the third GPU run's "baseline", run from here, was this checkout); the client and
the CPU accounting are this checkout's for both. Prints each race and the medians and ratios
(this / baseline), and writes them to $OUT/ab-race.json. Stdlib only, as race.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import race
import workloads

REPO = Path(__file__).resolve().parents[2]
FIGURES = ("req_per_s", "output_tok_per_s", "ttft_p50_ms", "tpot_p50_ms", "bubble", "host_us_per_output_token")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, default=REPO / ".gpu-pack" / "baseline", help="the older tree's root")
    p.add_argument("--workload", choices=sorted(workloads.WORKLOADS), default=workloads.DEFAULT, help="ops/gpu/workloads.py")
    p.add_argument("--model", type=Path, help="default: the runbook's checkpoint for the workload (/tmp/gpu-runbook/NAME)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=1, help="--num-scheduler-steps")
    p.add_argument("--num-prompts", type=int, help="default: the workload's; 16 with --emulated")
    p.add_argument("--warmup-prompts", type=int, default=64, help="the thrown-away first race's (0: none)")
    p.add_argument("--sharegpt", type=Path, help="default: .gpu-pack's, else ../shared/workloads'")
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--emulated", action="store_true", help="conveyor serve --device emulated on the runbook's emulated checkpoint")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-runbook-out"))
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    work = Path("/tmp/gpu-runbook-emulated" if args.emulated else "/tmp/gpu-runbook")
    workload = workloads.WORKLOADS[args.workload]
    model = args.model or work / ("tiny-emulated" if args.emulated else workload.checkpoint)
    if not (model / "config.json").is_file():
        step = f"checkpoint --workload {workload.name}{' --emulated' if args.emulated else ''}"
        p.error(f"no checkpoint at {model}: run `bash ops/gpu/run.sh {step}` first")
    if not (args.baseline / "conveyor" / "__init__.py").is_file():
        p.error(f"no tree at {args.baseline}: pack one with BASELINE=COMMIT bash ops/gpu/pack.sh")
    device = ("--device", "emulated", "--emulate", "h100") if args.emulated else ("--device", "cuda", "--attention-backend", "triton")
    steps = ("--num-scheduler-steps", str(args.steps)) if args.steps > 1 else ()
    sharegpt = args.sharegpt or REPO / ".gpu-pack" / "sharegpt_sample.json"
    if not sharegpt.is_file():
        sharegpt = REPO.parent / "shared" / "workloads" / "sharegpt_sample.json"
    trees = {"this": None, "baseline": args.baseline.resolve()}
    commits = {"this": _commit(REPO / ".gpu-pack" / "commit.txt"), "baseline": _commit(args.baseline / "commit.txt")}
    (args.out / "ab-race").mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    failures = []
    order = [("warm-up", "this")] if args.warmup_prompts else []
    for i in range(args.rounds):
        order += [(f"{side} round {i + 1}", side) for side in (("this", "baseline") if i % 2 == 0 else ("baseline", "this"))]
    for label, side in order:
        config = race.RaceConfig(
            label,
            model,
            (*device, *steps),
            sharegpt,
            args.warmup_prompts if label == "warm-up" else args.num_prompts or (16 if args.emulated else workload.num_prompts),
            args.out / "ab-race",
            deadline,
            600.0,
            90.0,
            trees[side],
        )
        print(f"{label} ({commits[side]}) ...", flush=True)
        try:
            figures = race.measure(config)
        except race.RaceFailed as e:
            failures.append({**e.record, "what": f"{label}: {e.record['what']}"})
            print(f"  failed: {e.record['what']}\n{e.record.get('output_tail', '')}", flush=True)
            continue
        if label != "warm-up":
            runs[side].append({**figures, "workload": workload.name})
        print("  " + ", ".join(f"{k} {figures[k]:.4g}" for k in FIGURES), flush=True)
    medians = {side: {k: statistics.median(r[k] for r in rs) for k in FIGURES} for side, rs in runs.items() if rs}
    ratios = {}
    if len(medians) == 2:
        ratios = {k: medians["this"][k] / medians["baseline"][k] for k in FIGURES if medians["baseline"][k]}
    report = {"workload": workload.name, "commits": commits, "runs": runs, "medians": medians, "ratios": ratios, "failures": failures}
    (args.out / "ab-race.json").write_text(json.dumps(report, indent=1))
    print(f"\n| figure | this ({commits['this']}) | baseline ({commits['baseline']}) | this / baseline |\n|---|---|---|---|")
    for k in FIGURES:
        row = [f"{medians[s][k]:.4g}" if s in medians else "-" for s in ("this", "baseline")]
        print(f"| {k} | {row[0]} | {row[1]} | {ratios[k]:.3f} |" if k in ratios else f"| {k} | {row[0]} | {row[1]} | - |")
    stages = {s: _stage_medians(rs) for s, rs in runs.items() if rs}
    if len(stages) == 2:
        both = [name for name in stages["this"] if name in stages["baseline"]]
        per_stage = ", ".join(f"{name} {stages['this'][name]:.0f} / {stages['baseline'][name]:.0f}" for name in both)
        print(f"\nhost ms per 1000 output tokens by stage, this / baseline (medians): {per_stage}")
    return 1 if failures else 0


def _commit(path: Path) -> str:
    return path.read_text().split()[0][:10] if path.is_file() else "unknown"


def _stage_medians(runs: list[dict]) -> dict[str, float]:
    names = runs[0]["stage_ms_per_1000_output_tokens"]
    return {n: statistics.median(r["stage_ms_per_1000_output_tokens"].get(n, 0.0) for r in runs) for n in names}


if __name__ == "__main__":
    sys.exit(main())
