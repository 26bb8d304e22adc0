"""The scheduler and block manager, driven through the real StepPlan protocol by a fake worker
that keeps a simulated KV store (tests/fake_worker.py): outputs are only right if every block
table, prefix-cache hit, copy-on-write and fork is."""

from __future__ import annotations

import pytest

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.block_manager import BlockManager
from conveyor.stages.scheduler.plan import step_plan
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.stages.scheduler.sequence import Sequence
from conveyor.stages.scheduler.waiting_queue import QueueFull
from conveyor.wire.messages import FinishReason, SamplingParams, ScheduleRequest
from tests.fake_worker import FakeRunner, expected_tokens, next_token

EOS = 999


def make(num_blocks=256, block_size=4, budget=32, max_seqs=64, max_model_len=512, **config):
    sched = Scheduler.from_config(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, **config),
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
    )
    return sched, FakeRunner(num_blocks, block_size)


def prompt_of(i: int, length: int) -> list[int]:
    return [(i * 7 + j) % 900 + 1 for j in range(length)]


def seq(i, prompt_len, max_tokens=8, **params):
    return Sequence(i, f"req-{i}", prompt_of(i, prompt_len), SamplingParams(max_tokens=max_tokens, **params))


def request(i, prompt, priority=0, arrival=0.0, **params):
    return ScheduleRequest(f"req-{i}", 0, prompt, SamplingParams(**params), arrival, priority)


def step_once(sched, runner):
    step = sched.schedule()
    if step is None:
        return None, sched.take_unsampled_updates()
    result = runner.execute(step_plan(step))
    return step, sched.update(step, result)


