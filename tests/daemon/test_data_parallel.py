"""Data-parallel engines through the real daemon (`--data-parallel-size 2` on the tiny model):
the router spreads distinct prompts evenly, keeps a shared prefix on one engine (so the prefix
cache serves it: `cached_tokens`), sends a client's abort to the engine that runs its request, and
when one engine's scheduler is killed only that engine's requests fail while the other keeps
serving, /health saying 503 until the engine is back. A killed router is restarted like a pool
process, and what it had already routed goes on.

Which engine served what is read from /metrics: the router's per-engine counter and the `engine`
label on each scheduler's own metrics.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import requests

from tests.conftest import Daemon, cmdline
from tests.daemon.test_supervision import LONG, ended_with_error, health, ok, restarts, streaming, wait_until

PREFIX = " ".join(f"w{i}" for i in range(120))  # the tiny tokenizer's bytes: well past 10 blocks of 16


@pytest.fixture(scope="module")
def daemon(daemon_factory):
    return daemon_factory("--data-parallel-size", "2", "--num-kv-blocks", "256", "--stage-timeout", "3", "--max-engine-restarts", "10")


def per_engine(daemon: Daemon, name: str, **labels: str) -> dict[int, float]:
    """A metric's value summed per `engine` label, over the series with these other labels."""
    text = requests.get(f"{daemon.url}/metrics", timeout=10).text
    values: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        series = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(series.get(k) == v for k, v in labels.items()):
            engine = int(series["engine"])
            values[engine] = values.get(engine, 0.0) + float(line.split()[-1])
    return values


def routed(daemon: Daemon) -> dict[int, float]:
    return per_engine(daemon, "conveyor_router_requests_total")


def delta(after: dict[int, float], before: dict[int, float]) -> dict[int, float]:
    return {e: after.get(e, 0.0) - before.get(e, 0.0) for e in (0, 1)}


def complete(daemon: Daemon, prompt: str, max_tokens: int = 2) -> dict:
    r = daemon.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def engine_pids(daemon: Daemon, stage: str, index: int) -> list[int]:
    return [pid for pid in daemon.stage_pids(stage) if cmdline(pid)[4:5] == [str(index)]]


def test_distinct_prompts_spread_evenly(daemon):
    before = routed(daemon)
    tokens_before = per_engine(daemon, "conveyor_prompt_tokens_total")
    for i in range(8):
        complete(daemon, f"distinct prompt number {i} about {'xyz'[i % 3] * (i + 1)}")
    assert delta(routed(daemon), before) == {0: 4, 1: 4}
    # Each engine's scheduler admitted its share: its own metrics say so under its label.
    tokens = delta(per_engine(daemon, "conveyor_prompt_tokens_total"), tokens_before)
    assert tokens[0] > 0 and tokens[1] > 0


def test_a_shared_prefix_stays_on_one_engine_and_hits_its_cache(daemon):
    before = routed(daemon)
    usages = [complete(daemon, f"{PREFIX} question {i}?")["usage"] for i in range(6)]
    moved = delta(routed(daemon), before)
    assert sorted(moved.values()) == [0, 6], moved  # round robin would have split them 3 / 3
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages[1:]]
    assert all(c >= 16 * 10 for c in cached), cached  # every later one found the prefix in its engine
    assert sum(per_engine(daemon, "conveyor_router_requests_total", reason="affinity").values()) >= 5


def test_a_client_that_goes_away_is_aborted_in_its_engine(daemon):
    before_routed, before_aborts = routed(daemon), per_engine(daemon, "conveyor_aborts_total")
    with requests.post(f"{daemon.url}/v1/completions", json=LONG | {"stream": True}, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line)  # the stream has begun: the request runs
        [engine] = [e for e, n in delta(routed(daemon), before_routed).items() if n == 1]
    # Closing the connection aborts it, in the engine that runs it: its aborts count, its KV is freed.
    wait_until(lambda: delta(per_engine(daemon, "conveyor_aborts_total"), before_aborts)[engine] == 1, timeout=20)
    assert delta(per_engine(daemon, "conveyor_aborts_total"), before_aborts)[1 - engine] == 0
    wait_until(lambda: per_engine(daemon, "conveyor_kv_blocks_used").get(engine) == 0, timeout=10)


def test_a_dead_router_is_restarted_and_admitted_streams_go_on(daemon):
    """Past admission a request no longer passes the router: its stream is untouched."""
    stream = streaming(daemon, LONG | {"max_tokens": 300})
    before = restarts(daemon, "router")
    [router] = daemon.stage_pids("router")
    os.kill(router, signal.SIGKILL)
    wait_until(lambda: [p for p in daemon.stage_pids("router") if p != router], timeout=5)
    wait_until(lambda: ok(daemon), timeout=30)  # the new router knows both engines are ready
    events = stream.finish()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert health(daemon) == 200 and restarts(daemon, "router") == before + 1


def test_a_dead_engine_fails_its_requests_while_the_other_serves(daemon):
    before = routed(daemon)
    doomed = streaming(daemon, LONG)
    [engine] = [e for e, n in delta(routed(daemon), before).items() if n == 1]
    survivor = streaming(daemon, LONG | {"prompt": "A different story", "max_tokens": 300})
    assert delta(routed(daemon), before)[1 - engine] == 1  # the idle engine took it
    other_worker = engine_pids(daemon, "worker", 1 - engine)
    detokenizers = daemon.stage_pids("detokenizer")
    restarts_before = restarts(daemon, "scheduler")

    [scheduler] = engine_pids(daemon, "scheduler", engine)
    os.kill(scheduler, signal.SIGKILL)
    error = ended_with_error(doomed.finish())
    assert error["code"] == "engine_not_ready"
    # Until the engine is back: /health 503 (not every engine is ready), yet requests are served.
    if health(daemon) == 503:  # on a fast machine the reload may be done already
        assert ok(daemon, "served by the other engine")
    events = survivor.finish()  # untouched by the other engine's failure
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"

    wait_until(lambda: health(daemon) == 200, timeout=60)
    assert restarts(daemon, "scheduler") == restarts_before + 1
    assert engine_pids(daemon, "worker", 1 - engine) == other_worker  # the other engine was not restarted
    assert daemon.stage_pids("detokenizer") == detokenizers  # the detokenizers outlive an engine
    assert f"engine {engine} failed" in daemon.output()
    # Both engines serve again, the restarted one included.
    before = routed(daemon)
    deadline = time.monotonic() + 30
    while min(delta(routed(daemon), before).values()) == 0 and time.monotonic() < deadline:
        assert ok(daemon, f"both engines {time.monotonic()}")
    assert min(delta(routed(daemon), before).values()) >= 1
