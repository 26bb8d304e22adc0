"""Every Prometheus metric a stage records, defined once so names stay stable.

Each stage imports its metrics from here and records them itself; in an engine's processes (a
scheduler, a worker rank) the stage entry point calls `bind_engine` first. Stages run in
prometheus-client's multiprocess mode (the launcher sets PROMETHEUS_MULTIPROC_DIR to a folder of
the run directory before they start); the ingress serves the merged view at /metrics.

Invariants:
- names are `conveyor_*`, base units (seconds, bytes), `_total` on counters (the client adds it),
  ratios in 0..1, no per-request labels; dashboards and alert rules in ops/ query these names:
  rename nothing without changing them.
- an engine's own metrics (`_per_engine` below) carry an `engine` label (0 with one engine) under
  their unlabelled names, so `sum(...)` reads the whole daemon and `sum by (engine)` each engine;
  what stages serving every engine record (the ingress's request histograms, the hops) and the
  finish reasons, whose zero series come from every process, stay unlabelled.
"""

from __future__ import annotations

import bisect
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from conveyor.stages.runtime import STAGES
from conveyor.wire.messages import FinishReason

# Latency buckets from 1 ms to 5 min; token-count buckets in powers of two.
_SECONDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    300.0,
)
_STEP_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TOKENS = tuple(float(2**i) for i in range(15))


_labels = {"engine": "0", "device": ""}  # this process's engine and device (bind_engine)


class PerEngine:
    """A metric with an `engine` label, used as if it had none: `.inc()`, `.set()`, `.observe()`
    go to this process's engine's series. The series is made at first use (or by bind_engine), so
    a process that never records one (a tokenizer) writes no 0 into an engine's live gauge."""

    def __init__(self, metric: Any, label_names: tuple[str, ...], *, gauge: bool = False):
        self.metric = metric
        self.label_names = label_names
        self.gauge = gauge
        self._child: Any = None

    def series(self) -> Any:
        """This process's engine's series (made now if it was not)."""
        if self._child is None:
            self._child = self.metric.labels(*(_labels[name] for name in self.label_names))
        return self._child

    def __getattr__(self, name: str) -> Any:
        return getattr(self.series(), name)


_PER_ENGINE: list[PerEngine] = []


def bind_engine(engine: int, device: str = "") -> None:
    """This process is (part of) engine `engine` (a scheduler, a worker rank; the stage entry point
    calls this before the stage runs), on `device` (ParallelConfig.device_label: the worker's
    metrics say which, so an emulated device's figures are never taken for a real one's): its
    engine metrics carry those labels, and its counters and histograms show 0 from the first
    scrape, as unlabelled ones would. Gauges are left to be set: a 0 from a worker rank would be
    the most recent value of its scheduler's gauge."""
    _labels.update(engine=str(engine), device=device)
    for metric in _PER_ENGINE:
        if not metric.gauge:
            metric.series()


def _per_engine(metric_type: Any, name: str, doc: str, *, per_device: bool = False, **kwargs: Any) -> Any:
    label_names = ("engine", "device") if per_device else ("engine",)
    metric = PerEngine(metric_type(name, doc, list(label_names), **kwargs), label_names, gauge=metric_type is Gauge)
    _PER_ENGINE.append(metric)
    return metric


def _gauge(name: str, doc: str) -> Any:
    # Owned by one process (its engine's scheduler): the most recent value of a live process is the truth.
    return _per_engine(Gauge, name, doc, multiprocess_mode="livemostrecent")


# --- request lifecycle (histograms): the ingress's, and per engine the scheduler's --------
queue_time = _per_engine(
    Histogram, "conveyor_request_queue_time_seconds", "Arrival at the ingress to first scheduled", buckets=_SECONDS
)
time_to_first_token = Histogram(
    "conveyor_time_to_first_token_seconds", "Arrival to the first token sent to the client", buckets=_SECONDS
)
inter_token_latency = Histogram(
    "conveyor_inter_token_latency_seconds", "Time between consecutive tokens sent to the client", buckets=_SECONDS
)
time_per_output_token = Histogram(
    "conveyor_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1), per request", buckets=_SECONDS
)
e2e_latency = Histogram("conveyor_e2e_request_latency_seconds", "Arrival to the last token", buckets=_SECONDS)
prefill_time = _per_engine(Histogram, "conveyor_request_prefill_time_seconds", "First scheduled to first token", buckets=_SECONDS)
decode_time = _per_engine(Histogram, "conveyor_request_decode_time_seconds", "First token to finish", buckets=_SECONDS)
request_prompt_tokens = Histogram("conveyor_request_prompt_tokens", "Prompt tokens per request", buckets=_TOKENS)
request_generation_tokens = Histogram("conveyor_request_generation_tokens", "Generated tokens per request", buckets=_TOKENS)

