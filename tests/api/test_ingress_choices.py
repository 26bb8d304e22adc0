"""Several choices for one request, over HTTP against a fake engine (ingress_fakes): n choices
whole and streamed, and best_of, which returns the n most likely of best_of choices."""

from __future__ import annotations

import pytest

from tests.ingress_fakes import choice_output
from tests.ingress_server import post, sse, usage_of, with_prompt


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices(server, chat):
    url, engine, _ = server
    path, body = with_prompt({"n": 3, "max_tokens": 4, "return_token_ids": True}, chat)
    out = post(url, path, body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for j, choice in enumerate(out["choices"]):
        text, ids, reason, _ = choice_output(j, 4)
        assert (choice["message"]["content"] if chat else choice["text"]) == text
        assert choice["token_ids"] == ids and choice["finish_reason"] == reason
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length", "stop"]
    assert out["usage"] == usage_of(2, 4 + 4 + 3)
    assert (engine.requests[-1].params.n, engine.requests[-1].params.best_of) == (3, None)


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_stream(server, chat):
    url, _, _ = server
    body = {"n": 3, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    path, body = with_prompt(body, chat)
    chunks = sse(post(url, path, body))
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"] == usage_of(2, 4 + 4 + 3)
    assert all(len(c["choices"]) == 1 for c in chunks)
    by_index: dict[int, list[dict]] = {}
    for c in chunks:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1, 2]
    for j, choices in by_index.items():
        text, _, reason, _ = choice_output(j, 4)
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [reason]
        if chat:
            assert choices[0]["delta"]["role"] == "assistant"
            assert all("role" not in c["delta"] for c in choices[1:])
            assert "".join(c["delta"].get("content", "") for c in choices) == text
        else:
            assert "".join(c["text"] for c in choices) == text


@pytest.mark.parametrize("n, best_of, best", [(1, 3, [2]), (2, 4, [2, 3]), (2, 2, [0, 1])])
@pytest.mark.parametrize("chat", [False, True])
def test_best_of_returns_the_most_likely_choices(server, chat, n, best_of, best):
    """The fake's cumulative logprobs at max_tokens 4: choice 0 -4.0, 1 -6.0, 2 -1.5, 3 -2.0."""
    url, engine, _ = server
    path, body = with_prompt({"n": n, "best_of": best_of, "max_tokens": 4, "return_token_ids": True}, chat)
    out = post(url, path, body).json()
    assert [c["index"] for c in out["choices"]] == list(range(n))
    for choice, j in zip(out["choices"], best, strict=True):
        text, ids, reason, _ = choice_output(j, 4)
        assert (choice["message"]["content"] if chat else choice["text"]) == text
        assert choice["token_ids"] == ids and choice["finish_reason"] == reason
    num_generated = sum(len(choice_output(j, 4)[1]) for j in range(best_of))
    assert out["usage"] == usage_of(2, num_generated)
    assert (engine.requests[-1].params.n, engine.requests[-1].params.best_of) == (n, best_of)


def test_best_of_equal_to_n_streams(server):
    url, _, _ = server
    chunks = sse(post(url, "/v1/completions", {"prompt": "a", "n": 2, "best_of": 2, "stream": True}))
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
