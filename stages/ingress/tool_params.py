"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked and resolved.

OpenAI's rule for the default: "auto" when tools are given, else "none". "required" and a named
function constrain the output (vLLM's scheme, which the answer side parses back into tool_calls):
a named function's output is its arguments object, so its `parameters` schema; "required" is a
JSON array of {"name", "parameters"} objects, one of the tools each, at least one (exactly one
when parallel_tool_calls is false). "none" and "auto" leave the output free; the tools still go
to the chat template, as vLLM and transformers pass them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conveyor.stages.ingress.bodies import ChatBody, NamedToolChoice, ToolBody
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.structured_params import json_schema_output
from conveyor.wire.sampling_params import StructuredOutput

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # the arguments of a function without a parameters schema


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    tools: list[dict[str, Any]] | None = None  # as the chat template takes them
    mode: str = "none"  # "none", "auto", "required" or "named"
    name: str | None = None  # the function, when mode is "named"
    structured: StructuredOutput | None = None  # what "required" and "named" constrain the output to


def tool_choice(body: ChatBody) -> ToolChoice:
    tools = body.tools or None  # [] is no tools, as vLLM reads it
    choice = body.tool_choice
    if tools is None:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise ApiError(400, "tool_choice asks for a tool call, but the request has no tools", param="tool_choice")
        return ToolChoice()
    functions = {}
    for i, tool in enumerate(tools):
        if tool.function.name in functions:
            raise ApiError(400, f"two tools are named {tool.function.name!r}", param=f"tools[{i}].function.name")
        functions[tool.function.name] = tool
    as_sent = [template_tool(tool) for tool in tools]
    if choice is None or choice in ("none", "auto"):
        return ToolChoice(as_sent, choice or "auto")
    if choice == "required":
        return ToolChoice(as_sent, "required", structured=json_schema_output(_any_calls(tools, body), "tools"))
    assert isinstance(choice, NamedToolChoice)  # decoding admits nothing else
    name = choice.function.name
    if name not in functions:
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the tools", param="tool_choice")
    schema = functions[name].function.parameters or ANY_OBJECT
    return ToolChoice(as_sent, "named", name, json_schema_output(schema, "tools"))  # a bad schema: the tool's


def _any_calls(tools: list[ToolBody], body: ChatBody) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": t.function.parameters or ANY_OBJECT},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def template_tool(tool: ToolBody) -> dict[str, Any]:
    """{"type": "function", "function": {...}} without the fields the client left out: templates
    test `is defined`, and a `tojson` of the tool shows every key it has."""
    function = tool.function
    spec: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        spec["description"] = function.description
    if function.parameters is not None:
        spec["parameters"] = function.parameters
    if function.strict is not None:
        spec["strict"] = function.strict
    return {"type": "function", "function": spec}
