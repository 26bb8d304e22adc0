"""Routing: which engine (or replica) serves a request. Pure Python: no zmq, no msgspec, no torch.

The router stage (main.py) drives one for a daemon's data-parallel engines, the HTTP replica
router (stages/replica_router/replicas.py) one for whole daemons. The interface, kept stable:

    policy = RoutingPolicy("cache_aware", num_engines=2)
    policy.set_ready(engine, True)                  # never route to an engine not ready
    policy.report(engine, EngineLoad(...))           # its latest load report
    route = policy.route(prefix_hashes(token_ids, block_size))   # None: no engine is ready
    route.engine, route.reason                       # reason: affinity | least_loaded | round_robin
    policy.forget(engine)                            # it restarted: its cache and counts are gone

Invariants: a block's hash names the whole prefix up to its end, as the scheduler's prefix cache
names its blocks; an engine's map never outgrows its reported KV capacity, its device pool plus
its host tier (--kv-offloading-size), since a prefix hit in either saves the recompute; a routed
request counts against its engine until the engine reports it received. The policies:
docs/architecture.md, 2b.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Literal

ROOT_HASH = 0x9E3779B97F4A7C15  # the "parent" of a prompt's first block
DEFAULT_MAP_BLOCKS = 1 << 16  # an engine's map bound before its first report names its capacity

Reason = Literal["affinity", "least_loaded", "round_robin"]
REASONS: tuple[Reason, ...] = ("affinity", "least_loaded", "round_robin")


def prefix_hashes(items: Sequence[Hashable], block_size: int) -> list[int]:
    """One chained hash per full block of `items`: hash i names items[: (i + 1) * block_size].
    Any hashable items: token ids for the router stage, characters for the replica router, which
    never tokenizes."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(items) - block_size + 1, block_size):
        parent = hash((parent, tuple(items[start : start + block_size])))
        hashes.append(parent)
    return hashes


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """What an engine last reported. `num_received`: requests it has been sent and received since
    it started; the policy counts those routed to it but not yet received on top of its queue."""

    num_waiting: int = 0
    num_running: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks: int = 0  # its device pool's capacity, in blocks (0: not known yet)
    num_received: int = 0
    num_host_blocks: int = 0  # its host tier's capacity, in blocks (0: none)


@dataclasses.dataclass(frozen=True)
class RoutingSettings:
    cache_threshold: float = 0.5  # the best match must cover this share of a prompt's blocks
    balance_abs_threshold: int = 32  # requests: below this difference loads count as balanced
    balance_rel_threshold: float = 1.5  # and the busiest must hold more than this times the idlest


@dataclasses.dataclass(frozen=True)
class Route:
    engine: int
    reason: Reason
    num_matched_blocks: int = 0  # of the request's blocks, the chosen engine's map held these


