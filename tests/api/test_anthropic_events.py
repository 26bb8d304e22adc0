"""The event streams of POST /v1/messages, read raw and checked against Anthropic's documented
order (anthropic_fakes.check_order): `event:` lines naming each event, text, thinking and tool_use
blocks with increasing indexes, one message_stop, message_delta with the stop reason and usage;
the blocks a stream assembles equal the whole message's; an error after the stream began is an
`error` event that ends it."""

from __future__ import annotations

import pytest
import requests

from conveyor.stages.ingress.anthropic.stream import MessageEvents
from tests.api.anthropic_fakes import (
    EXPECTED_CALLS,
    NUM_PROMPT_TOKENS,
    SCRIPTS,
    TOOLS,
    ScriptedEngine,
    check_order,
    events,
    parse_events,
)
from tests.ingress_server import MODEL_NAME, post, running_server, usage_of, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic-events")
    with running_server(root, ScriptedEngine, tool_call_parser="hermes", reasoning_parser="qwen3") as running:
        yield running


def ask(text: str, **kw) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 100, "messages": [{"role": "user", "content": text}]} | kw


def stream_of(url: str, body: dict) -> list[dict]:
    return events(post(url, "/v1/messages", body | {"stream": True}))


def tool_blocks(blocks: list[dict]) -> list[tuple[str, dict]]:
    return [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]


@pytest.mark.parametrize(
    "script, kinds, stop_reason",
    [
        ("PLAIN", ["text"], "end_turn"),
        ("THINK", ["thinking", "text"], "end_turn"),
        ("CALLS", ["text", "tool_use", "tool_use"], "tool_use"),
        ("THINK_CALLS", ["thinking", "text", "tool_use", "tool_use"], "tool_use"),
    ],
)
def test_blocks_in_order_and_equal_to_the_whole_message(server, script, kinds, stop_reason):
    url, _, _ = server
    stream = stream_of(url, ask(script, tools=TOOLS))
    blocks = check_order(stream)
    assert [b["type"] for b in blocks] == kinds
    whole = post(url, "/v1/messages", ask(script, tools=TOOLS)).json()
    for block in whole["content"]:  # ids are drawn per answer
        block.pop("id", None)
    assert [{k: v for k, v in b.items() if k != "id"} for b in blocks] == whole["content"]
    assert all(b["id"] for b in blocks if b["type"] == "tool_use")
    if "tool_use" in kinds:
        assert tool_blocks(blocks) == EXPECTED_CALLS
    message_delta = stream[-2]
    assert message_delta["delta"] == {"stop_reason": stop_reason, "stop_sequence": None}
    assert message_delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"] > 0
    start = stream[0]["message"]
    assert start["id"].startswith("msg") and whole["id"].startswith("msg") and start["id"] != whole["id"]
    assert start["model"] == MODEL_NAME and start["usage"]["input_tokens"] == NUM_PROMPT_TOKENS


def test_block_starts_are_empty_and_text_arrives_in_deltas(server):
    url, _, _ = server
    stream = stream_of(url, ask("THINK_CALLS", tools=TOOLS))
    starts = [e["content_block"] for e in stream if e["type"] == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert starts[1] == {"type": "text", "text": ""}
    assert [(s["type"], s["name"], s["input"]) for s in starts[2:]] == [("tool_use", "weather", {}), ("tool_use", "time", {})]
    text = "".join(e["delta"].get("text", "") for e in stream if e["type"] == "content_block_delta")
    assert text == "Let me check."  # the blank around the calls is held back (stream.py)


def test_a_stop_sequence_in_the_message_delta(server):
    url, _, _ = server
    stream = stream_of(url, ask("a b", stop_sequences=[" t3"]))
    blocks = check_order(stream)
    assert blocks == [{"type": "text", "text": " t0 t1 t2"}]
    assert stream[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " t3"}
    assert stream[-2]["usage"]["output_tokens"] == 4  # the stop string's token was generated


def test_max_tokens_in_the_message_delta(server):
    url, _, _ = server
    stream = stream_of(url, ask("a b", max_tokens=1))
    assert check_order(stream) == [{"type": "text", "text": " t0"}]
    assert stream[-2]["delta"]["stop_reason"] == "max_tokens" and stream[-2]["usage"]["output_tokens"] == 1


def test_no_content_no_blocks(server):
    """An answer with no text at all (here the reasoning only, cut by max_tokens) opens no empty text block."""
    url, _, _ = server
    stream = stream_of(url, ask("THINK", max_tokens=1))  # "<think>" only
    assert check_order(stream) == []
    assert stream[-2]["delta"]["stop_reason"] == "max_tokens"


def test_an_error_after_the_stream_began_is_an_error_event(server):
    url, _, _ = server
    stream = stream_of(url, ask("FAILS_AT_ONCE"))
    assert [e["type"] for e in stream] == ["message_start", "error"]
    assert stream[1]["error"]["type"] == "api_error" and "non-finite" in stream[1]["error"]["message"]
    assert set(stream[1]) == {"type", "error"} and set(stream[1]["error"]) == {"type", "message"}


def test_a_client_that_goes_away_aborts_the_request(server):
    url, engine, _ = server
    with requests.post(f"{url}/v1/messages", json=ask("SLOW", stream=True), stream=True, timeout=10) as response:
        lines = response.iter_lines()
        assert next(lines) == b"event: message_start"
        for line in lines:
            if b"text_delta" in line:
                break
    request_id = engine.requests[-1].request_id
    assert wait_for(lambda: request_id in engine.aborts)


def test_the_scripts_text_is_whole(server):
    url, _, _ = server
    blocks = check_order(stream_of(url, ask("PLAIN")))
    assert blocks == [{"type": "text", "text": SCRIPTS["PLAIN"]}]


def test_the_last_arguments_of_a_call_go_before_the_text_after_it():
    """One chunk may end a call and hold the text after it: the call's block takes its last
    arguments before it closes, then the text opens a block of its own."""
    stream = MessageEvents("msg-1", MODEL_NAME, [])
    opening = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x":'}}
    chunks = [
        {"delta": {"role": "assistant", "tool_calls": [opening]}, "finish_reason": None},
        {
            "delta": {
                "content": "between",
                "tool_calls": [
                    {"index": 0, "function": {"arguments": " 1}"}},
                    {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                ],
            },
            "finish_reason": "tool_calls",
        },
    ]
    raw = stream.start(usage_of(3, 0)) + b"".join(stream.feed(c) for c in chunks) + stream.finish(chunks[-1], usage_of(3, 5))
    out = parse_events(raw.decode())
    assert check_order(out) == [
        {"type": "tool_use", "id": "call_a", "name": "f", "input": {"x": 1}},
        {"type": "text", "text": "between"},
        {"type": "tool_use", "id": "call_b", "name": "g", "input": {}},
    ]
    assert out[-2]["delta"]["stop_reason"] == "tool_use" and out[-2]["usage"]["output_tokens"] == 5
