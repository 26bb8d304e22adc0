"""POST /v1/responses through the whole daemon (every stage its own process) on the tiny model,
with the official OpenAI SDK. Its weights are random, so only constrained output is predictable:
a named tool_choice makes a function_call whose arguments validate against the tool's
parameters; its answer (function_call_output over previous_response_id) gets a next response,
streamed, whose events the SDK assembles into the same final response that GET returns."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

# A daemon of its own (about 90 s on two cores): kept out of the default run, as test_anthropic_e2e.py.
pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "day": {"enum": ["today", "tomorrow"]}},
    "required": ["unit", "day"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "weather", "description": "the weather", "parameters": WEATHER, "strict": True}]


@pytest.fixture(scope="module")
def client(daemon_factory):
    daemon = daemon_factory("--num-kv-blocks", "512")
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_function_call_round_trip_streamed(client):
    model = client.models.list().data[0].id
    named = {"type": "function", "name": "weather"}
    first = client.responses.create(model=model, input="What is the weather?", tools=TOOLS, tool_choice=named, max_output_tokens=200)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    with client.responses.stream(model=model, previous_response_id=first.id, input=answer, tools=TOOLS, max_output_tokens=8) as stream:
        events = list(stream)
    # The SDK's get_final_response() wants response.completed; a cut answer ends in response.incomplete.
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == events[-1].type.removeprefix("response.") and final.usage.output_tokens <= 8
    assert final.usage.input_tokens > first.usage.input_tokens  # the conversation went on
    assert deltas == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text
