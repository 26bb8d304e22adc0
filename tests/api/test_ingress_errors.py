"""Every error the ingress answers with, in the OpenAI error shape, over HTTP against a fake
engine (ingress_fakes): a full queue (429), bad inputs and unknown routes, an oversize chunked
body, an engine that stops or drains, a draw that fails right behind its admission or a stream
that breaks mid-way, an unexpected exception (a logged 500), and a /tokenize without bound."""

from __future__ import annotations

import asyncio
import threading

import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from conveyor.stages.ingress.app import errors_as_json
from conveyor.wire.messages import DeltaBatch, EngineStatus, TextDelta
from tests.ingress_fakes import MAX_MODEL_LEN
from tests.ingress_server import MAX_BODY_BYTES, assert_error, post, running_server, sse, wait_for, with_prompt


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_queue_full_is_a_429_with_retry_after(server, chat, stream):
    url, _, _ = server
    path, body = with_prompt({"stream": stream}, chat, prompt="QUEUE_FULL")
    response = post(url, path, body)
    assert "data:" not in response.text
    error = assert_error(response, 429, code="rate_limit_exceeded")
    assert error["type"] == "rate_limit_error" and error["message"] == "the waiting queue is full"
    assert response.headers["Retry-After"] == "3"  # ceil(2.5)


BAD_INPUTS = [
    # (path, body, status, param, code)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, None),
    ("/v1/completions", b"", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed", None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "hi", "best_of": 129}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "hi", "best_of": 3, "stream": True}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "hi", "priority": 1.5}, 400, "priority", None),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x" * (MAX_BODY_BYTES + 1)}, 413, None, "request_too_large"),
    ("/v1/completions", {"prompt": "TOO_LONG", "stream": True}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0]",
        None,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "TOO_LONG"}], "stream": True},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 2, "best_of": 4, "stream": True},
        400,
        "best_of",
        None,
    ),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD_INPUTS)
def test_bad_input(server, path, body, status, param, code):
    url, _, _ = server
    response = post(url, path, body)
    assert "data:" not in response.text  # rejected before any SSE byte
    assert_error(response, status, param, code)
    good = {"prompt": "ok"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "ok"}]}
    assert post(url, path, good).status_code == 200


def test_unknown_route_and_method(server):
    url, _, _ = server
    assert_error(requests.get(f"{url}/v1/nothing"), 404)
    assert_error(requests.get(f"{url}/v1/completions"), 405)


def test_oversize_chunked_body(server):
    url, _, _ = server
    chunks = (b"x" * 16384 for _ in range(MAX_BODY_BYTES // 16384 + 2))  # no Content-Length
    response = requests.post(f"{url}/v1/completions", data=chunks, headers={"Content-Type": "application/json"}, timeout=10)
    assert_error(response, 413, code="request_too_large")


def test_engine_stop_fails_requests_in_flight(server):
    url, engine, _ = server
    num_requests = len(engine.requests)
    answers = {}
    waiting = threading.Thread(target=lambda: answers.update(r=post(url, "/v1/completions", {"prompt": "SLOW"})))
    waiting.start()
    streamed = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW"}], "stream": True}, stream=True)
    assert wait_for(lambda: len(engine.requests) == num_requests + 2)
    body = streamed.iter_content(None)
    first = next(body)  # the stream began
    engine.send(EngineStatus(ready=False))
    waiting.join(10)
    assert_error(answers["r"], 503, code="engine_not_ready")
    raw = (first + b"".join(body)).decode()
    assert raw.startswith("data: {")
    assert raw.endswith('"code":"engine_not_ready"}}\n\ndata: [DONE]\n\n'), raw[-200:]
    engine.send(EngineStatus(ready=True))
    assert wait_for(lambda: requests.get(f"{url}/health").status_code == 200)
    assert post(url, "/v1/completions", {"prompt": "ok"}).status_code == 200


def test_a_failure_right_behind_the_admission_is_an_error_event_in_a_stream(server):
    """The acceptance and the failed draw can reach the ingress together (a busy machine): once
    admitted, a stream begins (200), and the failure is its error event; without a stream, a 500."""
    url, _, _ = server
    streamed = post(url, "/v1/completions", {"prompt": "FAILS_AT_ONCE", "stream": True}, stream=True)
    assert streamed.status_code == 200
    events = sse(streamed)  # [DONE] checked and dropped
    assert events[-1]["error"]["code"] == "non_finite_logits"
    answered = post(url, "/v1/completions", {"prompt": "FAILS_AT_ONCE"})
    assert answered.status_code == 500 and answered.json()["error"]["code"] == "non_finite_logits"


def test_an_unexpected_error_mid_stream_ends_it_with_an_error_event(server):
    """A delta for a choice the request does not have (an engine bug) fails the stream, not the server."""
    url, engine, _ = server
    num_requests = len(engine.requests)
    streamed = post(url, "/v1/completions", {"prompt": "SLOW", "stream": True}, stream=True)
    assert wait_for(lambda: len(engine.requests) == num_requests + 1)
    request_id = engine.requests[-1].request_id
    body = streamed.iter_content(None)
    first = next(body)  # the stream began
    engine.send(DeltaBatch([TextDelta(request_id, 99, "?", [1])]))
    raw = (first + b"".join(body)).decode()
    assert raw.startswith("data: {")
    assert raw.endswith('"type":"server_error","param":null,"code":null}}\n\ndata: [DONE]\n\n'), raw[-200:]
    assert wait_for(lambda: request_id in engine.aborts)
    assert post(url, "/v1/completions", {"prompt": "ok"}).status_code == 200


def test_unexpected_exceptions_become_a_logged_json_500(caplog):
    async def boom(request):
        raise RuntimeError("boom")

    async def call() -> tuple[int, dict]:
        app = web.Application(middlewares=[errors_as_json])
        app.router.add_get("/boom", boom)
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/boom")
            return response.status, await response.json()

    status, body = asyncio.run(call())
    assert status == 500 and body["error"]["type"] == "server_error"
    assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)


def test_tokenize_counts_past_the_context_but_not_without_bound(server):
    url, _, _ = server
    r = post(url, "/tokenize", {"prompt": "many words here " * 3500})  # ~56 KB: over 16 contexts
    assert_error(r, 400, param="prompt", code="prompt_too_long")
    r = post(url, "/tokenize", {"prompt": "many words here " * 200})  # a few contexts
    assert r.status_code == 200 and MAX_MODEL_LEN < r.json()["count"] < 16 * MAX_MODEL_LEN


def test_draining_refuses_new_requests_and_reports_drained(tmp_path):
    from conveyor.wire.messages import Drained

    with running_server(tmp_path) as (url, engine, _):
        engine.send(EngineStatus(ready=True, draining=True))
        assert wait_for(lambda: requests.get(f"{url}/health").status_code == 503)
        assert requests.get(f"{url}/health").json() == {"status": "draining"}
        assert_error(post(url, "/v1/completions", {"prompt": "hi"}), 503, code="server_draining")
        assert wait_for(lambda: Drained(0) in engine.launcher_notes)
