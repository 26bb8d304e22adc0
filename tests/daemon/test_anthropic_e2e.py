"""Anthropic's Messages API through the whole daemon (every stage its own process) on the tiny
model, with Anthropic's own SDK. Its weights are random, so only constrained output is
predictable: tool_choice naming a tool (the grammar engine masks every draw) gives a tool_use
block whose input validates, and the conversation goes on after its tool_result. count_tokens
counts the prompt the daemon scheduled: usage's input tokens plus cache reads."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "day": {"enum": ["today", "tomorrow"]}},
    "required": ["unit", "day"],
    "additionalProperties": False,
}
TOOLS = [{"name": "weather", "description": "the weather", "input_schema": WEATHER}]
MAX_TOKENS = 200  # far more than any answer the schema allows
# A daemon of its own costs about 90 s on two cores (most of it the start), too much for the
# default run beside test_tools_e2e.py's daemon: `-m slow` runs it.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(daemon_factory):
    daemon = daemon_factory("--num-kv-blocks", "512")
    return anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0, timeout=120)


def model_name(client: anthropic.Anthropic) -> str:
    return client.get("/v1/models", cast_to=object)["data"][0]["id"]  # type: ignore[index]


def test_named_tool_round_trip_and_count_tokens(client):
    model = model_name(client)
    messages: list = [{"role": "user", "content": "What is the weather?"}]
    kw = dict(model=model, tools=TOOLS, max_tokens=MAX_TOKENS)
    with client.messages.stream(messages=messages, tool_choice={"type": "tool", "name": "weather"}, **kw) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "weather"
    jsonschema.validate(use.input, WEATHER)
    counted = client.messages.count_tokens(model=model, messages=messages, tools=TOOLS)
    assert counted.input_tokens == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    # The client runs the tool and answers; the model goes on from there, free to write.
    messages += [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temperature": 21}'}]},
    ]
    again = client.messages.create(messages=messages, tool_choice={"type": "none"}, **kw | {"max_tokens": 8})
    assert again.stop_reason in ("end_turn", "max_tokens")
    prompt = again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0)
    assert prompt == client.messages.count_tokens(model=model, messages=messages, tools=TOOLS).input_tokens > counted.input_tokens
