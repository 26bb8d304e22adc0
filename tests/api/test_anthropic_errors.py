"""Every error on /v1/messages and /v1/messages/count_tokens is Anthropic's error object with
Anthropic's type for its status, whoever raises it: body decoding and translation (400), the
model's name (404), read_body (413, 415), the router (405), the scheduler (429 with Retry-After),
the engine loading (503), a failed draw (500), and the API key middleware (401). The OpenAI routes
keep the OpenAI shape."""

from __future__ import annotations

import pytest
import requests

from conveyor.wire.messages import EngineStatus
from tests.api.anthropic_fakes import assert_error
from tests.ingress_server import MAX_BODY_BYTES, MODEL_NAME, post, running_server, wait_for

USER = [{"role": "user", "content": "hi"}]
OK = {"model": MODEL_NAME, "max_tokens": 10, "messages": USER}
TOOL = {"name": "weather", "input_schema": {"type": "object"}}
CALLED = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}]}


def result(tool_use_id: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "21"}]}


BAD_MESSAGES = [
    # (body, words the message must hold)
    ({"model": MODEL_NAME, "messages": USER}, "max_tokens"),
    (OK | {"max_tokens": "ten"}, "max_tokens"),
    (OK | {"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10, "messages": USER}, "model"),
    ({"model": MODEL_NAME, "max_tokens": 10}, "messages"),
    (OK | {"messages": []}, "messages"),
    (OK | {"messages": "hi"}, "messages"),
    (OK | {"messages": [{"role": "system", "content": "hi"}]}, "role"),
    (OK | {"messages": [{"role": "user"}]}, "content"),
    (OK | {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    (OK | {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "type"),
    (OK | {"temperature": 1.5}, "temperature"),
    (OK | {"top_p": 0}, "top_p"),
    (OK | {"top_k": -1}, "top_k"),
    (OK | {"stream": "yes"}, "stream"),
    (OK | {"stop_sequences": "END"}, "stop_sequences"),
    (OK | {"stop_sequences": [""]}, "stop_sequences"),
    (OK | {"system": 5}, "system"),
    (OK | {"tools": [{"name": "weather"}]}, "input_schema"),
    (OK | {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}, "web_search_20250305"),
    (OK | {"tools": [TOOL, TOOL]}, "weather"),
    (OK | {"tool_choice": {"type": "any"}}, "no tools"),
    (OK | {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "time"}}, "time"),
    (OK | {"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    (OK | {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]}, "image"),
    (OK | {"messages": [result("toolu_1")]}, "toolu_1"),
    (OK | {"messages": [result("toolu_2"), CALLED, result("toolu_2")]}, "toolu_2"),
    (OK | {"messages": [{"role": "user", "content": "hi"}, CALLED, result("toolu_9")]}, "toolu_9"),
    (OK | {"messages": [*USER, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    (OK | {"messages": [{"role": "user", "content": [CALLED["content"][0]]}]}, "tool_use"),
    (
        OK
        | {
            "messages": [
                CALLED,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image", "source": {}}]}],
                },
            ]
        },
        "image",
    ),
]


@pytest.mark.parametrize("body, words", BAD_MESSAGES)
def test_bad_input_is_a_400_in_anthropics_shape(server, body, words):
    url, engine, _ = server
    num_requests = len(engine.requests)
    message = assert_error(post(url, "/v1/messages", body), 400, "invalid_request_error")
    assert words in message
    assert len(engine.requests) == num_requests  # refused before the engine saw it


def test_a_valid_tool_round_trip_is_accepted(server):
    url, _, _ = server
    assert post(url, "/v1/messages", OK | {"tools": [TOOL], "messages": [*USER, CALLED, result("toolu_1")]}).status_code == 200


@pytest.mark.parametrize("data", [b'{"model": ', b"", b"[1, 2]", b"\xff\xfe"])
def test_bodies_that_are_not_a_json_object(server, data):
    url, _, _ = server
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert_error(post(url, path, data), 400, "invalid_request_error")


def test_count_tokens_bad_input(server):
    url, _, _ = server
    assert_error(post(url, "/v1/messages/count_tokens", {"model": MODEL_NAME}), 400, "invalid_request_error")
    bad_result = {"model": MODEL_NAME, "messages": [result("toolu_1")]}
    assert "toolu_1" in assert_error(post(url, "/v1/messages/count_tokens", bad_result), 400, "invalid_request_error")
    unknown = {"model": "another-model", "messages": USER}
    assert "another-model" in assert_error(post(url, "/v1/messages/count_tokens", unknown), 404, "not_found_error")
    counted = post(url, "/v1/messages/count_tokens", {"model": MODEL_NAME, "messages": USER, "max_tokens": 5})
    assert counted.status_code == 200 and set(counted.json()) == {"input_tokens"}


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_a_404(server, stream):
    url, _, _ = server
    assert_error(post(url, "/v1/messages", OK | {"model": "another-model", "stream": stream}), 404, "not_found_error")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_read_body_errors_before_the_handler(server, path):
    url, _, _ = server
    assert_error(post(url, path, b"{}", headers={"Content-Type": "text/plain"}), 415, "invalid_request_error")
    big = OK | {"messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}
    assert_error(post(url, path, big), 413, "request_too_large")
    assert_error(requests.get(url + path, timeout=5), 405, "invalid_request_error")


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_a_429_with_retry_after(server, stream):
    url, _, _ = server
    response = post(url, "/v1/messages", OK | {"stream": stream, "messages": [{"role": "user", "content": "QUEUE_FULL"}]})
    assert assert_error(response, 429, "rate_limit_error") == "the waiting queue is full"
    assert response.headers["Retry-After"] == "3"


def test_a_prompt_the_tokenizer_refuses(server):
    url, _, _ = server
    response = post(url, "/v1/messages", OK | {"messages": [{"role": "user", "content": "TOO_LONG"}]})
    assert "longer" in assert_error(response, 400, "invalid_request_error")


def test_a_failed_draw_is_a_500_api_error(server):
    url, _, _ = server
    response = post(url, "/v1/messages", OK | {"messages": [{"role": "user", "content": "FAILS_AT_ONCE"}]})
    assert "non-finite" in assert_error(response, 500, "api_error")


def test_engine_not_ready_is_a_503_overloaded_error(server):
    url, engine, _ = server
    engine.send(EngineStatus(ready=False))
    try:
        assert wait_for(lambda: requests.get(f"{url}/health").status_code == 503)
        response = post(url, "/v1/messages", OK)
        assert_error(response, 503, "overloaded_error")
        assert response.headers["Retry-After"] == "5"
        counted = post(url, "/v1/messages/count_tokens", {"model": MODEL_NAME, "messages": USER})
        assert counted.status_code == 200  # counting needs the tokenizer only
    finally:
        engine.send(EngineStatus(ready=True))
        assert wait_for(lambda: requests.get(f"{url}/health").status_code == 200)


def test_the_api_key_is_checked_in_anthropics_shape(tmp_path):
    with running_server(tmp_path, api_key="k") as (url, _, _):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            assert "API key" in assert_error(post(url, path, OK), 401, "authentication_error")
            assert_error(post(url, path, OK, headers={"X-Api-Key": "wrong"}), 401, "authentication_error")
        assert post(url, "/v1/messages", OK, headers={"X-Api-Key": "k"}).status_code == 200
        assert post(url, "/v1/messages", OK, headers={"Authorization": "Bearer k"}).status_code == 200
        # The OpenAI routes keep OpenAI's shape.
        assert post(url, "/v1/chat/completions", {"messages": USER}).json()["error"]["type"] == "authentication_error"


def test_openai_routes_keep_their_shape(server):
    url, _, _ = server
    body = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 0}).json()
    assert set(body) == {"error"} and body["error"]["param"] == "max_tokens"
    assert set(post(url, "/v1/messagesX", OK).json()) == {"error"}  # not a path of the Messages API
