"""Tool-call formats (stages/ingress/tools/): each parsed whole, and streamed in random pieces
(splits inside tags and JSON included) assembled as the OpenAI SDK assembles them, which must
equal the whole parse; the forced forms (named, required) and the template guess."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conveyor.config import EngineConfig, ModelConfig, ServerConfig
from conveyor.stages.ingress.tools import TOOL_PARSERS, tool_parser
from conveyor.stages.ingress.tools.base import ToolParser
from conveyor.stages.ingress.tools.forced import NamedCallParser, RequiredCallsParser
from conveyor.stages.ingress.tools.stream import ToolStream
from conveyor.stages.ingress.tools.template import chat_template_text, guess_tool_format, tool_format

WEATHER = {"city": "Paris", "unit": "c", "note": 'braces } and ] and quotes \\" inside'}
NESTED = {"a": [1, {"b": None, "c": [True, -2.5e3]}], "s": "</tool_call> [TOOL_CALLS] ;"}


def dumps(obj: dict) -> str:
    return json.dumps(obj)


# (parser, text, expected content, expected [(name, arguments object)])
CASES = [
    ("hermes", "Plain answer, no tools.", "Plain answer, no tools.", []),
    ("hermes", "", "", []),
    ("hermes", "a < b and <tool", "a < b and <tool", []),  # a tag's beginning at the end is content
    (
        "hermes",
        f'<tool_call>\n{{"name": "weather", "arguments": {dumps(WEATHER)}}}\n</tool_call>',
        None,
        [("weather", WEATHER)],
    ),
    (
        "hermes",
        f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {dumps(WEATHER)}}}\n</tool_call>\n'
        f'<tool_call>\n{{"arguments": {dumps(NESTED)}, "name": "nested"}}\n</tool_call>\nDone.',
        "Let me look.\n\n\nDone.",  # the newlines around and between the calls stay
        [("weather", WEATHER), ("nested", NESTED)],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
        [],
    ),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', []),
    ("llama3_json", f'{{"name": "weather", "parameters": {dumps(WEATHER)}}}', None, [("weather", WEATHER)]),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "weather", "parameters": {dumps(WEATHER)}}}; {{"name": "nested", "arguments": {dumps(NESTED)}}}',
        None,
        [("weather", WEATHER), ("nested", NESTED)],
    ),
    ("llama3_json", "The answer is {not json}.", "The answer is {not json}.", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}} and more', '{"name": "f", "parameters": {"x": 1}} and more', []),
    ("llama3_json", "<|python", "<|python", []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "weather", "arguments": {dumps(WEATHER)}}}]', None, [("weather", WEATHER)]),
    (
        "mistral",
        f'Sure. [TOOL_CALLS][{{"name": "weather", "arguments": {dumps(WEATHER)}}}, '
        f'{{"arguments": {dumps(NESTED)}, "name": "nested"}}]',
        "Sure. ",
        [("weather", WEATHER), ("nested", NESTED)],
    ),
    ("mistral", "[TOOL_CALLS] not an array", "[TOOL_CALLS] not an array", []),
    ("mistral", "no calls [TOOL", "no calls [TOOL", []),
]


def check_parse(parser: ToolParser, text: str, content: str | None, calls: list) -> None:
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


def stream_pieces(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        pieces.append(text[i : i + n])
        i += n
    return pieces or [""]


def assemble(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[dict]]:
    """Feed the pieces (the last one final) and join the deltas as the OpenAI SDK does: content
    concatenated, tool calls by index, the id and name from a call's first entry, arguments
    concatenated. Checks the entries' shape on the way."""
    stream = ToolStream(parser)
    content: str | None = None
    calls: list[dict] = []
    for k, piece in enumerate(pieces):
        text, entries = stream.feed(piece, final=k == len(pieces) - 1)
        if text:
            content = (content or "") + text
        assert len({e["index"] for e in entries}) == len(entries)  # one entry per call per delta
        for entry in entries:
            if entry["index"] == len(calls):  # a new call opens with its id, type and name
                assert entry["type"] == "function" and entry["id"] and entry["function"]["name"]
                calls.append({"id": entry["id"], "name": entry["function"]["name"], "arguments": ""})
            else:
                assert "id" not in entry and "name" not in entry["function"]
            calls[entry["index"]]["arguments"] += entry["function"].get("arguments", "")
    assert stream.made_calls == bool(calls)
    return content, calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_parse(name, text, content, calls):
    check_parse(tool_parser(name), text, content, calls)


