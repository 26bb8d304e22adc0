"""The data-parallel routing policy (stages/router/policy.py), without sockets: prefix affinity
wins while loads are balanced, the least loaded takes over past both imbalance thresholds, an
engine that is not ready is never chosen, round robin takes turns, and an engine's prefix map is
bounded by its reported KV capacity, device pool plus host tier."""

from __future__ import annotations

import pytest

from conveyor.stages.router.policy import EngineLoad, RoutingPolicy, RoutingSettings, prefix_hashes

BLOCK = 4


def ready_policy(name: str = "cache_aware", num_engines: int = 2, **settings) -> RoutingPolicy:
    policy = RoutingPolicy(name, num_engines, RoutingSettings(**settings))
    for e in range(num_engines):
        policy.set_ready(e, True)
    return policy


def prompt(prefix: int, tail: int, length: int = 32) -> list[int]:
    """`length` tokens: a shared head named by `prefix` (24 tokens), then a tail of its own."""
    return [prefix * 1000 + i for i in range(24)] + [tail * 1000 + 500 + i for i in range(length - 24)]


def test_prefix_hashes_chain_full_blocks_only():
    a = prefix_hashes(list(range(10)), BLOCK)
    b = prefix_hashes(list(range(8)) + [99, 98, 97], BLOCK)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    c = prefix_hashes([7] + list(range(1, 10)), BLOCK)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 renames every later block


def test_shared_prefix_goes_to_the_engine_that_holds_it():
    policy = ready_policy()
    first = policy.route(prefix_hashes(prompt(1, 0), BLOCK))
    assert first is not None and first.reason == "least_loaded"
    for tail in range(1, 6):
        route = policy.route(prefix_hashes(prompt(1, tail), BLOCK))
        assert route is not None
        assert (route.engine, route.reason, route.num_matched_blocks) == (first.engine, "affinity", 6)


def test_short_match_below_the_cache_threshold_goes_to_the_least_loaded():
    policy = ready_policy(cache_threshold=0.9)
    first = policy.route(prefix_hashes(prompt(1, 0), BLOCK))
    second = policy.route(prefix_hashes(prompt(1, 1), BLOCK))  # 6 of 8 blocks match: < 0.9
    assert first is not None and second is not None
    assert second.reason == "least_loaded" and second.engine != first.engine


def test_distinct_prompts_spread_evenly():
    policy = ready_policy()
    counts = [0, 0]
    for p in range(20):
        route = policy.route(prefix_hashes(prompt(p + 10, p), BLOCK))
        assert route is not None and route.reason == "least_loaded"
        counts[route.engine] += 1
    assert counts == [10, 10]


def test_distinct_prompts_one_at_a_time_alternate_over_idle_engines():
    """Each request has finished (an idle report) before the next: loads tie, the smaller map wins."""
    policy = ready_policy()
    engines = []
    for p in range(6):
        route = policy.route(prefix_hashes(prompt(p + 10, p), BLOCK))
        assert route is not None
        engines.append(route.engine)
        policy.report(route.engine, EngineLoad(num_kv_blocks=100, num_received=engines.count(route.engine)))
        assert policy.num_requests(route.engine) == 0
    assert engines == [0, 1, 0, 1, 0, 1]


def test_imbalance_past_both_thresholds_falls_back_to_least_loaded():
    policy = ready_policy(balance_abs_threshold=4, balance_rel_threshold=2.0)
    first = policy.route(prefix_hashes(prompt(1, 0), BLOCK))
    assert first is not None
    other = 1 - first.engine
    # The affine engine reports a long queue, the other one request: 9 - 1 > 4 and 9 > 2 * 1.
    policy.report(first.engine, EngineLoad(num_waiting=8, num_running=1, num_received=1))
    policy.report(other, EngineLoad(num_running=1))
    route = policy.route(prefix_hashes(prompt(1, 1), BLOCK))
    assert route is not None and (route.engine, route.reason) == (other, "least_loaded")


