"""The benches that run conveyor in this process, with no server: `conveyor bench offline`
against transformers, the scheduler's input preparation, and `conveyor bench forward`'s
variants on each shape."""

from __future__ import annotations

import json

import pytest

from conveyor import cli
from conveyor.gpu.backends.cpu.kernels import isa


def test_offline_reports_both_engines(tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = cli.main(
        (
            "bench offline --dataset random --input-len 16 --output-len 4 "
            "--num-prompts 4 --device cpu --hf-batch-size 2 --num-kv-blocks 64 "
            f"--result-json {out}"
        ).split()
    )
    assert rc == 0
    report = json.loads(out.read_text())
    ours, hf = report["results"]
    assert ours["engine"] == "conveyor" and hf["engine"].startswith("transformers")
    assert ours["num_output_tokens"] == hf["num_output_tokens"] == 16
    assert ours["output_throughput"] > 0 and hf["output_throughput"] > 0
    assert report["ratio"] == pytest.approx(ours["output_throughput"] / hf["output_throughput"])
    out = capsys.readouterr().out
    assert "conveyor / transformers:" in out
    assert report["cpu"] == f"CPU {isa.describe_in_use()}" and report["cpu"] in out  # the CPU's model, the kernels' variant


def test_step_times_input_preparation():
    from conveyor.bench import scheduler_cost

    r = scheduler_cost.measure_prepare(scheduler_cost.prepare_runner("cpu"), 8, repeats=10)
    assert r["running"] == 8 and 0 < r["median_ms"] <= r["p90_ms"]


def test_forward_times_each_variant_on_each_shape(capsys):
    from conveyor.bench import forward

    if not forward_kernels_available():
        pytest.skip("no C++ compiler for the CPU kernels")
    shapes = [("decode", 3, 20), ("prefill", 2, 9)]
    results = forward.measure(shapes, rounds=2, repeats=2)
    assert set(results) == {(*s, v) for s in shapes for v in forward.VARIANTS}
    assert all(seconds > 0 for seconds in results.values())
    rc = cli.main(["bench", "forward", "--decode", "2x8", "--prefill", "1x5", "--rounds", "1", "--repeats", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode 2x8" in out and "prefill 1x5" in out and f"CPU {isa.describe_in_use()}" in out


def test_forward_rejects_a_bad_shape(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "forward", "--decode", "256by500"])
    assert "ROWSxLENGTH" in capsys.readouterr().err


def forward_kernels_available() -> bool:
    from conveyor.gpu.backends.cpu.kernels import cpu_fused_ops, paged_attention_kernel

    return paged_attention_kernel() is not None and cpu_fused_ops() is not None
