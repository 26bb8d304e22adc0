"""`conveyor serve --ray-address` on Ray's local multi-node test cluster (ray.cluster_utils):
a head that holds no engine and two one-CPU nodes marked with a custom resource each, so where an
engine landed is checkable. The engine on another node answers greedily as transformers does,
over tcp:// with CurveZMQ; a node removed under load ends its requests with a clean error, and
the daemon stops rather than hangs.

Kept small (one CPU per node, no dashboard, 100 MB object stores): `python -m pytest -m ray`."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.conftest import Daemon, children, cmdline

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[test]' or '.[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a local multi-node Ray cluster: minutes (-m slow)
NUM_TOKENS = 8
MODEL = "LlamaForCausalLM"
LONG = 2000  # tokens: seconds of decoding on the tiny model, time enough to remove its node
PROMPT = "The capital of France"
OBJECT_STORE_BYTES = 100 * 1024 * 1024
# A removed node is noticed in about a second rather than Ray's default half a minute.
FAST_HEALTH_CHECKS = {"health_check_period_ms": 200, "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no report home from CI (inherited by the daemons)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "object_store_memory": OBJECT_STORE_BYTES,
            "_system_config": FAST_HEALTH_CHECKS,
        },
    )
    nodes = {
        name: cluster.add_node(num_cpus=1, resources={name: 1}, object_store_memory=OBJECT_STORE_BYTES)
        for name in ("node_a", "node_b")
    }
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="conveyor-tests", logging_level="WARNING")
    cluster.nodes_by_name = nodes
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def node_names() -> dict[str, str]:
    """Ray node id -> our custom resource name, for the live nodes."""
    return {n["NodeID"]: r for n in ray.nodes() if n["Alive"] for r in ("node_a", "node_b") if r in n["Resources"]}


def engine_nodes() -> dict[str, str]:
    """Each StageHost actor the daemon placed ("<run>-engine0-rank0") -> its node's name."""
    names = node_names()
    placed = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == "conveyor" and "-engine" in entry["name"]:
            actor = ray.get_actor(entry["name"], namespace="conveyor")
            node_id, _ = ray.get(actor.where.remote(), timeout=30)
            placed[entry["name"].split("-", 2)[-1]] = names.get(node_id, "?")
    return placed


def serve(cluster, *args: str, kv_blocks: int = 64) -> Daemon:
    return Daemon("--ray-address", cluster.address, "--num-kv-blocks", str(kv_blocks), *args, timeout=180)


