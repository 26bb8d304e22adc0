"""The KV host tier end to end (--kv-offloading-size): a prefix the device pool evicted comes back
from host memory, and every output is what recomputing it gives."""

from __future__ import annotations

import pytest

from conveyor import LLM
from conveyor.wire.messages import SamplingParams

BLOCK = 4
PREFIX = [5 + (7 * i) % 97 for i in range(10 * BLOCK)]  # ten full blocks
POOL = dict(device="cpu", block_size=BLOCK, num_kv_blocks=24)


def _prompts(tail: int) -> list[list[int]]:
    return [PREFIX + [120 + tail, 121 + tail, 122 + tail]]


def _evicting() -> list[list[int]]:
    """Prompts with nothing in common with PREFIX, that take the whole pool between them."""
    return [[150 + (11 * i + 3 * j) % 90 for i in range(12 * BLOCK)] for j in range(3)]


def _run(llm: LLM, params: list[SamplingParams] | SamplingParams) -> list[list[list[int]]]:
    """A prefix, prompts that evict it from the device, then the prefix again with another tail."""
    outputs = []
    for prompts in (_prompts(0), _evicting(), _prompts(1)):
        outputs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)])
    return outputs


@pytest.fixture(scope="module")
def path(checkpoints):
    return str(checkpoints["LlamaForCausalLM"])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6, n=2),
    ],
    ids=["greedy", "seeded-n2"],
)
@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_a_prefix_back_from_the_host_tier_gives_what_recomputing_it_gives(path, params, chunk):
    options = dict(POOL, max_num_batched_tokens=chunk) if chunk else POOL
    tiered = LLM(path, kv_offloading_size=0.01, **options)
    assert tiered.core.scheduler.tiers is not None
    ours = _run(tiered, params)
    tiers = tiered.core.scheduler.tiers
    assert tiers.num_host_hits >= 9  # the prefix's blocks but the one its last token's logits need
    assert _run(LLM(path, **options), params) == ours


def test_host_hits_count_as_cached_tokens(path):
    llm = LLM(path, kv_offloading_size=0.01, **POOL)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(_prompts(0), greedy)
    llm.generate(_evicting(), greedy)
    (again,) = llm.generate(_prompts(1), greedy)
    assert again.num_cached_tokens == 10 * BLOCK


def test_without_the_tier_the_evicted_prefix_is_recomputed(path):
    """The counterpart that makes the tests above able to fail: the pool alone forgets it."""
    llm = LLM(path, **POOL)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(_prompts(0), greedy)
    llm.generate(_evicting(), greedy)
    (again,) = llm.generate(_prompts(1), greedy)
    assert again.num_cached_tokens == 0 and llm.core.scheduler.tiers is None
