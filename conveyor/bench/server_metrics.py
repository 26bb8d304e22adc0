"""The server's own view of a run, from its Prometheus metrics: the prefix cache hit rate, the
share of it that the KV host tier supplied, and the size of the KV pool.

`scrape` reads GET /metrics once and keeps the prefix cache counters; a load point scrapes before
its first request and after its last, and `hit_rate` is the share of the lookups in between that
hit (`host_hit_rate`: the share the host tier held; those count as hits too). Counters are summed
over their labels, so an engine label (one series per data-parallel engine) or a replica label
changes nothing. A server that exports no such counters (or no /metrics at all) gives None, and
the report leaves the row blank. Behind `conveyor router`, whose /metrics are its own,
`--metrics-url` names the replicas, and their counters (and KV pools) are added up.

Names: conveyor's, taken from stages/metrics.py (they count full KV blocks); vLLM's, which count
tokens, as a second choice, so the same client reports a vLLM server's rate too.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from conveyor.stages.metrics import kv_host_hits, kv_tokens_capacity, prefix_cache_hits, prefix_cache_queries

# (lookups, hits) counter families, without the `_total` suffix, in order of preference.
PREFIX_CACHE_COUNTERS = (
    (prefix_cache_queries.describe()[0].name, prefix_cache_hits.describe()[0].name),
    ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"),
)
KV_HOST_HITS = f"{kv_host_hits.describe()[0].name}_total"  # conveyor's, with --kv-offloading-size
KV_POOL_TOKENS = kv_tokens_capacity.describe()[0].name  # a gauge, one per engine


@dataclasses.dataclass(frozen=True)
class PrefixCacheCounts:
    queries: float  # blocks (conveyor) or tokens (vLLM) looked up since the server started
    hits: float
    host_hits: float | None = None  # blocks the host tier supplied (None: the server has no such counter)


async def scrape_all(session: aiohttp.ClientSession, base_urls: Sequence[str]) -> PrefixCacheCounts | None:
    """The counters summed over several servers (the replicas behind a router), or None unless
    every one of them tells."""
    counts = await asyncio.gather(*(scrape(session, url) for url in base_urls))
    known = [c for c in counts if c is not None]
    if not counts or len(known) < len(counts):
        return None
    host = [c.host_hits for c in known if c.host_hits is not None]
    return PrefixCacheCounts(
        queries=sum(c.queries for c in known),
        hits=sum(c.hits for c in known),
        host_hits=sum(host) if len(host) == len(known) else None,
    )


async def scrape(session: aiohttp.ClientSession, base_url: str) -> PrefixCacheCounts | None:
    """The prefix cache counters now, or None if /metrics does not answer or lacks them."""
    text = await _metrics_text(session, base_url)
    return None if text is None else prefix_cache_counts(text)


async def kv_pool_tokens(session: aiohttp.ClientSession, base_urls: Sequence[str]) -> float | None:
    """Tokens the servers' KV pools hold together (conveyor's gauge), or None unless every one tells."""
    total = 0.0
    for url in base_urls:
        text = await _metrics_text(session, url)
        try:
            value = None if text is None else sample_totals(text).get(KV_POOL_TOKENS)
        except ValueError:  # not the Prometheus text format
            value = None
        if not value:
            return None
        total += value
    return total


async def _metrics_text(session: aiohttp.ClientSession, base_url: str) -> str | None:
    try:
        async with session.get(base_url + "/metrics") as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def prefix_cache_counts(text: str) -> PrefixCacheCounts | None:
    """The first known pair of counters in a Prometheus text exposition, summed over labels."""
    try:
        totals = sample_totals(text)
    except ValueError:  # not the Prometheus text format
        return None
    for queries, hits in PREFIX_CACHE_COUNTERS:
        if f"{queries}_total" in totals and f"{hits}_total" in totals:
            host_hits = totals.get(KV_HOST_HITS)  # conveyor's; vLLM's pair comes without one
            return PrefixCacheCounts(queries=totals[f"{queries}_total"], hits=totals[f"{hits}_total"], host_hits=host_hits)
    return None


def sample_totals(text: str) -> dict[str, float]:
    """Each sample name's values summed over every label set. By sample name, not family: an
    exposition may declare a counter's TYPE with or without its `_total`, and the parser groups
    the samples differently for each."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def hit_rate(before: PrefixCacheCounts | None, after: PrefixCacheCounts | None) -> float | None:
    """Hits / lookups between two scrapes; None without both, without lookups, or across a
    restart (a counter that went down)."""
    if before is None or after is None:
        return None
    queries, hits = after.queries - before.queries, after.hits - before.hits
    if queries <= 0 or hits < 0:
        return None
    return hits / queries


def host_hit_rate(before: PrefixCacheCounts | None, after: PrefixCacheCounts | None) -> float | None:
    """Blocks the host tier supplied / lookups between two scrapes; None as `hit_rate`, or when
    the server counts no host-tier hits."""
    if before is None or after is None or before.host_hits is None or after.host_hits is None:
        return None
    queries, hits = after.queries - before.queries, after.host_hits - before.host_hits
    if queries <= 0 or hits < 0:
        return None
    return hits / queries
