"""Property-based tests: random request streams (shared prefixes, parallel samples, aborts,
tight pools, every policy) against the scheduler's invariants, checked after every step:
- reference counts equal the number of sequences holding each block; nothing leaks or is freed
  twice (the block manager raises on a double free), and the pool is empty at the end;
- no step exceeds the token budget;
- every admitted request finishes, and every sample's tokens are exactly the fake model's,
  up to its max_tokens or its first EOS;
and all of it with asynchronous scheduling too (`lookahead`: step n+1 is planned and executed
before step n's ids reach the scheduler, as the scheduler stage runs it).
"""

from __future__ import annotations

from collections import Counter, deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.plan import step_plan
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.stages.scheduler.sequence import SeqStatus
from conveyor.wire.messages import FinishReason, SamplingParams, ScheduleRequest
from tests.fake_worker import FakeRunner, next_token

EOS_IDS = tuple(range(0, 1000, 10))  # one fake-model token in ten ends a sequence that allows it

requests_strategy = st.lists(
    st.tuples(
        st.integers(0, 2),  # which shared prefix (exercises the prefix cache)
        st.integers(1, 40),  # own prompt tokens after it
        st.integers(1, 12),  # max_tokens
        st.integers(1, 3),  # n
        st.integers(0, 6),  # arrival step
        st.booleans(),  # aborted a few steps after arrival
        st.integers(0, 2),  # priority
    ),
    min_size=1,
    max_size=14,
)


def check_invariants(sched: Scheduler) -> None:
    holders = Counter(b for s in sched.running for b in s.block_ids)
    for block in range(sched.blocks.num_blocks):
        assert sched.blocks.ref_count(block) == holders[block], f"block {block}"
    assert sched.blocks.num_used == len(holders)
    for s in sched.running:
        assert len(s.block_ids) * sched.blocks.block_size >= s.num_computed_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests_strategy,
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(12, 80),
    budget=st.integers(8, 64),
    max_seqs=st.integers(1, 16),
    policy=st.sampled_from(["splitfuse", "prefill_first", "orca"]),
    caching=st.booleans(),
    lookahead=st.booleans(),
    eos=st.booleans(),
)
def test_random_streams_keep_every_invariant(reqs, block_size, num_blocks, budget, max_seqs, policy, caching,
                                             lookahead, eos):  # fmt: skip
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy,
                             enable_prefix_caching=caching)  # fmt: skip
    sched = Scheduler.from_config(config, num_blocks=num_blocks, block_size=block_size, max_model_len=256,
                                  eos_token_ids=EOS_IDS)  # fmt: skip
    runner = FakeRunner(num_blocks, block_size)
    prefixes = [[(p * 31 + j) % 500 for j in range(k)] for p, k in enumerate((0, 9, 20))]
    prompts = {f"r{i}": prefixes[pre] + [(i * 13 + j) % 500 + 1 for j in range(own)]
               for i, (pre, own, *_ ) in enumerate(reqs)}  # fmt: skip
    seqs: dict[int, object] = {}
    in_flight: deque = deque()  # (step, result): executed, ids not yet given to the scheduler
    depth = 2 if lookahead else 1
    for step_no in range(5000):
        for i, (_, _, max_tokens, n, arrival, abort, priority) in enumerate(reqs):
            rid = f"r{i}"
            if arrival == step_no:
                params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=not eos)
                sched.add_request(ScheduleRequest(rid, 0, prompts[rid], params, float(arrival), priority))
            if abort and step_no == arrival + 3:
                sched.abort(rid)
        if step_no > 6 and not sched.has_work() and not in_flight:
            break
        step = sched.schedule() if len(in_flight) < depth else None
        if step is not None:
            assert step.num_tokens <= budget
            result = runner.execute(step_plan(step))  # the worker runs plans in order
            if step.rows:
                in_flight.append((step, result))
        updates = []
        if len(in_flight) >= depth or (in_flight and step is None):
            done, result = in_flight.popleft()
            updates = sched.update(done, result)
        updates += sched.take_unsampled_updates()
        for u in updates:
            seqs[u.seq.seq_id] = u.seq
        check_invariants(sched)
    else:
        raise AssertionError("requests never finished")

    assert sched.blocks.num_used == 0
    for seq in seqs.values():
        assert seq.status is SeqStatus.FINISHED
        _, _, max_tokens, n, _, abort, _ = reqs[int(seq.request_id[1:])]
        expected = expected_outputs(prompts[seq.request_id], max_tokens, seq.index, EOS_IDS if eos else ())
        if seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens < max_tokens:
            assert seq.output_token_ids == expected[: seq.num_output_tokens]  # too big for the pool
        elif seq.finish_reason is FinishReason.ABORT:
            assert abort and seq.output_token_ids == expected[: seq.num_output_tokens]
        else:
            assert seq.output_token_ids == expected
    finished_requests = {s.request_id for s in seqs.values()}
    for i, (*_, abort, _) in enumerate(reqs):
        assert abort or f"r{i}" in finished_requests, f"r{i} never finished"


def expected_outputs(prompt: list[int], max_tokens: int, index: int, eos_ids: tuple[int, ...]) -> list[int]:
    """What sample `index` must generate: the fake model's tokens (the first salted by the
    index), up to max_tokens or the first EOS, which is kept."""
    tokens = list(prompt)
    for i in range(max_tokens):
        tokens.append(next_token(tokens, index if i == 0 else 0))
        if tokens[-1] in eos_ids:
            break
    return tokens[len(prompt) :]
