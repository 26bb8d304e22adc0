"""The event sequence of a streamed /v1/responses answer, against OpenAI's documented order: raw
server-sent events from the real ingress (scripted engine), and ResponseEvents fed chunk choices
directly for the orders a real stream rarely shows (every kind of piece in one chunk, no output
at all, a failure)."""

from __future__ import annotations

import json

import pytest
import requests

from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.responses_api.answer import new_response
from conveyor.stages.ingress.responses_api.bodies import ResponsesBody
from conveyor.stages.ingress.responses_api.events import ResponseEvents
from tests.api.test_responses_api_sdk import SCRIPTS, TOOLS, ScriptedEngine
from tests.ingress_server import post, running_server

TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
TEXT_EVENTS = {
    "message": ("response.output_text.delta", "response.output_text.done"),
    "reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done"),
    "function_call": ("response.function_call_arguments.delta", "response.function_call_arguments.done"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses-events")
    with running_server(root, ScriptedEngine, tool_call_parser="hermes", reasoning_parser="qwen3") as running:
        yield running


def parse_sse(raw: bytes) -> list[dict]:
    text = raw.decode()
    assert text.endswith("\n\n") and "[DONE]" not in text
    events = []
    for block in text[:-2].split("\n\n"):
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    return events


def item_text(item: dict) -> str:
    return item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]


def check_sequence(events: list[dict]) -> dict:
    """Assert the documented order; the terminal event's response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in TERMINAL and sum(t in TERMINAL for t in types) == 1
    items: list[dict] = []  # added items, by output_index
    texts: list[str] = []  # their deltas joined
    done: list[dict] = []  # their output_item.done items
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(items) and len(done) == len(items), "an item opened while another was open"
            items.append(e["item"])
            texts.append("")
            continue
        index = e["output_index"]
        assert index == len(items) - 1 and len(done) == index, f"{e['type']} outside its open item"
        item = items[index]
        delta_type, done_type = TEXT_EVENTS[item["type"]]
        if "item_id" in e:
            assert e["item_id"] == item["id"]
        if item["type"] != "function_call" and e["type"] != "response.output_item.done":
            assert e["content_index"] == 0
        if e["type"] == delta_type:
            texts[index] += e["delta"]
        elif e["type"] == done_type:
            assert (e["arguments"] if item["type"] == "function_call" else e["text"]) == texts[index]
        elif e["type"] == "response.content_part.done":
            assert e["part"]["text"] == texts[index]
        elif e["type"] == "response.output_item.done":
            assert e["item"]["id"] == item["id"] and item_text(e["item"]) == texts[index]
            done.append(e["item"])
        else:
            assert e["type"] == "response.content_part.added" and item["type"] != "function_call"
    final = events[-1]["response"]
    assert final["output"] == done and len(done) == len(items)
    assert final["status"] == events[-1]["type"].removeprefix("response.")
    return final


def stream(url: str, body: dict) -> list[dict]:
    response = post(url, "/v1/responses", body | {"stream": True})
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    return parse_sse(response.content)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_documented_order(server, script):
    url, _, _ = server
    events = stream(url, {"input": script, "tools": TOOLS})
    final = check_sequence(events)
    whole = post(url, "/v1/responses", {"input": script, "tools": TOOLS}).json()
    assert [(i["type"], item_text(i)) for i in final["output"]] == [(i["type"], item_text(i)) for i in whole["output"]]
    assert final["usage"] == whole["usage"] and final["status"] == whole["status"] == "completed"


def test_reasoning_text_and_call_in_order(server):
    url, _, _ = server
    events = stream(url, {"input": "THINK_CALL", "tools": TOOLS})
    opened = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert opened == ["reasoning", "message", "function_call"]
    [arguments_done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(arguments_done["arguments"]) == {"city": "Paris"} and arguments_done["name"] == "weather"


def test_incomplete_stream(server):
    url, _, _ = server
    final = check_sequence(stream(url, {"input": "PLAIN", "max_output_tokens": 1}))
    assert final["incomplete_details"] == {"reason": "max_output_tokens"} and final["output"][0]["status"] == "incomplete"


def test_rejection_comes_before_any_event(server):
    url, _, _ = server
    response = post(url, "/v1/responses", {"input": "QUEUE_FULL", "stream": True})
    assert response.status_code == 429 and response.headers["Content-Type"].startswith("application/json")


def test_a_failure_after_the_start_is_the_terminal_event(server):
    url, _, _ = server
    final = check_sequence(stream(url, {"input": "FAILS_AT_ONCE"}))
    assert final["status"] == "failed" and final["error"]["code"] == "non_finite_logits"


def test_stream_is_stored(server):
    url, _, _ = server
    final = check_sequence(stream(url, {"input": "PLAIN"}))
    assert requests.get(f"{url}/v1/responses/{final['id']}", timeout=5).json() == final


# --- ResponseEvents alone ---------------------------------------------------------------------


def events_of(out: bytes) -> list[dict]:
    return parse_sse(out)


def new_events() -> ResponseEvents:
    return ResponseEvents(new_response("resp_x", ResponsesBody(), "m", "in_progress"))


USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}


def test_every_kind_of_piece_in_one_chunk():
    events = new_events()
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    out = events.start()
    out += events.feed({"delta": {"reasoning_content": "think", "content": "say", "tool_calls": [call]}})
    out += events.feed({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}})
    out += events.feed(
        {"delta": {"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}}
    )
    out += events.finish("tool_calls", USAGE)
    final = check_sequence(events_of(out))
    assert [(i["type"], item_text(i)) for i in final["output"]] == [
        ("reasoning", "think"),
        ("message", "say"),
        ("function_call", '{"a": 1}'),
        ("function_call", "{}"),
    ]
    assert [i["call_id"] for i in final["output"][2:]] == ["call_1", "call_2"] and final["status"] == "completed"
    assert final["usage"] == {
        "input_tokens": 1,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 3,
    }


def test_no_output_is_an_empty_message():
    events = new_events()
    out = events.start() + events.feed({"delta": {"role": "assistant", "content": ""}}) + events.finish("stop", USAGE)
    final = check_sequence(events_of(out))
    assert [(i["type"], item_text(i)) for i in final["output"]] == [("message", "")]


def test_failure_is_one_terminal_event():
    events = new_events()
    out = events.start() + events.feed({"delta": {"content": "a"}}) + events.fail(ApiError(500, "boom"))
    parsed = events_of(out)
    assert [e["type"] for e in parsed][-1] == "response.failed" and [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert parsed[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
