"""stages.metrics.Tally: a histogram's observations counted in-process and written once per
flush must expose exactly what observing each would have."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from conveyor.stages.metrics import Tally

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def samples(registry: CollectorRegistry) -> dict[str, float]:
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }


def test_a_tally_exposes_what_each_observation_would():
    direct_registry, tallied_registry = CollectorRegistry(), CollectorRegistry()
    direct = Histogram("latency_seconds", "x", buckets=BUCKETS, registry=direct_registry)
    tally = Tally(Histogram("latency_seconds", "x", buckets=BUCKETS, registry=tallied_registry))
    batches = [[(0.0005, 1), (0.01, 3)], [(0.5, 2), (7.0, 1), (0.001, 1)], []]
    for batch in batches:
        for value, count in batch:
            for _ in range(count):
                direct.observe(value)
            tally.observe(value, count)
        tally.flush()
    assert samples(tallied_registry) == samples(direct_registry)
    assert samples(direct_registry)["latency_seconds_count[]"] == 8


def test_nothing_is_written_before_a_flush():
    registry = CollectorRegistry()
    tally = Tally(Histogram("gap_seconds", "x", buckets=BUCKETS, registry=registry))
    tally.observe(0.02, 5)
    assert samples(registry)["gap_seconds_count[]"] == 0
    tally.flush()
    assert samples(registry)["gap_seconds_count[]"] == 5 and samples(registry)["gap_seconds_sum[]"] == 0.1
