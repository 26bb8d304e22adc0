"""An EngineCore over the fake worker (tests/fake_worker.py), driven as the scheduler stage drives
it, and the checks the scheduler tests make after every step.

`Driver.tick` is one turn of the stage's loop: plan if the core may (with asynchronous
scheduling two plans are in flight), else apply the oldest pass's result, and deliver the
updates as a detokenizer would (a simulated stop string ends its sequence through the core).
The fake worker reads every token back through the block tables, so outputs are right only if
every table, prefix-cache hit, copy-on-write, fork and window pass is."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.engine_core import EngineCore
from conveyor.stages.scheduler.scheduled_step import ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.wire.messages import FinishReason, SamplingParams, ScheduleRequest
from conveyor.wire.step import StepResult
from tests.fake_worker import FakeRunner, next_token

EOS_IDS = tuple(range(0, 1000, 10))  # one fake-model token in ten ends a sequence that allows it
STOP_IDS = list(range(3, 1000, 25))
DETOK_STOP = 53  # a token t with t % DETOK_STOP == 7 stands for a stop string the detokenizer matches


def detok_stops(token: int) -> bool:
    return token % DETOK_STOP == 7


def make(
    k: int = 1,
    num_blocks=256,
    block_size=4,
    budget=32,
    max_seqs=64,
    max_model_len=512,
    num_host_slots=0,
    num_disk_blocks=0,
    lost: Callable[[int], bool] = lambda name: False,
    num_ranks=1,
    **config,
):
    """A scheduler planning windows of up to `k` passes, and a fake worker with the same pool
    (and `num_host_slots` of KV host tier, `num_disk_blocks` of disk tier where the names `lost`
    selects are never written)."""
    sched = Scheduler.from_config(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, num_scheduler_steps=k, **config),
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        eos_token_ids=EOS_IDS,
        num_host_slots=num_host_slots,
        num_disk_blocks=num_disk_blocks,
        num_ranks=num_ranks,
    )
    return sched, FakeRunner(num_blocks, block_size, EOS_IDS, disk=num_disk_blocks > 0, lost=lost)


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


def check_invariants(sched: Scheduler) -> None:
    """Reference counts equal the sequences holding each block, and every running sequence's
    table covers its computed tokens."""
    holders = Counter(b for s in sched.running for b in s.block_ids)
    holders.update(sched.tiers.held_blocks() if sched.tiers is not None else [])  # loaded back, named at the next step
    for block in range(sched.blocks.num_blocks):
        assert sched.blocks.ref_count(block) == holders[block], f"block {block}"
    assert sched.blocks.num_used == len(holders)
    for s in sched.running:
        assert len(s.block_ids) * sched.blocks.block_size >= s.num_computed_tokens


def registered_blocks_hold_their_tokens(sched: Scheduler, runner: FakeRunner) -> None:
    """Every block a running sequence offered to the prefix cache holds, in the worker's KV, the
    tokens its name covers: registration never runs ahead of the passes that really ran."""
    bs = sched.blocks.block_size
    for seq in sched.running:
        for i in range(seq.num_registered_blocks):
            assert runner.kv[seq.block_ids[i]] == seq.token_ids[i * bs : (i + 1) * bs], f"{seq} block {i}"


class Driver:
    """`depth` 2 is asynchronous scheduling (EngineCore's pacing), 1 a plan at a time. Collects
    what clients would see, per sequence."""

    def __init__(self, sched: Scheduler, runner: FakeRunner, depth: int = 1, stop_strings: frozenset[str] = frozenset()):
        self.sched, self.runner = sched, runner
        self.core = EngineCore(sched, async_scheduling=depth > 1)
        self.stop_strings = stop_strings  # request ids whose stop "string" the detokenizer matches
        self.results: deque[StepResult] = deque()  # the worker's answers not applied yet, in order
        self.seen: dict[int, list[int]] = {}  # seq_id -> tokens streamed to its client
        self.finished: dict[int, FinishReason] = {}
        self.seqs: dict = {}
        self.steps: list[ScheduledStep] = []

    def plan(self) -> ScheduledStep | None:
        planned = self.core.plan()
        if planned is None:
            return None
        step, plan = planned
        # The budget a step spent: a window's first pass, or each row's tokens and its lookahead.
        assert step.num_tokens == sum(1 if step.num_steps > 1 else r.num_tokens + r.lookahead for r in step.rows)
        assert step.num_tokens <= self.sched.config.max_num_batched_tokens
        results = self.runner.execute_passes(plan)  # the worker runs plans in order
        if step.rows:  # a plan that only names finished sequences gets no answer
            self.results.extend(results)
        self.steps.append(step)
        return step

    def apply_one(self) -> None:
        _, updates = self.core.apply(self.results.popleft())
        self.deliver(updates)

    def deliver(self, updates: list[SeqUpdate]) -> None:
        for u in updates + self.core.take_unsampled_updates():
            sid = u.seq.seq_id
            assert sid not in self.finished, f"an update for seq {sid} after its final one"
            self.seqs[sid] = u.seq
            self.seen.setdefault(sid, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                self.finished[sid] = u.finish_reason
            elif u.seq.request_id in self.stop_strings and any(detok_stops(t) for t in u.new_token_ids):
                self.core.finish_seqs([sid])  # the detokenizer already ended the client's stream
                self.finished[sid] = FinishReason.STOP

    def tick(self) -> None:
        if (fetched := self.runner.take_fetched()) is not None:  # the worker's reads from disk answered since the last tick
            self.core.kv_fetched(fetched)
        step = self.plan() if self.core.may_plan() else None
        if self.results and (step is None or not self.core.may_plan()):
            self.apply_one()
        else:
            self.deliver([])
        check_invariants(self.sched)
        registered_blocks_hold_their_tokens(self.sched, self.runner)

    def run(self, max_ticks: int = 20_000) -> None:
        for _ in range(max_ticks):
            if not self.sched.has_work() and not self.results:
                return
            self.tick()
        raise AssertionError("did not finish")
