"""The replicas as the router sees them: which are ready, how many requests each has in flight,
and the routing policy (stages/router/policy.py) that picks one for a request.

A replica's load is its requests in flight through this router: the policy is told after every
pick and every finish (`num_running` = in flight, `num_received` = routed, so it counts nothing
in transit). In place of KV use, which only the replica knows, it is told how full the policy's
own prefix map for the replica is: between equally busy replicas a new prefix then goes to the
one holding fewer, so distinct prompts spread even when they arrive one at a time.

Readiness comes from the health poller (health.py) and from the proxy, which marks a replica not
ready the moment a connection to it fails. A replica that comes back after being
ready before is forgotten first: it most likely restarted, and its prefix cache with it.

Replicas found by DNS (discovery.py) come and go: each takes a slot of the policy (which counts a
fixed number of engines), and one that leaves gives its slot back, forgotten, once its last
request in flight has finished, so an old request's finish never counts against a new replica.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from conveyor.stages.router.policy import DEFAULT_MAP_BLOCKS, EngineLoad, Route, RoutingPolicy, RoutingSettings

log = logging.getLogger(__name__)
DEFAULT_SETTINGS = RoutingSettings()
MAP_CHUNKS = DEFAULT_MAP_BLOCKS  # prompt chunks remembered per replica, least recently sent dropped first


@dataclasses.dataclass
class Replica:
    url: str
    ready: bool = False
    was_ready: bool = False  # ready at least once: a return to ready means a restart
    num_in_flight: int = 0
    num_routed: int = 0  # since it was last forgotten
    num_failures: int = 0  # connections that failed, ever
    active: bool = True  # False: discovery no longer lists it (its slot is free once it is idle)


class Replicas:
    def __init__(
        self,
        urls: Sequence[str],
        policy: str = "cache_aware",
        settings: RoutingSettings = DEFAULT_SETTINGS,
        num_slots: int = 0,
    ):
        """`urls` from the start; room for `num_slots` replicas in all (at least as many as urls)."""
        self.replicas = [Replica(url) for url in urls]
        self.policy = RoutingPolicy(policy, max(num_slots, len(self.replicas), 1), settings)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    @property
    def active(self) -> list[Replica]:
        return [r for r in self.replicas if r.active]

    @property
    def num_ready(self) -> int:
        return sum(r.ready for r in self.replicas)

    def sync(self, urls: Sequence[str]) -> None:
        """Make the active replicas exactly `urls`: new ones join (not ready until checked), gone
        ones leave."""
        wanted = set(urls)
        for index, r in enumerate(self.replicas):
            if r.active and r.url not in wanted:
                log.info("replica %s left", r.url)
                r.active = False
                self.mark(index, False)
        known = {r.url for r in self.active}
        for url in urls:
            if url not in known and not self._add(url):
                log.warning("no slot for replica %s: raise --max-replicas", url)

    def _add(self, url: str) -> bool:
        free = [i for i, r in enumerate(self.replicas) if not r.active and r.num_in_flight == 0]
        if free:
            index = free[0]
            self.replicas[index] = Replica(url)
        elif len(self.replicas) < self.policy.num_engines:
            index = len(self.replicas)
            self.replicas.append(Replica(url))
        else:
            return False
        self.policy.forget(index)
        self._report(index)
        log.info("replica %s joined", url)
        return True

    def mark(self, index: int, ready: bool) -> None:
        r = self.replicas[index]
        if ready and not r.ready and r.was_ready:
            self.policy.forget(index)
            r.num_routed = 0
            self._report(index)
        r.ready, r.was_ready = ready, r.was_ready or ready
        self.policy.set_ready(index, ready)

    def route(self, hashes: Sequence[int]) -> Route | None:
        """Pick a ready replica for a prompt with these chunk hashes and count the request on it
        (until `finish`); None when no replica is ready."""
        route = self.policy.route(hashes)
        if route is not None:
            r = self.replicas[route.engine]
            r.num_in_flight += 1
            r.num_routed += 1
            self._report(route.engine)
        return route

    def finish(self, index: int) -> None:
        self.replicas[index].num_in_flight -= 1
        self._report(index)

    def fail(self, index: int) -> None:
        """A connection to the replica failed: not ready until its /health says so again."""
        self.replicas[index].num_failures += 1
        self.mark(index, False)

    def _report(self, index: int) -> None:
        r = self.replicas[index]
        num_mapped = self.policy.num_mapped_blocks(index)
        load = EngineLoad(
            num_running=r.num_in_flight, num_received=r.num_routed, num_kv_blocks_used=num_mapped, num_kv_blocks=MAP_CHUNKS
        )
        self.policy.report(index, load)
