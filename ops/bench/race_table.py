"""Markdown tables from ops/bench/emulated_race.sh's output: `python ops/bench/race_table.py OUT_DIR [NAME ...]`.

One table per (client, load): a row per configuration (NAME, in the order given, else sorted),
columns req/s, output tok/s, TTFT p50 / p99, TPOT p50, ITL p50 / p99 (ms), the bubble, the host's
CPU in us per output token and each stage's and the client's in ms per 1,000 output tokens.
Reads conveyor's result JSON (`bench serve --result-json`) and vLLM's (`--save-result`) alike.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STAGES = ("scheduler", "worker", "tokenizer", "detokenizer", "ingress")


def serve_figures(path: Path) -> dict[str, float]:
    data = json.loads(path.read_text())
    if "points" in data:  # conveyor's client: seconds
        (p,) = data["points"]
        ms = 1e3
        return {
            "req/s": p["request_throughput"],
            "tok/s": p["output_throughput"],
            "ttft50": p["ttft"]["p50"] * ms,
            "ttft99": p["ttft"]["p99"] * ms,
            "tpot50": p["tpot"]["p50"] * ms,
            "itl50": p["itl"]["p50"] * ms,
            "itl99": p["itl"]["p99"] * ms,
            "failed": p["num_failed"],
        }
    return {  # vLLM's client: milliseconds
        "req/s": data["request_throughput"],
        "tok/s": data["output_throughput"],
        "ttft50": data["p50_ttft_ms"],
        "ttft99": data["p99_ttft_ms"],
        "tpot50": data["p50_tpot_ms"],
        "itl50": data["p50_itl_ms"],
        "itl99": data["p99_itl_ms"],
        "failed": data.get("failed", 0),
    }


def row(name: str, serve: Path, cpu: Path) -> str:
    s, c = serve_figures(serve), json.loads(cpu.read_text())
    stages = c["stage_ms_per_1000_output_tokens"]
    cells = [
        name,
        f"{s['req/s']:.2f}",
        f"{s['tok/s']:.0f}",
        f"{s['ttft50']:.0f} / {s['ttft99']:.0f}",
        f"{s['tpot50']:.2f}",
        f"{s['itl50']:.2f} / {s['itl99']:.1f}",
        f"{100 * c['bubble']:.1f}%",
        f"{c['host_us_per_output_token']:.1f}",
        *(f"{stages.get(stage, 0.0):.1f}" for stage in STAGES),
        f"{c['client_ms_per_1000_output_tokens']:.1f}",
    ]
    failed = f" ({s['failed']:.0f} failed)" if s["failed"] else ""
    return "| " + " | ".join(cells) + failed + " |"


def tables(out: Path, names: list[str]) -> str:
    header = (
        "| config | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p50 / p99 ms | bubble | host us/token | "
        + " | ".join(STAGES)
        + " | client |\n|"
        + "---|"
        + "---:|" * (7 + len(STAGES) + 1)
    )
    loads = sorted({p.name.split(".")[0] for p in out.glob("*/*.cpu.json")}, key=lambda x: (x.split("-")[0], _rate(x)))
    parts = []
    for load in loads:
        client, rate = load.split("-", 1)
        rows = [
            row(n, out / n / f"{load}.serve.json", out / n / f"{load}.cpu.json")
            for n in names
            if (out / n / f"{load}.cpu.json").exists()
        ]
        title = "all at once" if rate == "inf" else f"{rate} req/s"
        parts.append(f"{client}'s client, ShareGPT, {title} (CPU columns: ms per 1,000 output tokens)\n\n{header}\n" + "\n".join(rows))
    return "\n\n".join(parts)


def _rate(load: str) -> float:
    rate = load.split("-", 1)[1]
    return float("inf") if rate == "inf" else float(rate)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    names = argv[1:] or sorted(p.name for p in out.iterdir() if p.is_dir())
    print(tables(out, names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
