"""Metrics of one simulated run: throughput, latency percentiles, FastGen's effective throughput,
KV memory waste, the device's bubble.

`compute` reads a SimResult (simulator.py) and nothing else; report.py prints its Metrics and
`python -m conveyor.sim --json` writes them. Each metric's definition is docs/simulator.md's
("Metrics"), and the code keeps to it: all times are seconds of simulated clock, a request's tokens
stamped at the end of the step that produced them; the first token is TTFT's, never a token
latency; FastGen's SLA is `meets_sla`'s.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from conveyor.sim.simulator import RequestRecord, SimResult

SLA_PROMPT_TOKENS_PER_S = 512.0
SLA_GEN_TOKENS_PER_S = (2.0, 4.0, 6.0)
EMA_SPAN = 16


@dataclasses.dataclass(frozen=True)
class Metrics:
    num_requests: int
    duration_s: float
    request_throughput: float  # requests / s
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    ttft: dict[str, float]  # mean, p50, p90, p95, p99 (s)
    token_latency: dict[str, float]  # mean, p50, p90, p95, p99, max (s)
    tpot: dict[str, float]  # mean, p50, p90, p99 (s)
    e2e: dict[str, float]  # mean, p50, p90, p99 (s)
    effective_throughput: dict[float, float]  # generation SLA (tokens/s) -> requests / s
    kv_waste: float  # mean over steps of the unfilled fraction of held slots
    kv_usage: float  # mean over steps of held slots / pool slots
    prefix_cache_hit_rate: float  # prompt tokens the prefix cache supplied / prompt tokens
    num_preemptions: int
    num_steps: int  # forward passes
    mean_step_tokens: float
    bubble: float = 0.0  # device idle / duration
    num_plans: int = 0  # host plans (a multi-step window is one)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["effective_throughput"] = {str(k): v for k, v in self.effective_throughput.items()}
        return out


def _finish(r: RequestRecord) -> float:
    assert r.finish is not None, "simulate() raises unless every request finished"
    return r.finish


def compute(result: SimResult) -> Metrics:
    reqs = result.requests
    start = min(r.arrival for r in reqs)
    duration = max(_finish(r) for r in reqs) - start
    num_prompt = sum(r.num_prompt_tokens for r in reqs)
    num_output = sum(len(r.token_times) for r in reqs)
    gaps = np.concatenate([np.diff(r.token_times) for r in reqs] + [np.zeros(0)])
    tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in reqs if len(r.token_times) > 1]
    steps = result.steps
    held = [s for s in steps if s.kv_allocated]
    return Metrics(
        num_requests=len(reqs),
        duration_s=duration,
        request_throughput=len(reqs) / duration,
        output_throughput=num_output / duration,
        total_throughput=(num_prompt + num_output) / duration,
        ttft=summary([r.ttft for r in reqs], (50, 90, 95, 99)),
        token_latency={**summary(gaps, (50, 90, 95, 99)), "max": float(gaps.max()) if gaps.size else 0.0},
        tpot=summary(tpots, (50, 90, 99)),
        e2e=summary([_finish(r) - r.arrival for r in reqs], (50, 90, 99)),
        effective_throughput={n: sum(meets_sla(r, gen_tokens_per_s=n) for r in reqs) / duration for n in SLA_GEN_TOKENS_PER_S},
        kv_waste=float(np.mean([1 - s.kv_filled / s.kv_allocated for s in held])) if held else 0.0,
        kv_usage=float(np.mean([s.kv_allocated / result.num_kv_slots for s in steps])) if steps else 0.0,
        prefix_cache_hit_rate=sum(r.num_cached_tokens for r in reqs) / max(1, num_prompt),
        num_preemptions=result.num_preemptions,
        num_steps=len(steps),
        mean_step_tokens=float(np.mean([s.shape.num_tokens for s in steps])) if steps else 0.0,
        bubble=1.0 - sum(s.seconds for s in steps) / duration if duration > 0 else 0.0,
        num_plans=result.num_plans,
    )


def meets_sla(
    record: RequestRecord, *, prompt_tokens_per_s: float = SLA_PROMPT_TOKENS_PER_S, gen_tokens_per_s: float, ema_span: int = EMA_SPAN
) -> bool:
    """FastGen's per-request SLA: the prompt at >= 512 tokens/s, then generation at >= N tokens/s
    by the EMA of the token gaps (pandas ewm(span, adjust=True).mean(), every value < 1/N)."""
    if record.ttft > record.num_prompt_tokens / prompt_tokens_per_s:
        return False
    decay = 1.0 - 2.0 / (ema_span + 1)
    num = den = 0.0
    for gap in np.diff(record.token_times):
        num, den = gap + decay * num, 1.0 + decay * den
        if num / den >= 1.0 / gen_tokens_per_s:
            return False
    return True


def summary(values, percentiles: tuple[int, ...]) -> dict[str, float]:
    """The mean and the given percentiles (numpy's linear interpolation); zeros when empty."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in percentiles}}
    return {"mean": float(values.mean()), **{f"p{p}": float(np.percentile(values, p)) for p in percentiles}}
