"""The simulator's host: a plan's host cost adds up under synchronous scheduling and overlaps the
device under asynchronous scheduling; multi-step windows pay the host once per window and run
each row its own passes; the H100 roofline preset is its written arithmetic; the CLI marks its
per-K columns as estimates."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conveyor.config import SchedulerConfig
from conveyor.gpu.emulated.costmodel import StepShape
from conveyor.sim import __main__ as cli
from conveyor.sim.hostcost import HostCost
from conveyor.sim.presets import H100_LLAMA3_8B, HOST_COSTS
from conveyor.sim.run_metrics import compute
from conveyor.sim.simulator import SimConfig, simulate
from conveyor.sim.workloads import WorkloadConfig, make_requests
from tests.scheduler.test_sim import AFFINE, request


def test_host_cost_adds_in_sync_and_overlaps_in_async():
    # One request: a 40-token prompt (one pass of 1 + 4 = 5 ms), then 5 decodes of 1.1 ms each.
    # Host 2 ms per plan. Sync: every token costs host + device. Async: after the first plan (it
    # follows an idle spell and runs alone), the host plans ahead, so each decode costs
    # max(2, 1.1) = 2 ms, the host's time.
    host = HostCost(per_plan_s=2e-3)
    prompt, decode = 1e-3 + 40 * 1e-4, 1e-3 + 1e-4
    gaps = {}
    for asynchronous in (False, True):
        config = SimConfig(SchedulerConfig(async_scheduling=asynchronous, enable_prefix_caching=False), host=host)
        result = simulate([request(0, 40, 6)], config, AFFINE)
        rec = result.requests[0]
        assert rec.ttft == pytest.approx(2e-3 + prompt)  # first plan alone in both modes
        gaps[asynchronous] = np.diff(rec.token_times)
        busy = prompt + 5 * decode
        assert compute(result).bubble == pytest.approx(1 - busy / rec.finish)
    assert gaps[False] == pytest.approx([2e-3 + decode] * 5)
    assert gaps[True] == pytest.approx([2e-3 + decode] + [2e-3] * 4)  # the first decode waits on a fresh plan


def test_async_never_slower_than_sync_with_host_work_and_faster_when_host_matches_device():
    reqs = make_requests(WorkloadConfig(kind="random", num_requests=40, prompt_len=32, output_len=100, rate=400.0, seed=1))

    def throughput(host_s: float, asynchronous: bool) -> float:
        scheduler = SchedulerConfig(max_num_batched_tokens=256, async_scheduling=asynchronous)
        return compute(simulate(reqs, SimConfig(scheduler, host=HostCost(per_plan_s=host_s)), AFFINE)).request_throughput

    for host_s in (0.2e-3, 0.5e-3, 1e-3, 5e-3):
        assert throughput(host_s, True) >= throughput(host_s, False), host_s
    # With no host work there is nothing to hide, and a plan made one step ahead sees arrivals and
    # finishes one step late: async may lose a little (0.6% on this workload), never much.
    assert throughput(0.0, True) == pytest.approx(throughput(0.0, False), rel=0.02)
    # A decode pass of ~30 rows costs ~4 ms here: a 3 ms host nearly doubles it in sync, hides in async.
    assert throughput(3e-3, True) > 1.4 * throughput(3e-3, False)


def test_multi_step_pays_the_host_once_per_window_and_each_row_its_own_passes():
    # Two requests, prompts together in one pass; a finishes after 5 tokens, b after 20. K = 8:
    # the scheduler gives a's row 4 passes of the first window (tokens 2-5) and b's row all 8, so
    # passes 5-8 compute b alone: a finished row is never computed again.
    host = HostCost(per_plan_s=3e-3)
    config = SimConfig(SchedulerConfig(num_scheduler_steps=8, async_scheduling=False, enable_prefix_caching=False), host=host)
    result = simulate([request(0, 30, 5), request(1, 30, 20)], config, AFFINE)
    a, b = result.requests
    two_rows, one_row = 1e-3 + 2e-4, 1e-3 + 1e-4
    first_window = [3e-3 + two_rows] + [two_rows] * 3 + [one_row] * 4  # one host cost, then back-to-back passes
    assert np.diff(b.token_times)[:8] == pytest.approx(first_window)
    assert np.diff(b.token_times)[8:] == pytest.approx([3e-3 + one_row] + [one_row] * 7 + [3e-3 + one_row] + [one_row] * 2)
    assert a.finish == pytest.approx(b.token_times[4])
    m = compute(result)
    assert m.num_plans == 1 + 3 and m.num_steps == 1 + 8 + 8 + 3  # the prompt plan, three windows


def test_multi_step_raises_decode_throughput_when_host_dominates_and_delays_late_arrivals():
    early = [request(i, 64, 200) for i in range(8)]
    late = [request(100 + i, 64, 4, arrival=0.05 + 0.0131 * i) for i in range(12)]
    host = HostCost(per_plan_s=3e-3)  # against ~1.9 ms decode passes
    runs = {}
    for k in (1, 8):
        scheduler = SchedulerConfig(num_scheduler_steps=k, async_scheduling=False, enable_prefix_caching=False)
        runs[k] = simulate(early + late, SimConfig(scheduler, host=host), AFFINE)
    m1, m8 = compute(runs[1]), compute(runs[8])
    assert m8.output_throughput > 1.5 * m1.output_throughput
    assert m8.bubble < m1.bubble
    ttft = {k: np.mean([r.ttft for r in runs[k].requests[8:]]) for k in runs}
    assert ttft[8] > ttft[1] + 2e-3  # a late arrival waits for the window under way to end


def test_h100_preset_is_its_written_arithmetic():
    weights, kv_per_token = 2 * 8.03e9, 2 * 32 * 8 * 128 * 2  # bytes
    bandwidth, flops = 3.35e12 * 0.8, 989e12 * 0.6
    assert kv_per_token == 131072
    for rows in ([(512, 1)] * 256, [(0, 2048)], [(100, 1)] * 8):
        shape = StepShape.of_rows(rows)
        memory = (weights + kv_per_token * shape.context_tokens) / bandwidth
        compute_s = (2 * 8.03e9 * shape.num_tokens + 4 * 128 * 32 * 32 * shape.attention_pairs) / flops
        assert H100_LLAMA3_8B.latency(shape) == pytest.approx(0.4e-3 + max(memory, compute_s), rel=1e-12)
    decode = StepShape.of_rows([(512, 1)] * 256)  # the docstring's worked example: 12.4 ms memory, 7.0 ms compute
    assert H100_LLAMA3_8B.memory_s(decode) == pytest.approx(12.4e-3, abs=0.05e-3)
    assert H100_LLAMA3_8B.compute_s(decode) == pytest.approx(7.0e-3, abs=0.05e-3)
    assert H100_LLAMA3_8B.compute_s(StepShape(2048, 1, 2048)) > H100_LLAMA3_8B.memory_s(StepShape(2048, 1, 2048))
    assert HOST_COSTS["h100-llama3-8b"].seconds(256) == pytest.approx(4e-3 + 256 * 35e-6)


def test_cli_columns_per_k_marked_as_estimates(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert (
        cli.main(
            (
                "--workload fixed --num-requests 24 --prompt-len 64 --output-len 40 "
                "--policies prefill_first --cost h100-llama3-8b --num-scheduler-steps 1,8 "
                f"--no-async-scheduling --json {out}"
            ).split()
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "ESTIMATE" in text and "async scheduling off" in text and "4 ms per plan" in text
    data = json.loads(out.read_text())
    assert data["estimate"] is True and set(data["results"]) == {"K=1", "K=8"}
    k1, k8 = data["results"]["K=1"], data["results"]["K=8"]
    assert k8["num_plans"] < k1["num_plans"] and k8["bubble"] < k1["bubble"]
    assert k8["request_throughput"] > k1["request_throughput"]
