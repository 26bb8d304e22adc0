"""Speculative decoding in the engine (LLM, the in-process pipeline): outputs token-for-token
those of the same engine without speculation, whatever the drafts.

Three proposers: n-gram itself (on repetitive prompts, so it proposes), an oracle that drafts the
non-speculative run's own continuation (a draft equal to the target: every draft is accepted, and
a step emits k + 1 tokens), and one that drafts wrong tokens (every draft rejected). Each with
greedy rows, n = 2, stop strings and max_tokens inside a run, logprobs, seeded sampling with
penalties, and a JSON schema; and SmolLM2 (the default model) with n-gram, where drafts hold.
"""

from __future__ import annotations

import pytest

from conveyor import LLM
from conveyor.gpu.step.features.speculation import SpeculationStep
from conveyor.wire.messages import SamplingParams, StructuredOutput


def _spec(llm) -> SpeculationStep:
    """The LLM's speculation feature (gpu/step/features/speculation.py)."""
    spec = llm.runner.feature(SpeculationStep)
    assert spec is not None
    return spec


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42, 43, 44, 45] * 3, [9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)


class Counting:
    """Wraps a proposer and counts the drafts it offered."""

    def __init__(self, inner) -> None:
        self.inner, self.drafts = inner, 0

    def propose(self, seqs, slots, limits):
        drafts = self.inner.propose(seqs, slots, limits)
        self.drafts += sum(map(len, drafts))
        return drafts


class Oracle:
    """Drafts what the non-speculative engine produced next (or those ids plus one: `wrong`)."""

    def __init__(self, runs: list[tuple[list[int], list[int]]], wrong: bool = False) -> None:
        self.runs, self.wrong = runs, wrong

    def propose(self, seqs, slots, limits):
        drafts = []
        for history, limit in zip((seq.token_ids for seq in seqs), limits):
            found: list[int] = []
            for prompt, output in self.runs:
                n = len(history) - len(prompt)
                if n >= 0 and history[: len(prompt)] == prompt and history[len(prompt) :] == output[:n]:
                    found = output[n : n + limit]
                    break
            drafts.append([(t + 1) % 512 for t in found] if self.wrong else found)
        return drafts


def generate(path, params, prompts=PROMPTS, proposer=None, **options):
    spec = options.pop("spec", proposer is not None)
    llm = LLM(str(path), device="cpu", num_kv_blocks=256, **({"speculative_config": SPEC} if spec else {}), **options)
    if proposer is not None:
        _spec(llm).proposer = proposer(_spec(llm).proposer) if proposer is Counting else proposer
    outputs = llm.generate(prompts, params)
    return outputs, llm


def token_ids(outputs):
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM"])
def path(request, checkpoints):
    return checkpoints[request.param]


def test_ngram_greedy_is_identical(path):
    base, _ = generate(path, GREEDY)
    spec, llm = generate(path, GREEDY, proposer=Counting)
    assert token_ids(spec) == token_ids(base)
    assert _spec(llm).proposer.drafts > 0


