"""The ingress stage end to end over HTTP: the real serve() against a fake engine (ingress_fakes)."""

from __future__ import annotations

import asyncio
import re
import threading

import openai
import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from conveyor.stages.ingress.app import errors_as_json
from conveyor.wire.messages import DeltaBatch, EngineStatus, TextDelta
from tests.ingress_fakes import (
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    MODEL_NAME,
    NUM_TOKENS,
    assert_error,
    choice_output,
    post,
    raw_post,
    running_server,
    sse,
    wait_for,
)

TEXT = "".join(f" t{i}" for i in range(NUM_TOKENS))
IDS = [100 + i for i in range(NUM_TOKENS)]


def usage_of(prompt: int, completion: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def with_prompt(body: dict, chat: bool, prompt: str = "a b") -> tuple[str, dict]:
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("ingress")) as running:
        yield running


def test_health_follows_engine_status(server):
    url, engine, _ = server
    assert requests.get(f"{url}/health").json() == {"status": "ok"}
    engine.send(EngineStatus(ready=False))
    assert wait_for(lambda: requests.get(f"{url}/health").status_code == 503)
    assert requests.get(f"{url}/health").json() == {"status": "unavailable"}
    assert_error(post(url, "/v1/completions", {"prompt": "hi"}), 503, code="engine_not_ready")
    engine.send(EngineStatus(ready=True))
    assert wait_for(lambda: requests.get(f"{url}/health").status_code == 200)


def test_models_and_metrics(server):
    url, _, _ = server
    models = requests.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["id"] == MODEL_NAME and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    metrics = requests.get(f"{url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["Content-Type"].startswith("text/plain")
    assert "# TYPE" in metrics.text


def test_completion(server):
    url, engine, _ = server
    body = {
        "model": MODEL_NAME,
        "prompt": "one two three",
        "max_tokens": 50,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "seed": 3,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "return_token_ids": True,
        "user": "u",
        "some_extension": {"x": 1},
    }
    out = post(url, "/v1/completions", body).json()
    assert out["object"] == "text_completion" and out["model"] == MODEL_NAME
    assert re.fullmatch(r"cmpl-0-\d+-[0-9a-f]+", out["id"])
    [choice] = out["choices"]
    assert choice == {"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": IDS}
    assert out["usage"] == usage_of(3, NUM_TOKENS)
    req = engine.requests[-1]
    assert req.request_id == out["id"] and req.ingress == 0 and req.prompt == "one two three"
    assert req.priority == 0 and (req.params.n, req.params.best_of) == (1, None)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (50, 0.5, 0.9, 7, 3)
    assert p.stop_token_ids == [2] and p.ignore_eos and p.skip_special_tokens


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]], ["a b c"]])
def test_completion_prompt_forms(server, prompt):
    url, engine, _ = server
    out = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    assert out["choices"][0]["text"] == " t0 t1" and out["choices"][0]["finish_reason"] == "length"
    assert "token_ids" not in out["choices"][0]
    req = engine.requests[-1]
    assert (req.prompt, req.prompt_token_ids) == (("a b c", None) if prompt == ["a b c"] else (None, [5, 6, 7]))
    assert req.params.max_tokens == 2


