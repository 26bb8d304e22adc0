"""RouterConfig: the settings of `conveyor router`, declared once as option() fields (config/
options.py), so the flags, their defaults and their help come from here.

The replicas are given as base URLs, comma-separated (`--backends http://a:8000,http://b:8000`),
each http(s) with a host; or found by DNS (`--backends-dns HOST:PORT`, discovery.py). The
routing thresholds default to the data-parallel router's (conveyor.stages.router.policy's
RoutingSettings), so the two layers start from the same balance.
"""

from __future__ import annotations

import argparse
import dataclasses
from urllib.parse import urlsplit

from conveyor.config.engine import ROUTING_POLICIES
from conveyor.config.options import option
from conveyor.stages.router.policy import RoutingSettings

_DEFAULTS = RoutingSettings()


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...] = ()  # replica base URLs, without a trailing slash (--backends)
    backends_dns: str | None = None  # HOST:PORT whose addresses are the replicas (--backends-dns)
    host: str = option("127.0.0.1", "address the router listens on")
    port: int = option(8080, "TCP port of the router")
    routing_policy: str = option(
        "cache_aware",
        "how a replica is picked: cache_aware (prefix affinity, then load), round_robin, least_loaded",
        choices=ROUTING_POLICIES,
    )
    chunk_chars: int = option(64, "prompt characters per hashed chunk (about a KV block of 16 tokens)", minimum=1)
    cache_threshold: float = option(_DEFAULTS.cache_threshold, "share of a prompt's chunks a replica must hold to win by affinity")
    balance_abs_threshold: int = option(
        _DEFAULTS.balance_abs_threshold, "in-flight difference (requests) below which loads count as balanced", minimum=0
    )
    balance_rel_threshold: float = option(
        _DEFAULTS.balance_rel_threshold, "and the busiest must hold more than this times the idlest's requests"
    )
    max_replicas: int = option(64, "replicas --backends-dns may find at most", minimum=1)
    health_interval: float = option(2.0, "seconds between /health checks of each replica", positive=True)
    connect_timeout: float = option(5.0, "seconds to open a connection to a replica before trying another", positive=True)

    @property
    def routing_settings(self) -> RoutingSettings:
        return RoutingSettings(self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold)


def parse_backends(text: str) -> tuple[str, ...]:
    """`--backends`: comma-separated base URLs, each http(s)://host[:port][/prefix]."""
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    if not urls:
        raise argparse.ArgumentTypeError("name at least one backend URL")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise argparse.ArgumentTypeError(f"not an http(s) URL with a host: {url!r}")
    if len(set(urls)) != len(urls):
        raise argparse.ArgumentTypeError("a backend is named twice")
    return urls