class _Engine:
    """The policy's view of one engine: readiness, its last report, its approximate prefix map."""

    def __init__(self) -> None:
        self.ready = False
        self.load = EngineLoad()
        self.num_routed = 0  # requests routed to it since it (re)started
        self.blocks: OrderedDict[int, None] = OrderedDict()  # block hash -> None, LRU first

    @property
    def num_requests(self) -> int:
        in_transit = max(0, self.num_routed - self.load.num_received)
        return self.load.num_waiting + self.load.num_running + in_transit

    @property
    def kv_usage(self) -> float:
        return self.load.num_kv_blocks_used / self.load.num_kv_blocks if self.load.num_kv_blocks else 0.0

    @property
    def map_capacity(self) -> int:
        """Blocks the engine's prefix cache can hold: what the device pool evicts, the host tier
        keeps, so the map remembers as many as both."""
        if not self.load.num_kv_blocks:
            return DEFAULT_MAP_BLOCKS
        return self.load.num_kv_blocks + self.load.num_host_blocks

    def num_matched(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        self.trim()

    def trim(self) -> None:
        while len(self.blocks) > self.map_capacity:
            self.blocks.popitem(last=False)


class RoutingPolicy:
    """round_robin: the ready engines in turn. least_loaded: `_least_loaded`. cache_aware
    (SGLang's cache-aware router, without its radix tree): an approximate map per engine of the
    block hashes it was sent, LRU-bounded by its KV capacity (device pool + host tier); an
    imbalanced set of engines sends the request to the least loaded, else the longest match (ties
    to the less loaded) wins if it covers `cache_threshold` of the prompt's blocks, else the least
    loaded. Either way the request's hashes join the chosen engine's map."""

    def __init__(self, policy: str, num_engines: int, settings: RoutingSettings = RoutingSettings()):
        if policy not in ("cache_aware", "round_robin", "least_loaded"):
            raise ValueError(f"unknown routing policy {policy!r}")
        if num_engines < 1:
            raise ValueError("num_engines must be at least 1")
        self.policy = policy
        self.settings = settings
        self._engines = [_Engine() for _ in range(num_engines)]
        self._turn = itertools.count()

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    def is_ready(self, engine: int) -> bool:
        return self._engines[engine].ready

    def ready_engines(self) -> list[int]:
        return [i for i, e in enumerate(self._engines) if e.ready]

    def set_ready(self, engine: int, ready: bool) -> None:
        self._engines[engine].ready = ready

    def report(self, engine: int, load: EngineLoad) -> None:
        e = self._engines[engine]
        e.load = load
        e.trim()

    def forget(self, engine: int) -> None:
        """The engine restarted (or died): its KV cache, queue and counts start from nothing."""
        e = self._engines[engine]
        e.load, e.num_routed = EngineLoad(), 0
        e.blocks.clear()

    def num_requests(self, engine: int) -> int:
        """Requests the policy counts against `engine`: waiting, running, routed but not received."""
        return self._engines[engine].num_requests

    def num_mapped_blocks(self, engine: int) -> int:
        return len(self._engines[engine].blocks)

    def route(self, hashes: Sequence[int]) -> Route | None:
        """Pick the engine for a request whose prompt has these block hashes, and count it there.
        None when no engine is ready."""
        ready = self.ready_engines()
        if not ready:
            return None
        if self.policy == "round_robin":
            route = Route(ready[next(self._turn) % len(ready)], "round_robin")
        elif self.policy == "least_loaded":
            route = Route(self._least_loaded(ready), "least_loaded")
        else:
            route = self._cache_aware(ready, hashes)
        chosen = self._engines[route.engine]
        chosen.num_routed += 1
        chosen.insert(hashes)
        return route

    def _least_loaded(self, ready: list[int]) -> int:
        """The fewest requests (waiting + running + routed but not yet received), then the lowest
        KV use, then the smallest prefix map (the most room for a new prefix, as SGLang sends a
        cache miss to the smallest tree), then the fewest routed, then the lowest index."""

        def load(i: int) -> tuple[int, float, int, int, int]:
            e = self._engines[i]
            return e.num_requests, e.kv_usage, len(e.blocks), e.num_routed, i

        return min(ready, key=load)

    def _is_imbalanced(self, ready: list[int]) -> bool:
        """Loads differ by more than balance_abs_threshold requests and the busiest holds more
        than balance_rel_threshold times the idlest's: a cache hit is then worth less than a queue."""
        loads = [self._engines[i].num_requests for i in ready]
        busiest, idlest = max(loads), min(loads)
        s = self.settings
        return busiest - idlest > s.balance_abs_threshold and busiest > idlest * s.balance_rel_threshold

    def _cache_aware(self, ready: list[int], hashes: Sequence[int]) -> Route:
        if not hashes or self._is_imbalanced(ready):
            return Route(self._least_loaded(ready), "least_loaded")
        matched = {i: self._engines[i].num_matched(hashes) for i in ready}
        best = max(ready, key=lambda i: (matched[i], -self._engines[i].num_requests, -i))
        if matched[best] and matched[best] >= self.settings.cache_threshold * len(hashes):
            return Route(best, "affinity", matched[best])
        engine = self._least_loaded(ready)
        return Route(engine, "least_loaded", matched[engine])
