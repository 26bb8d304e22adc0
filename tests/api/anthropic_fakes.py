"""What the Anthropic Messages tests share: an engine that writes scripted text (a hermes-format
model with qwen3 reasoning), a server over it, Anthropic's event stream parsed and checked against
the order Anthropic documents, and the error shape checked."""

from __future__ import annotations

import json
from typing import Any

import requests

from tests import ingress_fakes

TOOLS = [
    {
        "name": "weather",
        "description": "today's weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {"name": "time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}},
]
CALLS = (
    'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
EXPECTED_CALLS = [("weather", {"city": "Paris"}), ("time", {"zone": "CET"})]
# The text each script writes: the last word of the conversation names its script; the text
# streams in pieces that cut through the tags and the JSON.
SCRIPTS = {
    "CALLS": CALLS,
    "PLAIN": "Just words, no call.",
    "THINK_CALLS": "<think>\nThe user wants weather.\n</think>\n\n" + CALLS,
    "THINK": "<think>Hmm.</think>\n\nIt is sunny.",
    "NAMED": '{"city": "Paris"}',
    "REQUIRED": '[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "time", "parameters": {"zone": "CET"}}]',
    "ANSWERED": "It is 21 degrees in Paris and noon in CET.",
}
PIECE = ingress_fakes.ScriptedEngine.PIECE
NUM_PROMPT_TOKENS = ingress_fakes.ScriptedEngine.NUM_PROMPT_TOKENS


class ScriptedEngine(ingress_fakes.ScriptedEngine):
    scripts = SCRIPTS


def events(response: requests.Response) -> list[dict[str, Any]]:
    """An Anthropic event stream's events: each `event: TYPE` then `data: JSON` of that type."""
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    return parse_events(response.content.decode())


def parse_events(raw: str) -> list[dict[str, Any]]:
    assert raw.endswith("\n\n")
    out = []
    for block in raw[:-2].split("\n\n"):
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: ") :])
        assert data["type"] == name_line[len("event: ") :]
        out.append(data)
    return out


DELTA_OF = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}


def check_order(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assert Anthropic's documented order (message_start; per block start, deltas of its kind,
    stop, indexes 0, 1, ...; message_delta; one message_stop) and give the blocks assembled."""
    types = [e["type"] for e in stream]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    assert types.count("message_start") == types.count("message_delta") == types.count("message_stop") == 1
    start = stream[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    blocks: list[dict[str, Any]] = []
    open_index: int | None = None
    json_text: dict[int, str] = {}
    for e in stream[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(blocks)
            open_index = e["index"]
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            assert open_index is not None and e["index"] == open_index
            block, delta = blocks[open_index], e["delta"]
            assert delta["type"] == DELTA_OF[block["type"]]
            if block["type"] == "tool_use":
                json_text[open_index] = json_text.get(open_index, "") + delta["partial_json"]
            else:
                block[block["type"]] += delta[block["type"]]
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index, e
            open_index = None
    assert open_index is None
    for i, text in json_text.items():
        blocks[i]["input"] = json.loads(text)
    return blocks


def assert_error(response: requests.Response, status: int, error_type: str) -> str:
    """Anthropic's error shape, with this status and type; its message."""
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type, body
    assert body["error"]["message"]
    return body["error"]["message"]
