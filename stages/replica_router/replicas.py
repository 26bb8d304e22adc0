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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from conveyor.stages.router.policy import DEFAULT_MAP_BLOCKS, EngineLoad, Route, RoutingPolicy, RoutingSettings

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


class Replicas:
    def __init__(self, urls: Sequence[str], policy: str = "cache_aware", settings: RoutingSettings = DEFAULT_SETTINGS):
        self.replicas = [Replica(url) for url in urls]
        self.policy = RoutingPolicy(policy, len(self.replicas), settings)

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    @property
    def num_ready(self) -> int:
        return sum(r.ready for r in self.replicas)

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
        load = EngineLoad(num_running=r.num_in_flight, num_received=r.num_routed, num_kv_blocks_used=num_mapped,
                          num_kv_blocks=MAP_CHUNKS)  # fmt: skip
        self.policy.report(index, load)
