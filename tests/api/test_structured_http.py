"""Structured outputs over HTTP, end to end on the tiny random model (issue 18).

A random model left alone writes noise; constrained, every answer must still be what was asked
for: JSON that validates against its schema (nested objects, arrays, enums, bounded numbers,
optional fields, anyOf), exactly one of the choices, a full match of the regex. Each case runs
streamed and not, greedy and sampled, with n=2, and many requests at once, so one sequence's
grammar state cannot leak into another's. Every schema is bounded (strings by a pattern, numbers
by a range, arrays by maxItems) so that a finished answer is a complete one: finish_reason must
be "stop". A spec that does not compile is a 400 from the tokenizer stage, before any byte.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from tests.conftest import Daemon, stream_events

MAX_TOKENS = 300  # well past the longest answer any schema here admits, blanks included
# Strings bounded by a pattern here; those bounded by minLength and maxLength (whose xgrammar 0.2.8
# rule admitted raw control characters) have test_every_stopped_answer_is_strict_json below.
NAME = {"type": "string", "pattern": "^[a-zA-Z ]{0,8}$"}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"],
            },
            "admin": {"type": "boolean"},
        },
        "required": ["user", "admin"],
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, "big"]}},
        "required": ["color", "size"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "note": NAME,
            "tags": {"type": "array", "items": NAME, "maxItems": 2},
        },
        "required": ["id"],
    },
    "anyOf": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, NAME, {"type": "null"}]}},
        "required": ["value"],
    },
}
CHOICES = ["yes", "no", "maybe not", "ünïcode ✓"]
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"


@pytest.fixture(scope="module")
def daemon(daemon_factory) -> Daemon:
    return daemon_factory("--num-kv-blocks", "512")


def collect(daemon: Daemon, route: str, body: dict[str, Any]) -> tuple[list[str], list[str | None]]:
    """Each choice's text and finish reason, streamed or not."""
    body = {"max_tokens": MAX_TOKENS, **body}
    stream = body.get("stream", False)
    response = daemon.post(route, body, stream=stream)
    assert response.status_code == 200, response.text
    chunks = [e for e in stream_events(response) if e != "[DONE]"] if stream else [response.json()]
    n = body.get("n", 1)
    texts: list[str] = [""] * n
    reasons: list[str | None] = [None] * n
    for choice in (c for chunk in chunks for c in chunk["choices"]):
        i = choice["index"]
        message = choice.get("delta") or choice.get("message")  # chat; a completion has text
        texts[i] += (message.get("content") or "") if message is not None else choice.get("text", "")
        reasons[i] = choice["finish_reason"] or reasons[i]
    return texts, reasons


def answers(daemon: Daemon, route: str, body: dict[str, Any], reason: str = "stop") -> list[str]:
    """Each choice's text; every choice must end for `reason` (a constrained one stops on its
    own: the grammar lets it end once the answer is complete)."""
    texts, reasons = collect(daemon, route, body)
    assert reasons == [reason] * len(texts), (reasons, texts)
    return texts


