"""Structured outputs and tool calls through the whole daemon (every stage its own process) on
the tiny model, with the official OpenAI SDK. Its weights are random, so only constrained
output is predictable: response_format with a Pydantic model, and tool_choice named or
required (the grammar engine, gpu/structured/, masks every draw). What is checked is what any
model must give under the constraint: a parsed object, tool calls whose arguments validate
against their function's parameters, and a conversation that goes on after a tool's answer."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

# Enums only: a random model writes any string it may, so free strings could run to max_tokens.
WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "day": {"enum": ["today", "tomorrow"]}},
    "required": ["unit", "day"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "description": "the time", "parameters": TIME}},
]
SCHEMAS = {"weather": WEATHER, "time": TIME}
MAX_TOKENS = 200  # far more than any answer the schemas allow, whitespace bounded included


class Forecast(BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    rain: bool


@pytest.fixture(scope="module")
def client(daemon_factory):
    daemon = daemon_factory("--num-kv-blocks", "512")
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0, timeout=120)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_response_format_parses_into_the_model(client):
    messages = [{"role": "user", "content": "Forecast, please."}]
    out = client.beta.chat.completions.parse(
        model=model_name(client), messages=messages, response_format=Forecast, max_tokens=MAX_TOKENS
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Forecast)


def test_named_tool_call_round_trip(client):
    model = model_name(client)
    messages: list = [{"role": "user", "content": "What is the weather?"}]
    named = {"type": "function", "function": {"name": "weather"}}
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=MAX_TOKENS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "weather"
    check_calls([call])
    # The client runs the tool and answers; the model goes on from there.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    again = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length") and again.usage.prompt_tokens > out.usage.prompt_tokens


def test_required_tool_calls_streamed(client):
    messages = [{"role": "user", "content": "Weather and time, please."}]
    # parallel_tool_calls false: exactly one call. With more allowed, random weights rarely
    # close the array before max_tokens (each element is as likely as "]").
    kw = dict(
        model=model_name(client),
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
    )
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1
    whole = client.chat.completions.create(**kw).choices[0]  # the same constraint, not streamed
    assert whole.finish_reason == "tool_calls"
    check_calls(whole.message.tool_calls)
