"""The block manager's sequence-level operations, one by one: admission from the prefix cache,
append (with copy-on-write of a shared block), registering full blocks, fork and release.
tests/scheduler/test_scheduler*.py drive the same operations through the scheduler and a fake worker."""

from __future__ import annotations

from conveyor.stages.scheduler.block_manager import BlockCopy, BlockManager
from conveyor.stages.scheduler.sequence import Sequence
from conveyor.wire.messages import SamplingParams


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"req-{seq_id}", tokens, SamplingParams(max_tokens=8))


def compute(blocks: BlockManager, s: Sequence, num_tokens: int) -> None:
    """What the scheduler does around a step: blocks for the next tokens, then they count as
    computed and the full blocks are named."""
    blocks.append(s, num_tokens)
    s.num_computed_tokens += num_tokens
    blocks.register_full_blocks(s)


def test_a_prompt_is_admitted_with_fresh_blocks_for_what_is_scheduled():
    blocks = BlockManager(8, 4)
    s = seq(0, list(range(10)))
    hits = blocks.match_prefix(s)
    assert hits == [] and blocks.num_admittable(hits) == 8 * 4
    blocks.allocate_prompt(s, hits, 6)  # a chunk of 6 tokens: two blocks
    assert len(s.block_ids) == 2 and s.num_computed_tokens == 0 and blocks.num_free == 6


def test_a_cached_prefix_is_shared_but_never_the_block_of_the_last_token():
    blocks = BlockManager(8, 4)
    first = seq(0, list(range(12)))
    blocks.allocate_prompt(first, blocks.match_prefix(first), 12)
    first.num_computed_tokens = 12
    blocks.register_full_blocks(first)
    assert first.num_registered_blocks == 3 and blocks.num_cached == 3

    same = seq(1, list(range(12)))  # its third block holds its last token: recomputed
    hits = blocks.match_prefix(same)
    assert hits == first.block_ids[:2]
    blocks.allocate_prompt(same, hits, 4)
    assert same.num_computed_tokens == 8 and same.num_registered_blocks == 2
    assert same.block_ids[:2] == first.block_ids[:2] and same.block_ids[2] != first.block_ids[2]
    assert [blocks.ref_count(b) for b in same.block_ids] == [2, 2, 1]


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_pool():
    blocks = BlockManager(4, 4)
    first = seq(0, list(range(9)))
    blocks.allocate_prompt(first, [], 9)
    first.num_computed_tokens = 9
    blocks.register_full_blocks(first)
    blocks.release(first)
    assert first.block_ids == [] and first.num_registered_blocks == 0 and blocks.num_free == 4

    again = seq(1, list(range(9)))
    hits = blocks.match_prefix(again)
    assert len(hits) == 2
    assert blocks.num_admittable(hits) == (4 - 2) * 4  # the two revived blocks are no longer free
    blocks.allocate_prompt(again, hits, 1)
    assert blocks.num_free == 1


def test_a_sequence_with_computed_tokens_gets_no_prefix():
    blocks = BlockManager(4, 2)
    s = seq(0, [1, 2, 3, 4, 5])
    s.num_computed_tokens = 2
    assert blocks.match_prefix(s) == [] and blocks.num_cache_queries == 0


def test_append_in_place_only_into_an_own_partly_filled_block():
    blocks = BlockManager(8, 4)
    s = seq(0, [1, 2, 3, 4, 5, 6])
    blocks.allocate_prompt(s, [], 6)
    s.num_computed_tokens = 5
    assert blocks.can_append_in_place(s)  # token 6 goes into block 1, which only s holds
    s.num_computed_tokens = 4
    assert not blocks.can_append_in_place(s)  # a block boundary: it may need a new block


def test_append_grows_the_table_as_far_as_the_pool_allows():
    blocks = BlockManager(3, 4)
    s = seq(0, list(range(20)))
    blocks.allocate_prompt(s, [], 4)
    s.num_computed_tokens = 4
    assert blocks.num_appendable(s) == 2 * 4  # its full block holds nothing more: the two free blocks
    assert blocks.append(s, 6) is None
    assert len(s.block_ids) == 3 and blocks.num_free == 0 and blocks.num_appendable(s) == 8


def test_appending_into_a_shared_block_copies_it_first():
    blocks = BlockManager(8, 4)
    parent = seq(0, [1, 2, 3, 4, 5, 6])
    compute(blocks, parent, 6)
    child = parent.fork(1, 1)
    blocks.fork(parent, child)
    assert [blocks.ref_count(b) for b in parent.block_ids] == [2, 2]
    assert not blocks.can_append_in_place(child)
    assert blocks.num_appendable(child) == (2 + 6 - 1) * 4 - 6  # one free block goes to the copy

    shared = child.block_ids[1]
    copy = blocks.append(child, 1)
    assert copy == BlockCopy(position=1, src=shared, dst=child.block_ids[1]) and copy.dst != shared
    assert child.block_ids[0] == parent.block_ids[0] and blocks.ref_count(shared) == 1
    assert blocks.can_append_in_place(parent)  # the parent holds its last block alone again


def test_register_full_blocks_waits_for_every_id_of_a_block():
    blocks = BlockManager(8, 2)
    s = seq(0, [1, 2, 3])
    blocks.allocate_prompt(s, [], 4)
    s.num_pending_tokens = 1  # token 4 is drawn, its id not back yet
    s.num_computed_tokens = 4
    blocks.register_full_blocks(s)
    assert s.num_registered_blocks == 1  # the second block lacks the pending id
    s.token_ids.append(4)
    s.num_pending_tokens = 0
    blocks.register_full_blocks(s)
    assert s.num_registered_blocks == 2 and blocks.lookup(s.full_block_hashes(2, 2)) == s.block_ids


def test_register_full_blocks_names_nothing_without_prefix_caching():
    blocks = BlockManager(8, 2, enable_prefix_caching=False)
    s = seq(0, [1, 2, 3, 4])
    compute(blocks, s, 4)
    assert s.num_registered_blocks == 0 and blocks.num_cached == 0


def test_fork_and_release_keep_the_reference_counts():
    blocks = BlockManager(8, 4)
    parent = seq(0, list(range(7)))
    compute(blocks, parent, 7)
    children = [parent.fork(i, i) for i in (1, 2)]
    for child in children:
        blocks.fork(parent, child)
    assert all(blocks.ref_count(b) == 3 for b in parent.block_ids) and blocks.num_used == 2
    blocks.release(parent)
    blocks.release(children[0])
    assert all(blocks.ref_count(b) == 1 for b in children[1].block_ids) and blocks.num_used == 2
    blocks.release(children[1])
    assert blocks.num_used == 0
