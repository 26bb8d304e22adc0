"""Tensor parallelism through the daemon, on CPU with gloo: every stage its own process, each
worker rank too.

- TP=2 (the tiny checkpoint's 2 KV heads split; also verifying drafts of each proposer: n-gram,
  which every rank proposes alike from the ids rank 0 shared, a draft model sharded as the
  target, an EAGLE-3 head whole on each rank) and TP=4 (replicated: one KV head per rank, each
  on two ranks; with multi-step windows) give transformers' greedy tokens, streamed and not,
  with every request in flight at once and one request forked (n=2); beside them, sampled
  requests that only rank 0 can draw (a JSON schema's grammar mask, penalties, logprobs) keep
  the ranks' inputs in step too (a rank that drifted would break the greedy ones). tests/daemon/test_pipeline.py
  holds TP=1 to the same tokens on the same checkpoint and prompts, and
  tests/gpu/test_tensor_parallel.py holds the sharded model to the TP=1 one directly.
- A rank killed with SIGKILL mid-generation: the stream ends with an error (no hang), the other
  rank is gone within the launcher's grace period (it does not wait in a collective), the
  engine comes back, and the daemon serves again. Both the rank that samples and one that does
  not are killed in turn.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import pytest
import torch

from conveyor.tiny.eagle3 import make_eagle3_head
from tests.daemon.test_pipeline import PROMPTS, complete
from tests.daemon.test_supervision import LONG, ended_with_error, health, ok, streaming, wait_until
from tests.gpu.test_lora import make_adapters, peft_greedy

ARCH = "Qwen2ForCausalLM"  # q/k/v biases: a column-parallel bias is cut with its rows
NUM_TOKENS = 8
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"], "additionalProperties": False}
SAMPLED = [
    {"prompt": "Answer:", "temperature": 1, "n": 2, "seed": 5, "max_tokens": 48, "guided_json": SCHEMA},
    {
        "prompt": "Once",
        "temperature": 0.8,
        "seed": 9,
        "max_tokens": NUM_TOKENS,
        "ignore_eos": True,
        "logprobs": 2,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.2,
    },
]


# Speculative decoding, each proposer: DRAFT is the checkpoint itself (every draft holds), HEAD a
# random EAGLE-3 head for it (whole on each rank; drafts mostly rejected).
SPECS = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
    "draft": '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3, "draft_length": "fixed"}',
    "eagle3": '{"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 3}',
}


@pytest.mark.parametrize(
    ("tp", "extra"),
    [(2, ()), (4, ("--num-scheduler-steps", "4")), (2, ("--speculative-config", SPECS["ngram"]))]
    # The model proposers at TP = 2 (a draft model, an EAGLE-3 head): 12 s each, in the slow group.
    + [pytest.param(2, ("--speculative-config", SPECS[name]), marks=pytest.mark.slow) for name in ("draft", "eagle3")],
    ids=["tp2", "tp4-multistep", "tp2-speculative", "tp2-draft-model", "tp2-eagle3"],
)
def test_tensor_parallel_greedy_matches_transformers(tp, extra, checkpoints, reference, daemon_factory, tmp_path):
    path = checkpoints[ARCH]
    args = f"--model {path} --tensor-parallel-size {tp} --max-num-batched-tokens 32 --num-kv-blocks 128".split()
    if any("HEAD" in a for a in extra):  # the tiny checkpoint's 2 layers: the default (2, L // 2, L - 3) does not fit
        head = make_eagle3_head(path, tmp_path / "head", draft_vocab_size=1024, aux_layers=(1, 0, 1))
        extra = tuple(a.replace("HEAD", str(head)) for a in extra)
    daemon = daemon_factory(*args, *(a.replace("DRAFT", str(path)) for a in extra))
    assert len(daemon.stage_pids("worker")) == tp
    ref = reference(path)
    expected = {prompt: ref.greedy(ref.encode(prompt), NUM_TOKENS) for prompt in PROMPTS}
    ids = ref.encode(PROMPTS[1])
    with torch.inference_mode():  # the prompt's log-likelihoods, which rank 0 gathers in its passes
        rows = torch.log_softmax(ref.model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    likelihoods = [None] + [rows[i, token].item() for i, token in enumerate(ids[1:])]
    try:
        check_concurrent_requests(daemon, expected, likelihoods)
        if any("DRAFT" in a for a in extra):  # a draft equal to the model: its greedy rows' drafts hold
            drafts = daemon.metric('conveyor_spec_decode_draft_tokens_total{engine="0"}')
            accepted = daemon.metric('conveyor_spec_decode_accepted_tokens_total{engine="0"}')
            assert drafts > 0 and accepted >= 0.5 * drafts, (accepted, drafts)  # a rank drafting from other ids: few
    except AssertionError:
        print(daemon.output()[-20000:])  # shown by pytest with the failure: the ranks' logs
        raise


def check_concurrent_requests(daemon, expected: dict[str, list[int]], likelihoods: list[float | None]) -> None:
    jobs = [(prompt, stream) for prompt in PROMPTS for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 2 + len(SAMPLED)) as pool:
        scored = pool.submit(daemon.post, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 1})
        forked = pool.submit(
            daemon.post,
            "/v1/completions",
            {"prompt": PROMPTS[0], "n": 2, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        )
        sampled = [pool.submit(daemon.post, "/v1/completions", body) for body in SAMPLED]
        results = list(pool.map(lambda job: complete(daemon, job[0], stream=job[1], max_tokens=NUM_TOKENS), jobs))
    for (prompt, stream), (ids, _, _) in zip(jobs, results):
        assert ids == expected[prompt], (prompt, stream)
    assert forked.result().status_code == 200, forked.result().text
    assert [c["token_ids"] for c in forked.result().json()["choices"]] == [expected[PROMPTS[0]]] * 2
    constrained, penalised = (future.result() for future in sampled)
    assert constrained.status_code == 200 and penalised.status_code == 200, (constrained.text, penalised.text)
    for choice in constrained.json()["choices"]:  # the grammar held: an object, whole once it stopped
        assert choice["text"].lstrip().startswith("{"), choice
        if choice["finish_reason"] == "stop":
            assert json.loads(choice["text"])["answer"] in ("yes", "no"), choice
    logprobs = penalised.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == NUM_TOKENS and all(-50 < lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"])  # the top 2, and the sampled token where not among them
    assert scored.result().status_code == 200, scored.result().text
    assert scored.result().json()["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(likelihoods, abs=1e-4)


@pytest.mark.slow  # a rank killed and the engine restarted, twice: half a minute of daemons (-m slow)
def test_a_dead_rank_takes_the_engine_down_cleanly_and_it_comes_back(checkpoints, daemon_factory):
    args = "--tensor-parallel-size 2 --num-kv-blocks 256 --stage-timeout 5 --max-engine-restarts 10".split()
    daemon = daemon_factory("--model", str(checkpoints[ARCH]), *args)
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


def test_tensor_parallel_lora_matches_peft(checkpoints, daemon_factory, tmp_path):
    """Adapters split as their layers are (A like a row-parallel layer's input, B like a
    column-parallel one's output): each rank's delta joins its partial sums."""
    base = checkpoints[ARCH]
    paths = make_adapters(base, tmp_path)
    modules = [f"{name}={paths[name]}" for name in ("all16", "mlp8")]
    args = ["--model", str(base), "--tensor-parallel-size", "2", "--enable-lora", "--lora-modules", *modules, "--max-loras", "2"]
    daemon = daemon_factory(*args, "--max-num-batched-tokens", "32", "--num-kv-blocks", "128")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for name in ("all16", "mlp8", None):
        response = daemon.post("/v1/completions", {**body, **({"model": name} if name else {})})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == peft_greedy(base, paths.get(name) if name else None, prompt, 6), name
