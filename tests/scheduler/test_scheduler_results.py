"""The scheduler's answers to what the sampler and the detokenizer report: stop ids deferred by
min_tokens, stop strings, top logprobs, draws whose logits were not finite, and the requests of a
dead stage; through the fake worker as in test_scheduler.py."""

from __future__ import annotations

import msgspec
import pytest

from conveyor.stages.scheduler.plan import step_plan
from conveyor.wire.messages import FinishReason
from tests.fake_worker import expected_tokens
from tests.scheduler.test_scheduler import drive, make, outputs, prompt_of, request, seq, step_once

# --- what the detokenizer and the sampler ask for -------------------------------------------


def test_min_tokens_defers_stop_ids():
    sched, runner = make()
    prompt = prompt_of(9, 6)
    stop = expected_tokens(prompt, 1)[0]  # the first token it will generate
    got = outputs(sched, runner, [request(0, prompt, max_tokens=5, min_tokens=3, stop_token_ids=[stop])])
    out = got["req-0"][0].output_token_ids
    assert out[0] == stop and len(out) >= 3


def test_a_stop_string_finish_from_the_detokenizer_ends_the_sequence():
    sched, runner = make()
    sched.add_request(request(0, prompt_of(1, 5), max_tokens=50, ignore_eos=True))
    step_once(sched, runner)
    (seq,) = sched.running
    sched.finish_seqs([seq.seq_id])
    assert seq.finish_reason is FinishReason.STOP and not sched.has_work()
    assert sched.blocks.num_used == 0
    assert sched.take_unsampled_updates() == []  # the detokenizer already told the client


def test_top_logprobs_reach_the_update_of_sequences_that_asked():
    from conveyor.wire.step import StepResult, TopLogprobs

    sched, runner = make()
    sched.add_request(request(0, prompt_of(1, 5), max_tokens=1, logprobs=2))
    sched.add_request(request(1, prompt_of(2, 5), max_tokens=1))
    step = sched.schedule()
    (a, b) = (row.seq.seq_id for row in step.rows)
    # Keyed by sequence, in any order: b's draw first. Top logprobs go with every draw once any
    # sequence asked (empty entries for the others).
    tops = [TopLogprobs([], []), TopLogprobs([5, 9], [-0.5, -1.5])]
    updates = sched.update(step, StepResult(step.step, [6, 5], sampled_logprobs=[-0.25, -0.5], top_logprobs=tops, seq_ids=[b, a]))
    by_request = {u.seq.request_id: u for u in updates}
    assert by_request["req-0"].logprobs[0].top_token_ids == [5, 9]
    assert by_request["req-0"].logprobs[0].logprob == -0.5
    assert by_request["req-1"].logprobs == []


# --- draws whose logits were not finite -----------------------------------------------------


def test_a_failed_draw_ends_its_sequence_with_error_and_frees_its_blocks():
    sched, runner = make()
    a, bad, c = (seq(i, 9, max_tokens=6, ignore_eos=True) for i in range(3))
    for s in (a, bad, c):
        sched.add(s)
    step = sched.schedule()
    result = runner.execute(step_plan(step))
    held_by_bad = list(bad.block_ids)
    updates = sched.update(step, msgspec.structs.replace(result, failed_draws=[1]))
    by_seq = {u.seq.seq_id: u for u in updates}
    assert (by_seq[1].new_token_ids, by_seq[1].finish_reason) == ([], FinishReason.ERROR)
    assert bad.finish_reason is FinishReason.ERROR and bad.output_token_ids == [] and bad.block_ids == []
    assert all(sched.blocks.ref_count(b) == 0 for b in held_by_bad)
    assert [len(by_seq[s].new_token_ids) for s in (0, 2)] == [1, 1]
    step = sched.schedule()
    assert step.finished_seq_ids == [1]  # the worker forgets it with the next plan
    result = runner.execute(step_plan(step))
    sched.update(step, result)
    drive(sched, runner)
    for s in (a, c):
        assert s.output_token_ids == expected_tokens(prompt_of(s.seq_id, 9), 6)
    assert sched.blocks.num_used == 0 and "req-1" not in sched.by_request


def test_a_failed_fork_ends_alone_and_a_lookahead_draw_is_dropped():
    sched, runner = make()
    sched.add_request(request(0, prompt_of(0, 6), n=3, max_tokens=5, ignore_eos=True))
    first = sched.schedule()  # prompt + the first draw of each of the three samples
    second = sched.schedule()  # planned before the first's ids are back: asynchronous scheduling
    r1, r2 = runner.execute(step_plan(first)), runner.execute(step_plan(second))
    updates = sched.update(first, msgspec.structs.replace(r1, failed_draws=[2]))  # sample 2
    failed = [u.seq for u in updates if u.finish_reason is FinishReason.ERROR]
    assert [s.index for s in failed] == [2]
    later = sched.update(second, msgspec.structs.replace(r2, failed_draws=[0, 1, 2]))
    assert failed[0] not in [u.seq for u in later]  # its lookahead draw is dropped, not failed twice
    assert {u.seq.index for u in later if u.finish_reason is FinishReason.ERROR} == {0, 1}
    assert sched.blocks.num_used == 0 and not sched.has_work()


def test_failed_draws_outside_the_step_are_refused():
    sched, runner = make()
    sched.add(seq(0, 4))
    step = sched.schedule()
    result = runner.execute(step_plan(step))
    with pytest.raises(ValueError, match="failed draws"):
        sched.update(step, msgspec.structs.replace(result, failed_draws=[1]))


def test_drop_requests_frees_what_a_dead_stage_held_and_nothing_else():
    """A detokenizer (or ingress) process died: its requests go, running or waiting, samples and
    all; nothing is reported to a detokenizer, and the others finish exactly."""
    sched, runner = make(budget=16)
    for i in range(6):
        sched.add_request(request(i, prompt_of(i, 10), max_tokens=6, n=2, temperature=1.0, seed=i), detokenizer=i % 2)
    step_once(sched, runner)  # some running, some still waiting
    used_before = sched.blocks.num_used
    dropped = sched.drop_requests(lambda s: s.detokenizer == 1)
    assert sorted(s.request_id for s in dropped) == ["req-1", "req-3", "req-5"]
    assert sched.take_unsampled_updates() == []
    assert sorted(sched.by_request) == ["req-0", "req-2", "req-4"]
    assert all(s.detokenizer == 0 for s in sched.running) and len(sched.waiting) <= 3
    assert sched.blocks.num_used <= used_before
    drive(sched, runner)
    assert sched.blocks.num_used == 0 and not sched.by_request
