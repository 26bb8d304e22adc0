"""The whole daemon, every stage its own process: equivalence with transformers over HTTP,
concurrency, KV blocks returned, process supervision and clean shutdown."""

from __future__ import annotations

import concurrent.futures
import signal
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import ARCHITECTURES, children, cmdline, stream_events

NUM_TOKENS = 10
BUDGET = "32"  # step token budget: the long prompt below is chunked across steps
PROMPTS = ["The capital of France", "Tell me a long story about a river, a boat and a fox. " * 5]


def complete(daemon, prompt, *, stream: bool, max_tokens=NUM_TOKENS, **extra):
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **extra,
    }
    r = daemon.post("/v1/completions", body, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return choice["token_ids"], choice["text"], r.json()["usage"]
    events = stream_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    return ids, "".join(c["choices"][0]["text"] for c in chunks), None


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_http_greedy_matches_transformers(arch, checkpoints, reference, daemon_factory):
    daemon = daemon_factory("--model", str(checkpoints[arch]), "--max-num-batched-tokens", BUDGET, "--num-kv-blocks", "128")
    ref = reference(checkpoints[arch])
    for prompt in PROMPTS:
        prompt_ids = ref.encode(prompt)
        expected = ref.greedy(prompt_ids, NUM_TOKENS)
        ids, text, usage = complete(daemon, prompt, stream=False)
        assert ids == expected
        assert text == ref.tokenizer.decode(expected, skip_special_tokens=True)
        counts = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert counts == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": NUM_TOKENS,
            "total_tokens": len(prompt_ids) + NUM_TOKENS,
        }
        assert complete(daemon, prompt, stream=True)[:2] == (ids, text)
    assert len(ref.encode(PROMPTS[1])) > int(BUDGET)

    messages = [{"role": "user", "content": "Say hello"}]
    chat_ids = ref.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
    body = {"messages": messages, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = daemon.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref.greedy(chat_ids, NUM_TOKENS)


@pytest.fixture(scope="module", params=["--async-scheduling", "--no-async-scheduling", "--num-scheduler-steps=4"])
def default_daemon(daemon_factory, request):
    return daemon_factory("--max-num-batched-tokens", "64", "--num-kv-blocks", "512", request.param)


def test_multi_step_windows_stream_every_pass(daemon_factory):
    """With --num-scheduler-steps 8 a lone request decodes in windows of 8 passes, yet its stream
    gets its tokens pass by pass (a window's worth at once would be 3 events for 24 tokens)."""
    daemon = daemon_factory("--num-kv-blocks", "512", "--num-scheduler-steps", "8")
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = daemon.post("/v1/completions", {**body, "stream": True}, stream=True)
    chunks = [e for e in stream_events(r)[:-1] if e["choices"] and e["choices"][0].get("token_ids")]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == daemon.post("/v1/completions", body).json()["choices"][0]["token_ids"] and len(ids) == 24
    assert len(chunks) >= 12, [len(c["choices"][0]["token_ids"]) for c in chunks]


def test_concurrent_streams_equal_sequential(default_daemon):
    prompts = [f"Request number {i}: " + "tell me about the sea " * (i % 7) for i in range(32)]
    one_by_one = [complete(default_daemon, p, stream=True, max_tokens=16)[0] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda p: complete(default_daemon, p, stream=True, max_tokens=16)[0], prompts))
    assert together == one_by_one
    assert all(len(ids) == 16 for ids in together)
    # Every request finished: the scheduler holds no KV block.
    deadline = time.monotonic() + 5
    while default_daemon.metric("conveyor_kv_blocks_used") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert default_daemon.metric("conveyor_kv_blocks_used") == 0
    assert default_daemon.metric("conveyor_kv_blocks_capacity") == 512


