"""gpu/structured/ on its own: specs compile once (or fail with a message naming the problem and
the request field), matchers follow a sequence's ids and allow only EOS once the grammar is
complete, and a pass's mask touches only its constrained rows. No model runs here."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer

from conveyor.engine_config import build_engine_config
from conveyor.gpu.structured import TokenMask, check, combined, compiler, grammars_for, token_mask
from conveyor.stages.tokenizer.preparation import Rejected
from conveyor.stages.tokenizer.structured_check import check_structured
from conveyor.wire.sampling_params import SamplingParams, StructuredOutput


@pytest.fixture(scope="module")
def model(default_model):
    return build_engine_config(str(default_model), device="cpu").model


@pytest.fixture(scope="module")
def encode(default_model):
    tokenizer = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def allowed(matcher, vocab_size: int) -> list[int]:
    mask = token_mask([(matcher, [])], vocab_size, torch.device("cpu"))
    assert mask is not None
    logits = torch.zeros(1, vocab_size)
    mask.apply_(logits)
    return logits[0].isfinite().nonzero().flatten().tolist()


def test_a_matcher_follows_its_ids_and_then_allows_only_eos(model, encode):
    grammars = grammars_for(model)
    matcher = grammars.matcher(StructuredOutput("choice", '["yes", "no"]'))
    assert len(allowed(matcher, model.vocab_size)) > len(model.eos_token_ids)
    assert all(matcher.accept(t) for t in encode("yes"))
    assert allowed(matcher, model.vocab_size) == sorted(model.eos_token_ids)
    assert matcher.accept(model.eos_token_ids[0]) and matcher.is_terminated
    # ignore_eos, or a stale draw: a terminated matcher takes nothing and still allows only EOS
    assert not matcher.accept(model.eos_token_ids[0])
    assert allowed(matcher, model.vocab_size) == sorted(model.eos_token_ids)


def test_replayed_outputs_resume_where_they_left_off(model, encode):
    spec = StructuredOutput("regex", "ab[0-9]+")
    grammars = grammars_for(model)
    fed = grammars.matcher(spec)
    for t in encode("ab12"):
        fed.accept(t)
    assert allowed(grammars.matcher(spec, encode("ab12")), model.vocab_size) == allowed(fed, model.vocab_size)
    assert not grammars.matcher(spec).accept(encode("x")[0])  # outside the grammar: refused


def test_an_eos_id_in_the_sign_bit_of_a_bitmask_word(model, encode):
    """A terminated matcher sets its EOS bits by hand: bit 31 of an int32 word is its sign."""
    last = dataclasses.replace(model, eos_token_ids=(model.vocab_size - 1,))
    matcher = grammars_for(last).matcher(StructuredOutput("choice", '["no"]'), [*encode("no"), last.vocab_size - 1])
    assert matcher.is_terminated
    assert allowed(matcher, last.vocab_size) == [last.vocab_size - 1]


def test_a_mask_touches_only_constrained_rows(model):
    matcher = grammars_for(model).matcher(StructuredOutput("choice", '["yes", "no"]'))
    assert token_mask([None, None], model.vocab_size, torch.device("cpu")) is None
    logits = torch.randn(3, model.vocab_size)
    masked = logits.clone()
    mask = token_mask([None, (matcher, []), None], model.vocab_size, torch.device("cpu"))
    assert mask is not None
    mask.apply_(masked)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert 0 < masked[1].isfinite().sum() < 10


def test_two_masks_of_a_pass_combine_row_by_row():
    """Rows masked by either keep only what both allow; a row neither masks stays free."""
    a = TokenMask(torch.tensor([0, 2]), torch.tensor([[0b0111], [0b0001]], dtype=torch.int32))
    b = TokenMask(torch.tensor([2, 3]), torch.tensor([[0b0011], [0b0100]], dtype=torch.int32))
    mask = combined([a, b])
    assert mask is not None and mask.rows.tolist() == [0, 2, 3]
    assert mask.bitmask[:, 0].tolist() == [0b0111, 0b0001, 0b0100]
    logits = torch.zeros(4, 32)
    mask.apply_(logits)
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [[0, 1, 2], list(range(32)), [0], [2]]
    assert combined([a]) is a and combined([]) is None


def test_specs_compile_once_per_distinct_spec(model, monkeypatch):
    grammars = grammars_for(model)
    monkeypatch.setattr(compiler, "MAX_CACHED", 2)
    specs = [StructuredOutput("regex", f"[a-z]{{{n}}}") for n in (1, 2, 3)]
    first = grammars.compile(specs[0])
    assert grammars.compile(StructuredOutput("regex", "[a-z]{1}")) is first
    grammars.compile(specs[1])
    grammars.compile(specs[2])  # the least recently used, specs[0], leaves the cache
    assert grammars.compile(specs[2]) is grammars.compile(specs[2])
    assert grammars.compile(specs[0]) is not first


@pytest.mark.parametrize(
    ("kind", "spec", "param", "problem"),
    [
        ("json_schema", '{"type": "object", "properties": {"a": {"type": "colour"}}}', "response_format", "invalid JSON schema"),
        ("json_schema", "[1, 2]", "response_format", "Schema should be an object"),
        ("regex", "(a", "guided_regex", "invalid regex"),
        ("grammar", "not ebnf", "guided_grammar", "invalid grammar"),
        ("choice", '"yes"', "guided_choice", "non-empty JSON array of strings"),
        ("choice", "yes", "guided_choice", "invalid choice: not JSON"),
    ],
)
def test_the_tokenizer_stage_refuses_a_bad_spec_naming_its_field(model, kind, spec, param, problem):
    with pytest.raises(ValueError, match=problem):
        check(StructuredOutput(kind, spec), model)
    with pytest.raises(Rejected, match=problem) as e:
        check_structured(SamplingParams(structured=StructuredOutput(kind, spec)), model)
    assert e.value.param == param
    # The ingress says which field a spec came from (guided_json, a tool's parameters...): that wins.
    with pytest.raises(Rejected) as e:
        check_structured(SamplingParams(structured=StructuredOutput(kind, spec, param="structured_outputs")), model)
    assert e.value.param == "structured_outputs"


def test_good_specs_pass(model):
    for kind, spec in [
        ("json_object", ""),
        ("json_schema", '{"type": "integer"}'),
        ("choice", '["", "é\\n\\"x"]'),
        ("grammar", 'root ::= "a"+'),
        ("regex", "\\d{3}"),
    ]:
        check_structured(SamplingParams(structured=StructuredOutput(kind, spec)), model)
    check_structured(SamplingParams(), model)


def test_the_tokenizer_stage_starts_without_the_grammar_engine():
    code = "import sys, conveyor.stages.tokenizer.main; print(sorted({'xgrammar', 'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# RFC 8259 wants U+0000-U+001F escaped inside strings. xgrammar's own rule for a string with a
# length bound let them in raw (and let no escape in); gpu/structured/json_schema.py mends it.
# (schema, the start of an answer that leaves it inside a string)
STRINGS = {
    "plain": ({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}, '{"s": "a'),
    "bounded": (
        {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 9}}, "required": ["s"]},
        '{"s": "a',
    ),
    "bounded items": ({"type": "array", "items": {"type": "string", "maxLength": 9}}, '["a'),
    "property names": ({"type": "object", "propertyNames": {"maxLength": 3}}, '{"a'),
}


@pytest.mark.parametrize("name", STRINGS)
def test_json_strings_refuse_raw_control_characters(model, encode, default_model, name):
    """No id whose bytes hold a control character is allowed inside a string; its escape is."""
    schema, prefix = STRINGS[name]
    decode = Tokenizer.from_file(str(default_model / "tokenizer.json")).decode
    grammars = grammars_for(model)
    spec = StructuredOutput("json_schema", json.dumps(schema))
    matcher = grammars.matcher(spec, encode(prefix))
    assert matcher.num_rejected == 0
    # An id may close the string and go on with blanks ('",\n'): what comes before its quote counts.
    inside = [decode([t]).split('"')[0] for t in allowed(matcher, model.vocab_size)]
    assert inside and not [text for text in inside if any(ord(c) < 0x20 for c in text)]
    assert len(encode("\x01")) == 1 and not matcher.accept(encode("\x01")[0])  # the raw id exists: refused
    rest = {"plain": '"}', "bounded": '"}', "bounded items": '"]', "property names": '": 1}'}[name]
    assert all(matcher.accept(t) for t in encode("\\u0001\\n" + rest)), name
    assert allowed(matcher, model.vocab_size) == sorted(model.eos_token_ids)  # complete


def test_a_bounded_string_counts_an_escape_as_one_character(model, encode):
    schema = {"type": "string", "minLength": 2, "maxLength": 2}
    grammars = grammars_for(model)
    spec = StructuredOutput("json_schema", json.dumps(schema))
    for text, complete in [('"\\u00e9\\"', False), ('"\\u00e9\\""', True), ('"\\ud83d\\ude00x"', True), ('"é\\t"', True)]:
        matcher = grammars.matcher(spec, encode(text))
        assert matcher.num_rejected == 0, text
        assert (allowed(matcher, model.vocab_size) == sorted(model.eos_token_ids)) is complete, text
    # a surrogate pair is one code point (too few here); a lone surrogate none
    for text in ('"\\ud83d\\ude00"', '"\\ud83dx"'):
        assert grammars.matcher(spec, encode(text)).num_rejected > 0, text


# Keywords xgrammar would drop without a word: refused, naming the keyword.
UNSUPPORTED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "integer"}}, "not"),
    ({"type": "object", "properties": {"a": {"if": {"type": "integer"}, "then": {"minimum": 5}}}}, "if"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"allOf": [{"type": "integer"}, {"maximum": 5}]}, "allOf"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "enum": ["abc", "d"], "maxLength": 1}, "maxLength"),
    ({"type": "integer", "enum": [1, "a"]}, "is not of type"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "pattern"),
    ({"type": "string", "pattern": '^\\\\"$'}, "pattern"),
    ({"type": "string", "pattern": "^[\\x00-\\x1f]$"}, "pattern"),
    ({"type": "string", "format": "date", "maxLength": 3}, "format"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "propertyNames": {"maxLength": 0}}, "propertyNames"),
    ({"type": "array", "contains": {"const": 1}, "maxContains": 1}, "maxContains"),
]


@pytest.mark.parametrize(("schema", "keyword"), UNSUPPORTED)
def test_a_schema_keyword_the_grammar_cannot_hold_is_refused(model, schema, keyword):
    with pytest.raises(Rejected, match=f"invalid JSON schema: .*{keyword}") as e:
        check_structured(SamplingParams(structured=StructuredOutput("json_schema", json.dumps(schema))), model)
    assert e.value.param == "response_format"


def test_keywords_the_grammar_holds_pass(model):
    for schema in [
        {"oneOf": [{"type": "integer"}]},
        {"oneOf": [{"const": "a"}, {"const": "b"}], "discriminator": {"propertyName": "kind"}},
        {"type": "integer", "multipleOf": 3},
        {"type": "integer", "enum": [1, 2.0]},
        {"type": "object", "properties": {"not": {"type": "string", "maxLength": 2}, "if": {"enum": [True]}}},
        {"type": "string", "pattern": "^[a-z]+\\d$"},
    ]:
        check(StructuredOutput("json_schema", json.dumps(schema)), model)