def test_chat(server):
    url, engine, _ = server
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    out = post(url, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 3}).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-0-")
    [choice] = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": " t0 t1 t2"}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    req = engine.requests[-1]
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi\nthere")]
    assert req.add_generation_prompt and req.params.max_tokens == 3
    # Without max_tokens a chat runs until EOS or the context is full.
    post(url, "/v1/chat/completions", {"messages": messages, "add_generation_prompt": False})
    assert engine.requests[-1].params.max_tokens is None and not engine.requests[-1].add_generation_prompt


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream(server, chat, include_usage):
    url, _, _ = server
    body = {"max_tokens": 4, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": include_usage}}
    if chat:
        body["messages"] = [{"role": "user", "content": "a b"}]
    else:
        body["prompt"] = "a b"
    chunks = sse(post(url, "/v1/chat/completions" if chat else "/v1/completions", body))
    usage = chunks.pop() if include_usage else None
    assert len({c["id"] for c in chunks}) == 1 and len(chunks) >= 1
    assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert sum((c["token_ids"] for c in choices), []) == IDS[:4]
    if chat:
        assert choices[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in choices[1:])
        assert "".join(c["delta"].get("content", "") for c in choices) == " t0 t1 t2 t3"
    else:
        assert "".join(c["text"] for c in choices) == " t0 t1 t2 t3"
    if include_usage:
        assert all(c["usage"] is None for c in chunks)
        assert usage["choices"] == [] and usage["id"] == chunks[0]["id"]
        assert usage["usage"] == usage_of(2, 4)
    else:
        assert all("usage" not in c for c in chunks)


def test_first_delta_implies_acceptance(server):
    url, _, _ = server
    chunks = sse(post(url, "/v1/completions", {"prompt": "NO_ACCEPT", "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
    out = post(url, "/v1/completions", {"prompt": "NO_ACCEPT x", "max_tokens": 30}).json()
    assert out["choices"][0]["text"] == TEXT and out["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices(server, chat):
    url, engine, _ = server
    path, body = with_prompt({"n": 3, "max_tokens": 4, "return_token_ids": True}, chat)
    out = post(url, path, body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for j, choice in enumerate(out["choices"]):
        text, ids, reason, _ = choice_output(j, 4)
        assert (choice["message"]["content"] if chat else choice["text"]) == text
        assert choice["token_ids"] == ids and choice["finish_reason"] == reason
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length", "stop"]
    assert out["usage"] == usage_of(2, 4 + 4 + 3)
    assert (engine.requests[-1].params.n, engine.requests[-1].params.best_of) == (3, None)


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_stream(server, chat):
    url, _, _ = server
    body = {"n": 3, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    path, body = with_prompt(body, chat)
    chunks = sse(post(url, path, body))
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"] == usage_of(2, 4 + 4 + 3)
    assert all(len(c["choices"]) == 1 for c in chunks)
    by_index: dict[int, list[dict]] = {}
    for c in chunks:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1, 2]
    for j, choices in by_index.items():
        text, _, reason, _ = choice_output(j, 4)
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [reason]
        if chat:
            assert choices[0]["delta"]["role"] == "assistant"
            assert all("role" not in c["delta"] for c in choices[1:])
            assert "".join(c["delta"].get("content", "") for c in choices) == text
        else:
            assert "".join(c["text"] for c in choices) == text


@pytest.mark.parametrize("n, best_of, best", [(1, 3, [2]), (2, 4, [2, 3]), (2, 2, [0, 1])])
@pytest.mark.parametrize("chat", [False, True])
def test_best_of_returns_the_most_likely_choices(server, chat, n, best_of, best):
    """The fake's cumulative logprobs at max_tokens 4: choice 0 -4.0, 1 -6.0, 2 -1.5, 3 -2.0."""
    url, engine, _ = server
    path, body = with_prompt({"n": n, "best_of": best_of, "max_tokens": 4, "return_token_ids": True}, chat)
    out = post(url, path, body).json()
    assert [c["index"] for c in out["choices"]] == list(range(n))
    for choice, j in zip(out["choices"], best, strict=True):
        text, ids, reason, _ = choice_output(j, 4)
        assert (choice["message"]["content"] if chat else choice["text"]) == text
        assert choice["token_ids"] == ids and choice["finish_reason"] == reason
    num_generated = sum(len(choice_output(j, 4)[1]) for j in range(best_of))
    assert out["usage"] == usage_of(2, num_generated)
    assert (engine.requests[-1].params.n, engine.requests[-1].params.best_of) == (n, best_of)


def test_best_of_equal_to_n_streams(server):
    url, _, _ = server
    chunks = sse(post(url, "/v1/completions", {"prompt": "a", "n": 2, "best_of": 2, "stream": True}))
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}


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


@pytest.mark.parametrize("chat", [False, True])
def test_priority_reaches_the_tokenizer(server, chat):
    url, engine, _ = server
    path, body = with_prompt({"priority": -5}, chat)
    assert post(url, path, body).status_code == 200
    assert engine.requests[-1].priority == -5
    path, body = with_prompt({"priority": 7, "stream": True}, chat)
    sse(post(url, path, body))
    assert engine.requests[-1].priority == 7


@pytest.mark.parametrize("chat", [False, True])
def test_cached_tokens_in_usage(server, chat):
    url, _, _ = server
    path, body = with_prompt({"max_tokens": 2}, chat, prompt="CACHED a b c")
    assert post(url, path, body).json()["usage"] == usage_of(4, 2, cached=3)
    path, body = with_prompt({"max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}, chat, prompt="CACHED a b c")
    assert sse(post(url, path, body))[-1]["usage"] == usage_of(4, 2, cached=3)


def test_openai_sdk(server):
    url, _, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, extra_body={"return_token_ids": True})
    assert out.choices[0].text == " t0 t1 t2" and out.choices[0].finish_reason == "length"
    assert out.choices[0].token_ids == IDS[:3] and out.usage.completion_tokens == 3
    stream = client.completions.create(model=MODEL_NAME, prompt="hello", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert chat.choices[0].message.content == " t0 t1" and chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="TOO_LONG", stream=True)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "QUEUE_FULL"}])
    assert e.value.code == "rate_limit_exceeded" and e.value.response.headers["Retry-After"] == "3"

    out = client.completions.create(model=MODEL_NAME, prompt="hello", n=2, best_of=3, max_tokens=4)
    assert [c.text for c in out.choices] == [choice_output(2, 4)[0], choice_output(0, 4)[0]]
    assert out.usage.completion_tokens == 11 and out.usage.prompt_tokens_details.cached_tokens == 0


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
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content", None),
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


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_abort_when_a_stream_is_closed(server, path):
    url, engine, _ = server
    body = {"stream": True, "max_tokens": 1000}
    body |= {"prompt": "SLOW"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "SLOW"}]}
    sock = raw_post(url, path, body)
    received = b""
    while b"data: " not in received:
        received += sock.recv(65536)
    request_id = re.search(rb'"id":"([^"]+)"', received + sock.recv(65536)).group(1).decode()
    sock.close()
    assert wait_for(lambda: request_id in engine.aborts), f"no AbortRequest for {request_id}"


def test_abort_when_a_non_stream_client_goes_away(server):
    url, engine, _ = server
    num_requests = len(engine.requests)
    sock = raw_post(url, "/v1/completions", {"prompt": "SLOW", "max_tokens": 1000})
    assert wait_for(lambda: len(engine.requests) > num_requests)
    request_id = engine.requests[-1].request_id
    sock.close()
    assert wait_for(lambda: request_id in engine.aborts), f"no AbortRequest for {request_id}"


def test_finished_requests_are_not_aborted(server):
    url, engine, _ = server
    ids = [post(url, "/v1/completions", {"prompt": "x"}).json()["id"] for _ in range(3)]
    ids.append(sse(post(url, "/v1/completions", {"prompt": "x", "stream": True}))[0]["id"])
    assert not set(ids) & set(engine.aborts)
    assert len(set(ids)) == 4


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
