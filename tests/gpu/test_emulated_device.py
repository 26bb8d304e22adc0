"""The emulated device (gpu/emulated/): its virtual stream's clock, the bubble read from it, the
deterministic ids, its cost and memory from the device table, and the real runner on it.

The clock tests drive the stream with a fake clock whose sleep advances it, so nothing waits and
nothing depends on this machine's speed.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.config import CacheConfig, ConfigError, EngineConfig, ParallelConfig
from conveyor.config.model import ModelConfig
from conveyor.gpu.emulated.costmodel import StepShape
from conveyor.gpu.emulated.devices import DEVICES
from conveyor.gpu.emulated.draws import EmulatedDraws
from conveyor.gpu.emulated.footprint import footprint, pass_cost
from conveyor.gpu.emulated.platform import EmulatedPlatform, ordinary_ids
from conveyor.gpu.emulated.stream import VirtualCopy, VirtualStream
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.sampling.draws import SamplingRow
from conveyor.gpu.step.pass_clock import PassClock
from conveyor.gpu.step.runner import ModelRunner
from conveyor.gpu.structured import TokenMask
from conveyor.sim.presets import H100_LLAMA3_8B
from conveyor.tiny.checkpoint import make_config
from conveyor.tiny.generate import SHAPES
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan
from tests.gpu.test_gpu_multistep import WindowDriver


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def stream(clock: FakeClock) -> VirtualStream:
    return VirtualStream(clock, clock.sleep)


# --- the virtual stream --------------------------------------------------------------------------


def test_launches_return_at_once_and_run_back_to_back(stream, clock):
    stream.launch(0.010)
    stream.launch(0.004)
    assert clock.now == 100.0 and clock.slept == 0  # the host ran ahead
    done = stream.record()
    assert done.at == pytest.approx(100.014) and not done.query()
    clock.now = 100.0139
    assert not done.query()
    clock.now = 100.0141
    assert done.query()


def test_work_launched_on_an_idle_stream_starts_now(stream, clock):
    stream.launch(0.010)
    clock.now = 105.0  # the stream went idle long ago
    stream.launch(0.002)
    assert stream.record().at == pytest.approx(105.002)


def test_a_copy_is_not_readable_before_its_pass_ends(stream, clock):
    stream.launch(0.008)
    copy = VirtualCopy(["ids"], stream.record())
    assert not copy.ready() and copy.seconds_left() == pytest.approx(0.008)
    assert copy.wait() == ["ids"]  # waiting sleeps until the modelled end
    assert clock.slept == pytest.approx(0.008) and copy.ready() and copy.seconds_left() == 0.0


def test_the_bubble_is_zero_when_the_host_runs_ahead(stream, clock):
    first = PassClock(stream.record, None)
    stream.launch(0.010)
    first.stop()
    clock.now += 0.001  # the host prepares the next pass while the first computes
    second = PassClock(stream.record, first)
    stream.launch(0.010)
    second.stop()
    assert first.busy() == pytest.approx(0.010) and second.busy() == pytest.approx(0.010)
    assert second.idle() == 0.0


def test_the_bubble_is_the_hosts_lateness_when_it_falls_behind(stream, clock):
    first = PassClock(stream.record, None)
    stream.launch(0.010)
    first.stop()
    clock.now += 0.013  # the host took 13 ms: the device sat idle for 3
    second = PassClock(stream.record, first)
    stream.launch(0.010)
    second.stop()
    assert second.idle() == pytest.approx(0.003) and second.busy() == pytest.approx(0.010)


def test_after_an_idle_spell_idle_counts_from_the_plans_arrival(stream, clock):
    stream.launch(0.010)
    clock.now += 5.0  # nothing to do: no bubble
    arrival = stream.record()
    clock.now += 0.002  # the host works on the plan
    clock_ = PassClock(stream.record, arrival)
    stream.launch(0.010)
    clock_.stop()
    assert clock_.idle() == pytest.approx(0.002)


# --- cost and memory from the device table ---------------------------------------------------


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory) -> ModelConfig:
    path = make_config(tmp_path_factory.mktemp("l3"), dtype="bfloat16", **SHAPES["llama3-8b"])
    return read_model_config(path)


def test_llama3_8b_on_an_h100_is_the_simulators_preset(llama3_8b):
    """One roofline: the emulated device and the simulator's h100-llama3-8b give the same pass times."""
    f = footprint(llama3_8b)
    assert f.params == pytest.approx(8.03e9, rel=1e-3) and f.kv_bytes_per_token == 131072 and f.pair_flops == 524288
    cost = pass_cost(llama3_8b, DEVICES["h100"])
    for rows in ([(512, 1)] * 256, [(0, 2048)], [(100, 1)] * 8, [(300, 1)] * 40 + [(0, 700)]):
        shape = StepShape.of_rows(rows)
        assert cost.latency(shape) == pytest.approx(H100_LLAMA3_8B.latency(shape), rel=2e-3)


