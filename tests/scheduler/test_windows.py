"""Multi-step windows, step by step: when a window is planned and what it reserves, what happens
to a sequence that stops inside one, the rollback of a window the worker ends early, and the
protocol errors a result can make. An EngineCore and the fake worker
(tests/scheduler/engine_driver.py) answer one StepResult per pass."""

from __future__ import annotations

import msgspec
import pytest

from conveyor.stages.scheduler.plan import step_plan
from conveyor.stages.scheduler.scheduled_step import ScheduledStep
from conveyor.wire.messages import FinishReason, SamplingParams
from tests.scheduler.engine_driver import Driver, make, prompt_of, reference, registered_blocks_hold_their_tokens, request

# --- planning a window -----------------------------------------------------------------------


def step_through(driver: Driver) -> ScheduledStep:
    """Plan one step and apply every pass of it (no other step in flight)."""
    step = driver.plan()
    assert step is not None
    while driver.results:
        driver.apply_one()
    return step


def test_a_window_is_planned_only_when_every_row_decodes_and_nothing_waits():
    sched, runner = make(4, budget=16)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt_of(0, 5), max_tokens=50, ignore_eos=True))
    assert step_through(driver).num_steps == 1  # the prompt
    window = step_through(driver)
    assert (window.num_steps, [r.num_tokens for r in window.rows]) == (4, [4])
    assert step_plan(window).num_steps == 4 and window.num_sampled == 4 and window.num_prompt_tokens == 0
    sched.add_request(request(1, prompt_of(1, 30), max_tokens=50, ignore_eos=True))
    first = step_through(driver)  # a request waits: a single step admits it
    assert first.num_steps == 1 and [r.num_tokens for r in first.rows] == [1, 15]
    second = step_through(driver)  # nothing waits, but a prompt is under way
    assert second.num_steps == 1 and [r.num_tokens for r in second.rows] == [1, 15]
    assert step_through(driver).num_steps == 4  # both decode now
    (a, b) = (driver.seqs[0], driver.seqs[1])
    assert a.output_token_ids == reference(prompt_of(0, 5), a.params, 0, 512, False)[: a.num_output_tokens]
    assert b.output_token_ids == reference(prompt_of(1, 30), b.params, 0, 512, False)[: b.num_output_tokens]


def test_a_pending_fork_keeps_the_step_single():
    sched, runner = make(4, budget=4)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt_of(0, 5), max_tokens=50, ignore_eos=True))
    step_through(driver)
    sched.add_request(request(1, prompt_of(1, 4), n=3, max_tokens=50, ignore_eos=True))
    admitted = step_through(driver)  # 1 decode + 3 of the 4 prompt tokens: its draw is still to come
    assert [r.num_tokens for r in admitted.rows] == [1, 3]
    forking = step_through(driver)  # the prompt's last token is one uncomputed token, forks pending
    assert forking.num_steps == 1 and [len(r.forks) for r in forking.rows] == [0, 2]
    assert step_through(driver).num_steps == 4


def test_blocks_for_every_pass_are_taken_at_plan_time():
    sched, runner = make(8, block_size=4)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt_of(0, 6), max_tokens=50, ignore_eos=True))
    step_through(driver)
    (seq,) = sched.running
    held = list(seq.block_ids)  # 2 blocks: the 6 prompt tokens and the first output's slot
    step = driver.plan()
    assert step.num_steps == 8 and seq.num_computed_tokens == 6 + 8 and seq.num_pending_tokens == 8
    assert len(seq.block_ids) == 4 and step.rows[0].new_block_ids == seq.block_ids[2:] and seq.block_ids[:2] == held
    assert sched.blocks.num_used == 4  # nothing allocated while its passes come back
    while driver.results:
        driver.apply_one()
        assert sched.blocks.num_used == 4
    assert seq.num_pending_tokens == 0 and seq.num_output_tokens == 9


def test_a_short_pool_shrinks_windows_instead_of_preempting():
    # 5 blocks of 4: each sequence holds 2 (6 prompt tokens and its first output), one is free.
    sched, runner = make(8, num_blocks=5, block_size=4)
    driver = Driver(sched, runner)
    for i in range(2):
        sched.add_request(request(i, prompt_of(i, 6), max_tokens=12, ignore_eos=True))
    step_through(driver)
    window = driver.plan()
    assert [(r.seq.seq_id, r.num_tokens) for r in window.rows] == [(0, 6), (1, 2)]  # 3 blocks for 0, 2 for 1
    assert window.num_steps == 6 and sched.num_preemptions == 0 and sched.blocks.num_free == 0
    driver.run()
    assert sched.num_preemptions > 0  # later, single tokens no longer fit
    for sid, seq in driver.seqs.items():
        assert driver.seen[sid] == reference(prompt_of(sid, 6), seq.params, 0, 512, False)


def test_windows_stop_at_max_tokens_and_the_context_end():
    sched, runner = make(4, max_model_len=16)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt_of(0, 5), max_tokens=10, ignore_eos=True))  # 10 is no multiple of 4
    sched.add_request(request(1, prompt_of(1, 8), max_tokens=100, ignore_eos=True))  # 8 outputs reach 16
    driver.run()
    assert [[r.num_tokens for r in s.rows] for s in driver.steps] == [[5, 8], [4, 4], [4, 3], [1]]
    assert [len(driver.seen[sid]) for sid in (0, 1)] == [10, 8]
    assert [driver.finished[sid] for sid in (0, 1)] == [FinishReason.LENGTH] * 2


