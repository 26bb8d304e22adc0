"""KV memory and admission through the whole daemon: preemption under a tiny pool, the prefix
cache, parallel samples, and 429s past the queue bound."""

from __future__ import annotations

import concurrent.futures

import pytest
import requests

from conveyor import SamplingParams

LONG_PROMPTS = [f"Story {i}: " + "the fox crossed the river with the grain and the boat " * (4 + i % 5) for i in range(50)]
NUM_TOKENS = 48


def greedy_ids(daemon, prompt, max_tokens=NUM_TOKENS, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}
    r = daemon.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tiny_pool_preempts_and_loses_nothing(daemon_factory, default_model):
    from conveyor import LLM

    # 64 blocks of 16 tokens hold ~1000 tokens; 50 requests of ~100-200 tokens each need ~8000.
    daemon = daemon_factory("--num-kv-blocks", "64", "--max-num-batched-tokens", "256")
    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        pressured = list(pool.map(lambda p: greedy_ids(daemon, p)["choices"][0]["token_ids"], LONG_PROMPTS))
    assert daemon.metric("conveyor_preemptions_total") > 0
    assert daemon.metric("conveyor_kv_blocks_used") == 0

    unpressured = LLM(str(default_model), device="cpu", num_kv_blocks=2048, max_num_batched_tokens=4096)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in unpressured.generate(LONG_PROMPTS, params)]
    assert pressured == expected


@pytest.fixture(scope="module")
def daemon(daemon_factory):
    return daemon_factory("--num-kv-blocks", "512", "--max-num-batched-tokens", "128")


def test_a_repeated_prompt_reports_cached_tokens(daemon):
    prompt = "A long shared system prompt that many requests repeat word for word. " * 6
    first = greedy_ids(daemon, prompt, max_tokens=4)
    second = greedy_ids(daemon, prompt, max_tokens=4)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert daemon.metric("conveyor_prefix_cache_hits_total") >= cached // 16


def test_parallel_samples(daemon):
    body = {
        "prompt": "Four different endings:",
        "max_tokens": 12,
        "n": 4,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = daemon.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1, "samples are not all the same"
    assert r.json()["usage"]["completion_tokens"] == 48
    assert daemon.post("/v1/completions", body).json()["choices"] == choices, "seeded: reproducible"

    best = daemon.post("/v1/completions", {**body, "n": 1, "best_of": 3})
    assert best.status_code == 200 and len(best.json()["choices"]) == 1


def test_a_flood_past_the_queue_bound_gets_429(daemon_factory):
    daemon = daemon_factory("--max-queued-requests", "2", "--max-num-seqs", "2", "--num-kv-blocks", "256")

    def send(i):
        body = {"prompt": f"flood {i} " * 20, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        return requests.post(f"{daemon.url}/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        replies = list(pool.map(send, range(40)))
    refused = [r for r in replies if r.status_code == 429]
    served = [r for r in replies if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 40
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert all(r.json()["error"]["message"] for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 32 for r in served)
    assert daemon.metric("conveyor_rejections_total") == len(refused)
