"""The router's own Prometheus metrics, in a registry of its own (the replicas export theirs;
scrape them directly). Named apart from the data-parallel router stage's conveyor_router_*
(stages/metrics.py), which count engines inside one daemon. Labelled by replica URL: a handful
of series per replica.

  conveyor_replica_router_requests_total{replica, reason}  requests routed, by why (affinity,
                                                           least_loaded, round_robin)
  conveyor_replica_router_failures_total{replica}          connections to it that failed
  conveyor_replica_router_in_flight{replica}               requests in flight through the router
  conveyor_replica_router_ready{replica}                   1 while its /health is 200
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from conveyor.stages.replica_router.replicas import Replicas
from conveyor.stages.router.policy import REASONS


class RouterMetrics:
    def __init__(self, replicas: Replicas):
        self.replicas = replicas
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "conveyor_replica_router_requests", "Requests routed, by replica and reason", ["replica", "reason"], registry=self.registry
        )
        self.failures = Counter(
            "conveyor_replica_router_failures", "Failed connections to a replica", ["replica"], registry=self.registry
        )
        self.in_flight = Gauge("conveyor_replica_router_in_flight", "Requests in flight", ["replica"], registry=self.registry)
        self.ready = Gauge(
            "conveyor_replica_router_ready", "1 while the replica's /health is 200", ["replica"], registry=self.registry
        )
        for r in replicas.replicas:  # every series exists from the start, at zero
            for reason in REASONS:
                self.requests.labels(r.url, reason)
            self.failures.labels(r.url)

    def exposition(self) -> bytes:
        """The text format, with the gauges read from the replicas now."""
        self.in_flight.clear()  # replicas that left have no series
        self.ready.clear()
        for r in self.replicas.active:
            self.in_flight.labels(r.url).set(r.num_in_flight)
            self.ready.labels(r.url).set(int(r.ready))
        return generate_latest(self.registry)
