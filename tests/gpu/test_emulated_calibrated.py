"""The emulated device on its calibration table (gpu/emulated/calibrated.py): which cost it takes,
the host it holds for an eager forward, and the GPU host's CPU it counts without spending it.
A fake clock drives the stream, as in test_emulated_device.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conveyor.gpu.backends.base import AttentionMetadata
from conveyor.gpu.emulated.calibrated import CalibratedCost
from conveyor.gpu.emulated.model import EmulatedModel, GraphMetadata, pass_shape
from conveyor.gpu.emulated.platform import EmulatedPlatform
from conveyor.gpu.emulated.roofline import RooflineCost
from conveyor.gpu.emulated.stream import VirtualStream
from tests.gpu.test_emulated_device import FakeClock, emulated_config, llama3_8b  # noqa: F401  (fixtures)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def stream(clock: FakeClock) -> VirtualStream:
    return VirtualStream(clock, clock.sleep)


def test_held_host_time_and_spin_waits_are_counted_not_spent(stream, clock):
    counted: list[float] = []
    stream.on_modelled_cpu = counted.append
    stream.hold(0.003)
    assert clock.now == pytest.approx(100.003) and stream.modelled_cpu_s == pytest.approx(0.003)
    stream.launch(0.010)
    stream.record().synchronize()  # CUDA would sleep here: spin_waits is off
    assert stream.modelled_cpu_s == pytest.approx(0.003)
    stream.spin_waits = True
    stream.launch(0.005)
    stream.record().synchronize()
    assert clock.now == pytest.approx(100.018) and stream.modelled_cpu_s == pytest.approx(0.008)
    assert counted == pytest.approx([0.003, 0.005])


def test_an_eager_pass_ends_no_sooner_than_its_host_launched_it(stream, clock):
    stream.launch(0.002, host_seconds=0.030)  # a host-bound eager forward
    assert stream.record().at == pytest.approx(100.030)
    stream.launch(0.050, host_seconds=0.001)  # a device-bound one queues behind
    assert stream.record().at == pytest.approx(100.080)


def metadata(rows: int, context: int) -> AttentionMetadata:
    return AttentionMetadata.build_common(
        [1] * rows, [context] * rows, torch.zeros((rows, 64), dtype=torch.int32), torch.full((rows,), context - 1), 16, None
    )


def test_the_model_holds_the_host_for_an_eager_forward_only(llama3_8b, stream, clock):  # noqa: F811
    platform = EmulatedPlatform(emulated_config(llama3_8b, "h200"), 1)
    assert isinstance(platform.cost, CalibratedCost) and platform.stream.spin_waits
    model = EmulatedModel(platform.cost, stream)
    meta = metadata(64, 300)
    shape = pass_shape(meta)
    model(torch.zeros(64, dtype=torch.long), meta.positions, meta, [])
    eager_host = platform.cost.host_seconds(shape, graphed=False)
    assert eager_host > 0.025 and clock.now == pytest.approx(100.0 + eager_host)  # ~1 ms a layer on the H200's host
    assert stream.tail == pytest.approx(100.0 + max(eager_host, platform.cost.latency(shape)))
    graph_meta = GraphMetadata(**{f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)})
    before = clock.now
    model(torch.zeros(64, dtype=torch.long), meta.positions, graph_meta, [])
    assert clock.now == before  # a replay returns at once


def test_the_roofline_where_asked_or_where_the_table_cannot_say(llama3_8b):  # noqa: F811
    roofline = dataclasses.replace(
        emulated_config(llama3_8b, "h200"),
        parallel=dataclasses.replace(emulated_config(llama3_8b, "h200").parallel, emulate_cost="roofline"),
    )
    for config in (roofline, emulated_config(llama3_8b, "h100")):  # asked; no h100 table
        platform = EmulatedPlatform(config, 1)
        assert isinstance(platform.cost, RooflineCost) and not platform.stream.spin_waits
