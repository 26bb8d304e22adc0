"""Tabulate ops/bench/spec_race.sh's results: per workload and stream count, each configuration's
output tokens/s, median TPOT and TTFT from vLLM's result JSON, its ratio of output tokens/s to
the run without speculation of the same suffix (k8-again against none-again, k8-r1a against
none-r1a: spec_race.sh's abba pairs), and the draft acceptance from the server's spec_decode counters
(accepted / drafted, and tokens per verifying row: 1 + accepted / verify steps).

    python ops/bench/spec_table.py OUT
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"^(?P<workload>grounded|sharegpt)-(?P<config>.+)-c(?P<streams>\d+)\.json$")


def counters(path: Path) -> dict[str, float]:
    values = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        name, value = line.split("{")[0], float(line.split()[-1])
        values[name.removeprefix("conveyor_spec_decode_").removesuffix("_total")] = value
    return values


def main(out: Path) -> None:
    runs = {}
    for path in sorted(out.glob("*.json")):
        m = NAME.match(path.name)
        if m is None:
            continue
        result = json.loads(path.read_text())
        before, after = counters(path.with_suffix(".before")), counters(path.with_suffix(".after"))
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        runs[(m["workload"], int(m["streams"]), m["config"])] = (result, delta)
    columns = "output tok/s | vs none | median TPOT ms | median TTFT ms | accepted / drafted | tokens per verifying row"
    print(f"| workload | streams | config | {columns} |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for (workload, streams, config), (result, delta) in sorted(runs.items()):
        _, dash, suffix = config.partition("-")
        base = runs.get((workload, streams, "none" + dash + suffix))
        ratio = result["output_throughput"] / base[0]["output_throughput"] if base else float("nan")
        drafted, accepted, rows = delta.get("draft_tokens", 0), delta.get("accepted_tokens", 0), delta.get("verify_steps", 0)
        rate = f"{accepted / drafted:.2f} ({accepted:.0f} / {drafted:.0f})" if drafted else "-"
        per_row = f"{1 + accepted / rows:.2f}" if rows else "-"
        print(
            f"| {workload} | {streams} | {config} | {result['output_throughput']:.1f} | {ratio:.2f}x | "
            f"{result['median_tpot_ms']:.2f} | {result['median_ttft_ms']:.0f} | {rate} | {per_row} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
