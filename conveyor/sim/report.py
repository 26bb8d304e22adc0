"""The comparison table: one column per configuration (policy, K), one row per metric, plain text
(Markdown-ready). Token latency is the inter-token latency (ITL)."""

from __future__ import annotations

from conveyor.sim.run_metrics import Metrics

# (label, how to read it from Metrics, format)
ROWS = [
    ("requests", lambda m: m.num_requests, "{:d}"),
    ("duration (s)", lambda m: m.duration_s, "{:.1f}"),
    ("throughput (req/s)", lambda m: m.request_throughput, "{:.2f}"),
    ("output tokens/s", lambda m: m.output_throughput, "{:.0f}"),
    ("total tokens/s", lambda m: m.total_throughput, "{:.0f}"),
    ("TTFT mean (ms)", lambda m: m.ttft["mean"] * 1e3, "{:.0f}"),
    ("TTFT P50 (ms)", lambda m: m.ttft["p50"] * 1e3, "{:.0f}"),
    ("TTFT P90 (ms)", lambda m: m.ttft["p90"] * 1e3, "{:.0f}"),
    ("TTFT P95 (ms)", lambda m: m.ttft["p95"] * 1e3, "{:.0f}"),
    ("TTFT P99 (ms)", lambda m: m.ttft["p99"] * 1e3, "{:.0f}"),
    ("token latency P50 (ms)", lambda m: m.token_latency["p50"] * 1e3, "{:.1f}"),
    ("token latency P90 (ms)", lambda m: m.token_latency["p90"] * 1e3, "{:.1f}"),
    ("token latency P95 (ms)", lambda m: m.token_latency["p95"] * 1e3, "{:.1f}"),
    ("token latency P99 (ms)", lambda m: m.token_latency["p99"] * 1e3, "{:.1f}"),
    ("token latency max (ms)", lambda m: m.token_latency["max"] * 1e3, "{:.0f}"),
    ("TPOT mean (ms)", lambda m: m.tpot["mean"] * 1e3, "{:.1f}"),
    ("TPOT P50 (ms)", lambda m: m.tpot["p50"] * 1e3, "{:.1f}"),
    ("TPOT P90 (ms)", lambda m: m.tpot["p90"] * 1e3, "{:.1f}"),
    ("TPOT P99 (ms)", lambda m: m.tpot["p99"] * 1e3, "{:.1f}"),
    ("E2E mean (s)", lambda m: m.e2e["mean"], "{:.2f}"),
    ("E2E P99 (s)", lambda m: m.e2e["p99"], "{:.2f}"),
    *((f"effective req/s (gen {n:g} tok/s)", lambda m, n=n: m.effective_throughput[n], "{:.2f}") for n in (2.0, 4.0, 6.0)),
    ("KV waste in held blocks", lambda m: m.kv_waste * 100, "{:.1f}%"),
    ("KV pool in use (mean)", lambda m: m.kv_usage * 100, "{:.1f}%"),
    ("prefix cache hits", lambda m: m.prefix_cache_hit_rate * 100, "{:.1f}%"),
    ("preemptions", lambda m: m.num_preemptions, "{:d}"),
    ("steps", lambda m: m.num_steps, "{:d}"),
    ("mean tokens per step", lambda m: m.mean_step_tokens, "{:.0f}"),
    ("host plans", lambda m: m.num_plans, "{:d}"),
    ("bubble (device idle / wall)", lambda m: m.bubble * 100, "{:.1f}%"),
]


def comparison_table(by_policy: dict[str, Metrics]) -> str:
    """A Markdown table: metrics down, policies across."""
    body = [[label, *(fmt.format(get(m)) for m in by_policy.values())] for label, get, fmt in ROWS]
    return markdown_table(["metric", *by_policy], body)


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    """Cells already formatted; the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first, *rest = cells
        return "| " + " | ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:]))]) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2), *("-" * (w + 1) + ":" for w in widths[1:])]) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in body)])
