"""The request side of structured outputs and tool calling: bodies parsed into a Generation.

response_format, vLLM's guided_* and structured_outputs become one StructuredOutput; tools and
tool_choice become the Generation's tool fields (and, for "required" or a named function, the
constraint); tool calls and tool turns become ChatMessages. Every misuse is a 400 naming its param.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.protocol import Generation, parse_chat, parse_completion
from conveyor.wire.messages import ChatMessage, StructuredOutput, ToolCall

VOCAB = 1000
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}}, "required": ["a"]}
SORTED = json.dumps(SCHEMA, sort_keys=True)
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}
TOOLS = [{"type": "function", "function": ADD}, {"type": "function", "function": {"name": "now", "description": "d"}}]


def chat(**body) -> Generation:
    return parse_chat(json.dumps({"messages": USER} | body).encode(), VOCAB)


def completion(**body) -> Generation:
    return parse_completion(json.dumps({"prompt": "hi"} | body).encode(), VOCAB)


def refused(parse, **body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(**body)
    assert e.value.status == 400
    return e.value


CONSTRAINTS = [  # (body fields, the StructuredOutput they ask for)
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "")),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
        StructuredOutput("json_schema", SORTED),
    ),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", SORTED)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", SORTED)),
    ({"guided_regex": "[a-z]+@[a-z]+\\.com"}, StructuredOutput("regex", "[a-z]+@[a-z]+\\.com")),
    ({"guided_choice": ["yes", "no", "naïve"]}, StructuredOutput("choice", '["yes", "no", "naïve"]')),
    ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutput("grammar", 'root ::= "a" | "b"')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", SORTED)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput("json_schema", SORTED)),
    ({"structured_outputs": {"regex": "a|b"}}, StructuredOutput("regex", "a|b")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput("choice", '["a", "b"]')),
    ({"structured_outputs": {"grammar": "root ::= [0-9]+"}}, StructuredOutput("grammar", "root ::= [0-9]+")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", "")),
    ({"structured_outputs": {"json_object": False, "disable_any_whitespace": True}}, None),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutput("regex", "a")),  # text is no constraint
    ({}, None),
]


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize("fields, expected", CONSTRAINTS)
def test_each_constraint_becomes_one_structured_output(parse, fields, expected):
    got = parse(**fields).params.structured
    assert (got and (got.kind, got.spec)) == (expected and (expected.kind, expected.spec))
    if got is not None:  # it names the param it came from, for a 400 if it cannot compile
        assert got.param.split(".")[0] in fields and (got.kind != "regex" or got.param != "response_format")


def test_equal_schemas_share_one_spec():
    """Key order is the client's whim; the spec (and so the compiled grammar) is the same."""
    reordered = json.loads(json.dumps(SCHEMA))
    reordered = {k: reordered[k] for k in reversed(list(reordered))}
    assert chat(guided_json=reordered).params.structured == chat(guided_json=SCHEMA).params.structured


SHAPE_ERRORS = [  # (body fields, the param the 400 names)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "string"}}}, "response_format.json_schema.schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice[1]"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "nope"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
]


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize("fields, param", SHAPE_ERRORS)
def test_malformed_constraints_are_a_400_naming_the_param(parse, fields, param):
    assert refused(parse, **fields).param == param


TWO_CONSTRAINTS = [  # (body fields, the param the 400 names: the second in the order checked)
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": SCHEMA, "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize("fields, param", TWO_CONSTRAINTS)
def test_two_constraints_are_a_400_naming_one(parse, fields, param):
    error = refused(parse, **fields)
    assert error.param == param and "both constrain" in str(error)


def test_tools_default_to_auto_and_reach_the_generation_as_the_template_takes_them():
    gen = chat(tools=TOOLS)
    assert (gen.tool_mode, gen.tool_name, gen.params.structured, gen.parallel_tool_calls) == ("auto", None, None, True)
    assert gen.tools == [
        {"type": "function", "function": ADD},
        {"type": "function", "function": {"name": "now", "description": "d"}},  # absent fields stay absent
    ]
    assert chat().tools is None and chat().tool_mode == "none"
    assert chat(tools=[]).tools is None  # no tools, as vLLM reads it
    assert chat(tools=TOOLS, tool_choice="none").tool_mode == "none"
    assert chat(tool_choice="auto").tool_mode == "none"  # nothing to call


def test_a_named_function_constrains_the_output_to_its_arguments():
    gen = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert (gen.tool_mode, gen.tool_name) == ("named", "add")
    assert gen.params.structured == StructuredOutput("json_schema", json.dumps(ADD["parameters"], sort_keys=True), param="tools")
    # Without a parameters schema the arguments are any object.
    gen = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert gen.params.structured == StructuredOutput("json_schema", '{"type": "object"}', param="tools")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_the_output_to_an_array_of_calls(parallel):
    gen = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    assert (gen.tool_mode, gen.parallel_tool_calls) == ("required", parallel)
    assert gen.params.structured is not None and gen.params.structured.kind == "json_schema"
    schema = json.loads(gen.params.structured.spec)
    call = lambda name, params: {  # noqa: E731
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": params},
        "required": ["name", "parameters"],
    }
    expected = {"type": "array", "minItems": 1, "items": {"anyOf": [call("add", ADD["parameters"]), call("now", {"type": "object"})]}}
    assert schema == expected | ({} if parallel else {"maxItems": 1})
    jsonschema.validate([{"name": "add", "parameters": {"x": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "sub", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


TOOL_ERRORS = [  # (body fields, the param the 400 names)
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}, "guided_json": SCHEMA}, "guided_json"),
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "add"}}]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
]


@pytest.mark.parametrize("fields, param", TOOL_ERRORS)
def test_tool_misuse_is_a_400_naming_the_param(fields, param):
    assert refused(chat, **fields).param == param


def test_auto_tools_leave_room_for_a_response_format():
    gen = chat(tools=TOOLS, response_format={"type": "json_object"})
    assert gen.tool_mode == "auto" and gen.params.structured == StructuredOutput("json_object", "", param="response_format")


def test_tools_on_completions_are_a_400():
    assert refused(completion, tools=TOOLS).param == "tools"


def test_tool_calls_and_tool_turns_become_chat_messages():
    messages = [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"x": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {"tz": "UTC"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "name": "clock", "content": [{"type": "text", "text": "noon"}]},
    ]
    (prompt,) = parse_chat(json.dumps({"messages": messages}).encode(), VOCAB).prompts
    assert prompt.messages == [
        ChatMessage("user", "add 1 and 2"),
        ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "add", '{"x": 1}'), ToolCall("c2", "now", '{"tz":"UTC"}')]),
        ChatMessage("tool", "3", tool_call_id="c1", name="add"),  # the name its call had
        ChatMessage("tool", "noon", tool_call_id="c2", name="clock"),  # the client's name wins
    ]


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "user", "content": "x", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}, "messages[0].tool_calls[0].id"),
        (
            {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": 5}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"role": "function", "content": "x"}, "messages[0].role"),
    ],
)
def test_malformed_tool_messages_are_a_400(message, param):
    assert refused(chat, messages=[message]).param == param