# --- a sequence that stops inside a window -------------------------------------------------


def test_draws_after_a_stop_inside_a_window_never_reach_the_client_and_its_blocks_return():
    prompt = prompt_of(0, 6)
    stop = reference(prompt, SamplingParams(max_tokens=3, ignore_eos=True), 0, 512, False)[2]  # its third output
    sched, runner = make(8, block_size=4)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt, max_tokens=50, ignore_eos=True, stop_token_ids=[stop]))
    sched.add_request(request(1, prompt_of(1, 6), max_tokens=50, ignore_eos=True))
    step_through(driver)
    step = driver.plan()
    stopping = sched.running[0]
    held = list(stopping.block_ids)
    results = list(driver.results)
    assert step.num_steps == 8 and [r.masked_draws for r in results] == [[], []] + [[0]] * 6
    driver.apply_one()
    driver.apply_one()  # pass 1 draws the stop id
    assert driver.finished[0] is FinishReason.STOP and driver.seen[0] == reference(prompt, stopping.params, 0, 512, False)
    assert stopping.block_ids == [] and all(sched.blocks.ref_count(b) == 0 for b in held)
    while driver.results:
        driver.apply_one()  # Driver.deliver fails on any update after the final one
    assert len(driver.seen[1]) == 9


def test_a_window_whose_rows_all_stopped_ends_early():
    prompt = prompt_of(0, 6)
    stop = reference(prompt, SamplingParams(max_tokens=2, ignore_eos=True), 0, 512, False)[1]
    sched, runner = make(8)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt, max_tokens=50, ignore_eos=True, stop_token_ids=[stop]))
    step_through(driver)
    driver.plan()
    results = list(driver.results)
    assert [(r.pass_index, r.last_pass) for r in results] == [(0, True)]
    driver.apply_one()
    assert driver.seen[0][-1] == stop and not sched.has_work() and sched.blocks.num_used == 0


def test_a_window_the_worker_ends_early_rolls_back_and_is_planned_again():
    # Block size 4, 7 known tokens: pass 0 computes position 6 and draws position 7, the last
    # slot of block 1, which pass 1 would compute. Pass 1 never runs, so block 1 must not be
    # named in the prefix cache until a later plan computes position 7.
    prompt = prompt_of(0, 6)
    sched, runner = make(4, block_size=4)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt, max_tokens=20, ignore_eos=True))
    step_through(driver)
    (seq,) = sched.running
    step = sched.schedule()
    (pass0,) = runner.execute_passes(step_plan(step), end_after=0)
    assert pass0.last_pass and step.num_steps == 4
    updates = sched.update(step, pass0)
    assert [u.new_token_ids for u in updates] == [pass0.sampled_token_ids]
    assert (len(seq.token_ids), seq.num_computed_tokens, seq.num_pending_tokens) == (8, 7, 0)
    assert seq.num_registered_blocks == 1 and runner.kv[seq.block_ids[1]][3] is None
    registered_blocks_hold_their_tokens(sched, runner)
    driver.seen[0] = list(seq.output_token_ids)
    again = step_through(driver)
    assert again.num_steps == 4 and again.rows[0].new_block_ids == []  # the blocks it kept
    driver.run()
    assert driver.seen[0] == reference(prompt, seq.params, 0, 512, False) and sched.blocks.num_used == 0


# --- protocol errors ----------------------------------------------------------------------


def window_in_flight():
    sched, runner = make(4)
    driver = Driver(sched, runner)
    for i in range(2):
        sched.add_request(request(i, prompt_of(i, 6), max_tokens=50, ignore_eos=True))
    step_through(driver)
    step = sched.schedule()
    return sched, step, runner.execute_passes(step_plan(step))


def test_a_masked_draw_of_a_running_sequence_is_refused():
    sched, step, results = window_in_flight()
    r = results[0]
    with pytest.raises(ValueError, match="masked"):
        sched.update(step, msgspec.structs.replace(r, masked_draws=[1]))
    assert step.num_passes_done == 0 and all(s.num_pending_tokens == 4 for s in sched.running)  # nothing applied


def test_passes_out_of_order_or_a_final_pass_not_last_are_refused():
    sched, step, results = window_in_flight()
    with pytest.raises(ValueError, match="expected pass 0"):
        sched.update(step, results[1])
    for r in results[:3]:
        sched.update(step, r)
    with pytest.raises(ValueError, match="last_pass"):
        sched.update(step, msgspec.structs.replace(results[3], last_pass=False))


def test_a_request_waiting_for_a_seat_keeps_steps_single():
    sched, runner = make(4, max_seqs=1)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt_of(0, 5), max_tokens=6, ignore_eos=True))
    step_through(driver)
    sched.add_request(request(1, prompt_of(1, 5), max_tokens=6, ignore_eos=True))  # no seat until 0 ends
    assert [step_through(driver).num_steps for _ in range(5)] == [1] * 5
    assert step_through(driver).rows[0].seq.request_id == "r1"
    assert step_through(driver).num_steps == 4
