"""The launcher keeps the daemon serving, with real processes: kill -9 and SIGSTOP of each kind of
stage, SIGTERM mid-stream (the drain), and the run directory after the launcher itself is killed.

What each test holds: only the requests the failed process held fail, with a clean error (a JSON
error object, or an SSE error event and [DONE]); everything else goes on; /health says what a load
balancer needs to know; restarts are counted in /metrics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import Daemon, cmdline

pytestmark = pytest.mark.slow  # stages killed and restarted: minutes of daemons (-m slow)

LONG = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("timed out waiting")


def health(daemon: Daemon) -> int:
    try:
        return requests.get(f"{daemon.url}/health", timeout=2).status_code
    except requests.ConnectionError:
        return 0


class Stream(threading.Thread):
    """A streamed completion read in the background: `started` once its first chunk arrived."""

    def __init__(self, daemon: Daemon, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = f"{daemon.url}/v1/completions", body | {"stream": True}
        self.started = threading.Event()
        self.events: list = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with requests.post(self.url, json=self.body, stream=True, timeout=120) as r:
                assert r.status_code == 200, r.text
                for raw in r.iter_lines():
                    if line := raw.decode():  # SSE is UTF-8
                        data = line.removeprefix("data: ")
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except Exception as e:  # noqa: BLE001 - handed to the test
            self.error = e
            self.started.set()

    def finish(self) -> list:
        self.join(120)
        assert not self.is_alive() and self.error is None, self.error
        return self.events


def streaming(daemon: Daemon, body: dict) -> Stream:
    """A stream that has begun: its first chunk arrived."""
    stream = Stream(daemon, body)
    stream.start()
    assert stream.started.wait(60)
    return stream


def kill_one(daemon: Daemon, stage: str, sig: signal.Signals = signal.SIGKILL) -> int:
    [pid] = daemon.stage_pids(stage)
    os.kill(pid, sig)
    return pid


def ended_with_error(events: list) -> dict:
    assert events[-1] == "[DONE]", events[-3:]
    assert "error" in events[-2], events[-3:]
    return events[-2]["error"]


def ok(daemon: Daemon, prompt: str = "still serving?") -> bool:
    r = daemon.post("/v1/completions", {"prompt": prompt, "max_tokens": 4})
    return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def restarts(daemon: Daemon, stage: str) -> float:
    text = requests.get(f"{daemon.url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith(f'conveyor_stage_restarts_total{{stage="{stage}"}}'))
    return float(line.split()[-1])


@pytest.fixture(scope="module")
def daemon(daemon_factory):
    return daemon_factory("--num-kv-blocks", "256", "--stage-timeout", "3", "--max-engine-restarts", "10")


def test_a_dead_worker_fails_what_is_in_flight_and_the_engine_comes_back(daemon):
    stream = streaming(daemon, LONG)
    worker = kill_one(daemon, "worker")
    error = ended_with_error(stream.finish())
    assert error["code"] == "engine_not_ready"

    # While the engine reloads: 503 with Retry-After, /health 503; the port stays open.
    r = daemon.post("/v1/completions", {"prompt": "too soon", "max_tokens": 2})
    if r.status_code == 503:  # the reload may already be done on a fast machine
        assert r.json()["error"]["code"] == "engine_not_ready" and int(r.headers["Retry-After"]) >= 1
    wait_until(lambda: health(daemon) == 200)
    assert ok(daemon)
    [new_worker] = daemon.stage_pids("worker")
    assert new_worker != worker
    assert restarts(daemon, "worker") >= 1 and restarts(daemon, "scheduler") >= 1
    assert daemon.metric("conveyor_kv_blocks_used") == 0


def test_a_stalled_worker_is_declared_dead(daemon):
    """SIGSTOP stands for a hung kernel: no heartbeat for --stage-timeout (3 s) and it is killed."""
    stream = streaming(daemon, LONG)
    stopped_at = time.monotonic()
    worker = kill_one(daemon, "worker", signal.SIGSTOP)
    try:
        error = ended_with_error(stream.finish())
        assert error["code"] == "engine_not_ready"
        assert 2.5 < time.monotonic() - stopped_at < 30
        assert health(daemon) != 200 or daemon.stage_pids("worker") != [worker]
    finally:
        try:
            os.kill(worker, signal.SIGCONT)  # if the test failed before the launcher killed it
        except ProcessLookupError:
            pass
    wait_until(lambda: health(daemon) == 200)
    assert ok(daemon)
    assert "sent no heartbeat" in daemon.output()


def test_a_dead_tokenizer_is_restarted_and_nothing_else_fails(daemon):
    stream = streaming(daemon, LONG | {"max_tokens": 400})
    before = restarts(daemon, "tokenizer")
    tokenizer = kill_one(daemon, "tokenizer")
    t0 = time.monotonic()
    new = wait_until(lambda: [p for p in daemon.stage_pids("tokenizer") if p != tokenizer], timeout=5)
    assert time.monotonic() - t0 < 1.5, "not restarted within a second"
    assert new and health(daemon) == 200
    wait_until(lambda: ok(daemon), timeout=30)
    events = stream.finish()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"  # untouched
    assert restarts(daemon, "tokenizer") == before + 1


def test_a_dead_detokenizer_fails_only_its_streams(daemon):
    stream = streaming(daemon, LONG)
    kill_one(daemon, "detokenizer")
    error = ended_with_error(stream.finish())
    assert error["code"] == "stage_failed"
    assert health(daemon) == 200
    wait_until(lambda: ok(daemon), timeout=30)
    wait_until(lambda: daemon.metric("conveyor_kv_blocks_used") == 0, timeout=10)


def test_a_dead_ingress_is_restarted(daemon):
    ingress = kill_one(daemon, "ingress")
    wait_until(lambda: [p for p in daemon.stage_pids("ingress") if p != ingress], timeout=5)
    wait_until(lambda: health(daemon) == 200, timeout=60)
    assert ok(daemon)
    assert restarts(daemon, "ingress") >= 1


def test_too_many_engine_failures_exit_non_zero(daemon_factory):
    d = daemon_factory("--num-kv-blocks", "64", "--max-engine-restarts", "1", "--restart-window", "600")
    worker = kill_one(d, "worker")
    wait_until(lambda: health(d) == 200 and d.stage_pids("worker") not in ([], [worker]))
    kill_one(d, "scheduler")
    assert d.process.wait(timeout=60) == 1
    assert "giving up" in d.output()


def test_sigterm_drains_in_flight_requests(daemon_factory):
    d = daemon_factory("--num-kv-blocks", "256", "--drain-timeout", "60")
    stream = streaming(d, LONG | {"max_tokens": 300})
    d.process.send_signal(signal.SIGTERM)
    wait_until(lambda: health(d) == 503, timeout=10)
    r = d.post("/v1/completions", {"prompt": "late", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
    events = stream.finish()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert d.process.wait(timeout=30) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_whole_process_group_drains(sig):
    """Ctrl-C in a terminal sends SIGINT to every process of the foreground group, stages
    included (an orchestrator may do the same with SIGTERM): the stages leave it to the
    launcher, which drains; nothing is restarted and the stream finishes."""
    d = Daemon("--num-kv-blocks", "256", "--drain-timeout", "60", own_process_group=True)
    try:
        stream = streaming(d, LONG | {"max_tokens": 300})
        os.killpg(d.process.pid, sig)
        events = stream.finish()
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
        assert d.process.wait(timeout=30) == 0
        assert "restarting" not in d.output() and "exited with status" not in d.output()
    finally:
        d.stop()


def test_a_drain_past_its_timeout_ends_streams_cleanly(daemon_factory):
    d = daemon_factory("--num-kv-blocks", "256", "--drain-timeout", "1")
    stream = streaming(d, LONG | {"max_tokens": 1900})
    d.process.send_signal(signal.SIGTERM)
    ended_with_error(stream.finish())
    assert d.process.wait(timeout=30) == 0


def test_the_api_key_never_reaches_the_disk_or_ps(daemon_factory, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key-for-the-test\n")
    d = daemon_factory("--num-kv-blocks", "64", "--api-key-file", str(key_file))
    assert d.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 401
    auth = {"Authorization": "Bearer s3cret-key-for-the-test"}
    assert d.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=auth).status_code == 200
    [ingress] = d.stage_pids("ingress")
    config = next(a for a in cmdline(ingress) if a.endswith("config.json"))
    run_dir = Path(config).parent
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert b"s3cret" not in path.read_bytes(), path
    for pid in [d.process.pid, *d.stage_pids("ingress"), *d.stage_pids("worker")]:
        assert not any("s3cret" in a for a in cmdline(pid))
    # A restarted ingress still has the key.
    os.kill(ingress, signal.SIGKILL)
    wait_until(lambda: health(d) == 200 and d.stage_pids("ingress") not in ([], [ingress]))
    assert d.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=auth).status_code == 200


def test_the_run_directory_goes_when_the_launcher_is_killed(daemon_factory):
    d = daemon_factory("--num-kv-blocks", "64")
    [ingress] = d.stage_pids("ingress")
    run_dir = Path(next(a for a in cmdline(ingress) if a.endswith("config.json"))).parent
    assert run_dir.is_dir()
    d.process.kill()
    d.process.wait()
    wait_until(lambda: not run_dir.exists(), timeout=30)


def test_a_stale_run_directory_is_swept_at_the_next_start(tmp_path):
    from conveyor.wire import addresses

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = addresses.make_run_dir()
    (Path(stale) / addresses.OWNER_FILE).write_text(dead.stdout.strip())
    live = addresses.make_run_dir()  # ours: this process is alive
    try:
        removed = addresses.sweep_stale_run_dirs()
        assert stale in removed and not Path(stale).exists()
        assert Path(live).is_dir()
    finally:
        import shutil

        shutil.rmtree(live, ignore_errors=True)


def test_a_worker_and_a_detokenizer_dying_together_are_one_engine_restart(daemon_factory):
    d = daemon_factory("--num-kv-blocks", "64", "--max-engine-restarts", "5")
    [worker], [detokenizer] = d.stage_pids("worker"), d.stage_pids("detokenizer")
    os.kill(detokenizer, signal.SIGKILL)
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: health(d) == 200 and d.stage_pids("worker") not in ([], [worker]))
    assert ok(d)
    time.sleep(1)  # a second detokenizer would have started by now
    assert len(d.stage_pids("detokenizer")) == 1 and len(d.stage_pids("worker")) == 1
