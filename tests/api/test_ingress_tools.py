"""Tool calls and reasoning in /v1/chat/completions answers, through the real ingress against an
engine that writes scripted text (a hermes-format model, qwen3 reasoning), read back with the
official OpenAI SDK: whole answers, and streams assembled by the SDK's own helpers."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.ingress_fakes import ScriptedEngine
from tests.ingress_server import MODEL_NAME, post, running_server, sse

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "today's weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]

CALLS = (
    'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
# The text each script writes: the user message names its script; the text streams in pieces
# that cut through the tags and the JSON.
SCRIPTS = {
    "CALLS": CALLS,
    "PLAIN": "Just words, no call.",
    "THINK_CALLS": "<think>\nThe user wants weather.\n</think>\n\n" + CALLS,
    "THINK": "<think>Hmm.</think>\n\nIt is sunny.",
    "NAMED": '{"city": "Paris"}',
    "REQUIRED": '[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "time", "parameters": {"zone": "CET"}}]',
}
PIECE = ScriptedEngine.PIECE


class ToolScripts(ScriptedEngine):
    scripts = SCRIPTS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    with running_server(root, ToolScripts, tool_call_parser="hermes", reasoning_parser="qwen3") as running:
        yield running


@pytest.fixture
def client(server):
    url, _, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def ask(script: str, **kw) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": script}], "tools": TOOLS} | kw


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


EXPECTED_CALLS = [("weather", {"city": "Paris"}), ("time", {"zone": "CET"})]


def test_auto_whole_answer(client):
    out = client.chat.completions.create(**ask("CALLS"))
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n\n"
    assert calls_of(choice.message) == EXPECTED_CALLS
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)


def test_auto_stream_assembled_by_the_sdk(client):
    whole = client.chat.completions.create(**ask("CALLS")).choices[0]
    state = ChatCompletionStreamState(input_tools=TOOLS)
    chunks = list(client.chat.completions.create(**ask("CALLS"), stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    [choice] = state.get_final_completion().choices
    assert choice.message.content == whole.message.content and calls_of(choice.message) == EXPECTED_CALLS
    assert choice.finish_reason == "tool_calls" and [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    # Each call opens once, with its id and name (how many pieces its arguments take depends on
    # how the deltas batch up: tests/api/test_tool_parsers.py feeds them one by one).
    opening = [t for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.id is not None]
    assert [(t.index, t.function.name) for t in opening] == [(0, "weather"), (1, "time")]


def test_the_sdk_stream_helper(client):
    with client.chat.completions.stream(**ask("CALLS")) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    assert calls_of(final.choices[0].message) == EXPECTED_CALLS and final.choices[0].finish_reason == "tool_calls"


def test_plain_content_in_auto_mode(client):
    out = client.chat.completions.create(**ask("PLAIN"))
    assert out.choices[0].message.content == SCRIPTS["PLAIN"] and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**ask("PLAIN"), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == SCRIPTS["PLAIN"]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_length_stays_length(client):
    out = client.chat.completions.create(**ask("CALLS", max_tokens=6))
    assert out.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**ask("CALLS", max_tokens=6), stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_each_choice_parsed_on_its_own(client):
    out = client.chat.completions.create(**ask("CALLS", n=2))
    assert [calls_of(c.message) for c in out.choices] == [EXPECTED_CALLS] * 2
    ids = [t.id for c in out.choices for t in c.message.tool_calls]
    assert len(set(ids)) == 4
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in client.chat.completions.create(**ask("CALLS", n=2), stream=True):
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    assert [calls_of(c.message) for c in final.choices] == [EXPECTED_CALLS] * 2
    assert [c.finish_reason for c in final.choices] == ["tool_calls"] * 2


def test_reasoning_then_tool_calls(client):
    out = client.chat.completions.create(**ask("THINK_CALLS"))
    message = out.choices[0].message
    assert message.reasoning_content == "\nThe user wants weather.\n" and calls_of(message) == EXPECTED_CALLS
    state = ChatCompletionStreamState(input_tools=TOOLS)
    reasoning = ""
    for chunk in client.chat.completions.create(**ask("THINK_CALLS"), stream=True):
        state.handle_chunk(chunk)
        reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    assert reasoning == message.reasoning_content
    assert calls_of(state.get_final_completion().choices[0].message) == EXPECTED_CALLS


def test_reasoning_without_tools(server):
    url, _, _ = server
    body = {"messages": [{"role": "user", "content": "THINK"}]}
    message = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Hmm."}
    chunks = sse(post(url, "/v1/chat/completions", body | {"stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm."
    assert "".join(d.get("content", "") for d in deltas) == "It is sunny."


def test_named_tool_choice(client, server):
    _, engine, _ = server
    named = {"type": "function", "function": {"name": "weather"}}
    out = client.chat.completions.create(**ask("NAMED", tool_choice=named))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice.message) == [("weather", {"city": "Paris"})]
    assert engine.requests[-1].params.structured is not None  # the request side constrains it
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in client.chat.completions.create(**ask("NAMED", tool_choice=named), stream=True):
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert calls_of(final.message) == [("weather", {"city": "Paris"})] and final.finish_reason == "tool_calls"


def test_required_tool_choice(client):
    out = client.chat.completions.create(**ask("REQUIRED", tool_choice="required"))
    assert calls_of(out.choices[0].message) == EXPECTED_CALLS and out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.content is None
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in client.chat.completions.create(**ask("REQUIRED", tool_choice="required"), stream=True):
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert calls_of(final.message) == EXPECTED_CALLS and final.finish_reason == "tool_calls"


def test_tool_choice_none_is_plain_text(server):
    url, _, _ = server
    body = ask("CALLS", tool_choice="none")
    message = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    # Reasoning is configured, so the answer says it found none; the calls stay text.
    assert message == {"role": "assistant", "content": CALLS, "reasoning_content": None}
