"""Prompt log-likelihoods over HTTP, through the whole daemon on a tiny checkpoint, against
transformers' forward over the same prompt: the legacy `echo` + `logprobs` (with max_tokens 0 and
1, as evaluation harnesses send them, streamed too) and vLLM's `prompt_logprobs` on both routes."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import stream_events

PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on"


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints["LlamaForCausalLM"]


@pytest.fixture(scope="module")
def daemon(daemon_factory, path):
    return daemon_factory("--model", str(path), "--num-kv-blocks", "256", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def expected(path, reference):
    """Token ids -> log p of every next token under transformers' model, [len - 1, V]."""
    ref = reference(path)

    def expected(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(ref.model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)

    return expected


def prompt_ids(daemon) -> list[int]:
    return daemon.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]


def check_legacy(logprobs: dict, ids: list[int], expected: torch.Tensor, num_top: int) -> None:
    """The prompt's part of a legacy `logprobs` object: its first len(ids) entries."""
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][0] == 0
    for i in range(1, len(ids)):
        row = expected[i - 1]
        assert logprobs["token_logprobs"][i] == pytest.approx(row[ids[i]].item(), abs=1e-4), i
        top = logprobs["top_logprobs"][i]
        assert num_top <= len(top) <= num_top + 1 and top[logprobs["tokens"][i]] == logprobs["token_logprobs"][i]
        if num_top:
            assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-4)  # the most likely token is in it


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_logprobs_with_max_tokens_0_is_the_prompt_alone(daemon, expected, as_ids):
    ids = prompt_ids(daemon)
    body = {"prompt": ids if as_ids else PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    answer = daemon.post("/v1/completions", body).json()
    (choice,) = answer["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == len(ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_legacy(choice["logprobs"], ids, expected(ids), 2)


def test_what_an_evaluation_harness_sends(daemon, expected):
    """lm-evaluation-harness's loglikelihood payload: max_tokens 1, logprobs 1, echo, several prompts."""
    ids = prompt_ids(daemon)
    prompts = [ids, ids[:9]]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    answer = daemon.post("/v1/completions", body).json()
    for prompt, choice in zip(prompts, sorted(answer["choices"], key=lambda c: c["index"])):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 1  # the prompt's, then the drawn token's
        check_legacy(logprobs, prompt, expected(prompt), 1)
        assert logprobs["text_offset"][-1] >= logprobs["text_offset"][-2]


def test_streamed_echo_logprobs_lead_with_the_prompt(daemon, expected):
    ids = prompt_ids(daemon)
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0, "stream": True}
    events = stream_events(daemon.post("/v1/completions", body, stream=True))
    chunks = [e["choices"][0] for e in events if e != "[DONE]"]
    first = chunks[0]["logprobs"]
    assert len(first["tokens"]) >= len(ids)
    check_legacy(first, ids, expected(ids), 0)
    assert "".join(c["text"] for c in chunks).startswith(PROMPT)


def test_vllm_prompt_logprobs_on_both_routes(daemon, expected):
    ids = prompt_ids(daemon)
    out = daemon.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2}).json()
    prompt_logprobs = out["choices"][0]["prompt_logprobs"]
    rows = expected(ids)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for i, entry in enumerate(prompt_logprobs[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(rows[i - 1][ids[i]].item(), abs=1e-4)
        assert own["rank"] == int((rows[i - 1] > rows[i - 1][ids[i]]).sum()) + 1
        top_ids = rows[i - 1].topk(2).indices.tolist()
        assert all(str(t) in entry for t in top_ids) and len(entry) <= 3
    chat = daemon.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    )
    body = chat.json()
    chat_ids = daemon.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    assert len(body["prompt_logprobs"]) == len(chat_ids) and "prompt_logprobs" not in body["choices"][0]


def test_bad_requests(daemon):
    for body, param in [
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ]:
        r = daemon.post("/v1/completions", body)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param, r.json()
    chat = daemon.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0})
    assert chat.status_code == 400
    assert daemon.post("/v1/completions", {"prompt": "a", "max_tokens": 1}).status_code == 200  # still serving
