"""POST /v1/responses and the stored-response routes, through the real ingress against an engine
that writes scripted text (a hermes-format model with qwen3 reasoning), read with the official
OpenAI SDK unchanged: whole answers, streams assembled by its helpers, a function tool round
trip over previous_response_id, retrieve and cancel (background mode), and the 400s and 404s."""

from __future__ import annotations

import json

import openai
import pytest

from tests import ingress_fakes
from tests.ingress_server import MODEL_NAME, assert_error, post, running_server, wait_for

TOOLS = [
    {
        "type": "function",
        "name": "weather",
        "description": "today's weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False,
    },
]
CALL = 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# The text each script writes, in pieces that cut through the tags and the JSON: the last word of
# the conversation (a user message, or a tool's output) names the script.
SCRIPTS = {
    "PLAIN": "Just words, no call.",
    "CALL": CALL,
    "SUNNY": "It is sunny in Paris.",
    "THINK_CALL": "<think>\nThe user wants weather.\n</think>\n\n" + CALL,
    "JSON": '{"city": "Paris"}',
}
PIECE = ingress_fakes.ScriptedEngine.PIECE


class ScriptedEngine(ingress_fakes.ScriptedEngine):
    """Anything not scripted is FakeEngine's answer (SLOW: a token every 20 ms until aborted)."""

    scripts = SCRIPTS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    with running_server(root, ScriptedEngine, tool_call_parser="hermes", reasoning_parser="qwen3") as running:
        yield running


@pytest.fixture
def client(server):
    url, _, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def without_ids(items: list) -> list[dict]:
    """Output items as dicts, their item ids (new per answer) and call ids left out, and what the
    SDK's stream helper adds (`parsed`)."""
    out = []
    for item in items:
        d = {k: v for k, v in item.to_dict().items() if k not in ("id", "call_id", "parsed_arguments")}
        if "content" in d:
            d["content"] = [{k: v for k, v in part.items() if k != "parsed"} for part in d["content"]]
        out.append(d)
    return out


def test_plain_answer(client):
    out = client.responses.create(model=MODEL_NAME, input="PLAIN")
    assert out.id.startswith("resp_") and out.object == "response" and out.status == "completed"
    assert out.output_text == SCRIPTS["PLAIN"] and [item.type for item in out.output] == ["message"]
    [message] = out.output
    assert message.role == "assistant" and message.status == "completed" and message.content[0].type == "output_text"
    assert out.incomplete_details is None and out.error is None and out.model == MODEL_NAME
    assert out.usage.input_tokens == 3 and out.usage.output_tokens == 3 and out.usage.total_tokens == 6
    assert out.usage.input_tokens_details.cached_tokens == 0 and out.usage.output_tokens_details.reasoning_tokens == 0


def test_function_tool_round_trip(client, server):
    _, engine, _ = server
    first = client.responses.create(model=MODEL_NAME, input="CALL", tools=TOOLS, instructions="Be brief.")
    assert [item.type for item in first.output] == ["message", "function_call"]
    assert first.output[0].content[0].text == "Let me check.\n"
    call = first.output[1]
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert first.status == "completed" and first.tools[0].name == "weather" and first.tool_choice == "auto"
    assert [m.role for m in engine.requests[-1].messages] == ["system", "user"]

    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "SUNNY"}]
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=answer, tools=TOOLS)
    assert second.output_text == SCRIPTS["SUNNY"] and second.previous_response_id == first.id
    # The conversation: the first input, its answer (text and call: one assistant turn), the
    # output. The first request's instructions are not carried over, as on OpenAI.
    messages = engine.requests[-1].messages
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].content == "Let me check.\n" and [c.name for c in messages[1].tool_calls] == ["weather"]
    assert messages[1].tool_calls[0].id == call.call_id
    assert messages[2].tool_call_id == call.call_id and messages[2].content == "SUNNY" and messages[2].name == "weather"


def test_stream_helper_matches_the_whole_answer(client):
    whole = client.responses.create(model=MODEL_NAME, input="THINK_CALL", tools=TOOLS)
    with client.responses.stream(model=MODEL_NAME, input="THINK_CALL", tools=TOOLS) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "\nThe user wants weather.\n"
    assert without_ids(final.output) == without_ids(whole.output)
    assert final.status == "completed" and types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.done" in types


def test_stream_round_trip_with_previous_response(client, server):
    _, engine, _ = server
    with client.responses.stream(model=MODEL_NAME, input="CALL", tools=TOOLS) as stream:
        first = stream.get_final_response()
    call = first.output[-1]
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "SUNNY"}]
    with client.responses.stream(model=MODEL_NAME, previous_response_id=first.id, input=answer, tools=TOOLS) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        second = stream.get_final_response()
    assert deltas == second.output_text == SCRIPTS["SUNNY"]
    assert [m.role for m in engine.requests[-1].messages] == ["user", "assistant", "tool"]
    assert client.responses.retrieve(second.id).output_text == SCRIPTS["SUNNY"]


