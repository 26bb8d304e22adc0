"""The emulated device's host link (gpu/emulated/host_link.py): the KV host tier's copies as
time at the device's PCIe bandwidth, behind the compute work queued before them, which the
compute stream then waits for; and which copies a plan's passes wait for (kv_offload.py)."""

from __future__ import annotations

import pytest

from conveyor.gpu.emulated.devices import DEVICES
from conveyor.gpu.emulated.host_link import EmulatedHostLink
from conveyor.gpu.emulated.stream import VirtualStream
from conveyor.wire.step import ScheduledSeq, StepPlan
from tests.gpu.test_emulated_device import FakeClock

BLOCK = 2 * 2**20  # Llama-3-8B's bf16 KV for 16 tokens: 32 layers x 2 x 8 heads x 128 x 16 x 2 bytes


@pytest.fixture
def link() -> tuple[EmulatedHostLink, VirtualStream, FakeClock]:
    clock = FakeClock()
    stream = VirtualStream(clock, clock.sleep)
    return EmulatedHostLink(stream, 100, BLOCK, DEVICES["h100"].host_bw), stream, clock


def test_a_copy_takes_its_bytes_over_pcie_behind_the_passes_before_it(link):
    host, stream, clock = link
    stream.launch(0.010)  # a pass of 10 ms queued
    save = host.save([1, 2, 3, 4], [0, 1, 2, 3])
    seconds = 4 * BLOCK / DEVICES["h100"].host_bw
    assert save.start == pytest.approx(clock.now + 0.010) and save.end == pytest.approx(save.start + seconds)
    assert 0.1e-3 < seconds < 0.2e-3  # 8 MiB at ~51 GB/s
    load = host.load([0], [9])  # the copy engine is busy: it queues behind the save
    assert load.start == pytest.approx(save.end)
    assert not save.ready() and save.seconds() is None
    clock.now = load.end
    assert load.ready() and load.seconds() == pytest.approx(BLOCK / DEVICES["h100"].host_bw)


def test_the_compute_stream_waits_for_a_copy_only_when_told(link):
    host, stream, clock = link
    load = host.load(list(range(50)), list(range(50)))  # 100 MiB: about 2 ms
    stream.launch(0.001)
    assert stream.tail < load.end  # a pass that reads none of it runs beside the copy
    load.wait_on_stream()
    stream.launch(0.001)
    assert stream.tail == pytest.approx(load.end + 0.001)


def _offload(host: EmulatedHostLink):
    """The worker's KV tier feature over the emulated link, without a model behind it."""
    from types import SimpleNamespace

    from conveyor.gpu.step.features.kv_offload import KvOffloadStep

    cache = SimpleNamespace(block_size=16, kv_offloading_size=1.0, kv_disk_dir=None)
    platform = SimpleNamespace(host_tier=lambda caches, num_slots, block_bytes, pool: host)
    attn = SimpleNamespace(bytes_per_block=lambda block_size: BLOCK)
    offload = KvOffloadStep(SimpleNamespace(cache=cache), attn, SimpleNamespace(rank=0), platform)  # type: ignore[arg-type]
    offload.allocate(64, [])
    return offload


def test_a_plans_pass_waits_for_the_loads_its_rows_read_and_not_for_the_others(link):
    """Blocks 10-13 loaded for a sequence that starts in this plan (its row names them), blocks
    20-29 held for the next plan: this plan's pass starts once the first batch is in, and the
    second goes on beside it; the next plan's pass waits for that one."""
    host, stream, clock = link
    offload = _offload(host)
    stream.launch(0.005)  # the plan before, still computing
    before = stream.tail
    loads = [(s, 10 + s) for s in range(4)] + [(4 + s, 20 + s) for s in range(10)]
    row = ScheduledSeq(seq_id=1, num_tokens=3, new_block_ids=[10, 11, 12, 13, 14])
    offload.apply(StepPlan(step=2, new_seqs=[], scheduled=[row], kv_loads=loads))
    offload.begin_pass(None)  # pyright: ignore[reportArgumentType]
    per_block = BLOCK / DEVICES["h100"].host_bw
    assert stream.tail == pytest.approx(before + 4 * per_block)  # the pass starts after its own 4 blocks
    stream.launch(0.006)
    assert host.free_at == pytest.approx(before + 14 * per_block) and host.free_at < stream.tail  # the rest beside the pass
    offload.apply(StepPlan(step=3, new_seqs=[], scheduled=[]))
    stream.tail = before  # as if the pass were short: the next plan's still waits for the held blocks
    offload.begin_pass(None)  # pyright: ignore[reportArgumentType]
    assert stream.tail == pytest.approx(before + 14 * per_block)
    assert offload.num_loaded == 14


def test_an_a100_copies_at_pcie_4s_half(link):
    assert DEVICES["a100-80g"].host_bw == pytest.approx(DEVICES["h100"].host_bw / 2)


def test_an_emulated_engine_moves_its_host_tier_over_the_link(checkpoints):
    from conveyor import LLM
    from conveyor.gpu.step.features.kv_offload import KvOffloadStep
    from conveyor.wire.messages import SamplingParams
    from tests.gpu.test_kv_offload import POOL, _evicting, _prompts

    llm = LLM(str(checkpoints["LlamaForCausalLM"]), **dict(POOL, device="emulated"), kv_offloading_size=0.01)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    for prompts in (_prompts(0), _evicting(), _prompts(1)):
        llm.generate(prompts, greedy)
    tiers, offload = llm.core.scheduler.tiers, llm.runner.feature(KvOffloadStep)
    assert tiers is not None and tiers.num_host_hits >= 9
    assert offload is not None and isinstance(offload.host, EmulatedHostLink)
    moved = offload.num_saved + offload.num_loaded
    assert offload.host.busy_s == pytest.approx(moved * offload.block_bytes / DEVICES["h100"].host_bw)
