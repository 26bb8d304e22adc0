"""The output constraint a request asks for, as one StructuredOutput (or None).

Both generation routes take OpenAI's `response_format` and vLLM's extras: `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and the newer `structured_outputs` object.
A request may give one constraint at most; a second is a 400 naming it. Only the shape is checked
here; whether a schema, pattern or grammar compiles is the tokenizer stage's verdict (a 400 too).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from conveyor.stages.ingress.bodies import JsonObjectFormat, JsonSchemaFormat, SamplingBody, StructuredOutputsBody
from conveyor.stages.ingress.errors import ApiError
from conveyor.wire.sampling_params import StructuredOutput


def structured_output(body: SamplingBody) -> StructuredOutput | None:
    """The request's constraint, naming the param that gave it (`param`); None without one."""
    found = [output for output in _constraints(body) if output is not None]
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise ApiError(400, f"{second} and {first} both constrain the output; give one of them", param=second)
    return found[0] if found else None


def json_schema_output(schema: Any, param: str) -> StructuredOutput:
    """A json_schema constraint. Keys are sorted so equal schemas are one spec: compiled grammars
    are cached by it (gpu/structured/)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ApiError(400, f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param)
    return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False), param=param)


def _constraints(body: SamplingBody) -> list[StructuredOutput | None]:
    """What each constraint param asks for, carrying the param's name (a spec the tokenizer stage
    cannot compile is a 400 naming it)."""
    given = [
        ("response_format", _response_format(body)),
        ("structured_outputs", _structured_outputs(body.structured_outputs)),
        ("guided_json", None if body.guided_json is None else json_schema_output(body.guided_json, "guided_json")),
        ("guided_regex", None if body.guided_regex is None else StructuredOutput("regex", body.guided_regex)),
        ("guided_choice", None if body.guided_choice is None else _choice(body.guided_choice)),
        ("guided_grammar", None if body.guided_grammar is None else StructuredOutput("grammar", body.guided_grammar)),
    ]
    return [None if out is None else msgspec.structs.replace(out, param=name) for name, out in given]


def _response_format(body: SamplingBody) -> StructuredOutput | None:
    match body.response_format:
        case JsonObjectFormat():
            return StructuredOutput("json_object")
        case JsonSchemaFormat(json_schema=spec):
            if spec.schema is None:
                raise ApiError(400, "response_format.json_schema needs a schema", param="response_format.json_schema")
            return json_schema_output(spec.schema, "response_format.json_schema.schema")
    return None  # absent, or {"type": "text"}


def _structured_outputs(so: StructuredOutputsBody | None) -> StructuredOutput | None:
    if so is None:
        return None
    if so.structural_tag is not None:
        message = "structured_outputs.structural_tag is not supported; use json, regex, choice or grammar"
        raise ApiError(400, message, param="structured_outputs.structural_tag")
    given = [
        StructuredOutput("json_object") if so.json_object else None,
        None if so.json is None else json_schema_output(so.json, "structured_outputs.json"),
        None if so.regex is None else StructuredOutput("regex", so.regex),
        None if so.choice is None else _choice(so.choice),
        None if so.grammar is None else StructuredOutput("grammar", so.grammar),
    ]
    outputs = [output for output in given if output is not None]
    if len(outputs) > 1:
        message = "structured_outputs takes one of json, regex, choice, grammar and json_object"
        raise ApiError(400, message, param="structured_outputs")
    return outputs[0] if outputs else None


def _choice(choices: list[str]) -> StructuredOutput:
    return StructuredOutput("choice", json.dumps(choices, ensure_ascii=False))
