"""When the ingress aborts a request, over HTTP against a fake engine (ingress_fakes): a client
that closes its stream or goes away before a whole answer sends an AbortRequest; a request that
finished sends none."""

from __future__ import annotations

import re

import pytest

from tests.ingress_server import post, raw_post, sse, wait_for


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
