"""Hostile or careless request bodies get a 4xx in the OpenAI error shape, never a 500.

Against the real serve() and a fake engine (ingress_fakes): too many sequences for one request,
bytes that are not UTF-8, JSON nested past the recursion limit, a corrupt gzip body, and a POST
whose Content-Type is not JSON (what a cross-site form could send).
"""

from __future__ import annotations

import gzip
import json
import logging
import socket

import pytest
import requests

from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.protocol import Generation, Prompt, check_num_seqs
from conveyor.wire.messages import SamplingParams
from tests.ingress_server import assert_error, post

GOOD: dict[str, dict[str, object]] = {  # route: a body it accepts
    "/v1/completions": {"prompt": "ok"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "ok"}]},
    "/tokenize": {"prompt": "ok"},
    "/detokenize": {"tokens": [1, 2]},
}


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["a", "b", "c"], "n": 100},  # 300 sequences > 256
        {"prompt": [[1], [2], [3]], "n": 2, "best_of": 128},
    ],
)
def test_too_many_sequences_is_a_400_naming_the_batch(server, body):
    url, engine, _ = server
    num_requests = len(engine.requests)
    assert_error(post(url, "/v1/completions", body), 400, "prompt", "too_many_sequences")
    assert len(engine.requests) == num_requests  # nothing reached the engine
    assert post(url, "/v1/completions", body | {"n": 1, "best_of": None}).status_code == 200


@pytest.mark.parametrize(
    "num_prompts, n, best_of, param",
    [
        (1, 100, None, "n"),
        (1, 10, 100, "best_of"),
        (1, 100, 100, "n"),
        (10, 10, None, "prompt"),
    ],
)
def test_max_seqs_per_request_names_what_to_lower(num_prompts, n, best_of, param):
    gen = Generation(params=SamplingParams(n=n, best_of=best_of), prompts=[Prompt(text="a")] * num_prompts)
    check_num_seqs(gen, max_seqs=num_prompts * max(n, best_of or 0))  # exactly at the bound: fine
    with pytest.raises(ApiError) as e:
        check_num_seqs(gen, max_seqs=50)
    assert e.value.status == 400 and e.value.param == param and e.value.code == "too_many_sequences"


ROUTES = list(GOOD)
DEEP = b"[" * 1000 + b"]" * 1000
BAD_BYTES = {  # case: (the body for a route, the error code)
    "invalid utf-8 in a field": (lambda route: _with(route, b'"\xff\xfe"'), "invalid_utf8"),
    "invalid utf-8 in an ignored field": (lambda route: _with(route, b'"ok", "ignored": "\xc3\x28"'), "invalid_utf8"),
    "an encoded surrogate": (lambda route: _with(route, b'"\xed\xa0\x80"'), "invalid_utf8"),
    "an escaped lone surrogate": (lambda route: _with(route, b'"a\\ud800"'), None),
    "objects nested 1,000 deep": (lambda route: _with(route, b'"ok", "x": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000), "json_too_deep"),
    "nested 1,000 deep in an ignored field": (lambda route: _with(route, b'"ok", "ignored": ' + DEEP), "json_too_deep"),
}


def _with(route: str, value: bytes) -> bytes:
    """GOOD[route] with its first string (or token list) replaced by raw JSON bytes."""
    field = next(iter(GOOD[route]))
    if route == "/v1/chat/completions":
        return b'{"messages": [{"role": "user", "content": ' + value + b"}]}"
    if route == "/detokenize":
        return b'{"tokens": [1], "ignored": ' + value + b"}"
    return b'{"' + field.encode() + b'": ' + value + b"}"


def assert_json_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def assert_no_traceback(caplog) -> None:
    logged = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage() for r in logged]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(BAD_BYTES))
def test_bad_bytes_are_a_400_without_a_traceback(server, caplog, route, case):
    url, _, _ = server
    body, code = BAD_BYTES[case]
    assert assert_json_error(post(url, route, body(route)), 400)["code"] == code
    assert_no_traceback(caplog)
    assert post(url, route, GOOD[route]).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_corrupt_compressed_body_is_a_400_without_a_traceback(server, caplog, route, encoding):
    url, _, _ = server
    corrupt = b"\x1f\x8b\x08\x00" + b"not deflate data" * 4
    response = post(url, route, corrupt, headers={"Content-Encoding": encoding})
    assert assert_json_error(response, 400)["code"] == "invalid_content_encoding"
    assert response.headers["Connection"] == "close"  # the parser gave up on the connection
    assert_no_traceback(caplog)
    compressed = gzip.compress(json.dumps(GOOD[route]).encode())
    assert post(url, route, compressed, headers={"Content-Encoding": "gzip"}).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonp",
        None,
    ],
)
def test_a_body_that_is_not_declared_json_is_a_415(server, route, content_type):
    """What a cross-site form post or a no-cors fetch can send without a preflight."""
    url, engine, _ = server
    num_requests = len(engine.requests)
    data = json.dumps(GOOD[route])
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = requests.post(url + route, data=data, headers=headers, timeout=10)
    error = assert_json_error(response, 415)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert len(engine.requests) == num_requests


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_content_types_are_accepted(server, content_type):
    url, _, _ = server
    response = requests.post(url + "/v1/completions", data=b'{"prompt": "ok"}', headers={"Content-Type": content_type}, timeout=10)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Encoding: br\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nBad Header: 1\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -5\r\n",
    ],
)
def test_http_that_cannot_be_parsed_is_a_json_400_without_a_traceback(server, caplog, head):
    url, _, _ = server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head + b"Content-Length: 16\r\n\r\n" + b'{"prompt": "ok"}' if b"Length" not in head else head + b"\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    status, _, rest = received.partition(b"\r\n")
    assert status.endswith(b"400 Bad Request") and b"Content-Type: application/json" in rest
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed HTTP request")
    assert_no_traceback(caplog)
