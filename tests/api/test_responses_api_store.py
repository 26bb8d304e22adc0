"""The stored responses (LRU by size, expiry by age on an injected clock) and the translation of
Responses items to chat messages; one server with a store of two, to see eviction end to end."""

from __future__ import annotations

from typing import Any, cast

import pytest

from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.responses_api.items import chat_messages, output_items, responses_param
from conveyor.stages.ingress.responses_api.pages import input_items_page
from conveyor.stages.ingress.responses_api.store import ResponseStore, StoredResponse
from tests.ingress_server import assert_error, post, running_server


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Task:
    """Stands for a background response's asyncio task."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def stored(response_id: str, task: Task | None = None) -> StoredResponse:
    return StoredResponse(
        {"id": response_id, "output": [{"type": "message", "role": "assistant", "content": "out"}]}, [], cast(Any, task)
    )


def test_least_recently_used_goes_first():
    store = ResponseStore(max_size=2, ttl_s=60, clock=Clock())
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a") is not None  # a use: b is now the least recent
    store.put(stored("c"))
    assert len(store) == 2 and store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None


def test_evicting_a_running_background_response_cancels_it():
    store = ResponseStore(max_size=1, ttl_s=60, clock=Clock())
    task = Task()
    store.put(stored("a", task))
    store.put(stored("b"))
    assert task.cancelled and store.get("a") is None


def test_expiry_by_age():
    clock = Clock()
    store = ResponseStore(max_size=8, ttl_s=10, clock=clock)
    store.put(stored("a"))
    clock.now += 5
    store.put(stored("b"))
    clock.now += 4.9
    assert store.get("a") is not None  # a lookup does not extend a response's life
    clock.now += 0.1
    assert store.get("a") is None and len(store) == 1 and store.get("b") is not None
    clock.now += 5
    assert store.get("b") is None and len(store) == 0


def test_delete_and_unknown():
    store = ResponseStore(max_size=2, ttl_s=60, clock=Clock())
    store.put(stored("a"))
    assert store.delete("a") and store.get("a") is None
    assert not store.delete("a") and store.get("nope") is None


def test_next_conversation_is_input_then_output():
    entry = StoredResponse({"id": "a", "output": ["o"]}, ["i1", "i2"])
    assert entry.next_conversation == ["i1", "i2", "o"]


def test_calls_join_the_assistant_turn_before_them():
    conversation = [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": "r2"},
        {"type": "message", "role": "developer", "content": "d"},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    messages, _ = chat_messages(conversation, "be brief")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "developer", "assistant"]
    assert messages[2]["content"] == "let me see" and [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "r1"}
    assert messages[6] == {"role": "assistant", "content": None, "tool_calls": [messages[6]["tool_calls"][0]]}


def test_output_items_of_a_chat_message():
    message = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "hmm",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    items = output_items(message, incomplete=False)
    assert [i["type"] for i in items] == ["reasoning", "function_call"] and items[1]["call_id"] == "call_1"
    cut = output_items({"role": "assistant", "content": "abc"}, incomplete=True)
    assert [(i["type"], i["status"]) for i in cut] == [("message", "incomplete")]
    assert output_items({"role": "assistant", "content": ""}, incomplete=False)[0]["content"][0]["text"] == ""


@pytest.mark.parametrize(
    "chat, ours",
    [
        ("messages", "input"),
        ("messages[3].content", "input"),
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("tools[1].function.name", "tools[1].name"),
        ("tool_choice", "tool_choice"),
        (None, None),
    ],
)
def test_chat_params_named_as_responses_names_them(chat, ours):
    assert responses_param(chat) == ours


def test_a_full_store_forgets_the_oldest(tmp_path):
    with running_server(tmp_path, responses_store_size=2) as (url, _, _):
        ids = [post(url, "/v1/responses", {"input": "a b"}).json()["id"] for _ in range(3)]
        assert_error(
            post(url, "/v1/responses", {"input": "c", "previous_response_id": ids[0]}),
            404,
            "previous_response_id",
            "response_not_found",
        )
        follow = post(url, "/v1/responses", {"input": "c", "previous_response_id": ids[2]})
        assert follow.status_code == 200 and follow.json()["previous_response_id"] == ids[2]


ITEMS = [{"id": f"i{n}"} for n in range(5)]


def ids(page: dict) -> list[str]:
    return [item["id"] for item in page["data"]]


def test_pages_of_input_items():
    page = input_items_page(ITEMS, {})
    assert ids(page) == ["i4", "i3", "i2", "i1", "i0"] and not page["has_more"]
    assert (page["first_id"], page["last_id"]) == ("i4", "i0")
    page = input_items_page(ITEMS, {"order": "asc", "limit": "2"})
    assert ids(page) == ["i0", "i1"] and page["has_more"]
    page = input_items_page(ITEMS, {"order": "asc", "limit": "2", "after": "i1"})
    assert ids(page) == ["i2", "i3"] and page["has_more"]
    assert ids(input_items_page(ITEMS, {"before": "i1"})) == ["i4", "i3", "i2"]
    empty = input_items_page(ITEMS, {"after": "i0"})
    assert empty["data"] == [] and empty["first_id"] is None and not empty["has_more"]


@pytest.mark.parametrize(
    "query, param",
    [
        ({"order": "up"}, "order"),
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "9" * 5000}, "limit"),
        ({"limit": "\u00b2"}, "limit"),
        ({"after": "nope"}, "after"),
        ({"before": "nope"}, "before"),
    ],
)
def test_bad_page_queries(query, param):
    with pytest.raises(ApiError) as e:
        input_items_page(ITEMS, query)
    assert e.value.status == 400 and e.value.param == param
