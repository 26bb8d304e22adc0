"""Multi-step windows (num_scheduler_steps = K > 1) generate exactly the tokens single steps do:
random workloads (shared prefixes, parallel samples, aborts, stop ids and simulated stop strings,
tight pools) through an EngineCore and the fake worker, which runs a window pass by pass through
its simulated KV (tests/scheduler/engine_driver.py), at K = 1, 4 and 8."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.stages.scheduler.sequence import SeqStatus
from conveyor.wire.messages import FinishReason, SamplingParams, ScheduleRequest
from tests.scheduler.engine_driver import STOP_IDS, Driver, make, reference

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
        params = SamplingParams(
            n=n,
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop_token_ids=STOP_IDS if stop_ids else [],
            temperature=0.0,
        )
        arrivals.setdefault(arrival, []).append(ScheduleRequest(f"r{i}", 0, prompt, params, float(arrival)))
        if abort is not None:
            arrivals.setdefault(arrival + abort, []).append(f"r{i}")
    for tick in range(20_000):
        for item in arrivals.pop(tick, []):
            if isinstance(item, str):
                driver.core.abort([item])
            else:
                driver.core.add_request(item)
        if not arrivals and not sched.has_work() and not driver.results:
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
        got[k] = {
            (s.request_id, s.index): driver.seen[sid] for sid, s in driver.seqs.items() if reqs[int(s.request_id[1:])][5] is None
        }
        never_aborted = {(f"r{i}", j) for i, r in enumerate(reqs) if r[5] is None for j in range(r[3])}
        assert got[k].keys() == never_aborted, "a request never finished"
    assert got[1] == got[4] == got[8]


def test_a_fixed_workload_plans_windows_preempts_and_matches_single_steps():
    """The random test above, pinned: windows are really planned (and preemption happens) in a
    workload whose outputs K = 1 and K = 8 agree on."""
    reqs = [(i % 3, 5 + 4 * i, 20 + 3 * i, 1 + (i % 3 == 1), i % 2, None, i % 2, i % 3 != 0, i % 4 == 1, i % 5 == 2) for i in range(8)]
    single = run_workload(1, reqs, 4, 50, 32, 512, 2, True)
    multi = run_workload(8, reqs, 4, 50, 32, 512, 2, True)
    assert sum(s.num_steps > 1 for s in multi.steps) >= 5 and multi.sched.num_preemptions > 0
    assert len(multi.steps) < len(single.steps)
    outputs = [{(s.request_id, s.index): d.seen[sid] for sid, s in d.seqs.items()} for d in (single, multi)]
    assert outputs[0] == outputs[1]
