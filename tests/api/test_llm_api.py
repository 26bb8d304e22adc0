"""The Python API: greedy output equals transformers' own model, token for token."""

from __future__ import annotations

import pytest

from conveyor import SamplingParams
from conveyor.wire.sampling_params import StructuredOutput
from tests.conftest import ARCHITECTURES

NUM_TOKENS = 12
PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog, and then the dog " * 4,  # longer than the budget
    "a",
]


@pytest.fixture(scope="module")
def engines(checkpoints):
    from conveyor import LLM

    # A 32-token budget: the long prompt (~60 tokens) is split across steps.
    return {arch: LLM(str(path), device="cpu", max_num_batched_tokens=32, num_kv_blocks=128) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(arch, engines, checkpoints, reference):
    llm, ref = engines[arch], reference(checkpoints[arch])
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert max(len(o.prompt_token_ids) for o in outputs) > 32
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == ref.encode(prompt)
        assert out.outputs[0].token_ids == ref.greedy(out.prompt_token_ids, NUM_TOKENS), prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == ref.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert llm.core.scheduler.blocks.num_used == 0


def test_token_id_prompts_and_chat(engines, checkpoints, reference):
    llm, ref = engines["LlamaForCausalLM"], reference(checkpoints["LlamaForCausalLM"])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = ref.encode("Tokens in, tokens out")
    assert llm.generate([ids], params)[0].outputs[0].token_ids == ref.greedy(ids, 5)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = llm.chat(messages, params)[0]
    expected_prompt = ref.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected_prompt, list):
        expected_prompt = expected_prompt["input_ids"]
    assert out.prompt_token_ids == expected_prompt
    assert out.outputs[0].token_ids == ref.greedy(expected_prompt, 5)


def test_seeded_sampling_is_reproducible_and_seed_dependent(engines):
    llm = engines["LlamaForCausalLM"]
    prompt = ["Once upon a time"]

    def sample(seed):
        params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=16, ignore_eos=True)
        return llm.generate(prompt, params)[0].outputs[0].token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_stop_token_ids_and_bad_prompts(engines):
    llm = engines["LlamaForCausalLM"]
    first = llm.generate("Stop here", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    stop_id = first.token_ids[1]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[stop_id])
    stopped = llm.generate("Stop here", params)
    assert stopped[0].outputs[0].token_ids == first.token_ids[: first.token_ids.index(stop_id) + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="context length"):
        llm.generate("x " * 3000, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 10**6]], SamplingParams(max_tokens=4))


def test_stop_strings_n_and_best_of(engines):
    llm = engines["LlamaForCausalLM"]
    free = llm.generate("The boat", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    out = llm.generate("The boat", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].text == free[: free.index(stop)]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)

    many = llm.generate("Pick one:", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=0))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    best = llm.generate("Pick one:", SamplingParams(n=1, best_of=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert best.outputs[0].cumulative_logprob == max(c.cumulative_logprob for c in many.outputs)
    assert all(c.cumulative_logprob is None for c in out.outputs)  # neither logprobs nor best_of: None, as vLLM


def test_a_request_with_nothing_to_sample_finishes_with_error(engines):
    """min_tokens past a complete grammar: the grammar allows only EOS, min_tokens bans it, so the
    whole vocabulary is masked: that request ends with finish_reason "error", the one beside it
    completes."""
    llm = engines["LlamaForCausalLM"]
    masked = SamplingParams(temperature=1.0, min_tokens=6, max_tokens=8, structured=StructuredOutput("choice", '["a"]'))
    normal = SamplingParams(temperature=1e-46, max_tokens=6, ignore_eos=True)  # greedy, not NaN
    bad, good = llm.generate(["Nothing to draw", "Something to say"], [masked, normal])
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].text == "a"
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 6
    assert llm.core.scheduler.blocks.num_used == 0


def test_min_tokens_that_no_token_can_meet_is_refused(engines):
    """min_tokens bans the stop ids and EOS, a -inf logit_bias its ids: when they cover the
    vocabulary the request is the caller's error, refused before it is scheduled, not a draw
    that fails."""
    llm = engines["LlamaForCausalLM"]
    model = llm.config.model
    not_eos = [t for t in range(model.vocab_size) if t not in model.eos_token_ids]
    for params in [
        SamplingParams(min_tokens=3, max_tokens=6, stop_token_ids=list(range(model.vocab_size))),
        SamplingParams(min_tokens=1, max_tokens=6, stop_token_ids=not_eos),  # EOS covers the rest
    ]:
        with pytest.raises(ValueError, match="min_tokens=.*stop_token_ids"):
            llm.generate("x", params)
    with pytest.raises(ValueError, match="logit_bias masks all"):  # the Python API's bias is unbounded
        llm.generate("x", SamplingParams(max_tokens=2, logit_bias=dict.fromkeys(range(model.vocab_size), float("-inf"))))
    # What leaves an id to draw passes: no min_tokens, or EOS not banned under ignore_eos.
    assert llm.generate("x", SamplingParams(max_tokens=2, stop_token_ids=not_eos))[0].outputs[0].finish_reason == "stop"
    out = llm.generate("x", SamplingParams(min_tokens=2, max_tokens=2, stop_token_ids=not_eos, ignore_eos=True))[0]
    assert out.outputs[0].token_ids[0] in model.eos_token_ids
    assert llm.core.scheduler.blocks.num_used == 0
