"""Speculative decoding through the whole daemon (asynchronous scheduling, the worker a process
of its own): greedy text over HTTP, streamed and concurrent, with n = 2, token-for-token
transformers' own; the drafts verified and accepted counted in /metrics, and the dashboard's
speculative decoding row has data in a real Prometheus."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.daemon.test_observability import drive_load, expressions, expressions_without_data, needs_prometheus
from tests.daemon.test_pipeline import complete

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
# Repetitive text, so the n-gram proposer finds matches in the prompt and the output.
PROMPTS = ["one two three one two three one two three one two", "red fox red fox red fox red", "The capital of France"]
NUM_TOKENS = 24


def test_streamed_concurrent_and_two_samples_match_transformers(checkpoints, reference, daemon_factory):
    path = checkpoints["LlamaForCausalLM"]
    daemon = daemon_factory("--model", str(path), "--num-kv-blocks", "128", "--speculative-config", SPEC)
    ref = reference(path)
    expected = {p: ref.greedy(ref.encode(p), NUM_TOKENS) for p in PROMPTS}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = {
            (p, stream): pool.submit(complete, daemon, p, stream=stream, max_tokens=NUM_TOKENS) for p in PROMPTS for stream in (0, 1)
        }
        for (prompt, _), job in jobs.items():
            assert job.result()[0] == expected[prompt]
    body = {"prompt": PROMPTS[0], "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "n": 2, "return_token_ids": True}
    choices = daemon.post("/v1/completions", body).json()["choices"]
    assert [c["token_ids"] for c in choices] == [expected[PROMPTS[0]]] * 2
    drafts = daemon.metric('conveyor_spec_decode_draft_tokens_total{engine="0"}')
    accepted = daemon.metric('conveyor_spec_decode_accepted_tokens_total{engine="0"}')
    assert drafts > 0 and 0 <= accepted <= drafts


@pytest.mark.slow  # up to a minute of Prometheus scraping load (-m slow)
@needs_prometheus
def test_the_dashboards_speculation_row_has_data(daemon_factory, tmp_path):
    daemon = daemon_factory("--num-kv-blocks", "64", "--max-num-seqs", "4", "--speculative-config", SPEC)
    drive_load(daemon, seconds=2)  # its prompts repeat a sentence: the n-gram proposer finds matches
    exprs = expressions(speculation=True)
    assert len(exprs) == 3 and not expressions_without_data(daemon, exprs, tmp_path)
