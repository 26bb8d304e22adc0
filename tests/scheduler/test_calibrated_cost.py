"""The emulated device's calibration table (conveyor/sim/calibrate.py) and the pass times taken from
it (gpu/emulated/calibrated.py): the committed table is what the committed GPU records build, a
recorded shape gives its recorded time, and the times move with the table."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from conveyor.gpu.emulated.calibrated import CalibratedCost, for_model, interpolate, load_table
from conveyor.gpu.emulated.costmodel import StepShape
from conveyor.gpu.emulated.devices import DEVICES
from conveyor.gpu.models.registry import read_model_config
from conveyor.sim.calibrate import MODEL, TABLES, build, load_records
from conveyor.tiny.checkpoint import make_config
from conveyor.tiny.generate import SHAPES

RUNS = Path(__file__).resolve().parents[2] / "ops" / "gpu" / "runs"
H200 = DEVICES["h200"]


@pytest.fixture(scope="module")
def table() -> dict:
    found = load_table("h200")
    assert found is not None
    return found


def cost(table: dict, layers: int = 32) -> CalibratedCost:
    return CalibratedCost.from_table(table, H200, layers)


def decode(rows: int, context_per_row: float) -> StepShape:
    context = round(rows * context_per_row)
    return StepShape(rows, rows, context, context)  # a decode row: P = C


def test_the_committed_table_is_what_the_records_build(table):
    records = load_records(sorted(RUNS.glob("*.json")))
    assert build(records, "h200") == table
    assert sorted(p.name for p in TABLES.glob("*.json")) == ["h200.json"]
    assert table["sources"] == sorted(p.name for p in RUNS.glob("*.json"))


def test_the_table_is_consistent(table):
    points = table["layer_products"]["points"]
    assert [t for t, _ in points] == sorted(t for t, _ in points) and all(us > 0 for _, us in points)
    for gemm in table["gemms"]:
        ms = [m for m, _ in gemm["points"]]
        assert ms == sorted(set(ms)) and gemm["kind"] in ("bf16", "w4a16", "w8a16", "fp8")
    modes = {(s["rows"], s["mode"]) for s in table["decode_steps"]}
    assert {(64, "CUDA graphs"), (256, "CUDA graphs"), (64, "eager"), (256, "eager")} <= modes
    for step in table["decode_steps"]:  # its classes (the rest: those not recorded apart) add up to its device time
        assert sum(step["by_class_us"].values()) + step["rest_us"] == step["device_us_per_step"]
        assert 0 < step["by_class_us"]["attention"] < step["by_class_us"]["linears"] < step["device_us_per_step"]
    assert table["model"] == MODEL and all(r["workload"] and r["req_s"] > 0 for r in table["races"])


@pytest.mark.parametrize("rows", [64, 256])
def test_a_recorded_step_gives_its_recorded_time(table, rows):
    (step,) = [s for s in table["decode_steps"] if s["rows"] == rows and s["mode"] == "CUDA graphs"]
    shape = decode(rows, step["context_per_row"])
    assert cost(table, step["layers"]).latency(shape) * 1e6 == pytest.approx(step["device_us_per_step"], rel=1e-9)
    assert cost(table, 32).latency(shape) * 1e6 == pytest.approx(step["estimate_32_layers_us"], rel=1e-9)
    (eager,) = [s for s in table["decode_steps"] if s["rows"] == rows and s["mode"] == "eager"]
    host = cost(table, step["layers"]).host_seconds(shape, graphed=False)
    assert host * 1e3 == pytest.approx(eager["wall_ms_p50"] - step["wall_ms_p50"], rel=1e-9)
    assert cost(table).host_seconds(shape, graphed=True) == 0.0


def test_a_layers_products_follow_their_measured_points_then_the_roofline(table):
    c = cost(table)
    (t0, f0), (t1, f1) = c.in_situ
    for tokens, us in table["layer_products"]["points"]:
        factor = f0 if tokens <= t0 else f1 if tokens >= t1 else interpolate(list(c.in_situ), tokens)
        assert c.dense_us(tokens) == pytest.approx(us * factor)
    last_t, _ = table["layer_products"]["points"][-1]
    # Past the last point: compute-bound there, so twice the tokens take twice the time.
    assert c.dense_us(4 * last_t) == pytest.approx(2 * c.dense_us(2 * last_t))
    assert c.dense_us(last_t + 1) > c.dense_us(last_t)


def test_a_planted_change_in_the_table_changes_the_time(table, tmp_path):
    shape, prompt = decode(128, 400), StepShape.of_rows([(0, 512)])
    before = cost(table).latency(shape)
    planted = copy.deepcopy(table)
    for step in planted["decode_steps"]:
        step["estimate_32_layers_us"] += 7000  # the profile's layers 250 us longer each, its once-a-step kernels 1,000 shorter
    assert cost(planted).latency(shape) * 1e6 == pytest.approx(before * 1e6 + 32 * 250 - 1000, rel=0.01)
    planted = copy.deepcopy(table)
    for step in planted["decode_steps"]:
        step["by_class_us"]["attention"] *= 2
    assert cost(planted).latency(shape) > before
    planted = copy.deepcopy(table)
    planted["layer_products"]["points"][-1][1] *= 2  # the 512-token point
    assert cost(planted).latency(prompt) > 1.5 * cost(table).latency(prompt)
    (tmp_path / "h200.json").write_text(json.dumps(planted))
    assert cost(load_table("h200", tmp_path)).latency(prompt) == pytest.approx(cost(planted).latency(prompt))


def test_prompts_add_their_attention_pairs_and_eager_host_time(table):
    c = cost(table)
    prompt = StepShape.of_rows([(0, 512)])
    assert c.latency(prompt) > c.latency(decode(1, 512)) > 0
    assert c.host_seconds(prompt, graphed=False) > 32 * 900e-6  # ~1 ms a layer of torch on the H200's host
    assert c.latency(StepShape(0, 0, 0)) == 0.0 and c.host_seconds(StepShape(0, 0, 0), graphed=False) == 0.0


def test_only_the_tables_model_on_one_device_is_calibrated(table, tmp_path):
    llama = read_model_config(make_config(tmp_path / "l3", dtype="bfloat16", **SHAPES["llama3-8b"]))
    assert isinstance(for_model(table, H200, llama), CalibratedCost)
    assert for_model(table, H200, llama, ranks=2) is None
    assert for_model(table, H200, llama, kv_dtype="float8_e4m3fn") is None
    assert for_model(None, H200, llama) is None
    tiny = read_model_config(make_config(tmp_path / "tiny", hidden_size=64, intermediate_size=128, num_hidden_layers=2))
    assert for_model(table, H200, tiny) is None
    assert load_table("h100") is None
