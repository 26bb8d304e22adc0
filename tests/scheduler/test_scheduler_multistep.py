"""Multi-step windows (num_scheduler_steps = K > 1), driven through the StepPlan protocol by the
fake worker (tests/fake_worker.py), which runs a window pass by pass through its simulated KV
and answers one StepResult per pass: outputs are only right if every pass's block table, input
token and masking is. Checked here: K = 1, 4 and 8 generate the same tokens over random
workloads; when a window is planned and what it reserves; what happens to a sequence that
stops inside a window; the rollback of a window the worker ends early; protocol errors."""

from __future__ import annotations

import dataclasses
import shutil
from collections import deque

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.main import SchedulerStage
from conveyor.stages.scheduler.plan import step_plan
from conveyor.stages.scheduler.scheduled_step import ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.stages.scheduler.sequence import SeqStatus
from conveyor.wire.addresses import make_run_dir
from conveyor.wire.messages import (
    EngineStarted,
    FinishReason,
    SamplingParams,
    ScheduleRequest,
    StepPlan,
    TokenBatch,
    WorkerReady,
)
from conveyor.wire.topology import DETOKENIZER, INGRESS, SCHEDULER, WORKER, receiver, sender
from tests.fake_worker import FakeRunner, next_token
from tests.ingress_fakes import make_config
from tests.scheduler.test_scheduler_properties import check_invariants

EOS_IDS = tuple(range(0, 1000, 10))  # one fake-model token in ten ends a sequence that allows it
STOP_IDS = list(range(3, 1000, 25))
DETOK_STOP = 53  # a token t with t % DETOK_STOP == 7 stands for a stop string the detokenizer matches


def detok_stops(token: int) -> bool:
    return token % DETOK_STOP == 7


def make(k: int, num_blocks=256, block_size=4, budget=32, max_seqs=64, max_model_len=512, **config):
    sched = Scheduler.from_config(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, num_scheduler_steps=k, **config),
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        eos_token_ids=EOS_IDS,
    )
    return sched, FakeRunner(num_blocks, block_size, EOS_IDS)


def request(i: int, prompt: list[int], **params) -> ScheduleRequest:
    return ScheduleRequest(f"r{i}", 0, prompt, SamplingParams(**params), float(i))


def prompt_of(i: int, length: int) -> list[int]:
    return [(i * 7 + j) % 900 + 1 for j in range(length)]


def reference(prompt: list[int], params: SamplingParams, index: int, max_model_len: int, stop_strings: bool) -> list[int]:
    """What sample `index` must generate: the fake model's tokens (the first salted by the
    index) up to max_tokens, the model's length, a stop id (EOS, stop_token_ids, once min_tokens
    exist; kept), or a simulated stop string (kept)."""
    assert params.max_tokens is not None
    tokens = list(prompt)
    for i in range(params.max_tokens):
        token = next_token(tokens, index if i == 0 else 0)
        tokens.append(token)
        may_stop = len(tokens) - len(prompt) >= params.min_tokens
        if may_stop and ((token in EOS_IDS and not params.ignore_eos) or token in params.stop_token_ids):
            break
        if len(tokens) >= max_model_len or (stop_strings and detok_stops(token)):
            break
    return tokens[len(prompt) :]


def registered_blocks_hold_their_tokens(sched: Scheduler, runner: FakeRunner) -> None:
    """Every block a running sequence offered to the prefix cache holds, in the worker's KV, the
    tokens its name covers: registration never runs ahead of the passes that really ran."""
    bs = sched.blocks.block_size
    for seq in sched.running:
        for i in range(seq.num_registered_blocks):
            assert runner.kv[seq.block_ids[i]] == seq.token_ids[i * bs : (i + 1) * bs], f"{seq} block {i}"


