"""Markdown tables from ops/bench/image_mix_race.sh's output: `python ops/bench/image_mix_table.py OUT_DIR`.

The mix part (conveyor's client): a row per server, load and round, with the point's req/s and
the TTFT p50 / p99 of its text requests and of its image requests apart (bench serve's ": text"
and ": images" points). The vllm part (vLLM's client, `--save-result` JSON): a row per server,
load and round, with req/s, TTFT p50 / p99, TPOT p50 and the mean prompt tokens the server
counted (the images' placeholders included).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"(?P<server>conveyor-t\d|vllm)-r(?P<round>\d)-(?P<load>.+)")
MIX_LOADS = ("text", "half", "images", "half-repeated")
MIX_LABELS = {"text": "0% images", "half": "50% images", "images": "100% images", "half-repeated": "50% images, half repeated"}
VLLM_LOADS = {"mm1": "random-mm, 1 image each", "mm0to2": "random-mm, 0-2 images each"}


def _runs(out: Path) -> list[tuple[dict, dict]]:
    """(the name's parts with the load average, the JSON) of every result file, in server, load, round order."""
    runs = []
    for path in out.glob("*.json"):
        if match := NAME.fullmatch(path.stem):
            loadavg = path.with_suffix(".loadavg")
            parts = {**match.groupdict(), "loadavg": loadavg.read_text().strip() if loadavg.exists() else ""}
            runs.append((parts, json.loads(path.read_text())))
    order = {load: i for i, load in enumerate([*MIX_LOADS, *VLLM_LOADS])}
    return sorted(runs, key=lambda r: (r[0]["server"], order.get(r[0]["load"], 99), r[0]["round"]))


def _ms(point: dict | None, stat: str) -> str:
    return "" if point is None else f"{point['ttft'][stat] * 1e3:.1f}"


def mix_table(out: Path) -> str:
    rows = [
        "| tokenizer processes | load | round | load average | req/s | TTFT p50 text (ms) | TTFT p50 images | TTFT p99 text "
        "| TTFT p99 images |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, data in _runs(out):
        if "points" not in data or name["load"] not in MIX_LOADS:
            continue
        whole, *parts = data["points"]
        split = {p["label"].rsplit(": ", 1)[1]: p for p in parts} or {"text": whole}  # 0% images: no split
        rows.append(
            f"| {name['server'][-1]} | {MIX_LABELS[name['load']]} | {name['round']} | {name['loadavg']} "
            f"| {whole['request_throughput']:.1f} "
            f"| {_ms(split.get('text'), 'p50')} | {_ms(split.get('images'), 'p50')} "
            f"| {_ms(split.get('text'), 'p99')} | {_ms(split.get('images'), 'p99')} |"
        )
    return "\n".join(rows)


def vllm_table(out: Path) -> str:
    rows = [
        "| server | load | round | load average | req/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | prompt tokens / request |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, data in _runs(out):
        if name["load"] not in VLLM_LOADS:
            continue
        server = "vLLM CPU" if name["server"] == "vllm" else "conveyor"
        rows.append(
            f"| {server} | {VLLM_LOADS[name['load']]} | {name['round']} | {name['loadavg']} | {data['request_throughput']:.1f} "
            f"| {data['median_ttft_ms']:.1f} | {data['p99_ttft_ms']:.1f} | {data['median_tpot_ms']:.2f} "
            f"| {data['total_input_tokens'] / data['completed']:.0f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    print(mix_table(folder), "", vllm_table(folder), sep="\n")
