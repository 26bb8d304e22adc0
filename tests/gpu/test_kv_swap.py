"""Swap preemption (--preemption-mode swap) on a real model: a pool too small for every sequence
preempts, a swapped sequence resumes from the blocks the host tier kept, and every output is what
the same requests give in a pool that never preempts."""

from __future__ import annotations

import pytest

from conveyor import LLM
from conveyor.wire.messages import SamplingParams

PROMPTS = [[5 + (3 * i + 7 * j) % 90 for i in range(10)] for j in range(4)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=14, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_swapped_sequences_resume_where_they_were(checkpoints, params):
    path = str(checkpoints["LlamaForCausalLM"])
    roomy = LLM(path, device="cpu", block_size=4, num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params)]
    tight = LLM(path, device="cpu", block_size=4, num_kv_blocks=12, kv_offloading_size=0.01, preemption_mode="swap")
    ours = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, params)]
    sched = tight.core.scheduler
    assert sched.num_preemptions > 0 and sched.tiers is not None and sched.tiers.num_swapped_out > 0
    assert ours == expected


def test_swap_needs_the_host_tier(checkpoints):
    with pytest.raises(ValueError, match="--preemption-mode swap needs --kv-offloading-size"):
        LLM(str(checkpoints["LlamaForCausalLM"]), device="cpu", preemption_mode="swap")
