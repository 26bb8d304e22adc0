"""A draft model proposing (`{"method": "draft_model", "model": DIR}`): its KV follows the
target's passes in its own cache over the same blocks, and its greedy drafts are verified exactly.

A draft equal to the target (the same weights) has every draft accepted, so a run of steps emits
up to k + 1 tokens; a different random model's drafts mostly fail, and a draft cut from the
target (conveyor.tiny.truncate) is in between: every time the output is the engine's own without
speculation, greedy and seeded, through a pool small enough to preempt and with prompts sharing
cached blocks, on the tiny checkpoints and on SmolLM2. A draft with another vocabulary is refused
at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor import LLM
from conveyor.config import ConfigError
from conveyor.engine_config import build_engine_config
from conveyor.gpu.step.features.speculation import SpeculationStep
from conveyor.tiny.truncate import truncate
from conveyor.wire.messages import SamplingParams
from tests import gpu_checkpoints


def _spec(llm) -> SpeculationStep:
    """The LLM's speculation feature (gpu/step/features/speculation.py)."""
    spec = llm.runner.feature(SpeculationStep)
    assert spec is not None
    return spec


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42, 43, 44, 45] * 3, [9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)


def spec(draft, k=3):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "draft_length": "fixed"}


def run(path, params, draft=None, prompts=PROMPTS, **options):
    """Token ids per prompt, and the steps taken. With a draft, every row takes all k drafts its
    lookahead allows: a draft as big as the target never pays on a CPU (draft_length.py), but
    these tests are about exactness, not pay."""
    extra = {"speculative_config": spec(draft)} if draft is not None else {}
    llm = LLM(str(path), device="cpu", num_kv_blocks=options.pop("num_kv_blocks", 256), **extra, **options)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm.core.scheduler.num_steps


@pytest.fixture(scope="module")
def target(checkpoints):
    return checkpoints["LlamaForCausalLM"]


def test_a_draft_equal_to_the_target_is_always_right(target):
    base, base_steps = run(target, GREEDY)
    got, steps = run(target, GREEDY, draft=target)
    assert got == base
    assert steps == 1 + -(-22 // 4) < base_steps  # one prompt step, then runs of k + 1 = 4 tokens


def test_other_drafts_change_nothing(target, checkpoints, tmp_path):
    cut = truncate(target, tmp_path / "cut", 1)
    assert json.loads((cut / "config.json").read_text())["num_hidden_layers"] == 1
    base, _ = run(target, GREEDY)
    for draft in (checkpoints["MistralForCausalLM"], cut):  # another random model; the target's first layer
        assert run(target, GREEDY, draft=draft)[0] == base


def test_seeded_sampling_with_penalties_is_unchanged(target):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=seed, max_tokens=15) for seed in range(len(PROMPTS))
    ]
    assert run(target, params, draft=target)[0] == run(target, params)[0]


def test_preemption_and_shared_prefixes_keep_the_draft_in_step(target):
    """Ten prompts sharing a long prefix through a pool of 24 blocks of 4: prefix-cache hits
    (the draft's KV of those blocks came with the target's), copies on write and preemption."""
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] + [i, i + 1] for i in range(20, 30)]
    small = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=32)
    base, _ = run(target, GREEDY, prompts=prompts, **small)
    assert run(target, GREEDY, draft=target, prompts=prompts, **small)[0] == base


def test_a_draft_with_another_vocabulary_is_refused(target):
    other = gpu_checkpoints.checkpoint("llama")  # a 512-token vocabulary against the tiny model's 4096
    with pytest.raises(ConfigError, match="the draft's vocabulary has 512 tokens, the model's 4096"):
        build_engine_config(str(target), device="cpu", speculative_config=spec(other))
    with pytest.raises(ConfigError, match="is not a directory"):
        build_engine_config(str(target), device="cpu", speculative_config=spec(target / "nowhere"))


def test_smollm2_with_its_first_two_layers_drafting_is_unchanged(smollm2, tmp_path):
    """The real model, packed Q4_1, drafted for by its own first two layers (the self-speculation
    draft of docs/benchmarks.md, every draft verified): the output is its own."""
    base_llm = LLM(device="cpu", num_kv_blocks=64)
    cut = truncate(Path(base_llm.config.model.path), tmp_path / "cut", 2)
    ids = [base_llm.encoder.encode_chat([{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}])]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    base = [o.outputs[0].token_ids for o in base_llm.generate(ids, params)]
    llm = LLM(device="cpu", num_kv_blocks=64, speculative_config=spec(cut, 4))
    assert [o.outputs[0].token_ids for o in llm.generate(ids, params)] == base
    assert _spec(llm).drafter.model.config.num_layers == 2


@pytest.mark.parametrize("tied", [False, True])
def test_a_steps_bytes_count_every_weight_once_but_input_embeddings(tmp_path, tied):
    """draft_passes.bytes_per_step, the draft's cost ESTIMATE: an untied embedding table is not
    read whole by a step (its rows are), a tied one is (it is the output head too)."""
    from conveyor.gpu.loading.loader import load_model
    from conveyor.gpu.models.registry import read_model_config
    from conveyor.gpu.spec.draft_passes import bytes_per_step
    from conveyor.tiny.checkpoint import make_checkpoint

    model = load_model(read_model_config(make_checkpoint(tmp_path / "m", tie_word_embeddings=tied), dtype="float32"), "cpu")
    every = sum(p.numel() * 4 for p in model.parameters())  # a tied head's weight appears once
    table = model.model.embed_tokens.weight.numel() * 4
    assert bytes_per_step(model) == (every if tied else every - table)
    assert bytes_per_step(model, skip=(model.model.layers[0],)) == bytes_per_step(model) - sum(
        p.numel() * 4 for p in model.model.layers[0].parameters()
    )
