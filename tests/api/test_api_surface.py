"""The OpenAI parameter surface of the ingress, over HTTP against the fake engine (ingress_fakes):
parameters into SamplingParams, logprobs, echo, batches, stop strings, bad inputs, the API key,
CORS, /tokenize and /detokenize, and the openai SDK on all of it."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from conveyor.stages.ingress.cors import Cors
from conveyor.stages.tokenizer.encoder import PromptEncoder
from tests.ingress_fakes import (
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    MODEL_NAME,
    NUM_TOKENS,
    VOCAB_SIZE,
    assert_error,
    choice_output,
    post,
    running_server,
    sse,
    wait_for,
)

KEY = "sk-test-key"
GOOD_ORIGIN = "http://good.example"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("surface")) as running:
        yield running


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """A server with an API key, one allowed CORS origin and a chat template override."""
    root = tmp_path_factory.mktemp("locked")
    with running_server(root, api_key=KEY, allowed_origins=(GOOD_ORIGIN,), chat_template=TEMPLATE) as running:
        yield running


def with_prompt(body: dict, chat: bool, prompt: str = "a b") -> tuple[str, dict]:
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


def text_of(choice: dict) -> str:
    if "message" in choice:
        return choice["message"]["content"]
    return choice["delta"].get("content", "") if "delta" in choice else choice["text"]


def test_every_parameter_reaches_sampling_params(server):
    url, engine, _ = server
    common = {
        "temperature": 0.7,
        "top_p": 1,
        "top_k": 5,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "seed": 11,
        "n": 2,
        "stop": "zz",
        "stop_token_ids": [3],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "min_tokens": 2,
        "logit_bias": {"7": -100, "9": 100},
        "user": "someone",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sse(post(url, "/v1/completions", common | {"prompt": "a", "max_tokens": 4, "logprobs": 3}))
    sse(
        post(
            url,
            "/v1/chat/completions",
            common
            | {
                "messages": [{"role": "user", "content": "a"}],
                "max_tokens": 9,
                "max_completion_tokens": 4,
                "logprobs": True,
                "top_logprobs": 3,
            },
        )
    )
    for req in engine.requests[-2:]:
        p = req.params
        assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 1.0, 5, 0.1)
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
        assert (p.seed, p.n, p.max_tokens, p.min_tokens, p.logprobs) == (11, 2, 4, 2, 3)
        assert p.stop == ["zz"] and p.stop_token_ids == [3] and p.include_stop_str_in_output and p.ignore_eos
        assert p.logit_bias == {7: -100.0, 9: 100.0}
    sse(post(url, "/v1/completions", {"prompt": "a", "stop": ["x", "y"], "stream": True}))
    p = engine.requests[-1].params
    assert p.stop == ["x", "y"] and p.logprobs is None and p.logit_bias is None and p.max_tokens == 16
    post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True})
    assert engine.requests[-1].params.logprobs == 0
    out = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 0})
    assert out.status_code == 200 and engine.requests[-1].params.logprobs is None


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
    response = post(url, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1})
    assert "echo with logprobs" in assert_error(response, 400, "echo")["message"]


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
@pytest.mark.parametrize("stop, keep, text, reason", [
    ("1 t", False, " t0 t", "1 t"),  # matched across " t1" + " t2"
    (["t3", "t1"], False, " t0 ", "t1"),  # the earliest match wins
    ("1 t", True, " t0 t1 t", "1 t"),
    ("nowhere", False, " t0 t1 t2 t3 t4", None),
])  # fmt: skip
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


def test_boundary_values_are_accepted(server):
    url, _, _ = server
    for extra in (
        {"temperature": 0},
        {"temperature": 2},
        {"top_p": 1},
        {"logprobs": 20},
        {"n": 1},
        {"logit_bias": {"0": -100, str(VOCAB_SIZE - 1): 100}},
        {"stop_token_ids": [VOCAB_SIZE - 1]},
        {"prompt": [0, VOCAB_SIZE - 1]},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 0.01},
        {"repetition_penalty": 100},
        {"temperature": 1e-46},
    ):
        assert post(url, "/v1/completions", {"prompt": "a"} | extra).status_code == 200, extra


CHAT = "/v1/chat/completions"
COMPLETE = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (path, body, status, error type, param, code)
    (COMPLETE, b'{"prompt": "hi", ', 400, "invalid_request_error", None, None),
    (COMPLETE, {"prompt": "hi", "temperature": 2.5}, 400, "invalid_request_error", "temperature", None),
    (COMPLETE, {"prompt": "hi", "temperature": -0.1}, 400, "invalid_request_error", "temperature", None),
    (COMPLETE, {"prompt": "hi", "top_p": 0}, 400, "invalid_request_error", "top_p", None),
    (COMPLETE, {"prompt": "hi", "top_p": 1.01}, 400, "invalid_request_error", "top_p", None),
    (COMPLETE, {"prompt": "hi", "n": 0}, 400, "invalid_request_error", "n", None),
    (COMPLETE, {"prompt": "hi", "n": 129}, 400, "invalid_request_error", "n", None),
    (COMPLETE, {"prompt": "hi", "max_tokens": 0}, 400, "invalid_request_error", "max_tokens", None),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "invalid_request_error", "max_completion_tokens", None),
    (COMPLETE, {"prompt": "hi", "logprobs": 21}, 400, "invalid_request_error", "logprobs", None),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "invalid_request_error", "top_logprobs", None),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "invalid_request_error", "top_logprobs", None),
    (CHAT, {"messages": MESSAGES, "logprobs": 3}, 400, "invalid_request_error", "logprobs", None),
    (COMPLETE, {"prompt": [1, VOCAB_SIZE]}, 400, "invalid_request_error", "prompt", None),
    (COMPLETE, {"prompt": [[1], [-1]]}, 400, "invalid_request_error", "prompt", None),
    (COMPLETE, {"prompt": ["a", [1]]}, 400, "invalid_request_error", "prompt", None),
    (COMPLETE, {"prompt": [[]]}, 400, "invalid_request_error", "prompt", None),
    (COMPLETE, {"prompt": ["a"] * 257}, 400, "invalid_request_error", "prompt", None),
    (COMPLETE, {"prompt": "hi", "stop_token_ids": [VOCAB_SIZE]}, 400, "invalid_request_error", "stop_token_ids", None),
    (COMPLETE, {"prompt": "hi", "logit_bias": {str(VOCAB_SIZE): 1}}, 400, "invalid_request_error", "logit_bias", None),
    (COMPLETE, {"prompt": "hi", "logit_bias": {"one": 1}}, 400, "invalid_request_error", "logit_bias", None),
    (COMPLETE, {"prompt": "hi", "logit_bias": {"1": 101}}, 400, "invalid_request_error", "logit_bias", None),
    (COMPLETE, {"prompt": "hi", "min_p": 1.5}, 400, "invalid_request_error", "min_p", None),
    (COMPLETE, {"prompt": "hi", "presence_penalty": 2.5}, 400, "invalid_request_error", "presence_penalty", None),
    (COMPLETE, {"prompt": "hi", "frequency_penalty": -3}, 400, "invalid_request_error", "frequency_penalty", None),
    (COMPLETE, {"prompt": "hi", "repetition_penalty": 0}, 400, "invalid_request_error", "repetition_penalty", None),
    (COMPLETE, {"prompt": "hi", "repetition_penalty": 1e-50}, 400, "invalid_request_error", "repetition_penalty", None),
    (COMPLETE, {"prompt": "hi", "repetition_penalty": 101}, 400, "invalid_request_error", "repetition_penalty", None),
    (COMPLETE, b'{"prompt": "hi", "repetition_penalty": 1e999}', 400, "invalid_request_error", "repetition_penalty", None),
    (COMPLETE, {"prompt": "hi", "min_tokens": -1}, 400, "invalid_request_error", "min_tokens", None),
    (COMPLETE, {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "invalid_request_error", "min_tokens", None),
    (COMPLETE, {"prompt": "hi", "stop": ""}, 400, "invalid_request_error", "stop", None),
    (COMPLETE, {"prompt": "hi", "stop": [1]}, 400, "invalid_request_error", "stop[0]", None),
    (COMPLETE, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "invalid_request_error", "stream_options", None),
    (COMPLETE, {"prompt": "hi", "echo": True, "logprobs": 0}, 400, "invalid_request_error", "echo", None),
    (CHAT, {"messages": []}, 400, "invalid_request_error", "messages", None),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error", "messages[0].role", None),
    (CHAT, {"messages": MESSAGES, "model": "gpt-4o"}, 404, "not_found_error", "model", "model_not_found"),
    (COMPLETE, {"prompt": "x" * MAX_BODY_BYTES}, 413, "invalid_request_error", None, "request_too_large"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "TOO_LONG"}], "stream": True},
        400,
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    ),
    ("/tokenize", {}, 400, "invalid_request_error", "prompt", None),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "invalid_request_error", "prompt", None),
    ("/tokenize", {"messages": []}, 400, "invalid_request_error", "messages", None),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "not_found_error", "model", "model_not_found"),
    ("/detokenize", {"tokens": [VOCAB_SIZE]}, 400, "invalid_request_error", "tokens", None),
    ("/detokenize", {"tokens": "1 2"}, 400, "invalid_request_error", "tokens", None),
]
GOOD = {COMPLETE: {"prompt": "ok"}, CHAT: {"messages": MESSAGES}, "/tokenize": {"prompt": "ok"}, "/detokenize": {"tokens": [1, 2]}}


@pytest.mark.parametrize("path, body, status, error_type, param, code", BAD_INPUTS)
def test_bad_input(server, path, body, status, error_type, param, code):
    url, _, _ = server
    response = post(url, path, body)
    assert "data:" not in response.text  # rejected before any SSE byte
    assert assert_error(response, status, param, code)["type"] == error_type
    assert post(url, path, GOOD[path]).status_code == 200


def test_api_key(locked):
    url, _, _ = locked
    body = {"prompt": "a", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}, {"Authorization": KEY}):
        error = assert_error(post(url, COMPLETE, body, headers), 401, code="invalid_api_key")
        assert error["type"] == "authentication_error"
    for path in ("/v1/models", "/openapi.json"):
        assert requests.get(url + path, timeout=5).status_code == 401
    assert post(url, "/tokenize", {"prompt": "a"}).status_code == 401
    assert post(url, COMPLETE, body, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert post(url, COMPLETE, body, {"X-Api-Key": KEY}).status_code == 200
    assert requests.get(url + "/v1/models", headers={"X-Api-Key": KEY}, timeout=5).status_code == 200
    for path in ("/health", "/metrics"):
        assert requests.get(url + path, timeout=5).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=2).choices[0].text == " t0 t1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_cors(locked, server):
    url, _, _ = locked
    auth = {"X-Api-Key": KEY}
    response = post(url, COMPLETE, {"prompt": "a"}, auth | {"Origin": GOOD_ORIGIN})
    assert response.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN and "Origin" in response.headers["Vary"]
    response = post(url, COMPLETE, {"prompt": "a", "stream": True}, auth | {"Origin": GOOD_ORIGIN})
    assert response.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN  # set before the stream's headers
    response = post(url, COMPLETE, {"prompt": "a"}, {"Origin": GOOD_ORIGIN})  # a 401 the page may read
    assert response.status_code == 401 and response.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    response = requests.options(url + COMPLETE, headers=preflight | {"Origin": GOOD_ORIGIN}, timeout=5)
    assert response.status_code == 204 and response.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
    allowed = {h.strip().lower() for h in response.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "x-api-key"} <= allowed
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    response = requests.options(url + COMPLETE, headers=preflight | {"Origin": "http://evil.example"}, timeout=5)
    assert response.status_code == 403 and "Access-Control-Allow-Origin" not in response.headers
    response = post(url, COMPLETE, {"prompt": "a"}, auth | {"Origin": "http://evil.example"})
    assert response.status_code == 200 and "Access-Control-Allow-Origin" not in response.headers
    open_url = server[0]  # no origins configured: never a CORS header
    response = post(open_url, COMPLETE, {"prompt": "a"}, {"Origin": GOOD_ORIGIN})
    assert "Access-Control-Allow-Origin" not in response.headers
    assert Cors(("*",)).allows("http://anything.example") and not Cors(()).allows(GOOD_ORIGIN)


def test_tokenize_and_detokenize(server, locked):
    url, _, config = server
    encoder = PromptEncoder(config.model.path)
    out = post(url, "/tokenize", {"prompt": "hello world", "model": MODEL_NAME}).json()
    assert out == {"tokens": encoder.encode_prompt("hello world"), "count": len(out["tokens"]), "max_model_len": MAX_MODEL_LEN}
    back = post(url, "/detokenize", {"tokens": out["tokens"], "skip_special_tokens": True}).json()
    assert back == {"prompt": "hello world"}
    assert post(url, "/detokenize", {"tokens": out["tokens"]}).json()["prompt"] == encoder.decode(out["tokens"], False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = post(url, "/tokenize", {"messages": messages}).json()
    assert out["tokens"] == encoder.encode_chat(messages) and out["count"] == len(out["tokens"])
    # The server's chat template override is the one /tokenize (and the tokenizer stage) apply.
    locked_url = locked[0]
    out = post(locked_url, "/tokenize", {"messages": messages}, {"X-Api-Key": KEY}).json()
    assert out["tokens"] == encoder.tokenizer.encode("be brief|hi|", add_special_tokens=False).ids


@pytest.mark.parametrize("chat", [False, True])
def test_openai_sdk_parameters(server, chat):
    url, engine, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    if chat:

        def create(**kw):
            lp = {"logprobs": True, "top_logprobs": 2}
            return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "a"}], **lp, **kw)
    else:

        def create(**kw):
            return client.completions.create(model=MODEL_NAME, prompt="a", logprobs=2, **kw)

    out = create(max_tokens=9, stop=["1 t"], seed=42)
    choice = out.choices[0]
    assert (choice.message.content if chat else choice.text) == " t0 t" and choice.finish_reason == "stop"
    assert engine.requests[-1].params.seed == 42 and engine.requests[-1].params.stop == ["1 t"]
    if chat:
        assert [t.token for t in choice.logprobs.content] == [" t0", " t1", " t2"]
        assert [a.token for a in choice.logprobs.content[0].top_logprobs] == [" t0", " alt1"]
    else:
        assert choice.logprobs.tokens == [" t0", " t1", " t2"] and choice.logprobs.text_offset == [0, 3, 6]
        assert choice.logprobs.top_logprobs[1] == {" t1": -1.0, " alt1": -2.0}
    chunks = list(create(stream=True, stream_options={"include_usage": True}, seed=7))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NUM_TOKENS
    assert all(c.usage is None for c in chunks[:-1])
    tokens = [t.token for c in chunks[:-1] for t in (c.choices[0].logprobs.content if chat else [])]
    tokens += [t for c in chunks[:-1] for t in ([] if chat else c.choices[0].logprobs.tokens)]
    assert tokens == [f" t{i}" for i in range(NUM_TOKENS)]
    assert engine.requests[-1].params.seed == 7
    assert json.loads(chunks[0].model_dump_json())["system_fingerprint"].startswith("fp_")
