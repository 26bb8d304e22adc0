"""Slow or greedy HTTP clients: the ingress's read deadlines, keep-alive limits and connection bound.

Raw sockets against the real serve() (a fake engine behind it, ingress_fakes), with timeouts of a
fraction of a second: trickled or partial headers and half-sent bodies are cut off, idle
keep-alive connections close, a connection carries a bounded number of requests, and past
max_connections a new connection waits until one closes.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from tests.ingress_server import running_server

HEADER_TIMEOUT_S = 0.3
BODY_TIMEOUT_S = 0.3
KEEPALIVE_TIMEOUT_S = 2.0
MAX_KEEPALIVE_REQUESTS = 3
BODY = json.dumps({"prompt": "ok", "max_tokens": 2}).encode()
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    limits = dict(
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
        keepalive_timeout_s=KEEPALIVE_TIMEOUT_S,
        max_keepalive_requests=MAX_KEEPALIVE_REQUESTS,
    )
    with running_server(tmp_path_factory.mktemp("limits"), **limits) as running:
        yield running


@pytest.fixture(autouse=True)
def no_traceback_logged(caplog):
    """Cutting a client off is routine: nothing is logged as an error, no traceback."""
    yield
    logged = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage() for r in logged]


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def read_until_closed(sock: socket.socket, limit_s: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received, time.monotonic() - start


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length body."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_normal_request_and_a_kept_alive_second_one(server):
    url, _, _ = server
    with connect(url) as sock:
        sock.sendall(POST + BODY)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEADER_TIMEOUT_S + 0.2)  # idle but within keep-alive: the header clock is not running
        sock.sendall(POST[:20])
        time.sleep(HEADER_TIMEOUT_S / 3)
        sock.sendall(POST[20:] + BODY[:5])
        time.sleep(BODY_TIMEOUT_S / 3)
        sock.sendall(BODY[5:])
        assert read_response(sock).startswith(b"HTTP/1.1 200")


def test_a_silent_connection_is_closed_after_the_header_timeout(server):
    url, _, _ = server
    with connect(url) as sock:
        received, took = read_until_closed(sock)
    assert received == b"" and HEADER_TIMEOUT_S * 0.8 < took < HEADER_TIMEOUT_S + 1.0


def test_trickled_headers_are_cut_off(server):
    """A byte every 50 ms would take 5 s to complete the headers: the server hangs up long before."""
    url, _, _ = server
    start = time.monotonic()
    with connect(url) as sock, pytest.raises((BrokenPipeError, ConnectionResetError)):
        for byte in POST:
            sock.sendall(bytes([byte]))
            time.sleep(0.05)
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 1.0


def test_partial_headers_are_cut_off(server):
    url, _, _ = server
    with connect(url) as sock:
        sock.sendall(POST[:30])
        received, took = read_until_closed(sock)
    assert received == b"" and took < HEADER_TIMEOUT_S + 1.0


def test_the_next_requests_headers_have_their_own_deadline(server):
    url, _, _ = server
    with connect(url) as sock:
        sock.sendall(GET)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(GET[:10])  # and no more
        received, took = read_until_closed(sock)
    assert received == b"" and took < KEEPALIVE_TIMEOUT_S  # the header deadline, not keep-alive's


def test_a_half_sent_body_is_a_408(server):
    url, engine, _ = server
    num_requests = len(engine.requests)
    with connect(url) as sock:
        sock.sendall(POST + BODY[:10])
        received, took = read_until_closed(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert took < BODY_TIMEOUT_S + 1.0 and len(engine.requests) == num_requests


def test_an_idle_keepalive_connection_is_closed(server):
    url, _, _ = server
    with connect(url) as sock:
        sock.sendall(GET)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        received, took = read_until_closed(sock)
    assert received == b"" and KEEPALIVE_TIMEOUT_S * 0.8 < took < KEEPALIVE_TIMEOUT_S + 2.0


def test_a_connection_carries_at_most_max_keepalive_requests(server):
    url, _, _ = server
    with connect(url) as sock:
        for _ in range(MAX_KEEPALIVE_REQUESTS - 1):
            sock.sendall(GET)
            assert b"Connection: close" not in read_response(sock)
        sock.sendall(GET)
        last, _ = read_until_closed(sock)
    assert last.startswith(b"HTTP/1.1 200") and b"Connection: close" in last


def test_past_max_connections_a_connection_waits_for_a_free_one(tmp_path):
    with running_server(tmp_path, max_connections=2) as (url, _, _):
        first, second, third = connect(url), connect(url), connect(url)
        third.sendall(GET)
        third.settimeout(0.5)
        with pytest.raises(TimeoutError):
            third.recv(65536)  # accepted by the kernel, not by us: no answer
        first.close()
        third.settimeout(5)
        assert read_response(third).startswith(b"HTTP/1.1 200")
        second.sendall(GET)
        assert read_response(second).startswith(b"HTTP/1.1 200")
        for sock in (second, third):
            sock.close()
