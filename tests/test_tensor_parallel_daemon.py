"""Tensor parallelism through the daemon, on CPU with gloo: every stage its own process, each
worker rank too.

- TP=2 (the tiny checkpoint's 2 KV heads split) and TP=4 (replicated: one KV head per rank, each
  on two ranks; with multi-step windows) give transformers' greedy tokens, streamed and not,
  with every request in flight at once and one request forked (n=2). tests/test_pipeline.py
  holds TP=1 to the same tokens on the same checkpoint and prompts, and
  tests/test_tensor_parallel.py holds the sharded model to the TP=1 one directly.
- A rank killed with SIGKILL mid-generation: the stream ends with an error (no hang), the other
  rank is gone within the launcher's grace period (it does not wait in a collective), the
  engine comes back, and the daemon serves again. Both the rank that samples and one that does
  not are killed in turn.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

from tests.test_pipeline import PROMPTS, complete
from tests.test_supervision import LONG, ended_with_error, health, ok, streaming, wait_until

pytestmark = pytest.mark.slow
ARCH = "Qwen2ForCausalLM"  # q/k/v biases: a column-parallel bias is cut with its rows
NUM_TOKENS = 8


@pytest.mark.parametrize(("tp", "extra"), [(2, ()), (4, ("--num-scheduler-steps", "4"))], ids=["tp2", "tp4-multistep"])
def test_tensor_parallel_greedy_matches_transformers(tp, extra, checkpoints, reference, daemon_factory):
    path = checkpoints[ARCH]
    daemon = daemon_factory(
        "--model", str(path), "--tensor-parallel-size", str(tp), "--max-num-batched-tokens", "32", "--num-kv-blocks", "128",
        *extra,
    )  # fmt: skip
    assert len(daemon.stage_pids("worker")) == tp
    ref = reference(path)
    expected = {prompt: ref.greedy(ref.encode(prompt), NUM_TOKENS) for prompt in PROMPTS}
    jobs = [(prompt, stream) for prompt in PROMPTS for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:
        forked = pool.submit(
            daemon.post, "/v1/completions",
            {"prompt": PROMPTS[0], "n": 2, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        results = list(pool.map(lambda job: complete(daemon, job[0], stream=job[1], max_tokens=NUM_TOKENS), jobs))
    for (prompt, stream), (ids, _, _) in zip(jobs, results):
        assert ids == expected[prompt], (prompt, stream)
    assert forked.result().status_code == 200, forked.result().text
    assert [c["token_ids"] for c in forked.result().json()["choices"]] == [expected[PROMPTS[0]]] * 2


def test_a_dead_rank_takes_the_engine_down_cleanly_and_it_comes_back(checkpoints, daemon_factory):
    daemon = daemon_factory(
        "--model", str(checkpoints[ARCH]), "--tensor-parallel-size", "2", "--num-kv-blocks", "256", "--stage-timeout", "5",
        "--max-engine-restarts", "10",
    )  # fmt: skip
    for victim in (1, 0):  # a rank that does not sample, then the one that does
        workers = sorted(daemon.stage_pids("worker"))
        stream = streaming(daemon, LONG)
        os.kill(workers[victim], signal.SIGKILL)
        killed = time.monotonic()
        assert ended_with_error(stream.finish())["code"] == "engine_not_ready"
        # Every process of the old engine is gone well within the launcher's SIGTERM grace (5 s).
        old = set(workers)
        wait_until(lambda old=old: not old & set(daemon.stage_pids("worker")), timeout=30)
        assert time.monotonic() - killed < 10
        wait_until(lambda: health(daemon) == 200, timeout=90)
        assert ok(daemon)
        assert len(daemon.stage_pids("worker")) == 2 and not set(workers) & set(daemon.stage_pids("worker"))