def test_imbalance_within_the_relative_threshold_keeps_affinity():
    policy = ready_policy(balance_abs_threshold=4, balance_rel_threshold=2.0)
    first = policy.route(prefix_hashes(prompt(1, 0), BLOCK))
    assert first is not None
    # 16 against 10: past the absolute threshold, not the relative one.
    policy.report(first.engine, EngineLoad(num_waiting=15, num_running=1, num_received=1))
    policy.report(1 - first.engine, EngineLoad(num_running=10))
    route = policy.route(prefix_hashes(prompt(1, 1), BLOCK))
    assert route is not None and (route.engine, route.reason) == (first.engine, "affinity")


def test_requests_in_transit_count_as_load_until_reported_received():
    policy = ready_policy("least_loaded")
    routes = [policy.route([]) for _ in range(4)]
    assert [r.engine for r in routes if r] == [0, 1, 0, 1]
    assert policy.num_requests(0) == 2
    policy.report(0, EngineLoad(num_running=2, num_received=2))  # received: counted as running
    assert policy.num_requests(0) == 2
    policy.report(0, EngineLoad(num_received=2))  # both finished
    assert policy.num_requests(0) == 0


def test_not_ready_engines_are_never_chosen():
    for name in ("cache_aware", "round_robin", "least_loaded"):
        policy = ready_policy(name, 3)
        first = policy.route(prefix_hashes(prompt(1, 0), BLOCK))
        assert first is not None
        policy.set_ready(first.engine, False)
        chosen = {r.engine for r in (policy.route(prefix_hashes(prompt(1, t), BLOCK)) for t in range(9)) if r}
        assert first.engine not in chosen and chosen, name
        for e in range(3):
            policy.set_ready(e, False)
        assert policy.route(prefix_hashes(prompt(1, 0), BLOCK)) is None


def test_round_robin_takes_turns_over_ready_engines():
    policy = ready_policy("round_robin", 3)
    same = prefix_hashes(prompt(1, 0), BLOCK)
    routes = [policy.route(same) for _ in range(6)]
    assert [r.engine for r in routes if r] == [0, 1, 2, 0, 1, 2]
    assert {r.reason for r in routes if r} == {"round_robin"}


def test_prefix_map_is_lru_bounded_by_reported_kv_capacity():
    policy = ready_policy(num_engines=1)
    policy.report(0, EngineLoad(num_kv_blocks=10))
    old = prefix_hashes(prompt(1, 0), BLOCK)  # 8 blocks
    policy.route(old)
    policy.route(prefix_hashes(prompt(2, 0), BLOCK))  # 8 more: the oldest 6 are evicted
    assert policy.num_mapped_blocks(0) == 10
    route = policy.route(old)
    assert route is not None and route.num_matched_blocks == 0
    policy.report(0, EngineLoad(num_kv_blocks=3))  # a smaller capacity trims at once
    assert policy.num_mapped_blocks(0) == 3


@pytest.mark.parametrize(("num_host_blocks", "reason", "num_matched"), [(0, "least_loaded", 0), (16, "affinity", 8)])
def test_a_host_tier_keeps_affinity_past_the_device_pool(num_host_blocks: int, reason: str, num_matched: int):
    """24 blocks routed to an engine whose pool holds 10: the first prompt's 8 are still a hit
    when its host tier keeps what the pool evicted (10 + 16 >= 24), and forgotten without one."""
    policy = ready_policy(num_engines=1)
    policy.report(0, EngineLoad(num_kv_blocks=10, num_host_blocks=num_host_blocks))
    first = prefix_hashes(prompt(1, 0), BLOCK)  # 8 blocks
    for p in (1, 2, 3):
        policy.route(prefix_hashes(prompt(p, 0), BLOCK))
    assert policy.num_mapped_blocks(0) == min(24, 10 + num_host_blocks)
    route = policy.route(first)
    assert route is not None and (route.reason, route.num_matched_blocks) == (reason, num_matched)


def test_forget_empties_a_restarted_engines_map_and_counts():
    policy = ready_policy()
    hashes = prefix_hashes(prompt(1, 0), BLOCK)
    first = policy.route(hashes)
    assert first is not None
    policy.forget(first.engine)
    assert policy.num_mapped_blocks(first.engine) == 0 and policy.num_requests(first.engine) == 0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        RoutingPolicy("random", 2)