# A malformed call has streamed as it went, while the whole parse calls it content: not compared.
WELL_FORMED = [c for c in CASES if c[3] or not any(start in c[1] for start in ("<tool_call>", "[TOOL_CALLS]", '{"name"'))]


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED)
@pytest.mark.parametrize("seed", range(6))
def test_stream_assembles_to_the_whole_parse(name, text, content, calls, seed):
    parser = tool_parser(name)
    got_content, got_calls = assemble(parser, stream_pieces(text, random.Random(seed)))
    whole = parser.parse(text)
    # ("" and None are both no content: an empty output streams no content delta.)
    got = (got_content or None, [(c["name"], c["arguments"]) for c in got_calls])
    assert got == (whole.content or None, [(c.name, c.arguments) for c in whole.calls])


def test_each_character_alone_and_the_whole_text_at_once():
    text = CASES[4][1]
    for pieces in ([*text], [text], [text, ""], ["", text]):
        content, calls = assemble(tool_parser("hermes"), pieces)
        assert content == "Let me look.\n\n\nDone." and [json.loads(c["arguments"]) for c in calls] == [WEATHER, NESTED]


def test_a_call_opens_once_its_name_is_whole_and_arguments_flow_before_the_call_ends():
    stream = ToolStream(tool_parser("hermes"))
    assert stream.feed('<tool_call>\n{"name": "weat', final=False) == ("", [])
    _, entries = stream.feed('her", "arguments": {"city": "Pa', final=False)
    [entry] = entries  # the opening and the first arguments of a call in one entry
    assert entry == {"index": 0, "id": entry["id"], "type": "function", "function": {"name": "weather", "arguments": '{"city": "Pa'}}
    assert stream.feed('ris"}}\n</tool', final=False) == ("", [{"index": 0, "function": {"arguments": 'ris"}'}}])
    assert stream.feed("_call>", final=True) == ("", [])


def test_ids():
    for name in ("hermes", "llama3_json"):
        id = tool_parser(name).new_id()
        assert id.startswith("call_") and len(id) == 29 and id[5:].isalnum()
    id = tool_parser("mistral").new_id()  # Mistral's templates take 9 alphanumerics only
    assert len(id) == 9 and id.isalnum()


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")


def test_named_call_is_the_whole_output():
    parser = NamedCallParser("weather")
    text = dumps(WEATHER)
    check_parse(parser, text, None, [("weather", WEATHER)])
    for seed in range(4):
        content, calls = assemble(parser, stream_pieces(text, random.Random(seed)))
        assert content is None and [(c["name"], c["arguments"]) for c in calls] == [("weather", text)]


def test_required_calls_are_an_array_of_name_and_parameters():
    parser = RequiredCallsParser()
    text = f'[{{"name": "weather", "parameters": {dumps(WEATHER)}}}, {{"name": "nested", "parameters": {dumps(NESTED)}}}]'
    check_parse(parser, text, None, [("weather", WEATHER), ("nested", NESTED)])
    for seed in range(4):
        content, calls = assemble(parser, stream_pieces(text, random.Random(seed)))
        assert content is None and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("weather", WEATHER),
            ("nested", NESTED),
        ]
    # Cut short (max_tokens): no calls, the text is content.
    assert parser.parse(text[:-5]).calls == [] and parser.parse(text[:-5]).content == text[:-5]


@pytest.mark.parametrize(
    "template, name",
    [
        ("{% for m in messages %}<tool_call>\n{{ m }}</tool_call>{% endfor %}", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{ '<|python_tag|>' }}", "llama3_json"),
        ("{% if message.role == 'ipython' %}{% endif %}", "llama3_json"),
        ("{{ messages[0].content }}", None),
        ("", None),
    ],
)
def test_guess_from_the_chat_template(template, name):
    assert guess_tool_format(template) == name


def fake_config(root: Path, **server) -> EngineConfig:
    model = ModelConfig.__new__(ModelConfig)
    object.__setattr__(model, "path", str(root))
    return EngineConfig(model=model, server=ServerConfig(**server))


def test_the_template_is_read_as_the_tokenizer_stage_reads_it(tmp_path):
    assert chat_template_text(fake_config(tmp_path)) == ""  # no tokenizer_config.json: no guess
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "<tool_call>"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert tool_format(fake_config(tmp_path)) == "hermes"  # the tool_use template is read too
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "[TOOL_CALLS]"}))
    assert tool_format(fake_config(tmp_path)) == "mistral"
    (tmp_path / "chat_template.jinja").write_text("<|python_tag|>")
    assert tool_format(fake_config(tmp_path)) == "llama3_json"
    assert tool_format(fake_config(tmp_path, chat_template="plain")) is None  # the override wins
    assert tool_format(fake_config(tmp_path, tool_call_parser="hermes")) == "hermes"  # the flag wins
    with pytest.raises(ValueError, match="tool-call-parser"):
        tool_format(fake_config(tmp_path, tool_call_parser="nope"))
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
