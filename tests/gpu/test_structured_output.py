"""Constrained decoding through the Python API on the tiny random-weights model, which never
writes JSON by itself: whatever it draws, every output must parse and validate (with a strict
parser: no raw control character in a string, gpu/structured/json_schema.py), end on EOS
(finish reason "stop"), and leave the unconstrained requests beside it exactly as they are alone.
Under a single step per plan, multi-step windows, and a pool small enough to preempt (a resumed
sequence's matcher is rebuilt from its outputs)."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest

from conveyor import LLM, SamplingParams
from conveyor.wire.sampling_params import StructuredKind, StructuredOutput

PROMPTS = ["Hello, my name is", "The answer is"]
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "active": {"type": "boolean"}},
                "required": ["id", "active"],
            }
        },
        "required": ["user"],
    },
    "array": {
        "type": "object",
        "properties": {
            "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3}
        },
        "required": ["ids"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"],
    },
    "numbers": {
        "type": "object",
        "properties": {"t": {"type": "number", "minimum": -5, "maximum": 5}, "n": {"type": "integer", "minimum": 10, "maximum": 20}},
        "required": ["t", "n"],
    },
    "optional_anyof": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}, {"enum": ["none"]}]},
        },
        "required": ["value"],
    },
}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[a-z]{2,5}-[0-9]{2}"
EBNF = 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]? [a-z]?'
EBNF_AS_REGEX = r"(hello|hi) [a-z]{1,3}"


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(str(default_model), device="cpu", num_kv_blocks=512)


@pytest.fixture(scope="module")
def multistep_llm(default_model):
    return LLM(str(default_model), device="cpu", num_kv_blocks=512, num_scheduler_steps=4)


def loads(text: str):
    return json.loads(text)


def constrained(kind: StructuredKind, spec: str = "", **params) -> SamplingParams:
    return SamplingParams(max_tokens=250, structured=StructuredOutput(kind, spec), **params)


def batch(kind: StructuredKind, spec: str = "") -> tuple[list[str], list[SamplingParams]]:
    """Both prompts greedy, and sampled (seeded) with two choices each: six sequences."""
    greedy, sampled = constrained(kind, spec, temperature=0), constrained(kind, spec, temperature=1.0, n=2, seed=7)
    return PROMPTS * 2, [greedy, greedy, sampled, sampled]


def texts(outputs) -> list[str]:
    choices = [c for o in outputs for c in o.outputs]
    assert [c.finish_reason for c in choices] == ["stop"] * len(choices), [c.text for c in choices]
    return [c.text for c in choices]


def check_schema_outputs(llm: LLM, name: str) -> None:
    prompts, params = batch("json_schema", json.dumps(SCHEMAS[name]))
    for text in texts(llm.generate(prompts, params)):
        jsonschema.validate(loads(text), SCHEMAS[name])


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_validate(llm, name):
    check_schema_outputs(llm, name)


def test_json_object_choice_regex_and_grammar(llm):
    # A bias towards '"' and '}' (ids 1 and 92) closes strings and objects soon: the grammar
    # decides where they may go, so the output is still a JSON object, only a short one.
    prompts, params = batch("json_object")
    params = [msgspec.structs.replace(p, logit_bias={1: 20.0, 92: 10.0}) for p in params]
    for text in texts(llm.generate(prompts, params)):
        assert isinstance(loads(text), dict)
    assert set(texts(llm.generate(*batch("choice", json.dumps(CHOICES))))) <= set(CHOICES)
    for text in texts(llm.generate(*batch("regex", REGEX))):
        assert re.fullmatch(REGEX, text), text
    for text in texts(llm.generate(*batch("grammar", EBNF))):
        assert re.fullmatch(EBNF_AS_REGEX, text), text


def test_multi_step_windows(multistep_llm):
    """Passes after a window's first need the pass before's ids for their constrained rows."""
    num_steps = []
    execute = multistep_llm.runner.execute
    multistep_llm.runner.execute = lambda plan: num_steps.append(plan.num_steps) or execute(plan)
    try:
        check_schema_outputs(multistep_llm, "array")
        for text in texts(multistep_llm.generate(*batch("regex", REGEX))):
            assert re.fullmatch(REGEX, text), text
    finally:
        del multistep_llm.runner.execute
    assert max(num_steps) == 4


@pytest.mark.parametrize("engine", ["llm", "multistep_llm"])
def test_constraints_do_not_leak_into_other_rows(engine, request):
    llm = request.getfixturevalue(engine)
    free = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24, ignore_eos=True),
    ]
    alone = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, free)]
    schema = json.dumps(SCHEMAS["enum"])
    mixed = llm.generate(
        [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]],
        [constrained("json_schema", schema, temperature=1.0, seed=5), free[0], constrained("choice", json.dumps(CHOICES)), free[1]],
    )
    assert [[c.token_ids for c in mixed[i].outputs] for i in (1, 3)] == alone
    jsonschema.validate(loads(texts(mixed[:1])[0]), SCHEMAS["enum"])
    assert texts(mixed[2:3])[0] in CHOICES


def test_preempted_sequences_resume_their_grammar(default_model):
    """A pool that cannot hold every sequence: some are preempted and recomputed from their
    outputs, whose ids the new matcher replays."""
    llm = LLM(str(default_model), device="cpu", num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)
    schema = json.dumps(SCHEMAS["enum"])
    outputs = llm.generate(PROMPTS, constrained("json_schema", schema, temperature=1.0, seed=11, n=2))
    for text in texts(outputs):
        jsonschema.validate(loads(text), SCHEMAS["enum"])
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.scheduler.blocks.num_used == 0


@pytest.mark.parametrize(
    ("kind", "spec", "problem"),
    [
        ("json_schema", "{not json", "invalid JSON schema"),
        ("json_schema", '{"type": "colour"}', 'Unsupported type "colour"'),
        ("regex", "a(b", "invalid regex"),
        ("grammar", "root ::= missing", 'Rule "missing" is not defined'),
        ("choice", "[]", "non-empty JSON array of strings"),
        ("choice", '["a", 1]', "non-empty JSON array of strings"),
    ],
)
def test_a_bad_spec_raises_at_generate(llm, kind, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        llm.generate(PROMPTS[0], constrained(kind, spec))
