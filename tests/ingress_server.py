"""The real ingress in a thread, against the fake engine of tests/ingress_fakes.py, and the HTTP
helpers of the ingress tests.

ServerThread runs the real `serve()` on uvloop in a thread of its own, `running_server` both of
them over a tiny checkpoint (real tokenizer, so /tokenize works) served as MODEL_NAME; `post`,
`sse`, `assert_error`, `raw_post`, `with_prompt` and `usage_of` are the tests' HTTP helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import requests
import uvloop

from conveyor.config import EngineConfig, MediaConfig, ServerConfig
from conveyor.gpu.models.registry import read_model_config
from conveyor.stages.ingress.main import serve
from conveyor.tiny import tokenizer as tiny_tokenizer
from conveyor.tiny.checkpoint import make_checkpoint
from conveyor.wire.addresses import make_run_dir
from conveyor.wire.messages import EngineStatus
from tests.ingress_fakes import MAX_MODEL_LEN, FakeEngine

MODEL_NAME = "fake-model"
MAX_BODY_BYTES = 64 * 1024
VOCAB_SIZE = tiny_tokenizer.VOCAB_SIZE  # the tiny checkpoint's


def make_config(root: Path, run_dir: str, media: MediaConfig | None = None, **server_fields: Any) -> EngineConfig:
    """A tiny checkpoint (real tokenizer and chat template) served as MODEL_NAME; `server_fields`
    override ServerConfig fields (api_key, allowed_origins, ...); `media` the image settings."""
    ckpt = make_checkpoint(
        root / "ckpt",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
    )
    model = read_model_config(ckpt, served_name=MODEL_NAME)
    server = ServerConfig(host="127.0.0.1", port=free_port(), run_dir=run_dir, max_body_bytes=MAX_BODY_BYTES, **server_fields)
    return EngineConfig(model=model, server=server, media=media or MediaConfig())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- HTTP helpers ---------------------------------------------------------------------------


def post(url: str, path: str, body, headers: dict | None = None, **kw) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Content-Type": "application/json"} | (headers or {})
    return requests.post(url + path, data=data, headers=headers, timeout=10, **kw)


def sse(response: requests.Response) -> list:
    """Parse a text/event-stream body: every event is `data: ...`; returns JSON payloads, then "[DONE]"."""
    assert response.headers["Content-Type"].startswith("text/event-stream")
    raw = response.content.decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def assert_error(response: requests.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code
    return error


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=5)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def with_prompt(body: dict, chat: bool, prompt: str = "a b") -> tuple[str, dict]:
    """The route and body of a completion, or of a chat whose one user message is the prompt."""
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


def usage_of(prompt: int, completion: int, cached: int = 0) -> dict:
    """An answer's `usage` object for these counts."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ServerThread(threading.Thread):
    """serve(config, 0) on a uvloop loop; `stop()` cancels it and re-raises what it raised."""

    def __init__(self, config: EngineConfig):
        super().__init__(daemon=True, name="ingress-0")
        self.config = config
        self.error: BaseException | None = None
        self._started = threading.Event()

    def run(self) -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            try:
                runner.run(self._main())
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self.error = e

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.ensure_future(serve(self.config, 0))
        self._started.set()
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    def stop(self, timeout: float = 10) -> None:
        assert self._started.wait(5)
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.join(timeout)
        assert not self.is_alive(), "serve() did not return after cancellation"
        if self.error is not None:
            raise self.error


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@contextlib.contextmanager
def running_server(root: Path, engine_class: type[FakeEngine] = FakeEngine, media: MediaConfig | None = None, **server):
    """A FakeEngine (or a subclass answering otherwise) and the ingress, the engine reported
    ready: yields (url, engine, config)."""
    run_dir = make_run_dir()
    config = make_config(root, run_dir, media, **server)
    engine = engine_class(run_dir)
    engine.start()
    thread = ServerThread(config)
    thread.start()
    url = f"http://{config.server.host}:{config.server.port}"
    try:
        assert wait_for(lambda: engine.stage_ready == [("ingress", 0)]), "no StageReady from the ingress"
        assert requests.get(f"{url}/health").status_code == 503  # listening, engine not ready yet
        engine.send(EngineStatus(ready=True))
        assert wait_for(lambda: requests.get(f"{url}/health").status_code == 200)
        yield url, engine, config
    finally:
        thread.stop()
        engine.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
