"""Data-parallel engines spread over Ray nodes even when one node has room for them all: on two
nodes of two CPUs each, two one-rank engines could share a node, and stages/ray/placement.py
aims each at the node holding the fewest engines (Ray 2.60's own choice spreads them too; the
aim keeps it so whatever Ray prefers). In test_ray_placement.py's nodes, which hold one rank
each, the resources alone force the spread."""

from __future__ import annotations

import os

import pytest

from tests.conftest import Daemon
from tests.daemon.test_ray_placement import MODEL, OBJECT_STORE_BYTES, complete, engine_nodes

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[test]' or '.[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a local multi-node Ray cluster: minutes (-m slow)


@pytest.fixture(scope="module")
def roomy_cluster():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": OBJECT_STORE_BYTES}
    )
    for name in ("node_a", "node_b"):
        cluster.add_node(num_cpus=2, resources={name: 1}, object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="conveyor-tests", logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_engines_spread_over_nodes_with_room_for_both(roomy_cluster, checkpoints):
    args = f"--ray-address {roomy_cluster.address} --model {checkpoints[MODEL]} --num-kv-blocks 64 --data-parallel-size 2".split()
    daemon = Daemon(*args, timeout=180)
    try:
        placed = engine_nodes()
        assert {placed.get("engine0-rank0"), placed.get("engine1-rank0")} == {"node_a", "node_b"}, placed
        assert complete(daemon, "The capital of France").status_code == 200
    finally:
        output = daemon.stop()
    assert daemon.process.returncode == 0, output
