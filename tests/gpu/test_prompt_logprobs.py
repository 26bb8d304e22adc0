"""Prompt logprobs (SamplingParams.prompt_logprobs) through the Python API on tiny checkpoints,
against transformers' own forward over the whole prompt: each prompt token's logprob, its rank and
the top alternatives, through chunked prompts, a warm prefix cache, n = 2 and a batch."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams

PROMPT = list(range(3, 90))  # 87 tokens: three chunks under a 32-token budget
TOP = 3


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints["LlamaForCausalLM"]


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), device="cpu", max_num_batched_tokens=32, num_kv_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def check(path, reference):
    model = reference(path).model

    def check(prompt_logprobs, prompt: list[int], num_top: int) -> None:
        with torch.no_grad():  # log p of every next token under transformers' model: [len(prompt) - 1, V]
            expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
        for i, entry in enumerate(prompt_logprobs[1:]):
            row, token = expected[i], prompt[i + 1]
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4), i
            assert entry.rank == int((row > row[token]).sum()) + 1
            values, ids = row.topk(num_top)
            assert [t.token_id for t in entry.top] == ids.tolist()
            assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
            assert [t.rank for t in entry.top] == list(range(1, num_top + 1))

    return check


def test_prompt_logprobs_match_transformers_through_chunks(llm, check):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    (out,) = llm.generate([PROMPT], params)
    check(out.prompt_logprobs, PROMPT, TOP)
    # The answer is unchanged by asking.
    (plain,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_prefix_cache_hit_still_yields_every_logprob(llm, check):
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))  # the prompt's blocks cached
    (warm,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    assert warm.num_cached_tokens > 0  # a plain request does hit
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, PROMPT, 0)


def test_several_samples_and_prompts(llm, check):
    prompts = [PROMPT[:40], [7], PROMPT[5:20]]
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=3, prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs) == 2
        check(out.prompt_logprobs, prompt, 1)
    assert outs[1].prompt_logprobs == [None]  # a one-token prompt: nothing predicts its token