# --- the GPU bubble (worker) and the scheduler's own time ----------------------------------
# Labelled with the device too: "emulated-h100" marks a modelled device's (gpu/emulated/) figures.
worker_busy = _per_engine(Counter, "conveyor_worker_busy_seconds", "Device time spent computing steps", per_device=True)
worker_idle = _per_engine(
    Counter, "conveyor_worker_idle_seconds", "Device time spent waiting for the host between steps", per_device=True
)
# The emulated device's model of a GPU host's CPU that this host did not spend (gpu/emulated/stream.py:
# launches, eager forwards, spin-waits); `conveyor bench cpu` adds it to the worker's. 0 on a real device.
worker_emulated_host_cpu = _per_engine(
    Counter,
    "conveyor_worker_emulated_host_cpu_seconds",
    "CPU a GPU host would spend that the emulated device modelled (launches, eager forwards, spin-waits)",
    per_device=True,
)
kv_load_seconds = _per_engine(
    Histogram,
    "conveyor_kv_load_seconds",
    "KV host tier: one batch of a plan's loads to the device (for its own pass, or the next plan's), from when it could start",
    buckets=_STEP_SECONDS,
    per_device=True,
)
worker_step_busy = _per_engine(
    Histogram, "conveyor_worker_step_busy_seconds", "Device compute time per step", buckets=_STEP_SECONDS, per_device=True
)
worker_step_idle = _per_engine(
    Histogram, "conveyor_worker_step_idle_seconds", "Device idle time before each step", buckets=_STEP_SECONDS, per_device=True
)
scheduler_step_time = _per_engine(
    Histogram, "conveyor_scheduler_step_seconds", "Scheduler CPU time to plan one step", buckets=_STEP_SECONDS
)

# --- per-stage latency: the time each request spends in each hop, each stage its own ------
STAGE_HOPS = ("ingress", "tokenizer", "scheduler_queue", "worker", "detokenizer", "return")
stage_latency = Histogram("conveyor_stage_latency_seconds", "Time a request spends in each stage hop", ["stage"], buckets=_SECONDS)

# --- gauges (scheduler) --------------------------------------------------------------------
requests_running = _gauge("conveyor_requests_running", "Sequences in the running batch")
requests_waiting = _gauge("conveyor_requests_waiting", "Sequences waiting to be scheduled")
requests_preempted = _gauge("conveyor_requests_preempted", "Waiting sequences that were preempted")
kv_cache_usage = _gauge("conveyor_kv_cache_usage_ratio", "Fraction of KV blocks held by sequences")
kv_blocks_free = _gauge("conveyor_kv_blocks_free", "KV blocks free (cached or empty)")
kv_blocks_used = _gauge("conveyor_kv_blocks_used", "KV cache blocks held by sequences")
kv_blocks_capacity = _gauge("conveyor_kv_blocks_capacity", "KV cache blocks in the pool")
kv_tokens_capacity = _gauge("conveyor_kv_cache_capacity_tokens", "Tokens the KV pool holds (blocks x block size)")
kv_host_blocks_used = _gauge("conveyor_kv_host_blocks_used", "KV blocks the host tier holds (--kv-offloading-size)")
kv_host_blocks_capacity = _gauge("conveyor_kv_host_blocks_capacity", "KV blocks the host tier can hold")
# The Prometheus info idiom: always 1, its kv_cache_dtype label says what the cache stores
# (float8_e4m3fn with --kv-cache-dtype fp8, else the model's dtype). Set once by the scheduler.
kv_cache_info = Gauge(
    "conveyor_kv_cache_info",
    "What the KV cache stores (the kv_cache_dtype label); always 1",
    ["engine", "kv_cache_dtype"],
    multiprocess_mode="livemostrecent",
)

