"""Reasoning split off chat answers (stages/ingress/tools/reasoning.py): qwen3 and deepseek_r1,
whole and streamed in random pieces (splits inside the tags), and with tool calls after it
(tools/answer.py: reasoning first, calls parsed from the content)."""

from __future__ import annotations

import json
import random

import pytest

from conveyor.stages.ingress.tools.answer import chat_answer
from conveyor.stages.ingress.tools.reasoning import ReasoningParser, ReasoningStream

# (parser, text, reasoning, content)
CASES = [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "It is 4."),
    ("qwen3", "It is 4, no thinking.", None, "It is 4, no thinking."),
    ("qwen3", "  <think>only thoughts, cut short", "only thoughts, cut short", None),
    ("qwen3", "a <think> later is content", None, "a <think> later is content"),
    ("qwen3", "<think></think>Answer", None, "Answer"),
    ("qwen3", "<thin", None, "<thin"),
    ("deepseek_r1", "The prompt opened it.</think>\n\nAnswer.", "The prompt opened it.", "Answer."),
    ("deepseek_r1", "<think>Opened here.</think>Answer.", "Opened here.", "Answer."),
    ("deepseek_r1", "Never closed, all reasoning </thi", "Never closed, all reasoning </thi", None),
    ("deepseek_r1", "", None, None),
]


def pieces_of(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[i : i + n])
        i += n
    return pieces or [""]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_whole(name, text, reasoning, content):
    assert ReasoningParser(name).parse(text) == (reasoning, content)


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
@pytest.mark.parametrize("seed", range(5))
def test_streamed_pieces_join_to_the_whole(name, text, reasoning, content, seed):
    stream = ReasoningStream(ReasoningParser(name))
    pieces = pieces_of(text, random.Random(seed))
    got_reasoning, got_content = "", ""
    for k, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=k == len(pieces) - 1)
        assert not (c and not got_content and r)  # reasoning comes first, then content
        got_reasoning, got_content = got_reasoning + r, got_content + c
    assert (got_reasoning or None, got_content or None) == (reasoning, content or None)


def test_no_reasoning_text_leaks_while_a_tag_may_still_be_arriving():
    stream = ReasoningStream(ReasoningParser("deepseek_r1"))
    assert stream.feed("thinking </th", final=False) == ("thinking ", "")
    assert stream.feed("ink>\n\nHi", final=False) == ("", "Hi")
    stream = ReasoningStream(ReasoningParser("qwen3"))
    assert stream.feed("<th", final=False) == ("", "")
    assert stream.feed("ere", final=False) == ("", "<there")


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningParser("o1")


def test_tool_calls_are_parsed_after_the_reasoning():
    call = '<tool_call>\n{"name": "f", "arguments": {"x": "<tool_call>"}}\n</tool_call>'
    text = f"<think>I could write <tool_call> here.</think>\n\n{call}"
    answer = chat_answer("auto", None, "hermes", "qwen3")
    assert answer is not None
    message, made_calls = answer.message(text)
    assert made_calls and message["content"] is None and message["reasoning_content"] == "I could write <tool_call> here."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("f", {"x": "<tool_call>"})
    ]
    for seed in range(5):
        stream = answer.stream()
        pieces = pieces_of(text, random.Random(seed))
        joined: dict = {"reasoning_content": "", "content": "", "arguments": ""}
        for k, piece in enumerate(pieces):
            fields = stream.feed(piece, final=k == len(pieces) - 1)
            joined["reasoning_content"] += fields.get("reasoning_content", "")
            joined["content"] += fields.get("content", "")
            joined["arguments"] += "".join(e["function"].get("arguments", "") for e in fields.get("tool_calls", []))
        assert stream.made_calls
        assert joined == {
            "reasoning_content": message["reasoning_content"],
            "content": "",
            "arguments": message["tool_calls"][0]["function"]["arguments"],
        }


def test_what_shapes_an_answer():
    assert chat_answer("none", None, "hermes", None) is None  # the plain path, untouched
    assert chat_answer("auto", None, None, None) is None  # no format known: content stays plain
    forced = chat_answer("named", "f", None, "deepseek_r1")
    assert forced is not None and forced.reasoning is None  # forced output is JSON from its first token
    message, made_calls = forced.message('{"a": 1}')
    [call] = message.pop("tool_calls")
    assert made_calls and message == {"role": "assistant", "content": None}
    assert call == {"id": call["id"], "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