def test_tensor_parallel_splits_the_work_and_adds_all_reduces(llama3_8b):
    one, two = pass_cost(llama3_8b, DEVICES["h100"]), pass_cost(llama3_8b, DEVICES["h100"], ranks=2)
    decode = StepShape.of_rows([(512, 1)] * 64)
    assert two.memory_s(decode) == pytest.approx(one.memory_s(decode) / 2)
    # 64 all-reduces of 64 x 4096 x 2 bytes over NVLink: ring time plus latency each.
    expected_comm = 64 * DEVICES["h100"].allreduce_s(64 * 4096 * 2, 2)
    assert two.latency(decode) == pytest.approx(one.launch_s + expected_comm + one.memory_s(decode) / 2, rel=1e-9)


def emulated_config(model: ModelConfig, device: str = "h100", **cache) -> EngineConfig:
    return EngineConfig(model=model, cache=CacheConfig(**cache), parallel=ParallelConfig(device="emulated", emulate=device))


def test_kv_capacity_is_the_devices_memory_less_the_weights(llama3_8b):
    per_block = 16 * footprint(llama3_8b).kv_bytes_per_token
    h100 = EmulatedPlatform(emulated_config(llama3_8b), 1).kv_blocks(per_block, CacheConfig())
    h200 = EmulatedPlatform(emulated_config(llama3_8b, "h200"), 1).kv_blocks(per_block, CacheConfig())
    weights = 8.03e9 * 2
    assert h100 * per_block == pytest.approx(0.9 * 81559 * 2**20 - weights, rel=0.03)  # less ~1 GB of activations
    assert (h200 - h100) * per_block == pytest.approx(0.9 * (143771 - 81559) * 2**20, abs=per_block)  # the same model, more memory
    fixed = CacheConfig(num_kv_blocks=77)
    assert EmulatedPlatform(emulated_config(llama3_8b), 1).kv_blocks(per_block, fixed) == 77


def test_a_model_too_big_for_the_device_is_a_config_error(tmp_path):
    shape = dict(SHAPES["llama3-8b"], num_hidden_layers=320)  # ~70B parameters: 140 GB of bf16
    model = read_model_config(make_config(tmp_path, dtype="bfloat16", **shape))
    platform = EmulatedPlatform(emulated_config(model, "a100-80g"), 1)
    with pytest.raises(ConfigError, match="does not fit an emulated a100-80g"):
        platform.kv_blocks(16 * footprint(model).kv_bytes_per_token, CacheConfig())


# --- deterministic ids ---------------------------------------------------------------------------

SMALL: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ModelConfig:
    return read_model_config(make_config(tmp_path_factory.mktemp("tiny"), **SMALL))


def row(prompt: list[int], outputs: int = 0, choices=(0,), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=None, **params), list(prompt) + [7] * outputs, len(prompt), list(choices))


def test_ordinary_ids_leave_out_special_tokens(tiny):
    ids = set(ordinary_ids(tiny).tolist())
    assert not ids & set(tiny.eos_token_ids) and tiny.bos_token_id not in ids
    assert len(ids) > 3000 and max(ids) < tiny.vocab_size