def test_bad_requests_get_errors_and_the_daemon_keeps_serving(default_daemon):
    d = default_daemon
    r = requests.post(f"{d.url}/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
    r = d.post("/v1/completions", {"model": "no-such-model", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = d.post("/v1/completions", {"prompt": "word " * 3000, "max_tokens": 5, "stream": True}, stream=True)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = d.post("/v1/completions", {"prompt": [1, 2, 10**7], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = d.post("/v1/chat/completions", {"messages": "not a list"})
    assert r.status_code == 400
    assert complete(d, "still here?", stream=False, max_tokens=3)[0]
    assert requests.get(f"{d.url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_requests_that_break_sampling_fail_alone(default_daemon):
    """Issue 13: one request took the whole daemon down (NaN probabilities, an id equal to the
    vocabulary size, IndexError in the worker). Now a subnormal temperature is greedy, an extreme
    repetition_penalty is a 400, min_tokens that no token can meet is a 400, and a request left with
    nothing to draw fails by itself."""
    from conveyor.tiny.tokenizer import VOCAB_SIZE

    d = default_daemon
    r = d.post("/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 1e-46})
    assert r.status_code == 200, r.text
    greedy = d.post("/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 0})
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    r = d.post("/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 1, "repetition_penalty": 1e-50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"

    # min_tokens with every id a stop id could never be met: the client's error, refused at admission.
    every_id = {"prompt": "hi", "max_tokens": 8, "min_tokens": 4, "temperature": 1, "stop_token_ids": list(range(VOCAB_SIZE))}
    chat = {k: v for k, v in every_id.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
    for route, body in [
        ("/v1/completions", every_id),
        ("/v1/completions", every_id | {"stream": True}),
        ("/v1/chat/completions", chat),
    ]:
        r = d.post(route, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "min_tokens")
        assert "stop_token_ids" in error["message"]
        assert complete(d, "still here?", stream=False, max_tokens=3)[0]

    # min_tokens past a complete grammar: it allows only EOS, min_tokens bans it, nothing to draw.
    masked = {"prompt": "hi", "max_tokens": 8, "min_tokens": 4, "temperature": 1, "guided_choice": ["a"]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        normal = pool.submit(complete, d, "a request beside it", stream=False, max_tokens=24)
        r = d.post("/v1/completions", masked)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "non_finite_logits")
        assert "non-finite logits" in error["message"]
        assert len(normal.result()[0]) == 24
    r = d.post("/v1/completions", masked | {"stream": True}, stream=True)
    assert r.status_code == 200  # the request was admitted and the stream begun before the step failed
    events = stream_events(r)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "non_finite_logits"
    assert all("choices" in e for e in events[:-2])
    chat = {k: v for k, v in masked.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
    r = d.post("/v1/chat/completions", chat)
    assert r.status_code == 500 and r.json()["error"]["code"] == "non_finite_logits"

    assert complete(d, "still here?", stream=False, max_tokens=3)[0]
    deadline = time.monotonic() + 5
    while d.metric("conveyor_kv_blocks_used") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.metric("conveyor_kv_blocks_used") == 0  # the failed requests' blocks came back


def test_one_process_per_stage_and_clean_shutdown(daemon_factory):
    daemon = daemon_factory("--tokenizer-workers", "2", "--detokenizer-workers", "2", "--num-kv-blocks", "64")
    kids = children(daemon.process.pid)
    stages = sorted(cmdline(k)[3] for k in kids if "conveyor.stages" in cmdline(k))
    assert stages == ["detokenizer", "detokenizer", "ingress", "scheduler", "tokenizer", "tokenizer", "worker"]
    run_dir = Path(next(a for a in cmdline(kids[0]) if a.endswith("config.json"))).parent
    assert run_dir.is_dir() and (run_dir.stat().st_mode & 0o777) == 0o700
    assert {p.suffix for p in run_dir.iterdir()} >= {".sock"}
    assert complete(daemon, "two tokenizers", stream=True, max_tokens=4)[0]

    daemon.process.send_signal(signal.SIGTERM)
    assert daemon.process.wait(timeout=30) == 0
    for k in kids:
        assert not Path(f"/proc/{k}").exists() or "conveyor.stages" not in cmdline(k), f"stage {k} survived"
    assert not run_dir.exists()
