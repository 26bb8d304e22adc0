"""The KV host tier's books (stages/scheduler/kv_tiers.py) over the fake worker, which copies its
simulated KV to and from host slots as the plans say: a wrong save, load or slot gives wrong
tokens."""

from __future__ import annotations

import pytest

from conveyor.stages.scheduler.kv_tiers import HostSlots
from tests.scheduler.engine_driver import Driver, make, prompt_of, reference, request

BLOCK = 4


def test_host_slots_evict_the_least_recently_used_name():
    slots = HostSlots(2)
    assert slots.store(10) == 0 and slots.store(11) == 1
    assert slots.store(10) is None  # held already: a use
    assert slots.store(12) == 1  # 11 was least recently used
    assert 11 not in slots and slots.lookup([10, 12, 11]) == [0, 1]
    assert slots.store(13) == 0  # the lookup used 10 before 12
    taken = slots.reserve(2, avoid=set())
    assert taken is not None and sorted(taken) == [0, 1] and len(slots) == 0  # a swapped-out sequence takes every slot
    assert slots.store(14) is None  # no slot left to save into: the block is not kept
    slots.release(taken)
    assert slots.store(14) in (0, 1)


def _serve(driver: Driver, i: int, prompt: list[int]) -> list[int]:
    driver.core.add_request(request(i, prompt, max_tokens=3, ignore_eos=True))
    driver.run()
    (seq,) = [s for s in driver.seqs.values() if s.request_id == f"r{i}"]
    return seq.output_token_ids


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_an_evicted_prefix_comes_back_from_the_host_tier(depth):
    sched, runner = make(num_blocks=16, block_size=BLOCK, budget=64, num_host_slots=64)
    driver = Driver(sched, runner, depth=depth)
    prefix = prompt_of(1, 10 * BLOCK)
    first = _serve(driver, 0, prefix + [7])
    for i in range(1, 4):  # unrelated prompts that take the pool
        _serve(driver, i, prompt_of(100 + i, 12 * BLOCK))
    tiers = sched.tiers
    assert tiers is not None
    again = _serve(driver, 4, prefix + [7])
    assert again == first == reference(prefix + [7], request(0, [], max_tokens=3, ignore_eos=True).params, 0, 512, False)
    assert tiers.num_host_hits == 10  # every full block of the prompt, none recomputed
    (seq,) = [s for s in driver.seqs.values() if s.request_id == "r4"]
    assert seq.num_cached_tokens == 10 * BLOCK


def test_a_block_is_saved_by_the_plan_after_the_one_that_computes_it():
    sched, runner = make(num_blocks=32, block_size=BLOCK, budget=64, num_host_slots=32)
    driver = Driver(sched, runner)
    driver.core.add_request(request(0, prompt_of(2, 3 * BLOCK + 1), max_tokens=2, ignore_eos=True))
    driver.run()
    prefill, *later = driver.steps
    assert prefill.kv_saves == []  # computed by this plan: copied by the next
    assert sorted(block for step in later for block, _, _ in step.kv_saves) == sorted(prefill.rows[0].new_block_ids[:3])


def test_a_load_lost_to_the_pool_is_recomputed_not_retried():
    """A pool so small that what the tier loads back is evicted again before its sequence starts:
    the sequence computes its prompt (right tokens), and is loaded at most once in a row."""
    sched, runner = make(num_blocks=6, block_size=BLOCK, budget=64, num_host_slots=32, max_seqs=4)
    driver = Driver(sched, runner, depth=2)
    prefix = prompt_of(5, 4 * BLOCK)
    expected = _serve(driver, 0, prefix + [9])
    _serve(driver, 1, prompt_of(200, 5 * BLOCK))
    for i in range(2, 5):  # arriving together: they evict each other's loads
        driver.core.add_request(request(i, prefix + [9], max_tokens=3, ignore_eos=True))
    driver.run()
    for i in range(2, 5):
        (seq,) = [s for s in driver.seqs.values() if s.request_id == f"r{i}"]
        assert seq.output_token_ids == expected


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequences_come_back_from_the_host_tier_when_swapped(mode, depth):
    """A pool too small for every sequence at once preempts; swapped ones resume from their
    saved blocks (computing only their last token again), and every output is the fake model's."""
    sched, runner = make(num_blocks=10, block_size=BLOCK, budget=32, num_host_slots=64, preemption_mode=mode)
    driver = Driver(sched, runner, depth=depth)
    prompts = [prompt_of(300 + i, 2 * BLOCK + 1) for i in range(4)]
    for i, prompt in enumerate(prompts):
        driver.core.add_request(request(i, prompt, max_tokens=12, ignore_eos=True))
    driver.run()
    assert sched.num_preemptions > 0
    tiers = sched.tiers
    assert tiers is not None and (tiers.num_swapped_out > 0) == (mode == "swap")
    for i, prompt in enumerate(prompts):
        (seq,) = [s for s in driver.seqs.values() if s.request_id == f"r{i}"]
        assert seq.output_token_ids == reference(prompt, request(i, [], max_tokens=12, ignore_eos=True).params, 0, 512, False)
    computed = sum(row.num_tokens for step in driver.steps for row in step.rows)
    if mode == "swap":  # each resume computes one token again, not the whole sequence
        assert computed < sum(len(p) + 12 for p in prompts) + 2 * sched.num_preemptions
    assert sched.blocks.num_used == 0


def test_blocks_loaded_back_never_keep_the_queues_head_out():
    """Found by the property test: a swapped-out sequence loaded back while another, ahead of it
    in the queue, could not resume for want of the blocks it held. Held blocks now last one round:
    every request finishes, with the fake model's tokens."""
    from conveyor.wire.messages import SamplingParams, ScheduleRequest

    sched, runner = make(1, 58, 1, 9, 2, 256, 64, policy="prefill_first", enable_prefix_caching=False, preemption_mode="swap")
    driver = Driver(sched, runner)
    prompts = {
        "r0": [1],
        "r1": [(31 + j) % 500 for j in range(9)] + [14],
        "r2": [27],
        "r3": [40],
        "r4": [53],
        "r5": [(62 + j) % 500 for j in range(20)] + [(5 * 13 + j) % 500 + 1 for j in range(20)],
    }
    wanted = {"r0": (1, 1, 0), "r1": (6, 3, 0), "r2": (1, 1, 0), "r3": (1, 1, 0), "r4": (1, 1, 0), "r5": (2, 2, 1)}
    for rid, (max_tokens, n, priority) in wanted.items():
        params = SamplingParams(n=n, max_tokens=max_tokens)
        driver.core.add_request(ScheduleRequest(rid, 0, prompts[rid], params, 0.0, priority))
    driver.run(max_ticks=2000)
    assert sched.num_preemptions > 0 and sched.blocks.num_used == 0
