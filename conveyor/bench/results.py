"""The metrics of one benchmark run (one load point), from its RequestResults.

The definitions are the simulator's (docs/simulator.md, "Metrics"), on the client's clock:
  throughput      completed requests, prompt tokens, output tokens, both: per second of the run
                  (first send to last finish); failed requests count in the run, not in these
  TTFT            first output chunk - send
  ITL             gaps between consecutive output chunks, pooled over requests (vLLM's ITL;
                  FastGen's per-token generation latency when every chunk holds one token)
  TPOT            per request, (last chunk - first chunk) / (output tokens - 1)
  E2E             end of stream - send
  prefix cache    the server's hit rate over the run, from its /metrics (server_metrics.py);
  hit rate        blank when it exports no prefix cache counters; the host tier's share of the
                  lookups beside it (conveyor with --kv-offloading-size; its hits count in both)
  effective       FastGen's SLA (conveyor.sim.run_metrics.meets_sla): TTFT <= prompt tokens / 512
  throughput      tokens/s and the EMA of the per-token gaps under 1/N s, N = 2, 4, 6 tokens/s;
                  requests meeting it, per second
Every latency is summarised by its mean, P50, P90, P95 and P99 (seconds).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from conveyor.bench.client import RequestResult
from conveyor.sim.report import markdown_table
from conveyor.sim.run_metrics import SLA_GEN_TOKENS_PER_S, meets_sla, summary
from conveyor.sim.simulator import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclasses.dataclass(frozen=True)
class ServeMetrics:
    label: str  # "rate inf", "8 clients"
    num_clients: int | None  # closed loop
    request_rate: float | None  # open loop (None: all at once)
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # output tokens / s
    total_throughput: float
    mean_input_len: float
    mean_output_len: float
    ttft: dict[str, float]
    tpot: dict[str, float]
    itl: dict[str, float]
    e2e: dict[str, float]
    effective_throughput: dict[float, float]  # generation SLA (tokens/s) -> requests / s
    errors: dict[str, int]  # the failures' messages, with how often each happened
    prefix_cache_hit_rate: float | None = None  # the server's, over the run (server_metrics.py)
    kv_host_hit_rate: float | None = None  # lookups the server's KV host tier supplied, of all lookups

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["effective_throughput"] = {f"{k:g}": v for k, v in self.effective_throughput.items()}
        return out


def compute(
    results: list[RequestResult],
    duration: float,
    *,
    label: str,
    num_clients: int | None = None,
    request_rate: float | None = None,
    prefix_cache_hit_rate: float | None = None,
    kv_host_hit_rate: float | None = None,
) -> ServeMetrics:
    done = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    num_input = sum(r.prompt_len for r in done)
    num_output = sum(r.output_len for r in done)
    duration = max(duration, 1e-9)
    itl = np.concatenate([r.itl for r in done] + [np.zeros(0)])
    records = [RequestRecord(f"bench-{i}", r.start, r.prompt_len, r.output_len, r.token_times(), r.end) for i, r in enumerate(done)]
    return ServeMetrics(
        label=label,
        num_clients=num_clients,
        request_rate=request_rate,
        num_completed=len(done),
        num_failed=len(failed),
        duration_s=duration,
        request_throughput=len(done) / duration,
        input_throughput=num_input / duration,
        output_throughput=num_output / duration,
        total_throughput=(num_input + num_output) / duration,
        mean_input_len=num_input / len(done) if done else 0.0,
        mean_output_len=num_output / len(done) if done else 0.0,
        ttft=summary([r.ttft for r in done], PERCENTILES),
        tpot=summary([t for t in (r.tpot for r in done) if t is not None], PERCENTILES),
        itl=summary(itl, PERCENTILES),
        e2e=summary([r.e2e for r in done], PERCENTILES),
        effective_throughput={n: sum(meets_sla(rec, gen_tokens_per_s=n) for rec in records) / duration for n in SLA_GEN_TOKENS_PER_S},
        errors=dict(Counter(r.error or "" for r in failed)),  # a failed request has an error
        prefix_cache_hit_rate=prefix_cache_hit_rate,
        kv_host_hit_rate=kv_host_hit_rate,
    )


def _latency_rows(name: str, key: str, unit: str, scale: float, fmt: str) -> list[tuple]:
    """Rows for the mean and each percentile of one latency, e.g. "TTFT P90 (ms)"."""
    stats = ["mean", *(f"p{p}" for p in PERCENTILES)]
    return [(f"{name} {s if s == 'mean' else s.upper()} ({unit})", lambda m, s=s: getattr(m, key)[s] * scale, fmt) for s in stats]


ROWS = [
    ("completed requests", lambda m: m.num_completed, "{:d}"),
    ("failed requests", lambda m: m.num_failed, "{:d}"),
    ("duration (s)", lambda m: m.duration_s, "{:.2f}"),
    ("throughput (req/s)", lambda m: m.request_throughput, "{:.2f}"),
    ("input tokens/s", lambda m: m.input_throughput, "{:.0f}"),
    ("output tokens/s", lambda m: m.output_throughput, "{:.0f}"),
    ("total tokens/s", lambda m: m.total_throughput, "{:.0f}"),
    ("mean input / output tokens", lambda m: f"{m.mean_input_len:.0f} / {m.mean_output_len:.0f}", "{}"),
    ("prefix cache hit rate (server)", lambda m: _percent(m.prefix_cache_hit_rate), "{}"),
    ("hits from the KV host tier (server)", lambda m: _percent(m.kv_host_hit_rate), "{}"),
    *_latency_rows("TTFT", "ttft", "ms", 1e3, "{:.1f}"),
    *_latency_rows("TPOT", "tpot", "ms", 1e3, "{:.2f}"),
    *_latency_rows("ITL", "itl", "ms", 1e3, "{:.2f}"),
    *_latency_rows("E2E", "e2e", "s", 1.0, "{:.2f}"),
    *((f"effective req/s (gen {n:g} tok/s)", lambda m, n=n: m.effective_throughput[n], "{:.2f}") for n in SLA_GEN_TOKENS_PER_S),
]


def _percent(rate: float | None) -> str:
    return "" if rate is None else f"{rate:.1%}"


def table(points: list[ServeMetrics]) -> str:
    """A Markdown table: metrics down, load points across."""
    body = [[label, *(fmt.format(get(m)) for m in points)] for label, get, fmt in ROWS]
    return markdown_table(["metric", *(m.label for m in points)], body)
