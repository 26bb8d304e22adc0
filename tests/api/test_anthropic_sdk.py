"""POST /v1/messages and /v1/messages/count_tokens read back with Anthropic's own SDK, unchanged,
through the real ingress against a scripted engine (anthropic_fakes): whole messages and streams
assembled by the SDK's helpers, a tool round trip, thinking blocks, stop reasons, usage, the
token count, and the API key presented as x-api-key or as a bearer token."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.api.anthropic_fakes import EXPECTED_CALLS, NUM_PROMPT_TOKENS, SCRIPTS, TOOLS, ScriptedEngine
from tests.ingress_server import MODEL_NAME, post, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    with running_server(root, ScriptedEngine, tool_call_parser="hermes", reasoning_parser="qwen3") as running:
        yield running


@pytest.fixture
def client(server):
    url, _, _ = server
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def ask(text: str, **kw) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 100, "messages": [{"role": "user", "content": text}]} | kw


def calls_of(message) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def test_plain_text_message(client):
    out = client.messages.create(**ask("PLAIN"))
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL_NAME
    assert [(b.type, b.text) for b in out.content] == [("text", SCRIPTS["PLAIN"])]
    assert out.stop_reason == "end_turn" and out.stop_sequence is None
    assert out.usage.input_tokens == NUM_PROMPT_TOKENS and out.usage.output_tokens == 3  # 20 characters, 7 a piece


def test_stream_assembled_by_the_sdk_equals_the_whole_message(client):
    thinking = {"type": "enabled", "budget_tokens": 1024}  # accepted: whether the model reasons is its template's call
    whole = client.messages.create(**ask("THINK", thinking=thinking, max_tokens=2048))
    with client.messages.stream(**ask("THINK")) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "It is sunny."
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "Hmm."),
        ("text", "It is sunny."),
    ]
    assert final.stop_reason == whole.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens and final.usage.input_tokens == NUM_PROMPT_TOKENS


def test_stream_events_through_the_sdk(client):
    with client.messages.stream(**ask("CALLS", tools=TOOLS)) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds and "content_block_stop" in kinds
    assert calls_of(final) == EXPECTED_CALLS and final.stop_reason == "tool_use"


def test_tool_round_trip(client, server):
    _, engine, _ = server
    messages: list = [{"role": "user", "content": "What is the weather in Paris, and the time? CALLS"}]
    first = client.messages.create(**ask("", messages=messages, tools=TOOLS, system="Be brief."))
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use", "tool_use"] and first.content[0].text == "Let me check."
    assert calls_of(first) == EXPECTED_CALLS
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len({b.id for b in uses}) == 2
    # The client runs the tools and answers both calls; the model goes on from there.
    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 degrees"},
                {"type": "tool_result", "tool_use_id": uses[1].id, "content": [{"type": "text", "text": "noon ANSWERED"}]},
            ],
        },
    ]
    second = client.messages.create(**ask("", messages=messages, tools=TOOLS, system="Be brief."))
    assert [(b.type, b.text) for b in second.content] == [("text", SCRIPTS["ANSWERED"])] and second.stop_reason == "end_turn"
    # What the chat template was given: the system prompt, the calls with their ids, the results.
    req = engine.requests[-1]
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool", "tool"]
    assistant = req.messages[2]
    assert assistant.content == "Let me check."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [(b.id, b.name, b.input) for b in uses]
    assert [(m.tool_call_id, m.name, m.content) for m in req.messages[3:]] == [
        (uses[0].id, "weather", "21 degrees"),
        (uses[1].id, "time", "noon ANSWERED"),
    ]
    assert [t["function"]["name"] for t in json.loads(req.tools)] == ["weather", "time"]
    assert json.loads(req.tools)[0]["function"]["parameters"] == TOOLS[0]["input_schema"]


def test_thinking_then_tool_use(client):
    out = client.messages.create(**ask("THINK_CALLS", tools=TOOLS))
    assert [b.type for b in out.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert out.content[0].thinking == "\nThe user wants weather.\n" and out.content[0].signature == ""
    assert calls_of(out) == EXPECTED_CALLS and out.stop_reason == "tool_use"
    with client.messages.stream(**ask("THINK_CALLS", tools=TOOLS)) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in out.content if b.type != "tool_use"] + [
        b.model_dump() for b in final.content if b.type == "tool_use"
    ]
    assert calls_of(final) == EXPECTED_CALLS


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_tool_and_any(client, server, stream):
    _, engine, _ = server

    def create(**kw):
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    named = create(**ask("NAMED", tools=TOOLS, tool_choice={"type": "tool", "name": "weather"}))
    assert calls_of(named) == [("weather", {"city": "Paris"})] and named.stop_reason == "tool_use"
    assert [b.type for b in named.content] == ["tool_use"]
    assert json.loads(engine.requests[-1].params.structured.spec) == TOOLS[0]["input_schema"]
    any_ = create(**ask("REQUIRED", tools=TOOLS, tool_choice={"type": "any"}))
    assert calls_of(any_) == EXPECTED_CALLS and any_.stop_reason == "tool_use"
    assert "maxItems" not in json.loads(engine.requests[-1].params.structured.spec)
    create(**ask("REQUIRED", tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert json.loads(engine.requests[-1].params.structured.spec)["maxItems"] == 1


def test_tool_choice_none_and_auto(client, server):
    _, engine, _ = server
    out = client.messages.create(**ask("CALLS", tools=TOOLS, tool_choice={"type": "none"}))
    assert [(b.type, b.text) for b in out.content] == [("text", SCRIPTS["CALLS"])] and out.stop_reason == "end_turn"
    assert engine.requests[-1].params.structured is None and engine.requests[-1].tools is not None
    out = client.messages.create(**ask("CALLS", tools=TOOLS, tool_choice={"type": "auto"}))
    assert calls_of(out) == EXPECTED_CALLS


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reasons(client, stream):
    def create(**kw):
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    # The fake engine writes " t0 t1 t2 t3 t4" for a prompt it has no script for.
    out = create(**ask("a b", stop_sequences=["zz", " t2"]))
    assert out.content[0].text == " t0 t1" and (out.stop_reason, out.stop_sequence) == ("stop_sequence", " t2")
    out = create(**ask("a b", max_tokens=2))
    assert out.content[0].text == " t0 t1" and (out.stop_reason, out.stop_sequence) == ("max_tokens", None)
    assert out.usage.output_tokens == 2
    out = create(**ask("a b"))
    assert out.content[0].text == " t0 t1 t2 t3 t4" and (out.stop_reason, out.stop_sequence) == ("end_turn", None)
    cut = create(**ask("CALLS", tools=TOOLS, max_tokens=6))  # cut inside a call: text, not a tool_use
    assert cut.stop_reason == "max_tokens" and not calls_of(cut)


def test_sampling_parameters_reach_the_engine(client, server):
    _, engine, _ = server
    # This SDK's create() no longer names temperature, top_p and top_k; the API still takes them.
    sampling = {"temperature": 0.5, "top_p": 0.9, "top_k": 7}
    client.messages.create(**ask("PLAIN", metadata={"user_id": "u1"}), extra_body=sampling)
    params = engine.requests[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 7, 100)


def test_cached_prompt_tokens_are_cache_reads(client):
    out = client.messages.create(**ask("one two CACHED"))  # the fake reports all but one token cached
    assert (out.usage.input_tokens, out.usage.cache_read_input_tokens) == (1, 2)


def test_count_tokens_is_the_chat_templates_count(client, server):
    url, _, _ = server
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    bare = client.messages.count_tokens(model=MODEL_NAME, messages=messages)
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=messages, system=system, tools=TOOLS)
    chat = [{"role": "system", "content": "Be brief.\nBe kind."}, *messages]
    chat_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS]
    chat_tools[0]["function"]["description"] = TOOLS[0]["description"]
    tokenized = post(url, "/tokenize", {"messages": chat, "tools": chat_tools}).json()
    assert counted.input_tokens == tokenized["count"] > bare.input_tokens > 0
    assert bare.input_tokens == post(url, "/tokenize", {"messages": messages}).json()["count"]


def test_api_key_as_x_api_key_or_bearer(tmp_path):
    with running_server(tmp_path, ScriptedEngine, api_key="k") as (url, _, _):
        out = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(**ask("PLAIN"))
        assert out.content[0].text == SCRIPTS["PLAIN"]
        out = anthropic.Anthropic(base_url=url, auth_token="k", max_retries=0).messages.create(**ask("PLAIN"))
        assert out.content[0].text == SCRIPTS["PLAIN"]
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**ask("PLAIN"))
        assert caught.value.status_code == 401 and caught.value.body["error"]["type"] == "authentication_error"
        counted = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.count_tokens(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}]
        )
        assert counted.input_tokens > 0


def test_bad_request_through_the_sdk(client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**ask("PLAIN"), extra_body={"temperature": 1.5})
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(**ask("PLAIN", model="another-model"))
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_output_config_format_constrains_the_text(client, server):
    _, engine, _ = server
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    out = client.messages.create(**ask("NAMED", output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert json.loads(out.content[0].text) == {"city": "Paris"}
    structured = engine.requests[-1].params.structured
    assert structured is not None and json.loads(structured.spec) == schema
