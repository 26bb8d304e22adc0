"""The table of ops/bench/lora_race.sh's results: `python ops/bench/lora_table.py OUT`, one row per
run (req/s, output tok/s, median TTFT and TPOT, completed), then the adapters' medians over the
base's."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

FIELDS = ("request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms")


def main(out: Path) -> None:
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}
    print("| run | req/s | output tok/s | TTFT p50 ms | TPOT p50 ms | completed |\n|---|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | " + " | ".join(f"{r[f]:.2f}" for f in FIELDS) + f" | {r['completed']} |")
    for field in FIELDS:
        base = statistics.median(r[field] for n, r in runs.items() if n.startswith("base"))
        lora = statistics.median(r[field] for n, r in runs.items() if n.startswith("lora"))
        print(f"{field}: adapters / base = {lora / base:.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
