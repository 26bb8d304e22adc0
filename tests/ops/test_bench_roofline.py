"""`conveyor bench roofline`: the bandwidth kernels' byte counts, each decode step's bytes on the
tiny model against the model's own tensors, the figures derived from a round, and bad flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conveyor.bench import stream
from conveyor.bench.roofline import summarize
from conveyor.bench.roofline_round import Rig, Settings
from conveyor.cli import main as cli_main
from conveyor.gpu.quant.weight import QuantizedWeight


@pytest.mark.parametrize("kind,arrays", [("copy", 2), ("triad", 3), ("read", 1)])
def test_a_bandwidth_pass_counts_each_array_once(kind, arrays):
    before = torch.get_num_threads()
    b = stream.measure(kind, 4096 + 3, threads=1, repeats=3)  # 1024 whole float32 elements
    assert b.bytes_per_pass == arrays * 1024 * 4
    assert len(b.seconds) == 3 and b.best_gbps >= b.median_gbps > 0
    assert torch.get_num_threads() == before


def test_an_unknown_bandwidth_kernel_is_refused():
    with pytest.raises(ValueError, match="copy, triad, read"):
        stream.measure("scale", 4096, threads=1, repeats=1)


def weights_read_per_step(model, rows: int) -> int:
    """Every weight tensor of the model once (packed where quantized), counted from the model's
    own modules: the embedding table only where the head is tied to it, plus one row per token."""
    table = model.model.embed_tokens
    own = [table.weight, table.quantized]
    tied = model.lm_head.weight is table.weight or (table.quantized is not None and model.lm_head.quantized is table.quantized)
    tensors: dict[int, int] = {}
    for p in model.parameters():
        tensors[id(p)] = p.nbytes
    for m in model.modules():
        if isinstance(getattr(m, "quantized", None), QuantizedWeight):
            tensors[id(m.quantized)] = m.quantized.nbytes
    table_bytes = sum(tensors.pop(id(t), 0) for t in own if t is not None)
    return sum(tensors.values()) + (table_bytes if tied else 0) + table_bytes // table.num_embeddings * rows


@pytest.mark.parametrize("quantization,rows", [(None, 1), ("int8", 2)])
def test_a_step_reads_every_weight_once_and_each_rows_context(quantization, rows):
    s = Settings("tiny", quantization, rows=rows, context=20, steps=3, warmup=1, array_bytes=4096, repeats=1)
    rig = Rig(s)
    model, config = rig.runner.model, rig.config.model
    if quantization:
        assert any(isinstance(getattr(m, "quantized", None), QuantizedWeight) for m in model.modules())
    ops = rig.round()["ops"]
    assert sum(o["weights"] for o in ops.values()) == s.steps * weights_read_per_step(model, rows)
    per_token = 2 * config.num_kv_heads * config.head_dim * 4  # float32 keys and values, one layer
    # the metered steps follow warmup + 2 x steps plain ones (as served, then eager); a step's context includes its new token
    contexts = sum(s.context + s.warmup + 2 * s.steps + i + 1 for i in range(s.steps))
    assert ops["attention.attend"]["kv"] == rows * contexts * config.num_layers * per_token
    assert ops["attention.write_kv"]["kv"] == rows * s.steps * config.num_layers * per_token
    assert ops["attention.attend"]["calls"] == s.steps * config.num_layers


def test_the_figures_of_a_round():
    """Two rounds of 2 steps: medians of per-round figures; the roofline at the fastest
    bandwidth of the backend's threads; outside = the metered step minus its ops."""

    def round_(step: float, op: float) -> dict:
        bandwidth = [
            {"kind": "copy", "threads": 1, "bytes_per_pass": 8e9, "seconds": [2.0]},  # 4 GB/s, 1 thread: not the roofline
            {"kind": "copy", "threads": 2, "bytes_per_pass": 2e9, "seconds": [1.0, 2.0]},  # 2 GB/s best
            {"kind": "read", "threads": 2, "bytes_per_pass": 1e9, "seconds": [1.0]},
        ]
        ops = {"linears": {"seconds": 2 * op, "calls": 4, "weights": 2e6, "kv": 0, "other": 2e6}}
        return {
            "bandwidth": bandwidth,
            "plain_seconds": [step, step / 2],
            "eager_seconds": [step, step],
            "metered_seconds": [step, step],
            "ops": ops,
        }

    s = summarize({"describe": "cpu", "threads": 2}, [round_(0.004, 0.001), round_(0.006, 0.002)])
    assert s["roofline_bandwidth"]["kind"] == "copy" and s["roofline_bandwidth"]["best_gbps"] == 2.0
    assert s["bandwidth"]["copy/2"]["median_gbps"] == pytest.approx(2e9 / 1.5 / 1e9)
    (op,) = s["ops"]
    assert op["calls_per_step"] == 2 and op["mb_per_step"] == {"weights": 1.0, "kv": 0.0, "other": 1.0}
    assert op["roofline_ms"] == pytest.approx(1.0) and op["ms"] == pytest.approx(1.5)  # 2 MB at 2 GB/s; (1 + 2) / 2
    assert s["step_metered_ms"] == pytest.approx(5.0) and s["outside_ms"] == pytest.approx(3.5)
    assert s["step_plain_ms"] == pytest.approx((0.003 + 0.0045) / 2 * 1e3)
    assert s["step_eager_ms"] == pytest.approx((0.004 + 0.006) / 2 * 1e3)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--isa", "bogus"], "unknown CPU ISA variant 'bogus'"),
        (["--isa", ","], "expected `all`"),
        (["--rows", "0"], "must be at least 1"),
        (["--threads", "0"], "must be at least 1"),
        (["--temperature", "-1"], "at least 0"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "roofline", *flags])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0]


def test_the_command_runs_a_variant_in_its_own_process(tmp_path):
    out = tmp_path / "roofline.json"
    args = ["--model", "tiny", "--isa", "native", "--rounds", "1", "--steps", "2", "--warmup", "0", "--array-mib", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "bench", "roofline", *args, "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "#### native:" in done.stdout and "| step, timers off, eager |" in done.stdout
    figures = json.loads(out.read_text())["variants"]["native"]
    labels = {o["op"] for o in figures["ops"]}
    assert {"attention.attend", "LM head (argmax)", "embedding"} <= labels
    assert figures["roofline_ms"] > 0 and figures["step_plain_ms"] > 0