def complete(daemon: Daemon, prompt: str) -> requests.Response:
    body = {"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return daemon.post("/v1/completions", body)


def test_an_engine_on_another_node_answers_as_transformers(cluster, checkpoints, reference):
    daemon = serve(cluster, "--model", str(checkpoints[MODEL]))
    try:
        placed = engine_nodes()
        assert set(placed) == {"engine0-rank0"} and placed["engine0-rank0"] in ("node_a", "node_b"), placed
        ref = reference(checkpoints[MODEL])
        expected = ref.greedy(ref.encode(PROMPT), NUM_TOKENS)
        r = complete(daemon, PROMPT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected
        # Every stage inbox is a tcp:// endpoint (CurveZMQ), and the run's keys, which the
        # stages hold in their environment, are in no file of the run directory.
        (run_dir,) = run_dirs(daemon)
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            config = f.read()
        assert config.count(b"tcp://") >= 5 and b"ipc://" not in config
        keys = stage_keys(daemon).split()
        assert len(keys) == 4
        for root, _, files in os.walk(run_dir):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    content = f.read()
                assert not any(key.encode() in content for key in keys), name
    finally:
        output = daemon.stop()
    assert daemon.process.returncode == 0, output
    assert not engine_nodes(), "the daemon left its StageHost actors behind"


def test_tensor_parallel_ranks_across_two_nodes_answer_as_transformers(cluster, checkpoints, reference):
    """No node has room for both ranks (one CPU each): PACK puts one rank on each node, and the
    ranks meet at the rendezvous on rank 0's node."""
    daemon = serve(cluster, "--model", str(checkpoints[MODEL]), "--tensor-parallel-size", "2")
    try:
        placed = engine_nodes()
        assert set(placed) == {"engine0-rank0", "engine0-rank1"}, placed
        assert {placed["engine0-rank0"], placed["engine0-rank1"]} == {"node_a", "node_b"}, placed
        ref = reference(checkpoints[MODEL])
        for prompt in (PROMPT, "Tell me a long story about a river, a boat and a fox. " * 3):
            r = complete(daemon, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref.greedy(ref.encode(prompt), NUM_TOKENS)
    finally:
        output = daemon.stop()
    assert daemon.process.returncode == 0, output


def test_data_parallel_engines_one_per_node(cluster, checkpoints, reference):
    daemon = serve(cluster, "--model", str(checkpoints[MODEL]), "--data-parallel-size", "2")
    try:
        placed = engine_nodes()
        assert set(placed) == {"engine0-rank0", "engine1-rank0"}, placed
        assert {placed["engine0-rank0"], placed["engine1-rank0"]} == {"node_a", "node_b"}, placed
        ref = reference(checkpoints[MODEL])
        expected = ref.greedy(ref.encode(PROMPT), NUM_TOKENS)
        prompts = [f"{i} {PROMPT}" for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda p: complete(daemon, p), prompts))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        r = complete(daemon, PROMPT)
        assert r.json()["choices"][0]["token_ids"] == expected
    finally:
        output = daemon.stop()
    assert daemon.process.returncode == 0, output


def local_stages(daemon: Daemon) -> list[int]:
    return [pid for pid in children(daemon.process.pid) if cmdline(pid)[2:3] == ["conveyor.stages"]]


def run_dirs(daemon: Daemon) -> list[str]:
    """The launcher's run directory, found through its local stages' command lines."""
    return sorted({os.path.dirname(cmdline(pid)[5]) for pid in local_stages(daemon)})


def stage_keys(daemon: Daemon) -> str:
    """CONVEYOR_CURVE_KEYS as a local stage got it."""
    with open(f"/proc/{local_stages(daemon)[0]}/environ", "rb") as f:
        variables = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return variables[b"CONVEYOR_CURVE_KEYS"].decode()


def open_stream(daemon: Daemon) -> tuple[requests.Response, Iterator[bytes]]:
    """A streamed completion long enough to outlive its engine, once its first token is in."""
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    r = requests.post(f"{daemon.url}/v1/completions", json=body, stream=True, timeout=60)
    assert r.status_code == 200, r.text
    lines = (line for line in r.iter_lines() if line)
    assert next(lines).startswith(b"data: {")
    return r, lines


def test_a_removed_node_ends_streams_with_an_error_not_a_hang(cluster, checkpoints):
    daemon = serve(cluster, "--model", str(checkpoints[MODEL]), "--max-engine-restarts", "1", kv_blocks=512)
    where = engine_nodes()["engine0-rank0"]
    try:
        streams = [open_stream(daemon) for _ in range(3)]
        cluster.remove_node(cluster.nodes_by_name.pop(where))
        started = time.monotonic()
        for _, lines in streams:
            rest = list(lines)  # a hang here times out the read (60 s)
            events = [json.loads(line[len(b"data: ") :]) for line in rest if line != b"data: [DONE]"]
            assert any("error" in e for e in events), rest[-3:]
            assert len(events) < LONG  # cut short, not finished
        assert time.monotonic() - started < 30
        # Its engine cannot come back (its endpoints were on that node): the daemon gives up.
        daemon.process.wait(timeout=60)
        assert daemon.process.returncode == 1, daemon.output()
        assert "giving up" in daemon.output()
    finally:
        daemon.stop()
        cluster.nodes_by_name[where] = cluster.add_node(num_cpus=1, resources={where: 1}, object_store_memory=OBJECT_STORE_BYTES)
