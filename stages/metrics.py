"""Every Prometheus metric a stage records, defined once so names stay stable.

Stage processes run in prometheus-client's multiprocess mode (the launcher sets
PROMETHEUS_MULTIPROC_DIR to a folder in the run directory before they start); the ingress serves
the merged view at /metrics. Names are `conveyor_*`, base units, `_total` on counters.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

# Gauges owned by the single scheduler process: the most recent value is the truth.
kv_blocks_used = Gauge(
    "conveyor_kv_blocks_used", "KV cache blocks held by sequences", multiprocess_mode="livemostrecent"
)
kv_blocks_total = Gauge(
    "conveyor_kv_blocks_total", "KV cache blocks in the pool", multiprocess_mode="livemostrecent"
)
requests_running = Gauge(
    "conveyor_requests_running", "Sequences in the running batch", multiprocess_mode="livemostrecent"
)
requests_waiting = Gauge(
    "conveyor_requests_waiting", "Sequences waiting to be scheduled", multiprocess_mode="livemostrecent"
)

prompt_tokens = Counter("conveyor_prompt_tokens", "Prompt tokens of admitted requests")
generation_tokens = Counter("conveyor_generation_tokens", "Tokens generated")
steps = Counter("conveyor_scheduler_steps", "Forward passes planned")
preemptions = Counter("conveyor_preemptions", "Sequences preempted by recomputation")
prefix_cache_queries = Counter("conveyor_prefix_cache_queries", "Full KV blocks looked up in the prefix cache")
prefix_cache_hits = Counter("conveyor_prefix_cache_hits", "Full KV blocks found in the prefix cache")
rejections = Counter("conveyor_rejections", "Requests refused because the waiting queue was full")
