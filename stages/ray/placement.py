"""Where each engine's processes go on a Ray cluster, and the endpoints they listen on.

Engine e gets a placement group of one bundle per tensor-parallel rank (`{"GPU": 1}` on CUDA,
`{"CPU": 1}` on a CPU):
- STRICT_PACK when one node has room for all of its ranks, so TP traffic stays inside a node,
  aimed (Ray's soft target) at the node holding the fewest engines so far, so DP engines spread
  one per node while there are nodes to spread over;
- PACK when no node has room: the ranks take as few nodes as they need (TP across nodes).

Each bundle holds one StageHost actor (host.py) that runs rank r's worker; rank 0's also runs the
engine's scheduler. Every stage another node may talk to then gets a tcp:// endpoint on its
node's IP, on a port its host found free: the engines' processes on their nodes, the launcher and
its local stages (ingress, tokenizers, detokenizers, router) on the launcher's. Rank 0's host
also gives the engine's torch.distributed rendezvous its `tcp://ip:port`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conveyor.config import ConfigError, EngineConfig
from conveyor.stages.ray.host import StageHost, free_ports
from conveyor.wire.topology import LAUNCHER, SCHEDULER, WORKER, Stage, endpoint_name, engine_and_rank, start_plan

NAMESPACE = "conveyor"
PLACEMENT_TIMEOUT_S = 120.0  # a group still pending after this: the cluster lacks the resources
RemoteHost = Any  # a ray ActorHandle of StageHost


@dataclass
class EnginePlacement:
    group: PlacementGroup
    hosts: list[RemoteHost]  # by rank
    node_ids: list[str]  # by rank
    ips: list[str]  # by rank
    ports: list[list[int]]  # by rank: the worker's; rank 0 then the scheduler's and the rendezvous'

    @property
    def dist_init_method(self) -> str:
        return f"tcp://{self.ips[0]}:{self.ports[0][2]}"


def rank_resource(config: EngineConfig) -> str:
    return "GPU" if config.parallel.device == "cuda" else "CPU"


def place_engines(config: EngineConfig, run_id: str) -> list[EnginePlacement]:
    """A placement group and its hosts per engine, in engine order (waits until they are placed)."""
    tp, resource = config.parallel.tensor_parallel_size, rank_resource(config)
    engines_on: collections.Counter[str] = collections.Counter()
    host_class = ray.remote(StageHost)
    placements = []
    for engine in range(config.parallel.data_parallel_size):
        roomy = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource, 0) >= tp]
        target = min(roomy, key=lambda node: engines_on[node]) if roomy else None
        group = placement_group(
            [{resource: 1}] * tp,
            strategy="STRICT_PACK" if roomy else "PACK",
            name=f"{run_id}-engine{engine}",
            _soft_target_node_id=target,
        )
        if not group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            remove_placement_group(group)
            raise ConfigError(f"the Ray cluster has no room for engine {engine}: {tp} bundle(s) of 1 {resource}")
        hosts: list[RemoteHost] = [
            host_class.options(
                name=f"{run_id}-engine{engine}-rank{rank}",
                namespace=NAMESPACE,
                num_cpus=1 if resource == "CPU" else 0,
                num_gpus=1 if resource == "GPU" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(tp)
        ]
        where = ray.get([host.where.remote() for host in hosts])
        ports = ray.get([host.free_ports.remote(3 if rank == 0 else 1) for rank, host in enumerate(hosts)])
        placements.append(EnginePlacement(group, hosts, [w[0] for w in where], [w[1] for w in where], ports))
        engines_on.update(set(p for p in placements[-1].node_ids))
    return placements


def endpoints(config: EngineConfig, placements: list[EnginePlacement]) -> tuple[tuple[str, str], ...]:
    """A tcp:// endpoint for every stage process and the launcher's inbox."""
    local_ip = ray.util.get_node_ip_address()
    table = []
    local: list[tuple[Stage[Any], int]] = [(LAUNCHER, 0)]
    for stage, index in start_plan(config):
        if stage is SCHEDULER:
            placed = placements[index]
            table.append((endpoint_name(stage, index), f"tcp://{placed.ips[0]}:{placed.ports[0][1]}"))
        elif stage is WORKER:
            engine, rank = engine_and_rank(config, index)
            placed = placements[engine]
            table.append((endpoint_name(stage, index), f"tcp://{placed.ips[rank]}:{placed.ports[rank][0]}"))
        else:
            local.append((stage, index))
    for (stage, index), port in zip(local, free_ports(local_ip, len(local)), strict=True):
        table.append((endpoint_name(stage, index), f"tcp://{local_ip}:{port}"))
    return tuple(table)


def release(placements: list[EnginePlacement]) -> None:
    """Stop every host's processes, remove its run directory, and give the bundles back."""
    closing = [host.close.remote() for placed in placements for host in placed.hosts]
    ray.wait(closing, num_returns=len(closing), timeout=10)
    for placed in placements:
        for host in placed.hosts:
            ray.kill(host)
        remove_placement_group(placed.group)
