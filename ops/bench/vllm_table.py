"""A markdown table of vLLM's client's result files (`vllm bench serve --save-result`):
`python ops/bench/vllm_table.py OUT_DIR`, a row per JSON file in name order: requests completed
and failed, req/s, output tok/s, TTFT p50 / p99, TPOT p50 and ITL p50 (ms)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    print("| run | done | failed | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in sorted(out.glob("*.json")):
        d = json.loads(path.read_text())
        if "output_throughput" not in d:
            continue  # not vLLM's client's
        keys = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")
        figures = [d[k] for k in keys]
        print(f"| {path.stem} | {d['completed']} | {d.get('failed', 0)} | " + " | ".join(f"{x:.2f}" for x in figures) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