class Driver:
    """The scheduler stage's loop, in process: plans go to the fake worker in order, each pass's
    result is applied on its own, `depth` plans in flight (2: asynchronous scheduling, the next
    plan sent while a window runs). Collects what clients would see, per sequence."""

    def __init__(self, sched: Scheduler, runner: FakeRunner, depth: int = 1, stop_strings: frozenset[str] = frozenset()):
        self.sched, self.runner, self.depth = sched, runner, depth
        self.stop_strings = stop_strings  # request ids whose stop "string" the detokenizer matches
        self.in_flight: deque[tuple[ScheduledStep, deque]] = deque()
        self.seen: dict[int, list[int]] = {}  # seq_id -> tokens streamed to its client
        self.finished: dict[int, FinishReason] = {}
        self.seqs: dict = {}
        self.steps: list[ScheduledStep] = []

    def plan(self) -> ScheduledStep | None:
        step = self.sched.schedule()
        if step is not None:
            assert step.num_tokens == sum(1 if step.num_steps > 1 else r.num_tokens for r in step.rows)
            assert step.num_tokens <= self.sched.config.max_num_batched_tokens
            results = self.runner.execute_passes(step_plan(step))
            self.steps.append(step)
            if step.rows:
                self.in_flight.append((step, deque(results)))
        return step

    def apply_one(self) -> None:
        step, results = self.in_flight[0]
        r = results.popleft()
        if r.last_pass:
            assert not results
            self.in_flight.popleft()
        updates = self.sched.update(step, r)
        self.deliver(updates)

    def deliver(self, updates: list[SeqUpdate]) -> None:
        for u in updates + self.sched.take_unsampled_updates():
            sid = u.seq.seq_id
            assert sid not in self.finished, f"an update for seq {sid} after its final one"
            self.seqs[sid] = u.seq
            self.seen.setdefault(sid, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                self.finished[sid] = u.finish_reason
            elif u.seq.request_id in self.stop_strings and any(detok_stops(t) for t in u.new_token_ids):
                self.sched.finish_seqs([sid])  # the detokenizer already ended the client's stream
                self.finished[sid] = FinishReason.STOP

    def tick(self) -> None:
        step = self.plan() if len(self.in_flight) < self.depth else None
        if self.in_flight and (len(self.in_flight) >= self.depth or step is None):
            self.apply_one()
        else:
            self.deliver([])
        check_invariants(self.sched)
        registered_blocks_hold_their_tokens(self.sched, self.runner)

    def run(self, max_ticks: int = 20_000) -> None:
        for _ in range(max_ticks):
            if not self.sched.has_work() and not self.in_flight:
                return
            self.tick()
        raise AssertionError("did not finish")


# --- the same tokens whatever K ------------------------------------------------------------

workload = st.lists(
    st.tuples(
        st.integers(0, 2),  # which shared prefix (exercises the prefix cache)
        st.integers(1, 40),  # own prompt tokens after it
        st.integers(1, 30),  # max_tokens
        st.integers(1, 3),  # n
        st.integers(0, 8),  # arrival tick
        st.sampled_from([None, 2, 7]),  # aborted this many ticks after arrival (None: never)
        st.integers(0, 3),  # min_tokens
        st.booleans(),  # ignore_eos
        st.booleans(),  # stop_token_ids
        st.booleans(),  # a stop string the detokenizer matches
    ),
    min_size=1,
    max_size=10,
)


def run_workload(k, reqs, block_size, num_blocks, budget, max_model_len, depth, caching):
    sched, runner = make(k, num_blocks, block_size, budget, max_model_len=max_model_len, enable_prefix_caching=caching)
    prefixes = [[(p * 31 + j) % 500 for j in range(n)] for p, n in enumerate((0, 9, 20))]
    stop_strings = frozenset(f"r{i}" for i, r in enumerate(reqs) if r[9])
    driver = Driver(sched, runner, depth, stop_strings)
    arrivals = {}
    for i, (pre, own, max_tokens, n, arrival, abort, min_tokens, ignore_eos, stop_ids, _) in enumerate(reqs):
        prompt = prefixes[pre] + [(i * 13 + j) % 500 + 1 for j in range(own)]
        params = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos,
                                stop_token_ids=STOP_IDS if stop_ids else [], temperature=0.0)  # fmt: skip
        arrivals.setdefault(arrival, []).append(ScheduleRequest(f"r{i}", 0, prompt, params, float(arrival)))
        if abort is not None:
            arrivals.setdefault(arrival + abort, []).append(f"r{i}")
    for tick in range(20_000):
        for item in arrivals.pop(tick, []):
            if isinstance(item, str):
                sched.abort(item)
            else:
                sched.add_request(item)
        if not arrivals and not sched.has_work() and not driver.in_flight:
            break
        driver.tick()
    else:
        raise AssertionError("did not finish")
    driver.deliver([])  # the last aborts' reports
    assert sched.blocks.num_used == 0 and not sched.by_request
    return driver


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=workload,
    block_size=st.sampled_from([1, 4, 16]),
    extra_blocks=st.integers(2, 30),  # past what one sequence needs: preemption, never "too big"
    budget=st.integers(4, 64),
    max_model_len=st.sampled_from([64, 512]),
    depth=st.sampled_from([1, 2]),
    caching=st.booleans(),
)
def test_windows_generate_the_tokens_single_steps_do(reqs, block_size, extra_blocks, budget, max_model_len, depth, caching):
    longest = 20 + 40 + 30
    num_blocks = -(-longest // block_size) + extra_blocks
    got = {}
    for k in (1, 4, 8):
        driver = run_workload(k, reqs, block_size, num_blocks, budget, max_model_len, depth, caching)
        for sid, seq in driver.seqs.items():
            i = int(seq.request_id[1:])
            expected = reference(seq.token_ids[: seq.num_prompt_tokens], seq.params, seq.index, max_model_len, reqs[i][9])
            seen = driver.seen[sid]
            assert seq.status is SeqStatus.FINISHED and sid in driver.finished
            assert seen == seq.output_token_ids, "a stale draw reached the client, or one was lost"
            if driver.finished[sid] is FinishReason.ABORT:
                assert reqs[i][5] is not None and seen == expected[: len(seen)]
            else:
                assert seen == expected, f"K={k} {seq}"
        # Aborts land at different points of the output under different K: compared above only.
        got[k] = {(s.request_id, s.index): driver.seen[sid] for sid, s in driver.seqs.items()
                  if reqs[int(s.request_id[1:])][5] is None}  # fmt: skip
        never_aborted = {(f"r{i}", j) for i, r in enumerate(reqs) if r[5] is None for j in range(r[3])}
        assert got[k].keys() == never_aborted, "a request never finished"
    assert got[1] == got[4] == got[8]


def test_a_fixed_workload_plans_windows_preempts_and_matches_single_steps():
    """The random test above, pinned: windows are really planned (and preemption happens) in a
    workload whose outputs K = 1 and K = 8 agree on."""
    reqs = [(i % 3, 5 + 4 * i, 20 + 3 * i, 1 + (i % 3 == 1), i % 2, None, i % 2, i % 3 != 0, i % 4 == 1, i % 5 == 2)
            for i in range(8)]  # fmt: skip
    single = run_workload(1, reqs, 4, 50, 32, 512, 2, True)
    multi = run_workload(8, reqs, 4, 50, 32, 512, 2, True)
    assert sum(s.num_steps > 1 for s in multi.steps) >= 5 and multi.sched.num_preemptions > 0
    assert len(multi.steps) < len(single.steps)
    outputs = [{(s.request_id, s.index): d.seen[sid] for sid, s in d.seqs.items()} for d in (single, multi)]
    assert outputs[0] == outputs[1]


# --- planning a window -----------------------------------------------------------------------


def step_through(driver: Driver) -> ScheduledStep:
    """Plan one step and apply every pass of it (no other step in flight)."""
    step = driver.plan()
    assert step is not None
    while driver.in_flight:
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
    while driver.in_flight:
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
    _, results = driver.in_flight[0]
    assert step.num_steps == 8 and [r.masked_draws for r in results] == [[], []] + [[0]] * 6
    driver.apply_one()
    driver.apply_one()  # pass 1 draws the stop id
    assert driver.finished[0] is FinishReason.STOP and driver.seen[0] == reference(prompt, stopping.params, 0, 512, False)
    assert stopping.block_ids == [] and all(sched.blocks.ref_count(b) == 0 for b in held)
    while driver.in_flight:
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
    _, results = driver.in_flight[0]
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


# --- the scheduler stage -------------------------------------------------------------------


@pytest.fixture
def stage_with_windows(tmp_path):
    run_dir = make_run_dir()
    config = make_config(tmp_path, run_dir)
    config = dataclasses.replace(config, scheduler=SchedulerConfig(num_scheduler_steps=4))
    ctx = zmq.Context()
    worker, detok = receiver(ctx, config, WORKER), receiver(ctx, config, DETOKENIZER)
    ingress = receiver(ctx, config, INGRESS)  # bound so replies have somewhere to go
    stage = SchedulerStage(config, ctx)
    sender(ctx, config, SCHEDULER).send(WorkerReady(rank=0, num_kv_blocks=64))
    stage.start()
    worker.recv(timeout_ms=5000)  # InitializeCache
    assert isinstance(detok.recv(timeout_ms=5000), EngineStarted)  # before any TokenBatch
    yield stage, worker, detok
    for r in (worker, detok, ingress):
        r.close()
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_the_stage_keeps_a_window_in_flight_to_its_last_pass_and_streams_every_pass(stage_with_windows):
    stage, worker, detok = stage_with_windows
    runner = FakeRunner(64, stage.config.cache.block_size)
    stage.handle(ScheduleRequest("r0", 0, prompt_of(0, 6), SamplingParams(max_tokens=20, ignore_eos=True), 0.0))

    def plan() -> StepPlan:
        stage.plan_next()
        sent = worker.recv(timeout_ms=5000)
        assert isinstance(sent, StepPlan)
        return sent

    def result_in(result) -> list[int]:
        """The stage's loop body for one result: apply it, and the tokens it streams."""
        stage.emit(stage.handle(result) + stage.scheduler.take_unsampled_updates())
        batch = detok.recv(timeout_ms=5000)
        assert isinstance(batch, TokenBatch)
        return [t for u in batch.updates for t in u.token_ids]

    (first,) = runner.execute_passes(plan())
    assert result_in(first) == first.sampled_token_ids
    window = plan()
    assert window.num_steps == 4
    ahead = plan()  # asynchronous scheduling: the next plan goes out while the window runs
    assert ahead.num_steps == 4 and len(stage.core.in_flight) == 2 and not stage.may_plan()
    results = runner.execute_passes(window)
    for r in results:
        assert stage.core.in_flight[0].step == window.step
        assert result_in(r) == r.sampled_token_ids  # each pass streams on its own
    assert [s.step for s in stage.core.in_flight] == [ahead.step] and stage.may_plan()


def test_a_request_waiting_for_a_seat_keeps_steps_single():
    sched, runner = make(4, max_seqs=1)
    driver = Driver(sched, runner)
    sched.add_request(request(0, prompt_of(0, 5), max_tokens=6, ignore_eos=True))
    step_through(driver)
    sched.add_request(request(1, prompt_of(1, 5), max_tokens=6, ignore_eos=True))  # no seat until 0 ends
    assert [step_through(driver).num_steps for _ in range(5)] == [1] * 5
    assert step_through(driver).rows[0].seq.request_id == "r1"
    assert step_through(driver).num_steps == 4
