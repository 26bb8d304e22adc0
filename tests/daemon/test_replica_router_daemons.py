"""`conveyor router` as a process in front of two real `conveyor serve` daemons on the tiny model
(slow: three processes): a repeated long prefix stays on one replica and finds its KV blocks
cached there (usage.prompt_tokens_details.cached_tokens), distinct prompts use both, a stream
through the router is the replica's own answer, and a replica that stops leaves the other one
serving while /health says which."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import pytest
import requests

from tests.conftest import Daemon, free_port, stream_events

SYSTEM = "You answer in one word. " + " ".join(f"Rule {i}: never mention the number {i}." for i in range(40))


class Router:
    def __init__(self, backends: list[str]):
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [
            sys.executable,
            "-m",
            "conveyor",
            "router",
            "--port",
            port,
            "--backends",
            ",".join(backends),
            "--health-interval",
            "0.5",
        ]
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=1).json()["num_ready"] == len(backends):
                    return
            except (requests.ConnectionError, ValueError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("the router did not see every replica ready")

    def complete(self, prompt: str, **extra) -> requests.Response:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, **extra}
        return requests.post(self.url + "/v1/completions", json=body, timeout=120)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=40)


@pytest.fixture(scope="module")
def cluster():
    daemons = [Daemon(), Daemon()]
    router = Router([d.url for d in daemons])
    yield router, daemons
    router.stop()
    for d in daemons:
        d.stop()


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(cluster):
    router, _ = cluster
    answers = [router.complete(f"{SYSTEM}\nQuestion {i}: what colour is the sky?") for i in range(4)]
    assert all(a.status_code == 200 for a in answers)
    assert len({a.headers["X-Conveyor-Replica"] for a in answers}) == 1
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == 0 and all(c >= 16 * 8 for c in cached[1:])  # the system prompt's full blocks

    # One at a time, a new prefix goes to the replica the router has sent fewer chunks: the
    # other one, until it has been sent more than the system prompt's.
    distinct = [router.complete(f"Prompt number {i} " + "abc " * (250 + i)) for i in range(4)]
    assert {a.headers["X-Conveyor-Replica"] for a in distinct} == {"0", "1"}


def test_a_stream_through_the_router_is_the_replicas_own(cluster):
    router, daemons = cluster
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    direct = daemons[0].post("/v1/completions", body).json()["choices"][0]["text"]
    with requests.post(router.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = list(stream_events(resp))
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]) == direct
    assert requests.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_a_stopped_replica_leaves_the_other_serving(cluster):
    router, daemons = cluster
    daemons[1].stop()
    answers = [router.complete(f"after the stop {i} " + "xyz " * 30) for i in range(4)]
    assert all(a.status_code == 200 and a.headers["X-Conveyor-Replica"] == "0" for a in answers)
    health = requests.get(router.url + "/health", timeout=5).json()
    assert health["num_ready"] == 1 and [r["ready"] for r in health["replicas"]] == [True, False]
