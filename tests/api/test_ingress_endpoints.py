"""The ingress's routes answer as OpenAI's do, over HTTP against a fake engine (ingress_fakes):
/health follows the engine's status, /v1/models and /metrics, a completion and a chat with what
reaches the engine, streams with and without usage, priority and cached tokens, and the openai
SDK on all of it."""

from __future__ import annotations

import re

import openai
import pytest
import requests

from conveyor.wire.messages import EngineStatus
from tests.ingress_fakes import MAX_MODEL_LEN, NUM_TOKENS, choice_output
from tests.ingress_server import MODEL_NAME, assert_error, post, sse, usage_of, wait_for, with_prompt

TEXT = "".join(f" t{i}" for i in range(NUM_TOKENS))
IDS = [100 + i for i in range(NUM_TOKENS)]


def test_health_follows_engine_status(server):
    url, engine, _ = server
    assert requests.get(f"{url}/health").json() == {"status": "ok"}
    engine.send(EngineStatus(ready=False))
    assert wait_for(lambda: requests.get(f"{url}/health").status_code == 503)
    assert requests.get(f"{url}/health").json() == {"status": "unavailable"}
    assert_error(post(url, "/v1/completions", {"prompt": "hi"}), 503, code="engine_not_ready")
    engine.send(EngineStatus(ready=True))
    assert wait_for(lambda: requests.get(f"{url}/health").status_code == 200)


def test_models_and_metrics(server):
    url, _, _ = server
    models = requests.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["id"] == MODEL_NAME and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    metrics = requests.get(f"{url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["Content-Type"].startswith("text/plain")
    assert "# TYPE" in metrics.text


def test_completion(server):
    url, engine, _ = server
    body = {
        "model": MODEL_NAME,
        "prompt": "one two three",
        "max_tokens": 50,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "seed": 3,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "return_token_ids": True,
        "user": "u",
        "some_extension": {"x": 1},
    }
    out = post(url, "/v1/completions", body).json()
    assert out["object"] == "text_completion" and out["model"] == MODEL_NAME
    assert re.fullmatch(r"cmpl-0-\d+-[0-9a-f]+", out["id"])
    [choice] = out["choices"]
    assert choice == {"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": IDS}
    assert out["usage"] == usage_of(3, NUM_TOKENS)
    req = engine.requests[-1]
    assert req.request_id == out["id"] and req.ingress == 0 and req.prompt == "one two three"
    assert req.priority == 0 and (req.params.n, req.params.best_of) == (1, None)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (50, 0.5, 0.9, 7, 3)
    assert p.stop_token_ids == [2] and p.ignore_eos and p.skip_special_tokens


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]], ["a b c"]])
def test_completion_prompt_forms(server, prompt):
    url, engine, _ = server
    out = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    assert out["choices"][0]["text"] == " t0 t1" and out["choices"][0]["finish_reason"] == "length"
    assert "token_ids" not in out["choices"][0]
    req = engine.requests[-1]
    assert (req.prompt, req.prompt_token_ids) == (("a b c", None) if prompt == ["a b c"] else (None, [5, 6, 7]))
    assert req.params.max_tokens == 2


def test_chat(server):
    url, engine, _ = server
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    out = post(url, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 3}).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-0-")
    [choice] = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": " t0 t1 t2"}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    req = engine.requests[-1]
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi\nthere")]
    assert req.add_generation_prompt and req.params.max_tokens == 3
    # Without max_tokens a chat runs until EOS or the context is full.
    post(url, "/v1/chat/completions", {"messages": messages, "add_generation_prompt": False})
    assert engine.requests[-1].params.max_tokens is None and not engine.requests[-1].add_generation_prompt


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream(server, chat, include_usage):
    url, _, _ = server
    body = {"max_tokens": 4, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": include_usage}}
    if chat:
        body["messages"] = [{"role": "user", "content": "a b"}]
    else:
        body["prompt"] = "a b"
    chunks = sse(post(url, "/v1/chat/completions" if chat else "/v1/completions", body))
    usage = chunks.pop() if include_usage else None
    assert len({c["id"] for c in chunks}) == 1 and len(chunks) >= 1
    assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert sum((c["token_ids"] for c in choices), []) == IDS[:4]
    if chat:
        assert choices[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in choices[1:])
        assert "".join(c["delta"].get("content", "") for c in choices) == " t0 t1 t2 t3"
    else:
        assert "".join(c["text"] for c in choices) == " t0 t1 t2 t3"
    if include_usage:
        assert all(c["usage"] is None for c in chunks)
        assert usage["choices"] == [] and usage["id"] == chunks[0]["id"]
        assert usage["usage"] == usage_of(2, 4)
    else:
        assert all("usage" not in c for c in chunks)


def test_first_delta_implies_acceptance(server):
    url, _, _ = server
    chunks = sse(post(url, "/v1/completions", {"prompt": "NO_ACCEPT", "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
    out = post(url, "/v1/completions", {"prompt": "NO_ACCEPT x", "max_tokens": 30}).json()
    assert out["choices"][0]["text"] == TEXT and out["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("chat", [False, True])
def test_priority_reaches_the_tokenizer(server, chat):
    url, engine, _ = server
    path, body = with_prompt({"priority": -5}, chat)
    assert post(url, path, body).status_code == 200
    assert engine.requests[-1].priority == -5
    path, body = with_prompt({"priority": 7, "stream": True}, chat)
    sse(post(url, path, body))
    assert engine.requests[-1].priority == 7


@pytest.mark.parametrize("chat", [False, True])
def test_cached_tokens_in_usage(server, chat):
    url, _, _ = server
    path, body = with_prompt({"max_tokens": 2}, chat, prompt="CACHED a b c")
    assert post(url, path, body).json()["usage"] == usage_of(4, 2, cached=3)
    path, body = with_prompt({"max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}, chat, prompt="CACHED a b c")
    assert sse(post(url, path, body))[-1]["usage"] == usage_of(4, 2, cached=3)


def test_openai_sdk(server):
    url, _, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, extra_body={"return_token_ids": True})
    assert out.choices[0].text == " t0 t1 t2" and out.choices[0].finish_reason == "length"
    assert out.choices[0].token_ids == IDS[:3] and out.usage.completion_tokens == 3
    stream = client.completions.create(model=MODEL_NAME, prompt="hello", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert chat.choices[0].message.content == " t0 t1" and chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="TOO_LONG", stream=True)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "QUEUE_FULL"}])
    assert e.value.code == "rate_limit_exceeded" and e.value.response.headers["Retry-After"] == "3"

    out = client.completions.create(model=MODEL_NAME, prompt="hello", n=2, best_of=3, max_tokens=4)
    assert [c.text for c in out.choices] == [choice_output(2, 4)[0], choice_output(0, 4)[0]]
    assert out.usage.completion_tokens == 11 and out.usage.prompt_tokens_details.cached_tokens == 0


def test_embeddings_need_an_embedding_model(server):
    url, _, _ = server
    error = assert_error(post(url, "/v1/embeddings", {"input": "hi"}), 400, "model", "model_not_embedding")
    assert "generates text" in error["message"]
