"""The OpenAI surface through the whole daemon, driven by the official `openai` SDK."""

from __future__ import annotations

import time

import openai
import pytest
import requests


@pytest.fixture(scope="module")
def daemon(daemon_factory):
    return daemon_factory("--num-kv-blocks", "512", "--max-num-batched-tokens", "256")


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_completions_streamed_equals_not_streamed_at_temperature_0(client, model):
    kw = dict(model=model, prompt="The river and the fox", max_tokens=24, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2] if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_streamed_equals_not_streamed(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert whole.usage is not None and whole.system_fingerprint


def test_seed_reproduces_and_differs(client, model):
    def draw(seed):
        return client.completions.create(model=model, prompt="Once", max_tokens=16, temperature=1.0, seed=seed).choices[0].text

    assert draw(11) == draw(11)
    assert draw(11) != draw(12)


def test_n_logprobs_and_stop(client, model):
    out = client.completions.create(model=model, prompt="Count:", max_tokens=8, n=3, temperature=1.0, seed=3, logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 and t.bytes for t in content)
    # Token bytes are exact even where a token holds part of a character.
    text = bytes(b for t in content for b in t.bytes).decode("utf-8", errors="replace")
    assert text == chat.choices[0].message.content

    free = client.completions.create(model=model, prompt="The boat", max_tokens=30, temperature=0).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    stopped = client.completions.create(model=model, prompt="The boat", max_tokens=30, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free[: free.index(stop)]
    streamed = client.completions.create(model=model, prompt="The boat", max_tokens=30, temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == free[: free.index(stop)]


def test_a_disconnected_stream_is_aborted_within_two_seconds(daemon):
    settle = time.monotonic() + 5  # an earlier test's stop-string request may still be winding down
    while daemon.metric("conveyor_requests_running") and time.monotonic() < settle:
        time.sleep(0.05)
    running_before = daemon.metric("conveyor_requests_running")
    # The tiny model has 2048 positions: 2000 new tokens is the longest request it can take.
    body = {"prompt": "Go on forever", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with requests.post(f"{daemon.url}/v1/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 2.0
    while daemon.metric("conveyor_requests_running") != running_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.metric("conveyor_requests_running") == running_before
    generated = daemon.metric("conveyor_generation_tokens_total")
    time.sleep(0.5)
    assert daemon.metric("conveyor_generation_tokens_total") == generated, "generation went on"
    assert daemon.metric("conveyor_kv_blocks_used") == 0


def test_bad_input_table_through_the_daemon(daemon):
    cases = [
        ({"prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
        ({"prompt": [5, 1 << 30]}, 400, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "x", "model": "nope"}, 404, None),
        ({"prompt": "word " * 5000, "max_tokens": 5}, 400, None),
    ]
    for body, status, param in cases:
        r = requests.post(f"{daemon.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert error["param"] == param, (body, error)
        ok = requests.post(f"{daemon.url}/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
