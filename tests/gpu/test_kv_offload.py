"""The KV host tier end to end (--kv-offloading-size): a prefix the device pool evicted comes back
from host memory, and every output is what recomputing it gives."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from conveyor import LLM, LoRARequest
from conveyor.gpu.step.features.kv_offload import KvOffloadStep
from conveyor.llm import RequestOutput
from conveyor.tiny.lora import make_random_adapter
from conveyor.wire.messages import SamplingParams

BLOCK = 4
PREFIX = [5 + (7 * i) % 97 for i in range(10 * BLOCK)]  # ten full blocks
POOL = dict(device="cpu", block_size=BLOCK, num_kv_blocks=24)


def _prompts(tail: int) -> list[list[int]]:
    return [PREFIX + [120 + tail, 121 + tail, 122 + tail]]


def _evicting() -> list[list[int]]:
    """Prompts with nothing in common with PREFIX, that take the whole pool between them."""
    return [[150 + (11 * i + 3 * j) % 90 for i in range(12 * BLOCK)] for j in range(3)]


def _run(llm: LLM, params: list[SamplingParams] | SamplingParams) -> list[list[list[list[int]]]]:
    """A prefix, prompts that evict it from the device, then the prefix again with another tail."""
    outputs = []
    for prompts in (_prompts(0), _evicting(), _prompts(1)):
        outputs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)])
    return outputs


@pytest.fixture(scope="module")
def path(checkpoints):
    return str(checkpoints["LlamaForCausalLM"])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6, n=2),
    ],
    ids=["greedy", "seeded-n2"],
)
@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_a_prefix_back_from_the_host_tier_gives_what_recomputing_it_gives(path, params, chunk):
    options = dict(POOL, max_num_batched_tokens=chunk) if chunk else POOL
    tiered = LLM(path, kv_offloading_size=0.01, **options)
    assert tiered.core.scheduler.tiers is not None
    ours = _run(tiered, params)
    tiers = tiered.core.scheduler.tiers
    assert tiers.num_host_hits >= 9  # the prefix's blocks but the one its last token's logits need
    assert _run(LLM(path, **options), params) == ours


def test_host_hits_count_as_cached_tokens(path):
    llm = LLM(path, kv_offloading_size=0.01, **POOL)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(_prompts(0), greedy)
    llm.generate(_evicting(), greedy)
    (again,) = llm.generate(_prompts(1), greedy)
    assert again.num_cached_tokens == 10 * BLOCK


def test_without_the_tier_the_evicted_prefix_is_recomputed(path):
    """The counterpart that makes the tests above able to fail: the pool alone forgets it."""
    llm = LLM(path, **POOL)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(_prompts(0), greedy)
    llm.generate(_evicting(), greedy)
    (again,) = llm.generate(_prompts(1), greedy)
    assert again.num_cached_tokens == 0 and llm.core.scheduler.tiers is None


def _disk_llm(path: str, root) -> LLM:
    return LLM(path, kv_offloading_size=0.01, kv_disk_dir=str(root), **POOL)


def test_a_restart_finds_its_prefixes_on_disk(path, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    first = _disk_llm(path, tmp_path / "kv")
    (before,) = first.generate(_prompts(0), greedy)
    offload = first.runner.feature(KvOffloadStep)
    assert offload is not None and offload.disk is not None
    offload.flush()
    del first, offload
    restarted = _disk_llm(path, tmp_path / "kv")
    (again,) = restarted.generate(_prompts(0), greedy)
    assert again.num_cached_tokens == 10 * BLOCK  # nothing of it on the device: all from disk
    assert again.outputs[0].token_ids == before.outputs[0].token_ids


def test_a_corrupt_block_on_disk_is_a_miss(path, tmp_path, caplog):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    first = _disk_llm(path, tmp_path / "kv")
    (before,) = first.generate(_prompts(0), greedy)
    offload = first.runner.feature(KvOffloadStep)
    assert offload is not None
    offload.flush()
    del first, offload
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert len(files) >= 10
    for f in files:  # one flipped byte each, past the header
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    restarted = _disk_llm(path, tmp_path / "kv")
    (again,) = restarted.generate(_prompts(0), greedy)
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == before.outputs[0].token_ids
    assert sum("checksum" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_another_model_never_reads_the_blocks(checkpoints, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    first = _disk_llm(str(checkpoints["LlamaForCausalLM"]), tmp_path / "kv")
    first.generate(_prompts(0), greedy)
    offload = first.runner.feature(KvOffloadStep)
    assert offload is not None
    offload.flush()
    del first, offload
    other = _disk_llm(str(checkpoints["Qwen2ForCausalLM"]), tmp_path / "kv")
    (again,) = other.generate(_prompts(0), greedy)
    assert again.num_cached_tokens == 0


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=0.9, seed=7, max_tokens=6, n=2)],
    ids=["greedy", "seeded-n2"],
)
def test_an_adapters_prefix_back_from_the_host_tier_is_its_own(path, tmp_path, params):
    """A prefix served through an adapter, evicted, asked for by the base model (whose hashes
    differ: no hit in either tier), then through the adapter again (its blocks from the host):
    outputs as without the tier."""
    adapter = LoRARequest("tiny", str(make_random_adapter(Path(path), tmp_path / "lora", rank=8)))
    options = dict(POOL, enable_lora=True, max_loras=1, max_lora_rank=8)
    turns = [(_prompts(0), adapter), (_evicting(), None), (_prompts(0), None), (_prompts(1), adapter)]

    def serve(llm: LLM) -> list[list[RequestOutput]]:
        return [llm.generate(prompts, params, lora_request=lora) for prompts, lora in turns]

    tiered = LLM(path, kv_offloading_size=0.01, **options)
    tiers = tiered.core.scheduler.tiers
    assert tiers is not None
    first, _, base, again = ours = serve(tiered)
    assert base[0].num_cached_tokens == 0  # the adapter's blocks sit in the host tier under other names
    assert again[0].num_cached_tokens == 10 * BLOCK and tiers.num_host_hits >= 9
    assert base[0].outputs[0].token_ids != first[0].outputs[0].token_ids  # the adapter changes the text
    plain = serve(LLM(path, **options))
    assert [[c.token_ids for o in turn for c in o.outputs] for turn in ours] == [
        [c.token_ids for o in turn for c in o.outputs] for turn in plain
    ]


def _written(llm: LLM) -> None:
    """Every block saved so far on disk (the write-through is asynchronous)."""
    offload = llm.runner.feature(KvOffloadStep)
    assert offload is not None and offload.disk is not None
    offload.flush()


def _on_disk_only(path: str, root: Path, greedy: SamplingParams) -> tuple[list[int], list[Path], int]:
    """The prefix served by one engine, then unrelated prompts, all written through to `root`:
    (its outputs, its files, a block's bytes). Its files are made the oldest, so that an engine
    started on `root` with a small host tier reads the others back at start-up, not these."""
    first = _disk_llm(path, root)
    (before,) = first.generate(_prompts(0), greedy)
    _written(first)
    prefix_files = sorted(root.rglob("*.kv"))
    assert len(prefix_files) == 11  # the prompt's ten full blocks, and one of its tail and output
    for f in prefix_files:
        os.utime(f, (time.time() - 1000, time.time() - 1000))
    first.generate(_evicting(), greedy)
    _written(first)
    offload = first.runner.feature(KvOffloadStep)
    assert offload is not None
    return before.outputs[0].token_ids, prefix_files, offload.block_bytes


def _restarted(path: str, root: Path, num_slots: int, block_bytes: int) -> tuple[LLM, KvOffloadStep]:
    llm = LLM(path, kv_offloading_size=num_slots * block_bytes / 2**30, kv_disk_dir=str(root), **POOL)
    offload = llm.runner.feature(KvOffloadStep)
    assert offload is not None and offload.num_slots == num_slots and len(offload.warm) == num_slots
    return llm, offload


def test_a_prefix_on_disk_beyond_the_host_tier_is_read_on_a_hit(path, tmp_path):
    """A restart whose host tier (16 blocks) is smaller than what the disk holds (46): it reads the
    most recently used blocks back at start-up, and the repeated prompt's prefix, older, is read
    from disk when the prompt comes, not computed."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    before, _, block_bytes = _on_disk_only(path, tmp_path / "kv", greedy)
    restarted, offload = _restarted(path, tmp_path / "kv", 16, block_bytes)
    tiers = restarted.core.scheduler.tiers
    assert tiers is not None and tiers.disk is not None and len(tiers.disk.index) > 16
    assert offload.disk is not None
    reads = offload.disk.stats.hits
    (again,) = restarted.generate(_prompts(0), greedy)
    assert again.outputs[0].token_ids == before  # as computed fresh by the first engine
    assert again.num_cached_tokens == 10 * BLOCK
    assert tiers.disk.num_hits == 10 and tiers.num_host_hits == 0 and offload.disk.stats.hits - reads == 10


def test_a_corrupt_block_read_on_a_hit_is_a_miss(path, tmp_path, caplog):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    before, prefix_files, block_bytes = _on_disk_only(path, tmp_path / "kv", greedy)
    for f in prefix_files:  # one flipped byte each, past the header; still the oldest files
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        os.utime(f, (time.time() - 1000, time.time() - 1000))
    restarted, offload = _restarted(path, tmp_path / "kv", 16, block_bytes)
    tiers = restarted.core.scheduler.tiers
    assert tiers is not None and tiers.disk is not None
    with caplog.at_level(logging.WARNING, logger="conveyor.gpu.kv.disk_tier"):
        (again,) = restarted.generate(_prompts(0), greedy)
    assert again.outputs[0].token_ids == before and again.num_cached_tokens == 0
    assert tiers.disk.num_misses == 10 and tiers.disk.num_hits == 0
    assert sum("checksum" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert offload.disk is not None and offload.disk.stats.bad_files == 10  # each found bad, and deleted


def test_a_prefix_another_engine_wrote_after_start_up_is_read_on_a_hit(path, tmp_path):
    """Two engines on one disk directory (data-parallel replicas): B starts first, on an empty
    directory; A then serves a prompt and writes its blocks. Once B's disk tier has looked (every
    --kv-disk-scan-s; here asked for), B serves the prompt with its prefix read from A's files:
    A's tokens, and every prefix block a disk hit."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    root = tmp_path / "kv"
    b = LLM(path, kv_offloading_size=0.01, kv_disk_dir=str(root), kv_disk_scan_s=0, **POOL)
    tiers = b.core.scheduler.tiers
    assert tiers is not None and tiers.disk is not None and len(tiers.disk.index) == 0
    a = _disk_llm(path, root)
    (computed,) = a.generate(_prompts(0), greedy)
    _written(a)
    offload = b.runner.feature(KvOffloadStep)
    assert offload is not None and offload.disk is not None
    offload.disk.discover()
    (served,) = b.generate(_prompts(0), greedy)
    assert served.outputs[0].token_ids == computed.outputs[0].token_ids
    assert served.num_cached_tokens == 10 * BLOCK
    assert tiers.disk.num_hits == 10 and tiers.disk.num_misses == 0 and tiers.num_host_hits == 0


def test_a_prefix_on_disk_longer_than_the_host_tier_is_read_in_full(path, tmp_path):
    """A restart whose host tier (4 blocks) is smaller than the prompt's prefix on disk (10): the
    prefix is read 4 blocks at a time, each part loaded into device blocks held for the request
    before the next is read, and the request starts with all ten as hits. Greedy tokens as
    without any tier."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    _, _, block_bytes = _on_disk_only(path, tmp_path / "kv", greedy)
    restarted, offload = _restarted(path, tmp_path / "kv", 4, block_bytes)
    tiers = restarted.core.scheduler.tiers
    assert tiers is not None and tiers.disk is not None and offload.disk is not None
    reads = offload.disk.stats.hits
    (again,) = restarted.generate(_prompts(0), greedy)
    (plain,) = LLM(path, **POOL).generate(_prompts(0), greedy)
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids
    assert again.num_cached_tokens == 10 * BLOCK
    assert tiers.disk.num_hits == 10 and tiers.disk.num_misses == 0 and offload.disk.stats.hits - reads == 10
    assert tiers.held_blocks() == []