@pytest.mark.parametrize("wrong", [False, True])
def test_a_draft_equal_to_the_target_holds_and_a_wrong_one_changes_nothing(path, wrong):
    base, base_llm = generate(path, GREEDY)
    runs = [(p, out.outputs[0].token_ids) for p, out in zip(PROMPTS, base)]
    spec, llm = generate(path, GREEDY, proposer=Oracle(runs, wrong))
    assert token_ids(spec) == token_ids(base)
    base_steps, steps = base_llm.core.scheduler.num_steps, llm.core.scheduler.num_steps
    if wrong:
        assert steps == base_steps
    else:  # one prompt step, then 22 tokens in runs of up to k + 1 = 4 (fewer while the row's record is short)
        assert 1 + -(-22 // 4) <= steps <= 1 + -(-22 // 2) < base_steps


def test_two_samples_stop_strings_max_tokens_and_logprobs_are_unchanged(path):
    params = SamplingParams(temperature=0.0, max_tokens=14, n=2, logprobs=2, stop=["zz"], ignore_eos=True)
    base, _ = generate(path, params)
    runs = [(p, c.token_ids) for p, out in zip(PROMPTS, base) for c in out.outputs]
    spec, _ = generate(path, params, proposer=Oracle(runs))
    assert token_ids(spec) == token_ids(base)
    for b, s in zip(base, spec):
        for bc, sc in zip(b.outputs, s.outputs):
            assert (sc.text, sc.finish_reason) == (bc.text, bc.finish_reason)
            assert len(sc.logprobs) == len(bc.logprobs) == len(bc.token_ids)
            for spec_lp, base_lp in zip(sc.logprobs, bc.logprobs):
                assert [t.token for t in spec_lp.top] == [t.token for t in base_lp.top]
                assert [spec_lp.logprob, *(t.logprob for t in spec_lp.top)] == pytest.approx(
                    [base_lp.logprob, *(t.logprob for t in base_lp.top)], abs=1e-4
                )


def test_a_stop_string_inside_an_accepted_run_ends_it_there(path):
    base, _ = generate(path, GREEDY)
    text = base[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # somewhere in the middle of a run of drafts
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, stop=[stop])
    stopped, _ = generate(path, params, prompts=PROMPTS[:1])
    runs = [(PROMPTS[0], base[0].outputs[0].token_ids)]
    spec, _ = generate(path, params, prompts=PROMPTS[:1], proposer=Oracle(runs))
    assert spec[0].outputs[0].text == stopped[0].outputs[0].text == text[: text.index(stop)]
    assert spec[0].outputs[0].finish_reason == "stop"


def test_seeded_sampling_with_penalties_draws_the_same_tokens(path):
    """The verified positions draw with the uniforms of their output indices, over histories
    holding the drafts: a seeded request gets the tokens it gets without speculation."""
    params = [
        SamplingParams(
            temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2, frequency_penalty=0.3, seed=seed, max_tokens=17
        )
        for seed in range(len(PROMPTS))
    ]
    base, _ = generate(path, params)
    runs = [(p, out.outputs[0].token_ids) for p, out in zip(PROMPTS, base)]
    spec, llm = generate(path, params, proposer=Oracle(runs))
    assert token_ids(spec) == token_ids(base)
    assert llm.core.scheduler.num_steps < 17


SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}'


class Breaking(Oracle):
    """The oracle's drafts with their second token replaced by '}': a draft the grammar refuses
    wherever an object's key or value is due (verified unmasked, it would only be rejected; it is
    fill_after's accepting it that would break the matcher, so it must be cut first)."""

    def __init__(self, runs, brace: int) -> None:
        super().__init__(runs)
        self.brace = brace

    def propose(self, seqs, slots, limits):
        return [d[:1] + [self.brace] + d[2:] if len(d) > 1 else d for d in super().propose(seqs, slots, limits)]


@pytest.mark.parametrize("drafts", ["oracle", "breaking"])
def test_a_schema_constrained_row_verifies_only_drafts_its_grammar_allows(path, drafts):
    """The constrained row comes after verifying rows (whose draft positions add logits rows before
    its own) and verifies drafts itself: position j masked as if j drafts were drawn. Drafts that
    break the grammar are cut before verification; the output is the same either way."""
    params = [GREEDY] * 3 + [SamplingParams(temperature=0.0, max_tokens=30, structured=StructuredOutput("json_schema", SCHEMA))]
    base, base_llm = generate(path, params)
    runs = [(p, out.outputs[0].token_ids) for p, out in zip(PROMPTS, base)]
    assert base[3].outputs[0].text.lstrip().startswith("{")
    brace = base_llm.encoder.tokenizer.token_to_id("}")
    proposer = Oracle(runs) if drafts == "oracle" else Breaking(runs, brace)
    spec, llm = generate(path, params, proposer=proposer)
    assert token_ids(spec) == token_ids(base)
    assert llm.core.scheduler.num_steps < base_llm.core.scheduler.num_steps


def test_smollm2_greedy_is_identical_and_drafts_hold(smollm2):
    prompts = [
        "Repeat the following text exactly:\n\nThe quick brown fox jumps over the lazy dog. The dog was not amused, "
        "and it barked at the fox for a long time.",
        "Rename the function add to plus in this code and show the full code:\n\ndef add(a, b):\n    result = a + b\n"
        "    return result\n\ndef times(a, b):\n    result = a * b\n    return result\n",
    ]
    llm = LLM(device="cpu", num_kv_blocks=64)
    ids = [llm.encoder.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    base = token_ids(llm.generate(ids, params))
    spec_llm = LLM(device="cpu", num_kv_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    spec = token_ids(spec_llm.generate(ids, params))
    assert spec == base
    assert spec_llm.core.scheduler.num_steps < llm.core.scheduler.num_steps - 2  # drafts held