def drive(sched, runner, max_steps=20_000):
    """Run to completion, checking the budget at every step; returns the steps taken."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_work():
            return steps
        step, _ = step_once(sched, runner)
        if step is not None:
            assert step.num_tokens == sum(r.num_tokens for r in step.rows) <= sched.config.max_num_batched_tokens
            steps.append(step)
    raise AssertionError("did not finish")


def outputs(sched, runner, requests):
    """Generated ids per request id, all samples, sorted by sample index."""
    seqs = {}
    for r in requests:
        sched.add_request(r)
    while sched.has_work():
        _, updates = step_once(sched, runner)
        for u in updates:
            seqs[u.seq.seq_id] = u.seq
    by_request: dict[str, list[Sequence]] = {}
    for s in sorted(seqs.values(), key=lambda s: s.index):
        by_request.setdefault(s.request_id, []).append(s)
    return by_request


def test_outputs_are_exact_and_blocks_return():
    sched, runner = make()
    seqs = [seq(i, 3 + 5 * i, max_tokens=6) for i in range(10)]
    for s in seqs:
        sched.add(s)
    drive(sched, runner)
    for s in seqs:
        assert s.output_token_ids == expected_tokens(s.token_ids[: s.num_prompt_tokens], 6, stop=EOS)
    assert sched.blocks.num_used == 0


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched, runner = make(budget=16)
    short = seq(0, 4, max_tokens=20, ignore_eos=True)
    sched.add(short)
    while short.num_output_tokens < 2:
        step_once(sched, runner)
    long = seq(1, 50, max_tokens=3, ignore_eos=True)
    sched.add(long)
    step, _ = step_once(sched, runner)
    assert (step.rows[0].seq, step.rows[0].num_tokens) == (short, 1), "the running decode comes first"
    assert (step.rows[1].seq, step.rows[1].num_tokens) == (long, 15), "the prompt fills the budget exactly"
    drive(sched, runner)
    assert long.output_token_ids == expected_tokens(prompt_of(1, 50), 3)


def test_max_num_seqs_caps_the_batch():
    sched, runner = make(max_seqs=3, budget=64)
    for i in range(8):
        sched.add(seq(i, 5))
    assert max(len(s.rows) for s in drive(sched, runner)) == 3


def test_preemption_under_a_tiny_pool_loses_nothing_and_picks_the_latest_arrival():
    # 20 sequences needing up to 10 blocks each, in a pool of 24: preemption is unavoidable.
    sched, runner = make(num_blocks=24, block_size=4, budget=24)
    seqs = [seq(i, 10 + i, max_tokens=20, ignore_eos=True) for i in range(20)]
    for i, s in enumerate(seqs):
        s.arrival_time = float(i)
        sched.add(s)
    drive(sched, runner)
    assert sched.num_preemptions > 0
    assert seqs[0].num_preemptions == 0, "the earliest arrival is never the victim"
    for s in seqs:
        assert s.output_token_ids == expected_tokens(s.token_ids[: s.num_prompt_tokens], 20)
    assert sched.blocks.num_used == 0


def test_stop_conditions():
    sched, runner = make(max_model_len=20)
    by_len = seq(0, 5, max_tokens=3, ignore_eos=True)
    by_ctx = seq(1, 15, max_tokens=100, ignore_eos=True)
    first = next_token(prompt_of(2, 5))
    by_stop_id = seq(2, 5, max_tokens=50, stop_token_ids=[first])
    for s in (by_len, by_ctx, by_stop_id):
        sched.add(s)
    drive(sched, runner)
    assert (by_len.num_output_tokens, by_len.finish_reason) == (3, FinishReason.LENGTH)
    assert (by_ctx.num_tokens, by_ctx.finish_reason) == (20, FinishReason.LENGTH)
    assert (by_stop_id.output_token_ids, by_stop_id.finish_reason) == ([first], FinishReason.STOP)


def test_abort_frees_blocks_and_reports_once():
    sched, runner = make()
    a, b = seq(0, 30, max_tokens=50, ignore_eos=True), seq(1, 30, max_tokens=50, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.abort("req-0")  # while its step is in flight
    result = runner.execute(step_plan(step))
    updates = sched.update(step, result)
    assert [u.finish_reason for u in updates if u.seq is a] == [FinishReason.ABORT]
    assert a.block_ids == []
    drive(sched, runner)
    assert b.num_output_tokens == 50
    assert sched.blocks.num_used == 0


def test_abort_that_overtakes_its_request():
    sched, _ = make()
    sched.abort("req-0")
    assert sched.add_request(request(0, [1, 2, 3])) is None
    assert not sched.has_work()


def test_a_sequence_too_big_for_the_pool_finishes_instead_of_hanging():
    sched, runner = make(num_blocks=4, block_size=4)
    big = seq(0, 40)
    sched.add(big)
    drive(sched, runner)
    assert big.finish_reason is FinishReason.LENGTH
    assert sched.blocks.num_used == 0


# --- prefix cache --------------------------------------------------------------------------


def test_a_repeated_prompt_hits_the_prefix_cache():
    sched, runner = make(block_size=4)
    prompt = prompt_of(3, 22)  # 5 full blocks and 2 tokens
    first = outputs(sched, runner, [request(0, prompt, max_tokens=5, ignore_eos=True)])["req-0"][0]
    assert first.num_cached_tokens == 0
    queries, hits = sched.blocks.num_cache_queries, sched.blocks.num_cache_hits
    used_before = sched.blocks.num_used
    second = outputs(sched, runner, [request(1, prompt, max_tokens=5, ignore_eos=True)])["req-1"][0]
    assert second.num_cached_tokens == 20  # every full prompt block
    assert sched.blocks.num_cache_hits - hits == 5 and sched.blocks.num_cache_queries - queries == 5
    assert second.output_token_ids == first.output_token_ids == expected_tokens(prompt, 5)
    assert sched.blocks.num_used == used_before == 0


def test_the_block_of_the_last_prompt_token_is_never_reused():
    sched, runner = make(block_size=4)
    prompt = prompt_of(4, 16)  # exactly 4 full blocks: the last one holds the last token
    outputs(sched, runner, [request(0, prompt, max_tokens=2)])
    again = outputs(sched, runner, [request(1, prompt, max_tokens=2)])["req-1"][0]
    assert again.num_cached_tokens == 12


def test_shared_prefix_blocks_are_held_once():
    sched, runner = make(block_size=4, budget=64)
    system = prompt_of(5, 16)
    outputs(sched, runner, [request(0, system + [7], max_tokens=1)])  # warms the cache
    for i in range(1, 4):
        sched.add_request(request(i, system + [i, i], max_tokens=3, ignore_eos=True))
    step_once(sched, runner)
    assert sched.blocks.num_used == 4 + 3  # the 4 shared prefix blocks once, a tail block each
    assert all(sched.blocks.ref_count(b) == 3 for b in sched.running[0].block_ids[:4])


def test_free_cached_blocks_are_evicted_least_recently_used_first():
    blocks = BlockManager(4, 2)
    a, b = blocks.allocate(1), blocks.allocate(1)
    blocks.register(a[0], 111)
    blocks.register(b[0], 222)
    blocks.free(a)
    blocks.free(b)
    blocks.share(blocks.lookup([111]))  # a is used again: b is now the least recently used
    blocks.allocate(2)  # the two never-named blocks go first
    assert blocks.lookup([222]) == b
    blocks.allocate(1)
    assert blocks.lookup([222]) == [] and blocks.lookup([111]) == a


# --- parallel sampling and copy-on-write ---------------------------------------------------


def test_parallel_samples_fork_share_the_prompt_and_copy_on_write():
    sched, runner = make(block_size=4)
    prompt = prompt_of(6, 10)  # the last prompt block is partial: the forks share it
    got = outputs(sched, runner, [request(0, prompt, n=4, max_tokens=6, ignore_eos=True)])["req-0"]
    assert [s.index for s in got] == [0, 1, 2, 3]
    for s in got:
        assert s.output_token_ids == expected_tokens(prompt, 6, s.index)
    assert len({tuple(s.output_token_ids) for s in got}) == 4
    assert sched.blocks.num_used == 0


def test_n_samples_hold_fewer_blocks_than_n_requests():
    prompt = prompt_of(7, 40)

    def peak(requests):
        sched, runner = make(block_size=4, budget=256)
        for r in requests:
            sched.add_request(r)
        most = 0
        while sched.has_work():
            step_once(sched, runner)
            most = max(most, sched.blocks.num_used)
        return most

    params = dict(max_tokens=4, ignore_eos=True)
    forked = peak([request(0, prompt, n=4, **params)])
    separate = peak([request(i, prompt, **params) for i in range(4)])
    assert forked < separate
    assert forked == 10 + 4  # the prompt's 10 full blocks once, then a new block per sample


def test_best_of_tracks_cumulative_logprobs():
    sched, runner = make()
    got = outputs(sched, runner, [request(0, prompt_of(8, 9), n=1, best_of=3, max_tokens=4, ignore_eos=True)])["req-0"]
    assert len(got) == 3
    for s in got:
        assert s.cumulative_logprob == pytest.approx(sum(-(t % 7) / 7 for t in s.output_token_ids))


# --- admission: priority, queue bounds, policies --------------------------------------------


def test_priority_orders_the_waiting_queue():
    sched, runner = make(max_seqs=1, budget=64)
    for i, priority in enumerate([5, 0, 3]):
        sched.add_request(request(i, prompt_of(i, 4), priority=priority, arrival=float(i), max_tokens=1))
    order = []
    while sched.has_work():
        step, _ = step_once(sched, runner)
        order += [r.seq.request_id for r in step.rows]
    assert order == ["req-1", "req-2", "req-0"]


def test_queue_bounds_refuse_past_the_limit():
    sched, _ = make(max_queued_requests=2, max_queued_tokens=100)
    sched.add_request(request(0, [1] * 10))
    sched.add_request(request(1, [1] * 10))
    with pytest.raises(QueueFull, match="max-queued-requests"):
        sched.add_request(request(2, [1] * 10))
    sched2, _ = make(max_queued_tokens=25)
    sched2.add_request(request(0, [1] * 20))
    with pytest.raises(QueueFull, match="max-queued-tokens"):
        sched2.add_request(request(1, [1] * 10))


@pytest.mark.parametrize("policy", ["splitfuse", "prefill_first", "orca"])
def test_every_policy_generates_the_same_tokens(policy):
    sched, runner = make(budget=64, policy=policy)
    requests = [request(i, prompt_of(i, 5 + 9 * i), max_tokens=7, ignore_eos=True) for i in range(6)]
    got = outputs(sched, runner, requests)
    for r in requests:
        assert got[r.request_id][0].output_token_ids == expected_tokens(r.prompt_token_ids, 7)


def test_policies_compose_steps_as_named():
    def first_steps(policy):
        sched, runner = make(budget=32, policy=policy)
        sched.add_request(request(0, prompt_of(0, 8), max_tokens=50, ignore_eos=True))
        step_once(sched, runner)  # request 0 is decoding now
        sched.add_request(request(1, prompt_of(1, 40), max_tokens=2))
        step, _ = step_once(sched, runner)
        return [(r.seq.request_id, r.num_tokens) for r in step.rows]

    assert first_steps("splitfuse") == [("req-0", 1), ("req-1", 31)]  # fused, split to fill
    assert first_steps("orca") == [("req-0", 1)]  # 40 tokens do not fit beside the decode
    assert first_steps("prefill_first") == [("req-1", 32)]  # alone and over budget: chunked


def test_kv_slot_accounting():
    sched, runner = make(block_size=4)
    sched.add_request(request(0, prompt_of(0, 10), max_tokens=3, ignore_eos=True))
    step_once(sched, runner)
    assert sched.kv_slots() == (12, 10)


def test_block_manager_refuses_double_free():
    blocks = BlockManager(4, 16)
    held = blocks.allocate(2)
    blocks.free(held)
    with pytest.raises(RuntimeError):
        blocks.free(held)
