"""What an answer carries, over HTTP against a fake engine (ingress_fakes): logprobs of a
completion and of a chat, echo, the choices of a batch of prompts (and a bad prompt failing the
batch), stop strings and stop token ids with their stop_reason, and the envelope (ids,
fingerprint, created, model) of whole answers and streams."""

from __future__ import annotations

import pytest

from conveyor.stages.tokenizer.encoder import PromptEncoder
from tests.ingress_fakes import choice_output
from tests.ingress_server import MODEL_NAME, assert_error, post, sse, wait_for, with_prompt


def text_of(choice: dict) -> str:
    if "message" in choice:
        return choice["message"]["content"]
    return choice["delta"].get("content", "") if "delta" in choice else choice["text"]


def expected_top(i: int, k: int) -> list[tuple[str, float]]:
    """Choice 0's token i alternatives in the fake: itself (-1.0), then " alt1" (-2.0), ..."""
    return [(f" t{i}", -1.0)] + [(f" alt{a}", -1.0 - a) for a in range(1, k)]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(server, stream):
    url, _, _ = server
    body = {"prompt": "a b", "max_tokens": 3, "logprobs": 2, "stream": stream, "return_token_ids": True}
    out = post(url, "/v1/completions", body)
    choices = [c["choices"][0] for c in sse(out)] if stream else out.json()["choices"]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in choices:  # a stream: each chunk carries its own tokens', offsets continuing
        assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
        for key in merged:
            merged[key] += choice["logprobs"][key]
    assert merged == {
        "tokens": [" t0", " t1", " t2"],
        "token_logprobs": [-1.0, -1.0, -1.0],
        "top_logprobs": [dict(expected_top(i, 2)) for i in range(3)],
        "text_offset": [0, 3, 6],
    }


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(server, stream):
    url, _, _ = server
    body = {
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "stream": stream,
        "return_token_ids": True,
    }
    out = post(url, "/v1/chat/completions", body)
    choices = [c["choices"][0] for c in sse(out)] if stream else out.json()["choices"]
    content = sum((c["logprobs"]["content"] for c in choices), [])
    assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) for c in choices)
    assert content == [
        {
            "token": f" t{i}",
            "logprob": -1.0,
            "bytes": list(f" t{i}".encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in expected_top(i, 3)],
        }
        for i in range(2)
    ]


def test_echo(server):
    url, _, config = server
    out = post(url, "/v1/completions", {"prompt": "say it", "echo": True, "max_tokens": 2, "n": 2}).json()
    assert [c["text"] for c in out["choices"]] == ["say it t0 t1", "say it t0/1 t1/1"]
    prompt_text = PromptEncoder(config.model.path).decode([300, 301])
    out = post(url, "/v1/completions", {"prompt": [300, 301], "echo": True, "max_tokens": 1}).json()
    assert out["choices"][0]["text"] == prompt_text + " t0"
    chunks = sse(post(url, "/v1/completions", {"prompt": "say it", "echo": True, "max_tokens": 2, "stream": True}))
    assert chunks[0]["choices"][0]["text"].startswith("say it t0")
    assert "".join(c["choices"][0]["text"] for c in chunks) == "say it t0 t1"
    # echo with logprobs asks for the prompt's logprobs (tests/daemon/test_prompt_logprobs_http.py)
    assert post(url, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}).status_code == 200


@pytest.mark.parametrize("prompts, num_words", [(["a", "b c"], [1, 2]), ([[5, 6], [7, 8, 9]], [2, 3])])
def test_batch_of_prompts(server, prompts, num_words):
    url, engine, _ = server
    out = post(url, "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 3, "return_token_ids": True}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]  # prompt_index * n + i
    for choice in out["choices"]:
        text, ids, reason, _ = choice_output(choice["index"] % 2, 3)
        assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (text, ids, reason)
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (sum(num_words), 4 * 3)
    first, second = engine.requests[-2:]
    assert (first.request_id, second.request_id) == (out["id"] + "-0", out["id"] + "-1")
    sent = [r.prompt if isinstance(prompts[0], str) else r.prompt_token_ids for r in (first, second)]
    assert sent == prompts

    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse(post(url, "/v1/completions", body))
    usage = chunks.pop()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (sum(num_words), 4 * 3)
    assert len({c["id"] for c in chunks}) == 1
    for index in range(4):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == choice_output(index % 2, 3)[0]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]


def test_a_rejected_prompt_fails_the_batch_before_any_byte(server):
    url, engine, _ = server
    response = post(url, "/v1/completions", {"prompt": ["SLOW", "TOO_LONG"], "stream": True})
    assert "data:" not in response.text
    assert_error(response, 400, "prompt", "context_length_exceeded")
    slow = engine.requests[-2]
    assert slow.prompt == "SLOW" and wait_for(lambda: slow.request_id in engine.aborts)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    "stop, keep, text, reason",
    [
        ("1 t", False, " t0 t", "1 t"),  # matched across " t1" + " t2"
        (["t3", "t1"], False, " t0 ", "t1"),  # the earliest match wins
        ("1 t", True, " t0 t1 t", "1 t"),
        ("nowhere", False, " t0 t1 t2 t3 t4", None),
    ],
)
def test_stop_strings(server, chat, stop, keep, text, reason):
    url, _, _ = server
    path, body = with_prompt({"stop": stop, "include_stop_str_in_output": keep, "max_tokens": 20}, chat)
    [choice] = post(url, path, body).json()["choices"]
    assert (text_of(choice), choice["finish_reason"], choice["stop_reason"]) == (text, "stop", reason)
    chunks = sse(post(url, path, body | {"stream": True}))
    assert "".join(text_of(c["choices"][0]) for c in chunks) == text
    assert [c["choices"][0]["stop_reason"] for c in chunks][-1] == reason
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("stop") == 1


def test_stop_token_ids(server):
    url, _, _ = server
    out = post(url, "/v1/completions", {"prompt": "a", "stop_token_ids": [102], "max_tokens": 9}).json()
    [choice] = out["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (" t0 t1", "stop", 102)
    assert out["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("chat", [False, True])
def test_response_envelope(server, chat):
    url, _, _ = server
    path, body = with_prompt({"max_tokens": 3, "n": 2}, chat)
    answers = [post(url, path, body).json() for _ in range(2)]
    fingerprint = answers[0]["system_fingerprint"]
    assert fingerprint.startswith("fp_") and answers[1]["system_fingerprint"] == fingerprint
    assert all(isinstance(a["created"], int) and a["model"] == MODEL_NAME for a in answers)
    chunks = sse(post(url, path, body | {"stream": True}))
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"] not in {a["id"] for a in answers}
    assert {c["system_fingerprint"] for c in chunks} == {fingerprint}
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [c["finish_reason"] is not None for c in mine] == [False] * (len(mine) - 1) + [True]
        if chat:
            assert ["role" in c["delta"] for c in mine] == [True] + [False] * (len(mine) - 1)
    assert all("usage" not in c for c in chunks)
