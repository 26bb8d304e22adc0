"""The OpenAI request parameters the ingress takes, over HTTP against a fake engine (ingress_fakes):
every one reaches SamplingParams, values on the bounds are accepted, bad ones are refused in the
OpenAI error shape before any byte of a stream, and the openai SDK sends them as it should."""

from __future__ import annotations

import json

import openai
import pytest

from tests.ingress_fakes import NUM_TOKENS
from tests.ingress_server import MAX_BODY_BYTES, MODEL_NAME, VOCAB_SIZE, assert_error, post, sse


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
    (COMPLETE, {"prompt": "hi", "max_tokens": 0}, 400, "invalid_request_error", "max_tokens", None),
    (COMPLETE, {"prompt": "hi", "prompt_logprobs": 21}, 400, "invalid_request_error", "prompt_logprobs", None),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens", None),
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