def test_max_output_tokens_is_incomplete(client):
    out = client.responses.create(model=MODEL_NAME, input="PLAIN", max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text == SCRIPTS["PLAIN"][: 2 * PIECE] and out.output[0].status == "incomplete"
    with client.responses.stream(model=MODEL_NAME, input="PLAIN", max_output_tokens=2) as stream:
        types = [event.type for event in stream]
    assert types[-1] == "response.incomplete" and "response.completed" not in types


def test_text_format_is_the_chat_routes_structured_output(client, server):
    _, engine, _ = server
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}}
    out = client.responses.create(model=MODEL_NAME, input="JSON", text=text)
    assert json.loads(out.output_text) == {"city": "Paris"} and out.text.format.type == "json_schema"
    structured = engine.requests[-1].params.structured
    assert structured.kind == "json_schema" and json.loads(structured.spec) == schema


def test_sampling_and_tool_choice_reach_the_engine(client, server):
    _, engine, _ = server
    named = {"type": "function", "name": "weather"}
    out = client.responses.create(model=MODEL_NAME, input="JSON", tools=TOOLS, tool_choice=named, temperature=0.5, top_p=0.9)
    [call] = out.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    params = engine.requests[-1].params
    assert (params.temperature, params.top_p) == (0.5, 0.9) and params.structured is not None
    assert out.tool_choice.name == "weather" and out.temperature == 0.5


def test_retrieve_and_store(client, server):
    url, _, _ = server
    out = client.responses.create(model=MODEL_NAME, input="PLAIN", metadata={"k": "v"})
    got = client.responses.retrieve(out.id)
    assert got.to_dict() == out.to_dict() and got.metadata == {"k": "v"}
    unstored = client.responses.create(model=MODEL_NAME, input="PLAIN", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(out.id)
    assert_error(
        post(url, "/v1/responses", {"input": "PLAIN", "previous_response_id": out.id}),
        404,
        "previous_response_id",
        "response_not_found",
    )


def test_input_items_list_the_whole_conversation(client):
    first = client.responses.create(model=MODEL_NAME, input="CALL", tools=TOOLS)
    call = first.output[-1]
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "SUNNY"}]
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=answer, tools=TOOLS)
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in items] == ["message", "message", "function_call", "function_call_output"]
    assert items[0].content[0].text == "CALL" and items[0].role == "user"
    assert [i.id for i in items[1:3]] == [item.id for item in first.output] and items[3].call_id == call.call_id
    newest_first = client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in newest_first.data] == [items[3].id, items[2].id] and newest_first.has_more
    rest = client.responses.input_items.list(second.id, limit=2, after=newest_first.last_id)
    assert [i.id for i in rest.data] == [items[1].id, items[0].id] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_unknown_ids_are_404(client, server):
    url, _, _ = server
    for call in (client.responses.retrieve, client.responses.cancel, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as e:
            call("resp_nope")
        assert e.value.body["param"] == "response_id" and e.value.body["code"] == "response_not_found"
    error = assert_error(
        post(url, "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}),
        404,
        "previous_response_id",
        "response_not_found",
    )
    assert error["type"] == "not_found_error"


def test_only_background_responses_cancel(client):
    out = client.responses.create(model=MODEL_NAME, input="PLAIN")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(out.id)


def test_background_runs_and_polls(client):
    out = client.responses.create(model=MODEL_NAME, input="PLAIN", background=True)
    assert out.status == "queued" and out.background is True
    assert wait_for(lambda: client.responses.retrieve(out.id).status == "completed")
    assert client.responses.retrieve(out.id).output_text == SCRIPTS["PLAIN"]
    assert client.responses.cancel(out.id).status == "completed"  # finished: unchanged


def test_background_cancel_aborts_the_engine_request(client, server):
    _, engine, _ = server
    out = client.responses.create(model=MODEL_NAME, input="SLOW", background=True)
    assert wait_for(lambda: client.responses.retrieve(out.id).status == "in_progress")
    with pytest.raises(openai.BadRequestError) as e:  # a conversation cannot go on from a running response
        client.responses.create(model=MODEL_NAME, input="PLAIN", previous_response_id=out.id)
    assert e.value.body["param"] == "previous_response_id"
    num_aborts = len(engine.aborts)
    cancelled = client.responses.cancel(out.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(out.id).status == "cancelled"
    assert wait_for(lambda: len(engine.aborts) > num_aborts) and engine.aborts[-1] == engine.requests[-1].request_id


def test_a_background_rejection_fails_the_response(client):
    out = client.responses.create(model=MODEL_NAME, input="QUEUE_FULL", background=True)
    assert wait_for(lambda: client.responses.retrieve(out.id).status == "failed")
    error = client.responses.retrieve(out.id).error
    assert error.code == "rate_limit_exceeded" and error.message == "the waiting queue is full"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"content": "no role"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "detail": "low"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "x", "background": True, "store": False}, "store"),
        ({"input": "x", "metadata": {"k": 5}}, "metadata"),
    ],
)
def test_bad_input_names_the_param(server, body, param):
    url, _, _ = server
    assert_error(post(url, "/v1/responses", body), 400, param)


def test_an_unknown_model_is_404_even_in_background(server):
    url, _, _ = server
    for background in (False, True):
        body = {"model": "other", "input": "PLAIN", "background": background}
        assert_error(post(url, "/v1/responses", body), 404, "model", "model_not_found")
