"""The KV host tier's books (stages/scheduler/kv_tiers.py) over the fake worker, which copies its
simulated KV to and from host slots as the plans say: a wrong save, load or slot gives wrong
tokens."""

from __future__ import annotations

import pytest

from conveyor.stages.scheduler.kv_disk import FETCH_WAIT_S, DiskBooks, DiskIndex
from conveyor.stages.scheduler.kv_tiers import HostSlots
from conveyor.stages.scheduler.sequence import SeqStatus
from conveyor.wire.messages import KvDiskChanged, KvFetched
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


def _evicted_from_the_device(depth: int = 1, num_blocks: int = 16, **options) -> tuple[Driver, list[int], list[int]]:
    """A prefix of ten blocks served once, then unrelated prompts that evict it from the device
    pool of `num_blocks` (the host tier keeps it): (driver, the prompt, its outputs)."""
    sched, runner = make(num_blocks=num_blocks, block_size=BLOCK, budget=64, num_host_slots=128, **options)
    driver = Driver(sched, runner, depth=depth)
    prompt = prompt_of(1, 10 * BLOCK) + [7]
    first = _serve(driver, 0, prompt)
    for i in range(1, 1 + -(-num_blocks // 12) + 1):
        _serve(driver, i, prompt_of(100 + i, 12 * BLOCK))
    assert sched.blocks.match_prefix(_seq(driver, 0)) == []  # off the device
    return driver, prompt, first


def _loads_and_starts(driver: Driver, rid: str):
    """(the plans that load blocks, the plan where request `rid` starts)."""
    loading = [step for step in driver.steps if step.kv_loads]
    (start,) = [step for step in driver.steps if any(s.request_id == rid for s in step.new_seqs)]
    return loading, start


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_a_host_hit_starts_in_the_plan_that_loads_it(depth):
    """The plan carries the loads and the sequence's row; the row starts after the loaded blocks,
    which are its table's first (the worker's pass waits for their copy). The tokens are right."""
    driver, prompt, first = _evicted_from_the_device(depth)
    num_steps = len(driver.steps)
    assert _serve(driver, 10, prompt) == first
    (loading,), start = _loads_and_starts(driver, "r10")
    assert start is loading and driver.steps.index(start) == num_steps  # the request's first plan
    (row,) = [r for r in start.rows if r.seq.request_id == "r10"]
    (computed,) = start.new_seqs_computed
    assert computed == 10 * BLOCK and row.num_tokens == 1  # only the last prompt token is computed
    assert row.new_block_ids[:10] == [block for _, block in start.kv_loads]
    tiers = driver.sched.tiers
    assert tiers is not None and tiers.num_host_hits == 10 and not tiers.holding
    assert _seq(driver, 10).num_cached_tokens == 10 * BLOCK


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_a_load_past_the_bound_goes_one_step_ahead(depth):
    """A load of more blocks than a plan may load for its own rows: loaded by one plan, held
    unnamed (no row reads them), and the sequence starts at the next with them as device hits."""
    driver, prompt, first = _evicted_from_the_device(depth)
    tiers = driver.sched.tiers
    assert tiers is not None
    tiers.max_load_now = 9
    assert _serve(driver, 10, prompt) == first
    (loading,), start = _loads_and_starts(driver, "r10")
    assert driver.steps.index(start) == driver.steps.index(loading) + 1
    loaded = {block for _, block in loading.kv_loads}
    assert not any(loaded & {*r.new_block_ids} for r in loading.rows)
    (row,) = [r for r in start.rows if r.seq.request_id == "r10"]
    assert set(row.new_block_ids[:10]) == loaded and start.new_seqs_computed == [10 * BLOCK]
    assert start.kv_loads == [] and tiers.num_host_hits == 10


def test_a_prompt_that_cannot_start_whole_in_this_plan_is_loaded_one_step_ahead():
    """prefill_first runs a prompt whole: with the budget left too small for the rest of it,
    the load goes one step ahead, and the request behind it starts meanwhile."""
    driver, prompt, first = _evicted_from_the_device(num_blocks=48, policy="prefill_first")
    long_prompt = prompt[:-1] + prompt_of(50, 20)  # the ten loaded blocks, then 20 tokens to compute
    expected = reference(long_prompt, request(0, [], max_tokens=3, ignore_eos=True).params, 0, 512, False)
    ahead = prompt_of(400, 50)  # arrives first and takes 50 of the 64 tokens
    behind = prompt_of(500, 9)
    for i, p in ((10, ahead), (11, long_prompt), (12, behind)):
        driver.core.add_request(request(i, p, max_tokens=3, ignore_eos=True))
    driver.run()
    (loading,), start = _loads_and_starts(driver, "r11")
    assert {s.request_id for s in loading.new_seqs} == {"r10", "r12"}  # the one behind did not wait
    assert driver.steps.index(start) == driver.steps.index(loading) + 1 and start.new_seqs_computed == [10 * BLOCK]
    assert _seq(driver, 11).output_token_ids == expected


def test_the_queue_goes_on_past_a_sequence_waiting_for_its_load():
    """A head whose load goes one step ahead is set aside, not a wall: the request behind it
    starts in the plan that loads for the head, and the head starts at the next (its place in
    the queue kept)."""
    driver, prompt, first = _evicted_from_the_device()
    tiers = driver.sched.tiers
    assert tiers is not None
    tiers.max_load_now = 0  # every load one step ahead
    other = prompt_of(600, 6)
    driver.core.add_request(request(10, prompt, max_tokens=3, ignore_eos=True))
    driver.core.add_request(request(11, other, max_tokens=3, ignore_eos=True))
    driver.run()
    (loading,), start = _loads_and_starts(driver, "r10")
    assert [s.request_id for s in loading.new_seqs] == ["r11"]
    assert driver.steps.index(start) == driver.steps.index(loading) + 1
    assert _seq(driver, 10).output_token_ids == first
    assert _seq(driver, 11).output_token_ids == reference(other, request(11, [], max_tokens=3, ignore_eos=True).params, 0, 512, False)


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


def test_a_sequence_loaded_back_keeps_room_for_its_next_token():
    """Found by the property test: two samples of a prompt, each needing 11 of the pool's 12 blocks,
    both swapped out. The first was loaded back with room for its next token only checked, the
    second, recomputed, took that room in the same plan; the first could not run, its blocks went
    back after their round, and the two took turns for ever. The room is now held with the blocks:
    every request finishes, with the fake model's tokens."""
    sched, runner = make(1, 12, 2, 11, 2, 256, 64, policy="prefill_first", enable_prefix_caching=False, preemption_mode="swap")
    driver = Driver(sched, runner)
    wanted = [request(0, [66], max_tokens=3, ignore_eos=True), request(1, prompt_of(6, 20), max_tokens=2, n=2, ignore_eos=True)]
    for req in wanted:
        driver.core.add_request(req)
    driver.run(max_ticks=200)  # it took turns for 2,000 ticks and more
    tiers = sched.tiers
    assert tiers is not None and tiers.num_swapped_out > 0 and sched.blocks.num_used == 0
    assert len(driver.finished) == 3
    for seq in driver.seqs.values():
        req = wanted[int(seq.request_id[1:])]
        assert seq.output_token_ids == reference(req.prompt_token_ids, req.params, seq.index, 512, False)


# --- the disk tier: reads on a hit (kv_disk.py) -----------------------------------------------


def test_the_disk_index_forgets_the_least_recently_used_past_its_size():
    index = DiskIndex(3, [1, 2, 3, 4])
    assert len(index) == 3 and 1 not in index
    index.add(2)  # a use
    index.add(5)
    assert 3 not in index and all(n in index for n in (2, 4, 5))
    index.discard(4)
    assert 4 not in index and len(index) == 2


def _evicted_from_both_tiers(depth: int = 1, **options):
    """A prefix served once (saved to the host tier and written through to disk), then unrelated
    prompts that evict it from the device pool and from a host tier of 12 slots: only the disk
    holds it. Returns (driver, the prefix's prompt, its first outputs, its block names)."""
    sched, runner = make(num_blocks=16, block_size=BLOCK, budget=64, num_host_slots=12, num_disk_blocks=1000, **options)
    driver = Driver(sched, runner, depth=depth)
    prompt = prompt_of(1, 10 * BLOCK) + [7]
    first = _serve(driver, 0, prompt)
    (seq,) = [s for s in driver.seqs.values() if s.request_id == "r0"]
    names = seq.full_block_hashes(BLOCK, 10)
    for i in range(1, 4):
        _serve(driver, i, prompt_of(100 + i, 12 * BLOCK))
    tiers = sched.tiers
    assert tiers is not None and tiers.disk is not None
    assert not any(name in tiers.host for name in names) and all(name in tiers.disk.index for name in names)
    return driver, prompt, first, names


def _seq(driver: Driver, i: int):
    return next(s for s in driver.core.scheduler.by_request.get(f"r{i}", []) + list(driver.seqs.values()) if s.request_id == f"r{i}")


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_a_prefix_only_the_disk_holds_is_read_loaded_and_hit(depth):
    driver, prompt, first, names = _evicted_from_both_tiers(depth)
    tiers = driver.sched.tiers
    assert tiers is not None and tiers.disk is not None
    hits_before = tiers.num_host_hits
    again = _serve(driver, 4, prompt)
    assert again == first
    fetched = [name for step in driver.steps for name, _ in step.kv_fetches]
    assert fetched == names  # each block read once, in prompt order
    assert _seq(driver, 4).num_cached_tokens == 10 * BLOCK  # none of it computed again
    assert tiers.disk.num_hits == 10 and tiers.num_host_hits == hits_before and tiers.disk.num_misses == 0
    assert driver.runner.num_reads == 10


def test_nothing_counts_before_the_read_is_answered_and_the_others_run_meanwhile():
    driver, prompt, first, names = _evicted_from_both_tiers()
    sched, core, runner = driver.sched, driver.core, driver.runner
    tiers = sched.tiers
    assert tiers is not None and tiers.disk is not None
    runner.hold_reads = True
    core.add_request(request(4, prompt, max_tokens=3, ignore_eos=True))
    other = prompt_of(300, 2 * BLOCK)
    core.add_request(request(5, other, max_tokens=3, ignore_eos=True))
    for _ in range(12):  # the read is not answered: its sequence waits, the one behind it runs to its end
        driver.tick()
    waiting = _seq(driver, 4)
    assert waiting.status is SeqStatus.WAITING and waiting.num_computed_tokens == 0
    assert _seq(driver, 5).output_token_ids == reference(other, request(5, [], max_tokens=3, ignore_eos=True).params, 0, 512, False)
    assert not any(name in tiers.host for name in names) and tiers.disk.num_hits == 0  # not a hit before it is answered
    assert len(runner.reads) == 10 and not core.wants_to_plan()  # idle: the stage waits for KvFetched
    runner.hold_reads = False
    core.kv_fetched(runner.take_fetched())
    assert all(name in tiers.host for name in names) and core.wants_to_plan()
    driver.run()
    assert _seq(driver, 4).output_token_ids == first and _seq(driver, 4).num_cached_tokens == 10 * BLOCK
    assert tiers.disk.num_hits == 10


def test_a_read_that_fails_is_a_miss_and_the_rest_is_computed():
    driver, prompt, first, names = _evicted_from_both_tiers()
    tiers = driver.sched.tiers
    assert tiers is not None and tiers.disk is not None and driver.runner.disk is not None
    del driver.runner.disk[names[4]]  # a corrupt file, deleted by the worker's check (or another daemon's eviction)
    again = _serve(driver, 4, prompt)
    assert again == first
    assert _seq(driver, 4).num_cached_tokens == 4 * BLOCK  # the blocks before the missing one
    assert tiers.disk.num_misses == 1 and tiers.disk.num_hits == 4
    assert names[4] in tiers.host  # computed again, and saved again
    assert len(tiers.host) + len(tiers.host._free) == tiers.host.num_slots  # no slot lost to the miss


def test_with_tensor_parallelism_a_block_counts_when_every_rank_read_it():
    driver, prompt, first, names = _evicted_from_both_tiers(num_ranks=2)
    core, runner = driver.core, driver.runner
    tiers = driver.sched.tiers
    assert tiers is not None and tiers.disk is not None
    runner.hold_reads = True
    core.add_request(request(4, prompt, max_tokens=3, ignore_eos=True))
    driver.tick()
    runner.hold_reads = False
    rank0 = runner.take_fetched(rank=0)
    assert rank0 is not None and len(rank0.fetched) == 10
    core.kv_fetched(rank0)
    core.kv_fetched(rank0)  # a rank's answer counts once
    assert not any(name in tiers.host for name in names)
    # Rank 1 found its shard of the fifth block bad: a miss for all ranks, its slot free again.
    missed = [rank0.fetched[4]]
    core.kv_fetched(KvFetched(1, rank0.fetched[:4] + rank0.fetched[5:], missed))
    assert [name in tiers.host for name in names] == [True] * 4 + [False] + [True] * 5
    assert names[4] not in tiers.disk.index and tiers.disk.num_misses == 1
    driver.run()
    assert _seq(driver, 4).output_token_ids == first and _seq(driver, 4).num_cached_tokens == 4 * BLOCK


def test_a_read_never_answered_stops_the_wait_after_a_while():
    driver, prompt, first, names = _evicted_from_both_tiers()
    core, runner = driver.core, driver.runner
    tiers = driver.sched.tiers
    assert tiers is not None and tiers.disk is not None
    now = [1000.0]
    tiers.disk.clock = lambda: now[0]
    runner.hold_reads = True  # a hung disk
    core.add_request(request(4, prompt, max_tokens=3, ignore_eos=True))
    for _ in range(3):
        driver.tick()
    assert _seq(driver, 4).status is SeqStatus.WAITING
    assert core.wake_in() == pytest.approx(FETCH_WAIT_S)  # the stage wakes then, with no input
    now[0] += FETCH_WAIT_S
    driver.run()  # it computes its prompt, reads still in flight
    assert _seq(driver, 4).output_token_ids == first and _seq(driver, 4).num_cached_tokens == 0
    assert len(runner.reads) == 10 and len(tiers.disk.reads) == 10  # their slots stay out until answered
    runner.hold_reads = False
    core.kv_fetched(runner.take_fetched())  # late answers: the slots go back (the tier holds those names again)
    assert len(tiers.disk.reads) == 0 and len(tiers.host) + len(tiers.host._free) == tiers.host.num_slots


def test_a_restarted_scheduler_reads_what_the_disk_held():
    """A scheduler started with names on disk (WorkerReady.kv_disk) and an empty host tier: the
    prefix comes from disk, with the fake model's tokens."""
    driver, prompt, first, names = _evicted_from_both_tiers()
    disk = driver.runner.disk
    sched, runner = make(num_blocks=16, block_size=BLOCK, budget=64, num_host_slots=12, num_disk_blocks=1000)
    tiers = sched.tiers
    assert tiers is not None and tiers.disk is not None
    tiers.disk.index = DiskIndex(1000, names)
    runner.disk = disk
    restarted = Driver(sched, runner)
    assert _serve(restarted, 0, prompt) == first
    assert _seq(restarted, 0).num_cached_tokens == 10 * BLOCK and tiers.disk.num_hits == 10


def test_names_another_daemon_wrote_join_the_index_once_every_rank_reported_them():
    books = DiskBooks(HostSlots(4), capacity=4, names=[1, 2], num_ranks=2)
    books.changed(KvDiskChanged(0, came=[5, 6, 7]))
    assert not any(n in books.index for n in (5, 6, 7))  # rank 1's shards may not be written yet
    books.changed(KvDiskChanged(1, came=[6, 5]))
    assert 5 in books.index and 6 in books.index and 7 not in books.index
    books.changed(KvDiskChanged(1, came=[8], went=[1]))  # rank 1's shard of 1 was evicted: the block is gone
    assert 1 not in books.index and 2 in books.index
    books.changed(KvDiskChanged(0, went=[7]))  # gone from rank 0 before rank 1 reported it
    books.changed(KvDiskChanged(1, came=[7]))
    assert 7 not in books.index
    books.changed(KvDiskChanged(0, came=[7, 8, 9]))
    books.changed(KvDiskChanged(1, came=[9]))
    # 7 once rank 0 has it again; bounded by the disk's size, the least recently used out: 2, then 6.
    assert [n in books.index for n in (2, 6, 5, 7, 8, 9)] == [False, False, True, True, True, True]


def test_the_names_waiting_for_other_ranks_are_bounded():
    books = DiskBooks(HostSlots(1), capacity=3, names=[], num_ranks=2)
    books.changed(KvDiskChanged(0, came=[1, 2, 3, 4]))  # rank 1 never wrote its shard of 1
    assert len(books.arrivals) == 3
    books.changed(KvDiskChanged(1, came=[1, 2, 3, 4]))
    assert 1 not in books.index and all(n in books.index for n in (2, 3, 4))
    assert len(books.arrivals) == 1  # 1, now from rank 1 alone


def test_a_prefix_another_engine_wrote_after_start_up_is_read_on_a_hit():
    """Two engines on one disk directory (the fake worker's `disk`): B starts with nothing on it,
    A then serves a prompt; once B's worker reports A's blocks (KvDiskChanged), B serves the same
    prompt with its prefix read from disk, with A's tokens."""
    driver, prompt, first, names = _evicted_from_both_tiers()  # engine A
    sched, runner = make(num_blocks=16, block_size=BLOCK, budget=64, num_host_slots=12, num_disk_blocks=1000)
    runner.disk = driver.runner.disk  # engine B, started before A wrote: its index is empty
    b = Driver(sched, runner)
    tiers = sched.tiers
    assert tiers is not None and tiers.disk is not None and len(tiers.disk.index) == 0
    b.core.kv_disk_changed(KvDiskChanged(0, came=names))
    assert _serve(b, 0, prompt) == first
    assert _seq(b, 0).num_cached_tokens == 10 * BLOCK and tiers.disk.num_hits == 10 and tiers.disk.num_misses == 0


def test_sequences_short_of_host_slots_never_take_turns_evicting_each_others_reads():
    """Found by the property test: prefixes read from disk into a host tier too small for them
    all, each read evicting another's before it was loaded, forever. A block is read once per
    sequence: what the host tier loses again is computed. Every request finishes, with the fake
    model's tokens."""
    from conveyor.wire.messages import SamplingParams, ScheduleRequest

    sched, runner = make(1, 12, 2, 8, 3, 256, 3, 200, lambda name: name % 5 == 0, policy="prefill_first", enable_prefix_caching=True)
    driver = Driver(sched, runner)
    prompts = {"r0": [1, 2, 3, 4, 5, 6], "r1": [14], "r2": [27], "r3": [(31 + j) % 500 for j in range(9)] + [40, 41]}
    wanted = {"r0": (4, 1, 1), "r1": (1, 1, 0), "r2": (3, 1, 1), "r3": (5, 2, 0)}
    for rid, (max_tokens, n, priority) in wanted.items():
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
        driver.core.add_request(ScheduleRequest(rid, 0, prompts[rid], params, 0.0, priority))
    driver.run(max_ticks=2000)
    for seq in driver.seqs.values():
        assert seq.output_token_ids == reference(prompts[seq.request_id], seq.params, seq.index, 256, False)
    assert len(driver.seqs) == 5 and runner.num_reads > 0


def test_more_blocks_named_in_a_step_than_host_slots_save_each_slot_once():
    """Found through the daemon: a prompt of 10 blocks computed in one step over a host tier of 3
    slots saved three blocks into each slot in one plan (the worker refuses a transfer writing a
    slot twice). The last three named are saved."""
    sched, runner = make(num_blocks=32, block_size=BLOCK, budget=64, num_host_slots=3)
    driver = Driver(sched, runner)
    prompt = prompt_of(9, 10 * BLOCK + 1)
    _serve(driver, 0, prompt)
    saves = [save for step in driver.steps for save in step.kv_saves]
    assert saves and all(len({slot for _, slot, _ in step.kv_saves}) == len(step.kv_saves) for step in driver.steps)
    names = _seq(driver, 0).full_block_hashes(BLOCK, 10)
    tiers = sched.tiers
    assert tiers is not None and [name in tiers.host for name in names] == [False] * 7 + [True] * 3


# --- a disk hit longer than the host tier (kv_holds.py) -----------------------------------------


def _restarted_over(disk: dict, names: list[int], num_host_slots: int, num_blocks: int = 32) -> Driver:
    """A scheduler started with `names` on the fake worker's `disk` and an empty host tier of
    `num_host_slots`."""
    sched, runner = make(num_blocks=num_blocks, block_size=BLOCK, budget=64, num_host_slots=num_host_slots, num_disk_blocks=1000)
    tiers = sched.tiers
    assert tiers is not None and tiers.disk is not None
    tiers.disk.index = DiskIndex(1000, names)
    runner.disk = disk
    return Driver(sched, runner)


def _on_disk(num_blocks: int) -> tuple[list[int], list[int], dict, list[int]]:
    """A prefix of `num_blocks` blocks served once by an engine whose host tier holds all of it,
    written through to disk: (the prompt, its outputs, the disk, the prefix's block names)."""
    sched, runner = make(num_blocks=64, block_size=BLOCK, budget=16, num_host_slots=64, num_disk_blocks=1000)
    first = Driver(sched, runner)
    prompt = prompt_of(3, num_blocks * BLOCK) + [7]
    outputs = _serve(first, 0, prompt)
    names = _seq(first, 0).full_block_hashes(BLOCK, num_blocks)
    assert runner.disk is not None and all(name in runner.disk for name in names)
    return prompt, outputs, runner.disk, names


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_a_disk_hit_three_times_the_host_tier_is_read_in_full(depth):
    """A restart with a host tier of 4 slots finds a prefix of 12 blocks on disk: it reads 4,
    loads them into device blocks held for the sequence, reads the next 4 into the slots that
    frees, and so on; the sequence starts once all 12 are on the device, none computed again."""
    prompt, first, disk, names = _on_disk(12)
    driver = _restarted_over(disk, names, num_host_slots=4)
    driver.runner.read_delay = 2
    tiers = driver.sched.tiers
    assert tiers is not None and tiers.disk is not None
    assert _serve(driver, 0, prompt) == first
    fetched = [name for step in driver.steps for name, _ in step.kv_fetches]
    assert fetched == names  # each block read once, in prompt order
    assert max(len(step.kv_fetches) for step in driver.steps) == 4
    assert _seq(driver, 0).num_cached_tokens == 12 * BLOCK
    assert tiers.disk.num_hits == 12 and tiers.disk.num_misses == 0
    assert [len(step.kv_loads) for step in driver.steps if step.kv_loads] == [4, 4, 4]  # each part loaded once
    (start,) = [step for step in driver.steps if step.new_seqs]
    assert start.new_seqs_computed == [12 * BLOCK]
    assert tiers.held_blocks() == [] and driver.sched.blocks.num_used == 0


def test_a_held_prefix_yields_to_a_running_sequence():
    """A sequence holding device blocks while the next part of its prefix is read (here, never
    answered: a hung disk) does not keep a running sequence from its next tokens: the hold goes
    free instead of a preemption, and both requests finish with the fake model's tokens."""
    prompt, first, disk, names = _on_disk(12)
    driver = _restarted_over(disk, names, num_host_slots=4, num_blocks=16)
    sched, core, runner = driver.sched, driver.core, driver.runner
    tiers = sched.tiers
    assert tiers is not None
    core.add_request(request(0, prompt, max_tokens=3, ignore_eos=True))
    while len(tiers.held_blocks()) < 8 or not runner.reads:  # two parts on the device, the third being read
        driver.tick()
    runner.hold_reads = True
    other = prompt_of(700, 4 * BLOCK + 1)  # 5 blocks, then 6 more for its outputs: 11, where 8 are free
    core.add_request(request(1, other, max_tokens=6 * BLOCK, ignore_eos=True))
    for _ in range(60):
        driver.tick()
    params = request(1, [], max_tokens=6 * BLOCK, ignore_eos=True).params
    assert _seq(driver, 1).output_token_ids == reference(other, params, 0, 512, False)
    assert sched.num_preemptions == 0 and tiers.held_blocks() == []  # the hold yielded
    assert _seq(driver, 0).status is SeqStatus.WAITING
    runner.hold_reads = False
    driver.run()
    assert _seq(driver, 0).output_token_ids == first and sched.blocks.num_used == 0
