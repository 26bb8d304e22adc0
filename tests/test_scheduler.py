"""The scheduler and block pool, driven through the real StepPlan protocol by a checking fake."""

from __future__ import annotations

import pytest

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.block_pool import BlockPool
from conveyor.stages.scheduler.plan import step_plan
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.stages.scheduler.sequence import Sequence
from conveyor.wire.messages import FinishReason, SamplingParams
from tests.fake_worker import FakeRunner, next_token

EOS = 999


def make(num_blocks=256, block_size=4, budget=32, max_seqs=64, max_model_len=512):
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        BlockPool(num_blocks, block_size),
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
    )
    return sched, FakeRunner(num_blocks, block_size)


def seq(i, prompt_len, max_tokens=8, **params):
    prompt = [(i * 7 + j) % 900 + 1 for j in range(prompt_len)]
    return Sequence(i, f"req-{i}", prompt, SamplingParams(max_tokens=max_tokens, **params))


def drive(sched, runner, max_steps=10_000):
    """Run to completion; returns the steps taken and checks the budget at every step."""
    steps = []
    while sched.has_work():
        step = sched.schedule()
        assert len(steps) < max_steps
        if step is None:  # e.g. a sequence finished while planning
            steps.append(step)
            continue
        assert step.num_tokens == sum(n for _, n in step.rows) <= sched.config.max_num_batched_tokens
        assert len(step.rows) <= sched.config.max_num_seqs
        result = runner.execute(step_plan(step))
        sched.update(step, result.sampled_token_ids)
        steps.append(step)
    return [s for s in steps if s is not None]


def expected_output(s: Sequence, max_tokens: int) -> list[int]:
    tokens = list(s.token_ids[: s.num_prompt_tokens])
    for _ in range(max_tokens):
        t = next_token(tokens, 1000)
        tokens.append(t)
        if t == EOS:
            break
    return tokens[s.num_prompt_tokens :]


def test_outputs_are_exact_and_blocks_return():
    sched, runner = make()
    seqs = [seq(i, 3 + 5 * i, max_tokens=6) for i in range(10)]
    for s in seqs:
        sched.add(s)
    drive(sched, runner)
    for s in seqs:
        assert s.output_token_ids == expected_output(s, 6)
        assert s.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert sched.blocks.num_used == 0


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched, runner = make(budget=16)
    short = seq(0, 4, max_tokens=20)
    sched.add(short)
    drive_steps = 0
    while short.num_output_tokens < 2:  # short is decoding
        step = sched.schedule()
        sched.update(step, runner.execute(step_plan(step)).sampled_token_ids)
        drive_steps += 1
    long = seq(1, 50, max_tokens=3)
    sched.add(long)
    step = sched.schedule()
    assert step.rows[0] == (short, 1), "the running decode comes first"
    assert step.rows[1] == (long, 15), "the prompt fills the rest of the budget exactly"
    sched.update(step, runner.execute(step_plan(step)).sampled_token_ids)
    drive(sched, runner)
    assert long.output_token_ids == expected_output(long, 3)
    assert short.output_token_ids == expected_output(short, 20)


def test_max_num_seqs_caps_the_batch():
    sched, runner = make(max_seqs=3, budget=64)
    for i in range(8):
        sched.add(seq(i, 5))
    steps = drive(sched, runner)
    assert max(len(s.rows) for s in steps) == 3


def test_preemption_under_a_tiny_pool_loses_nothing():
    # 20 sequences needing up to 10 blocks each, in a pool of 24: preemption is unavoidable.
    sched, runner = make(num_blocks=24, block_size=4, budget=24)
    seqs = [seq(i, 10 + i, max_tokens=20, ignore_eos=True) for i in range(20)]
    for s in seqs:
        sched.add(s)
    drive(sched, runner)
    assert sched.num_preemptions > 0
    for s in seqs:
        assert s.num_output_tokens == 20
        tokens = list(s.token_ids[: s.num_prompt_tokens])
        for _ in range(20):
            tokens.append(next_token(tokens, 1000))
        assert s.output_token_ids == tokens[s.num_prompt_tokens :]
    assert sched.blocks.num_used == 0


def test_stop_conditions():
    sched, runner = make(max_model_len=20)
    by_len = seq(0, 5, max_tokens=3, ignore_eos=True)
    by_ctx = seq(1, 15, max_tokens=100, ignore_eos=True)
    first = next_token(seq(2, 5).token_ids, 1000)
    by_stop_id = seq(2, 5, max_tokens=50, stop_token_ids=[first])
    for s in (by_len, by_ctx, by_stop_id):
        sched.add(s)
    drive(sched, runner)
    assert (by_len.num_output_tokens, by_len.finish_reason) == (3, FinishReason.LENGTH)
    assert (by_ctx.num_tokens, by_ctx.finish_reason) == (20, FinishReason.LENGTH)
    assert (by_stop_id.output_token_ids, by_stop_id.finish_reason) == ([first], FinishReason.STOP)


def test_abort_frees_blocks_and_reports_once():
    sched, runner = make()
    a, b = seq(0, 30, max_tokens=50), seq(1, 30, max_tokens=50)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.abort("req-0")  # while its step is in flight
    updates = sched.update(step, runner.execute(step_plan(step)).sampled_token_ids)
    assert [(u.seq, u.finish_reason) for u in updates if u.seq is a] == [(a, FinishReason.ABORT)]
    assert a.block_ids == []
    drive(sched, runner)
    assert b.num_output_tokens == 50 or b.finish_reason is FinishReason.STOP
    assert sched.blocks.num_used == 0


def test_abort_that_overtakes_its_request():
    sched, _ = make()
    sched.abort("req-0")
    sched.add(seq(0, 5))
    assert not sched.has_work()


def test_a_sequence_too_big_for_the_pool_finishes_instead_of_hanging():
    sched, runner = make(num_blocks=4, block_size=4)
    big = seq(0, 40)
    sched.add(big)
    drive(sched, runner)
    assert big.finish_reason is FinishReason.LENGTH


def test_block_pool_refuses_double_free():
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)
