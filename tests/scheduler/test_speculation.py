"""Speculative decoding, the scheduler's side (stages/scheduler/speculation.py): which rows get a
lookahead, the blocks and budget it takes, and runs of draws folded back in; through the fake
worker (tests/fake_worker.py), which drafts the model's own tokens for a pseudo-random count and
then a wrong one, writes every draft into the slot its table names and reads each context back
through the tables. So outputs are exact only if every reservation covers what the worker
writes (a step planned before the last one's acceptance is known included), rejected slots are
written again, and the prefix cache names only accepted tokens (engine_driver's checks after
every step)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import SchedulerConfig
from conveyor.config.speculative import SpeculativeConfig
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.stages.scheduler.sequence import SeqStatus
from conveyor.wire.messages import FinishReason, SamplingParams, ScheduleRequest, StructuredOutput
from conveyor.wire.step import StepResult
from tests.fake_worker import FakeRunner
from tests.scheduler.engine_driver import EOS_IDS, Driver, reference


def make(k: int, *, num_blocks=256, block_size=4, budget=64, max_seqs=64, max_model_len=512, disable=None, **config):
    sched = Scheduler.from_config(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, **config),
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        eos_token_ids=EOS_IDS,
        speculative=SpeculativeConfig("ngram", k, disable_by_batch_size=disable),
    )
    return sched, FakeRunner(num_blocks, block_size, EOS_IDS, max_model_len)


def prompt(i: int, length: int) -> list[int]:
    return [(i * 13 + j) % 500 + 1 for j in range(length)]


@pytest.mark.parametrize("depth", [1, 2])
def test_runs_of_accepted_drafts_give_the_exact_outputs_in_fewer_steps(depth):
    sched, runner = make(3)
    driver = Driver(sched, runner, depth=depth)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(4):
        driver.core.add_request(ScheduleRequest(f"r{i}", 0, prompt(i, 9), params, float(i)))
    driver.run()
    for seq in driver.seqs.values():
        assert seq.output_token_ids == reference(prompt(int(seq.request_id[1:]), 9), params, 0, 512, False)
        assert driver.seen[seq.seq_id] == seq.output_token_ids
    accepted = sum(a for _, a in runner.spec_rows)
    assert accepted > 0 and any(a < d for d, a in runner.spec_rows)  # drafts held, and some were rejected
    assert len(driver.steps) < 40 and sched.blocks.num_used == 0


def test_a_lookahead_is_charged_to_the_budget_and_its_slots_reserved():
    sched, _ = make(4, block_size=4, budget=64)
    sched.add_request(ScheduleRequest("a", 0, prompt(0, 6), SamplingParams(max_tokens=50), 0.0))
    step = sched.schedule()  # the prompt: no lookahead
    assert step.rows[0].lookahead == 0
    (seq,) = sched.running
    sched.update(step, StepResult(step.step, [7], seq_ids=[seq.seq_id]))
    step = sched.schedule()
    (row,) = step.rows
    assert (row.num_tokens, row.lookahead, step.num_tokens) == (1, 4, 5)
    # Its token and 4 drafts: positions 6 .. 10, so 11 slots, 3 blocks of 4.
    assert len(seq.block_ids) == 3 and seq.num_pending_lookahead == 4
    # Planned again before that result (asynchronous scheduling): the worker may be 4 ahead.
    step2 = sched.schedule()
    assert step2.rows[0].lookahead == 4
    assert len(seq.block_ids) * 4 >= seq.num_computed_tokens + 4 + 4 and seq.num_pending_lookahead == 8
    # Step 1 kept 2 drafts and a token: a run of 3 draws, one update.
    (update,) = sched.update(step, StepResult(step.step, [8, 9, 11], seq_ids=[seq.seq_id] * 3))
    assert update.new_token_ids == [8, 9, 11] and seq.num_pending_lookahead == 4
    # Known: the prompt, 7, the run; computed: all but the run's last, which step 2 computes; its draw pending.
    assert (seq.num_computed_tokens, seq.num_tokens) == (10, 11)


def test_too_long_or_split_runs_are_refused():
    sched, _ = make(2)
    for name in ("a", "b"):
        sched.add_request(ScheduleRequest(name, 0, prompt(1, 6), SamplingParams(max_tokens=50), 0.0))
    step = sched.schedule()
    a, b = (row.seq.seq_id for row in step.rows)
    sched.update(step, StepResult(step.step, [3, 4], seq_ids=[a, b]))
    step = sched.schedule()
    with pytest.raises(ValueError, match="longer than its row's lookahead"):
        step.take_pass(StepResult(step.step, [1, 2, 3, 4, 5], seq_ids=[a, a, a, a, b]))
    with pytest.raises(ValueError, match="draws for sequences"):
        step.take_pass(StepResult(step.step, [1, 2, 3], seq_ids=[a, b, a]))


def test_which_rows_speculate():
    sched, _ = make(3, disable=2)
    schema = StructuredOutput("json_object")
    for name, params in [("plain", SamplingParams(max_tokens=50)), ("json", SamplingParams(max_tokens=50, structured=schema))]:
        sched.add_request(ScheduleRequest(name, 0, prompt(2, 5), params, 0.0))
    sched.add_request(ScheduleRequest("short", 0, prompt(3, 5), SamplingParams(max_tokens=3), 0.0))  # 2 left after its first
    step = sched.schedule()
    sched.update(step, StepResult(step.step, [5, 6, 7], seq_ids=[r.seq.seq_id for r in step.rows]))
    # Three running, past disable_by_batch_size 2: nobody speculates.
    assert [r.lookahead for r in sched.schedule().rows] == [0, 0, 0]
    sched, _ = make(3)
    for name, params in [("plain", SamplingParams(max_tokens=50)), ("json", SamplingParams(max_tokens=50, structured=schema))]:
        sched.add_request(ScheduleRequest(name, 0, prompt(2, 5), params, 0.0))
    sched.add_request(ScheduleRequest("short", 0, prompt(3, 5), SamplingParams(max_tokens=3), 0.0))
    step = sched.schedule()
    sched.update(step, StepResult(step.step, [5, 6, 7], seq_ids=[r.seq.seq_id for r in step.rows]))
    # A grammar's row too (the worker cuts its drafts); the short one only as far as its max_tokens
    # lets it: 1 more after this one.
    assert {r.seq.request_id: r.lookahead for r in sched.schedule().rows} == {"plain": 3, "json": 3, "short": 1}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # (prompt length, max_tokens, n, arrival tick, aborted 3 ticks after)
    reqs=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 16), st.integers(1, 2), st.integers(0, 5), st.booleans()), min_size=1, max_size=10
    ),
    k=st.integers(1, 5),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(10, 80),
    budget=st.integers(8, 64),
    max_seqs=st.integers(1, 12),
    disable=st.sampled_from([None, 1, 3]),
    depth=st.sampled_from([1, 2]),
    eos=st.booleans(),
)
def test_random_streams_with_speculation_keep_every_invariant(reqs, k, block_size, num_blocks, budget, max_seqs, disable, depth, eos):
    sched, runner = make(
        k, num_blocks=num_blocks, block_size=block_size, budget=budget, max_seqs=max_seqs, max_model_len=128, disable=disable
    )
    driver = Driver(sched, runner, depth=depth)
    prompts = {f"r{i}": prompt(i, length) for i, (length, *_) in enumerate(reqs)}
    for tick in range(5000):
        for i, (_, max_tokens, n, arrival, abort) in enumerate(reqs):
            if arrival == tick:
                params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=not eos)
                driver.core.add_request(ScheduleRequest(f"r{i}", 0, prompts[f"r{i}"], params, float(arrival)))
            if abort and tick == arrival + 3:
                driver.core.abort([f"r{i}"])
        if tick > 5 and not sched.has_work() and not driver.results:
            break
        driver.tick()  # the pool's books, and registered blocks holding their tokens, after every step
    else:
        raise AssertionError("requests never finished")
    driver.deliver([])
    assert sched.blocks.num_used == 0
    for seq in driver.seqs.values():
        assert seq.status is SeqStatus.FINISHED
        length, max_tokens, n, _, abort = reqs[int(seq.request_id[1:])]
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=not eos)
        expected = reference(prompts[seq.request_id], params, seq.index, 128, False)
        if seq.finish_reason in (FinishReason.ABORT, FinishReason.LENGTH):
            assert seq.output_token_ids == expected[: seq.num_output_tokens]
            assert abort or seq.finish_reason is FinishReason.LENGTH
        else:
            assert seq.output_token_ids == expected
        assert driver.seen[seq.seq_id] == seq.output_token_ids