def schema_requests(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The same schema asked every way: both routes, each way of giving it, greedy and sampled,
    streamed and not, two samples at once."""
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    return [
        ("/v1/completions", {"prompt": "JSON:", "temperature": 0, "response_format": response_format}),
        ("/v1/completions", {"prompt": "Data", "temperature": 1, "n": 2, "stream": True, "guided_json": schema}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Answer in JSON"}],
                "temperature": 1,
                "seed": 7,
                "response_format": response_format,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "go"}],
                "temperature": 1,
                "n": 2,
                "stream": True,
                "structured_outputs": {"json": json.dumps(schema)},
            },
        ),
    ]


def run_all(daemon: Daemon, requests: list[tuple[str, dict[str, Any]]]) -> list[list[str]]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda r: answers(daemon, *r), requests))


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_answers_validate(daemon, name):
    schema = SCHEMAS[name]
    for texts in run_all(daemon, schema_requests(schema)):
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


def test_json_object_answers_are_objects(daemon):
    """Any object: nothing bounds it, so a random model may run out of tokens inside one; what it
    wrote is then still the start of an object, and an answer that stopped is a whole one."""
    for stream in (False, True):
        body = {"prompt": "{", "temperature": 1, "n": 2, "seed": 3, "stream": stream, "max_tokens": 48}
        texts, reasons = collect(daemon, "/v1/completions", body | {"response_format": {"type": "json_object"}})
        for text, reason in zip(texts, reasons, strict=True):
            assert text.lstrip().startswith("{")
            if reason == "stop":
                assert isinstance(json.loads(text), dict)


def test_choice_answers_are_exactly_one_choice(daemon):
    chat = {"messages": [{"role": "user", "content": "pick"}]}
    requests = [
        ("/v1/completions", {"prompt": "Pick:", "temperature": 0, "guided_choice": CHOICES}),
        ("/v1/completions", {"prompt": "Pick:", "temperature": 1, "n": 2, "stream": True, "guided_choice": CHOICES}),
        ("/v1/chat/completions", chat | {"temperature": 1, "n": 2, "structured_outputs": {"choice": CHOICES}}),
        ("/v1/chat/completions", chat | {"temperature": 1, "stream": True, "guided_choice": CHOICES}),
    ]
    for texts in run_all(daemon, requests):
        assert all(text in CHOICES for text in texts), texts


def test_regex_and_grammar_answers_match(daemon):
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    requests = [
        ("/v1/completions", {"prompt": "id:", "temperature": 0, "guided_regex": REGEX}),
        ("/v1/completions", {"prompt": "id:", "temperature": 1, "n": 2, "stream": True, "guided_regex": REGEX}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "id"}], "structured_outputs": {"regex": REGEX}}),
        ("/v1/completions", {"prompt": "sum:", "temperature": 1, "n": 2, "max_tokens": 60, "guided_grammar": grammar}),
    ]
    *regex_answers, grammar_answers = run_all(daemon, requests)
    for texts in regex_answers:
        assert all(re.fullmatch(REGEX, text) for text in texts), texts
    assert all(re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text) for text in grammar_answers), grammar_answers


def test_concurrent_mixed_constraints_each_keep_their_own(daemon):
    """Eight at once, each constraint different, one request unconstrained beside them: a mask
    applied to the wrong row, or a grammar state shared, would break one of them."""
    cases: list[tuple[dict[str, Any], Any]] = [  # (body fields, what each answer must be)
        ({"guided_json": SCHEMAS["nested"]}, SCHEMAS["nested"]),
        ({"guided_json": SCHEMAS["array"]}, SCHEMAS["array"]),
        ({"guided_choice": CHOICES}, CHOICES),
        ({"guided_regex": REGEX}, REGEX),
        ({"guided_grammar": 'root ::= "x" [0-9]'}, r"x[0-9]"),
        ({"guided_json": SCHEMAS["enum"]}, SCHEMAS["enum"]),
        ({"max_tokens": 8, "ignore_eos": True}, None),
        ({"guided_json": SCHEMAS["anyOf"]}, SCHEMAS["anyOf"]),
    ]
    requests = [
        ("/v1/completions", {"prompt": f"case {i}", "temperature": 1, "stream": i % 2 == 1, **fields})
        for i, (fields, _) in enumerate(cases)
    ]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda r: answers(daemon, *r, reason="length" if "ignore_eos" in r[1] else "stop"), requests))
    for (_, expected), (text,) in zip(cases, results, strict=True):
        if isinstance(expected, dict):
            jsonschema.validate(json.loads(text), expected)
        elif isinstance(expected, list):
            assert text in expected
        elif isinstance(expected, str):
            assert re.fullmatch(expected, text)


# Every string bound and number bound there is, and raw control characters (which a random model
# at temperature 1 draws often: 110 of the tiny vocabulary's ids hold one) have somewhere to go.
STRINGS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "note": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "count": {"type": "integer", "minimum": 3, "maximum": 7},
        "kind": {"enum": ["a", "b\n", 3]},
    },
    "required": ["name", "tags", "score", "count", "kind"],
}


def test_every_stopped_answer_is_strict_json(daemon):
    """Many seeds at temperature 1, n=2, streamed and not (and greedy once): each answer that
    stopped parses with a strict parser (no raw U+0000-U+001F in a string) and validates."""
    requests = [
        (
            "/v1/completions",
            {"prompt": f"JSON {seed}:", "temperature": 1, "seed": seed, "n": 2, "stream": seed % 2 == 0, "guided_json": STRINGS},
        )
        for seed in range(8)
    ] + [("/v1/completions", {"prompt": "JSON:", "temperature": 0, "guided_json": STRINGS})]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda r: collect(daemon, *r), requests))
    stopped = [text for texts, reasons in results for text, reason in zip(texts, reasons, strict=True) if reason == "stop"]
    assert len(stopped) >= 12, results  # every string and number is bounded: nearly all stop
    for text in stopped:
        jsonschema.validate(json.loads(text), STRINGS)


BAD_SPECS = [  # (body fields, the param the 400 names)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}}},
        "response_format",
    ),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "guided_json"),  # not enforced: refused
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, param", BAD_SPECS)
def test_a_spec_that_does_not_compile_is_a_400(daemon, fields, param, stream):
    response = daemon.post("/v1/completions", {"prompt": "x", "stream": stream, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert daemon.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200  # still serving