def test_ids_depend_on_the_prompt_choice_and_position_only(tiny):
    draws = EmulatedDraws(ordinary_ids(tiny), tiny.vocab_size)
    logits = torch.empty((2, 0))

    def ids(*rows: SamplingRow) -> list[int]:
        return draws(logits[: len(rows)], list(rows), tiny.eos_token_ids, None, None).token_ids.tolist()

    a, b = [5, 6, 7, 8], [5, 6, 7, 9]
    alone = ids(row(a, 3))
    assert ids(row(b, 1), row(a, 3))[1:] == alone  # not the batch
    assert ids(row(a, 3)) == alone and ids(row(a, 4)) != alone  # the position
    assert ids(row(b, 3)) != alone  # the prompt
    assert ids(row(a, 3, choices=(0, 1)))[0] == alone[0] != ids(row(a, 3, choices=(0, 1)))[1]  # the choice
    assert ids(row(a, 3, seed=1)) != alone  # the request's seed
    ordinary = set(ordinary_ids(tiny).tolist())
    assert all(t in ordinary for t in ids(*(row([i, i + 1], i) for i in range(50))))


def test_a_grammar_mask_constrains_the_ids(tiny):
    draws = EmulatedDraws(ordinary_ids(tiny), tiny.vocab_size)
    words = -(-tiny.vocab_size // 32)
    allowed = [11, 300, 2000]
    bitmask = torch.zeros((2, words), dtype=torch.int32)
    for i in allowed:
        bitmask[0, i // 32] |= 1 << (i % 32)
    # row 1 of the mask allows nothing: that draw fails, as a model's would
    mask = TokenMask(rows=torch.tensor([0, 2]), bitmask=bitmask)
    rows = [row([1, 2, 3], i) for i in range(3)]
    out = draws(torch.empty((3, 0)), rows, tiny.eos_token_ids, None, mask)
    assert out.token_ids[0].item() in allowed
    assert out.valid.tolist() == [True, True, False]


def test_min_tokens_keeps_stop_ids_out(tiny):
    draws = EmulatedDraws(ordinary_ids(tiny), tiny.vocab_size)
    free = draws(torch.empty((1, 0)), [row([1, 2, 3], 0)], tiny.eos_token_ids, None, None).token_ids.item()
    banned = draws(torch.empty((1, 0)), [row([1, 2, 3], 0, min_tokens=2, stop_token_ids=[free])], tiny.eos_token_ids, None, None)
    late = draws(torch.empty((1, 0)), [row([1, 2, 3], 0, min_tokens=0, stop_token_ids=[free])], tiny.eos_token_ids, None, None)
    assert banned.token_ids.item() != free and late.token_ids.item() == free


def test_logprobs_are_a_uniform_draws(tiny):
    draws = EmulatedDraws(ordinary_ids(tiny), tiny.vocab_size)
    out = draws(torch.empty((1, 0)), [row([1, 2], 0, logprobs=3)], tiny.eos_token_ids, None, None)
    n = len(ordinary_ids(tiny))
    assert out.logprobs.tolist() == pytest.approx([-math.log(n)])
    assert out.top_ids is not None and out.top_ids.shape == (1, 3) and out.top_ids[0, 0] == out.token_ids[0]


# --- the real runner on the emulated device -----------------------------------------------------


def emulated_runner(model: ModelConfig, clock: FakeClock | None = None) -> ModelRunner:
    runner = ModelRunner(emulated_config(model, block_size=4, num_kv_blocks=256))
    if clock is not None:
        stream = runner.platform.stream  # type: ignore[attr-defined]
        stream.clock, stream._sleep = clock, clock.sleep
    runner.initialize_cache(runner.num_available_blocks())
    return runner


def test_a_pass_launches_at_once_and_its_ids_land_at_its_modelled_end(tiny, clock):
    runner = emulated_runner(tiny, clock)
    prompt = list(range(20, 40))
    plan = StepPlan(
        0, [NewSeq(0, prompt, SamplingParams(max_tokens=None), len(prompt))], [ScheduledSeq(0, len(prompt), [0, 1, 2, 3, 4])]
    )
    for _ in runner.launch(plan):
        pass
    assert clock.now == 100.0  # launching did not wait for the device
    modelled = runner.platform.cost.latency(StepShape.of_rows([(0, 20)]))
    assert runner.landing_in() == pytest.approx(modelled)
    (result,) = runner.collect_due()  # waits for the pass
    assert clock.now == pytest.approx(100.0 + modelled)
    assert result.busy_time == pytest.approx(modelled) and len(result.sampled_token_ids) == 1


@pytest.mark.parametrize("lag", [False, True])
def test_windows_and_a_lagging_host_give_the_same_ids(tiny, lag):
    """Multi-step windows and asynchronous scheduling change when ids reach the host, never which."""
    prompts = [[5 + i, 9, 13 + i, 2] for i in range(4)]
    requests = [(p, SamplingParams(max_tokens=None), n) for p, n in zip(prompts, (9, 3, 12, 1))]
    outputs = {k: WindowDriver(emulated_runner(tiny), k, lag=lag).run(requests) for k in (1, 8)}
    assert outputs[1] == outputs[8]
    assert [len(outputs[1][i]) for i in range(4)] == [9, 3, 12, 1]
    draws = EmulatedDraws(ordinary_ids(tiny), tiny.vocab_size)
    first = draws(torch.empty((1, 0)), [row(prompts[0])], tiny.eos_token_ids, None, None).token_ids.item()
    assert outputs[1][0][0] == first


def test_a_config_without_a_tokenizer_is_refused(tmp_path, tiny):
    (tmp_path / "config.json").write_text((Path(tiny.path) / "config.json").read_text())
    model = dataclasses.replace(tiny, path=str(tmp_path))
    with pytest.raises(ConfigError, match="tokenizer.json"):
        ordinary_ids(model)


def test_a_complete_grammar_ends_the_answer_unless_min_tokens_forbids_it(tiny):
    draws = EmulatedDraws(ordinary_ids(tiny), tiny.vocab_size)
    eos = tiny.eos_token_ids[0]
    bitmask = torch.zeros((1, -(-tiny.vocab_size // 32)), dtype=torch.int32)
    bitmask[0, eos // 32] |= 1 << (eos % 32)  # a complete grammar: only EOS
    mask = TokenMask(rows=torch.tensor([0]), bitmask=bitmask)
    ended = draws(torch.empty((1, 0)), [row([1, 2], 3, min_tokens=3)], tiny.eos_token_ids, None, mask)
    early = draws(torch.empty((1, 0)), [row([1, 2], 1, min_tokens=3)], tiny.eos_token_ids, None, mask)
    assert ended.token_ids.tolist() == [eos] and ended.valid.tolist() == [True]
    assert early.valid.tolist() == [False]  # nothing left to draw: the row fails, as on a model


class UnknownLanding:
    """A copy whose landing time cannot be known in advance, as a CUDA event's."""

    def __init__(self, inner) -> None:
        self.inner, self.landed = inner, False

    def ready(self) -> bool:
        return self.landed

    def seconds_left(self) -> float | None:
        return 0.0 if self.landed else None

    def wait(self):
        self.landed = True
        return self.inner.wait()


def test_the_worker_waits_for_a_plan_or_a_landing(tiny, clock):
    from conveyor.stages.worker.main import POLL_MS, wait_ms

    runner = emulated_runner(tiny, clock)
    assert wait_ms(runner) is None  # nothing in flight: wait for a plan as long as it takes
    prompt = list(range(30, 42))
    new = NewSeq(0, prompt, SamplingParams(max_tokens=None), len(prompt))
    for _ in runner.launch(StepPlan(0, [new], [ScheduledSeq(0, len(prompt), [0, 1, 2])])):
        pass
    modelled = runner.landing_in()
    assert modelled is not None and wait_ms(runner) == int(modelled * 1000)  # until the pass lands
    runner.in_flight.pending[0].copy = UnknownLanding(runner.in_flight.pending[0].copy)
    assert wait_ms(runner) == POLL_MS  # a CUDA event: look for a plan every POLL_MS
    assert runner.collect_due() == [] and runner.has_pending()  # it did not land: nothing is waited for
    runner.in_flight.pending[0].copy.landed = True
    (result,) = runner.collect_due()
    assert result.step == 0 and not runner.has_pending()