# --- counters (the scheduler's; errors the ingress's) --------------------------------------
prompt_tokens = _per_engine(Counter, "conveyor_prompt_tokens", "Prompt tokens of admitted requests")
generation_tokens = _per_engine(Counter, "conveyor_generation_tokens", "Tokens generated")
steps = _per_engine(Counter, "conveyor_scheduler_steps", "Forward passes planned")
prefix_cache_queries = _per_engine(Counter, "conveyor_prefix_cache_queries", "Full KV blocks looked up in the prefix cache")
prefix_cache_hits = _per_engine(Counter, "conveyor_prefix_cache_hits", "Full KV blocks found in the prefix cache")
kv_host_hits = _per_engine(Counter, "conveyor_kv_host_hits", "Full KV blocks the device missed and the host tier held")
kv_disk_hits = _per_engine(
    Counter, "conveyor_kv_disk_hits", "Full KV blocks the device and the host tier missed, read from the disk tier (--kv-disk-dir)"
)
kv_disk_misses = _per_engine(
    Counter, "conveyor_kv_disk_misses", "Reads from the KV disk tier that found no valid file (computed again instead)"
)
kv_bytes_to_host = _per_engine(Counter, "conveyor_kv_offload_bytes_to_host", "KV bytes copied to the host tier (each rank's)")
kv_bytes_to_device = _per_engine(Counter, "conveyor_kv_offload_bytes_to_device", "KV bytes loaded back from the host tier")
preemptions = _per_engine(Counter, "conveyor_preemptions", "Sequences preempted by recomputation")
aborts = _per_engine(Counter, "conveyor_aborts", "Requests aborted (client gone, or cancelled)")
rejections = _per_engine(Counter, "conveyor_rejections", "Requests refused because the waiting queue was full")
requests_finished = Counter("conveyor_requests_finished", "Finished requests by finish reason", ["finish_reason"])
# Speculative decoding (the scheduler's, from StepResult.spec_rows): acceptance rate is accepted /
# draft; mean accepted length per verifying step is 1 + accepted / verify_steps.
spec_draft_tokens = _per_engine(Counter, "conveyor_spec_decode_draft_tokens", "Draft tokens verified")
spec_accepted_tokens = _per_engine(Counter, "conveyor_spec_decode_accepted_tokens", "Draft tokens accepted")
spec_verify_steps = _per_engine(Counter, "conveyor_spec_decode_verify_steps", "Rows that verified drafts (one per sequence per step)")
_BY_POSITION = "by position in the draft (0: the first)"
spec_draft_by_position = Counter(
    "conveyor_spec_decode_draft_tokens_per_pos", f"Draft tokens verified, {_BY_POSITION}", ["engine", "position"]
)
spec_accepted_by_position = Counter(
    "conveyor_spec_decode_accepted_tokens_per_pos", f"Draft tokens accepted, {_BY_POSITION}", ["engine", "position"]
)


def record_speculation(rows: list[tuple[int, int, int]]) -> None:
    """One result's verifying rows, (seq_id, drafts, accepted) each, into the spec_decode counters."""
    if not rows:
        return
    engine = _labels["engine"]
    spec_verify_steps.inc(len(rows))
    spec_draft_tokens.inc(sum(d for _, d, _ in rows))
    spec_accepted_tokens.inc(sum(a for _, _, a in rows))
    for _, drafted, accepted in rows:
        for position in range(drafted):
            spec_draft_by_position.labels(engine, str(position)).inc()
            if position < accepted:
                spec_accepted_by_position.labels(engine, str(position)).inc()


# --- LoRA adapters (the scheduler's: stages/scheduler/adapters.py) -------------------------
lora_requests = Counter("conveyor_lora_requests", "Requests admitted, by adapter (base: none)", ["engine", "adapter"])
lora_resident = _gauge("conveyor_lora_adapters_resident", "LoRA adapters in the worker's slots")
lora_loads = _per_engine(Counter, "conveyor_lora_adapter_loads", "Adapters placed in a slot")
lora_evictions = _per_engine(Counter, "conveyor_lora_adapter_evictions", "Adapters evicted from a slot for another")

errors = Counter("conveyor_errors", "Error answers by type", ["type"])

# --- router (data parallelism; reasons: stages/router/policy.py's REASONS) -------------------
routed = Counter("conveyor_router_requests", "Requests routed to an engine, by why it was chosen", ["engine", "reason"])
routed_unavailable = Counter("conveyor_router_unavailable", "Requests refused because no engine was ready")
# Counted by the restarted process itself at start (the launcher records no metrics).
stage_restarts = Counter("conveyor_stage_restarts", "Stage processes restarted after dying or stalling", ["stage"])


class Tally:
    """Observations of an unlabelled histogram counted in this process, written to it by `flush`.

    For a histogram observed per token (the ingress's inter-token latency): in multiprocess mode
    every observe is two locked writes to the shared file and a getpid(), about 3 us, per token;
    tallied, the writes happen once per flush (per message), one per bucket touched. The buckets
    hold what observe would have put there (each value in the first bucket whose bound is not
    below it), so the exposition is the same."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.bounds: list[float] = list(histogram._upper_bounds)  # prometheus-client's, ending in +Inf
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count

    def flush(self) -> None:
        if not any(self.counts):
            return
        for bucket, count in zip(self.histogram._buckets, self.counts):
            if count:
                bucket.inc(count)
        self.histogram._sum.inc(self.total)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0


def zero_series(metric: Counter | Histogram, label_values) -> None:
    """Create a labelled metric's series for each known value now, at 0, rather than at its first
    event: a dashboard then shows a rate of 0, not "no data", and an alert on `increase()` sees the
    first error. In multiprocess mode creating the child writes its 0 into this process's file."""
    for value in label_values:
        metric.labels(value)


# Every process that imports this module (each stage does) contributes the zeros; the ingress adds
# the error types it answers with (errors.py), which only it knows.
zero_series(stage_latency, STAGE_HOPS)
zero_series(requests_finished, sorted({reason.openai for reason in FinishReason}))
zero_series(stage_restarts, STAGES)
