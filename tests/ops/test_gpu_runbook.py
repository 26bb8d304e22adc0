"""The GPU runbook (ops/gpu/) rehearsed without a GPU: `run.sh all --emulated` runs every step
against `conveyor serve --device emulated` at a tiny scale, and a step that fails is recorded and
turns the exit status non-zero. The same code runs on the H100, where only the device differs;
what this cannot check (the offline install of the packed wheels, CUDA) waits for one.

The ShareGPT file is written here (a few made-up conversations), so the test needs neither the
shared workloads folder nor the network.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RACES = {"race-k1": ("K = 1, CUDA graphs", "K = 1, eager"), "race-k8": ("K = 8, CUDA graphs", "K = 8, eager")}


def sharegpt(path: Path, num: int = 12) -> Path:
    words = "the river runs past the old mill and under the stone bridge toward the sea".split()
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": " ".join(words[: 5 + i % 9]) + f" (question {i})?"},
                {"from": "gpt", "value": " ".join(words * (1 + i % 4))},
            ]
        }
        for i in range(num)
    ]
    path.write_text(json.dumps(conversations))
    return path


def runbook(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path / "out"
    cmd = ["bash", "ops/gpu/run.sh", *args, "--emulated", "--out", str(out), "--work", str(tmp_path / "work")]
    cmd += ["--sharegpt", str(sharegpt(tmp_path / "sharegpt.json")), "--num-prompts", "8", "--resume", str(tmp_path / "none.json")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    return done, json.loads((out / "gpu-runbook.json").read_text()), (out / "gpu-runbook.md").read_text()


@pytest.mark.slow  # the whole runbook on an emulated GPU: a minute (-m slow)
def test_every_step_runs_emulated_and_reports(tmp_path):
    done, report, markdown = runbook(tmp_path, "all")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert report["emulated"] is True and report["device"] == "EMULATED h100"
    steps = report["steps"]
    assert set(steps) == {"setup", "tests", "kernels", "checkpoint", "race-k1", "race-k8", "race-defaults"}
    assert all(step["failures"] == [] for step in steps.values())
    assert steps["setup"]["figures"]["modules_imported"] > 100 and steps["setup"]["figures"]["torch"]
    tests = steps["tests"]
    assert tests["status"] == "ok" and tests["figures"]["failed"] == 0 or tests["status"] == "skipped" and "no CUDA" in tests["note"]
    assert steps["kernels"]["status"] == "skipped" and "no CUDA" in steps["kernels"]["note"]
    assert steps["checkpoint"]["status"] == "ok" and (Path(steps["checkpoint"]["figures"]["path"]) / "config.json").is_file()
    for name, labels in RACES.items():
        assert steps[name]["status"] == "ok" and set(steps[name]["figures"]) == set(labels)
        for figures in steps[name]["figures"].values():
            assert figures["ok"] and figures["completed"] == 8 and figures["failed"] == 0 and figures["workload"] == "sharegpt-500"
            assert figures["req_per_s"] > 0 and figures["output_tok_per_s"] > 0 and figures["ttft_p50_ms"] > 0
            assert figures["mean_prompt_tokens"] > 0 and figures["mean_output_tokens"] > 0
            assert 0 <= figures["bubble"] <= 1
            assert {"worker", "scheduler", "ingress"} <= set(figures["stage_cpu_s"])
            assert any("EMULATED device" in line for line in figures["log_lines"])
    assert markdown.startswith("# GPU runbook: EMULATED h100")
    race_rows = [line for line in markdown.splitlines() if line.startswith("| ") and "K = " in line]
    assert len(race_rows) >= 8 and all("EMULATED" in row for row in race_rows)

    # Idempotent: a measured configuration is kept, the checkpoint reused, nothing fails.
    again, report, _ = runbook(tmp_path, "race-k1")
    assert again.returncode == 0, again.stdout[-4000:]
    assert "kept from an earlier call" in report["steps"]["race-k1"]["note"]
    assert report["steps"]["race-k1"]["figures"] == steps["race-k1"]["figures"]


def test_a_failing_step_is_recorded_and_fails_the_run(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    done, report, markdown = runbook(tmp_path, "race-k1", "--model", str(missing))
    assert done.returncode != 0
    step = report["steps"]["race-k1"]
    assert step["status"] == "failed" and len(step["failures"]) == 2
    for failure, label in zip(step["failures"], RACES["race-k1"]):
        assert failure["what"].startswith(label) and "exited" in failure["what"]
        assert failure["exit_status"] not in (0, None) and str(missing) in failure["output_tail"]
    assert "FAILED: K = 1, CUDA graphs" in markdown

    done, report, _ = runbook(tmp_path, "checkpoint", "--model", str(missing))
    assert done.returncode != 0 and report["steps"]["checkpoint"]["failures"][0]["what"].endswith("no config.json there")
    assert report["steps"]["race-k1"]["status"] == "failed"  # earlier calls' results stay in the report


def test_the_workload_names_the_checkpoints_tokenizer(tmp_path, monkeypatch):
    """sharegpt-500's checkpoint takes the packed SmolLM2 tokenizer (vLLM's client picks with it);
    the first runs' workload keeps the generated one; without the pack the step says what to do."""
    monkeypatch.syspath_prepend(str(REPO / "ops/gpu"))
    runbook = importlib.import_module("runbook")
    opts = runbook.options(["checkpoint", "--work", str(tmp_path)])
    assert opts.workload.name == "sharegpt-500" and opts.num_prompts == 500 and opts.model == tmp_path / "llama3-8b-bf16-smollm2"
    cmd = runbook.checkpoint_command(opts)
    assert cmd[cmd.index("--shape") + 1] == "llama3-8b" and cmd[cmd.index("--tokenizer-from") + 1] == str(REPO / ".gpu-pack/smollm2")
    old = runbook.options(["checkpoint", "--work", str(tmp_path), "--workload", "runbook-bpe4096-500"])
    assert "--tokenizer-from" not in runbook.checkpoint_command(old) and old.model == tmp_path / "llama3-8b-bf16"
    assert "--tokenizer-from" not in runbook.checkpoint_command(runbook.options(["checkpoint", "--emulated"]))
    monkeypatch.setattr(runbook, "PACK", tmp_path / "no-pack")
    with pytest.raises(runbook.StepFailed, match="pack.sh"):
        runbook.checkpoint(opts, {}, time.monotonic() + 10)


def test_the_tests_step_runs_the_quantized_kernels_gpu_tests(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "ops/gpu"))
    runbook = importlib.import_module("runbook")  # a script beside ops/gpu/run.sh, not a package

    assert "tests/kernels/test_triton_quant_linear.py" in runbook.gpu_test_files()


def test_the_kernel_benchmark_runs_every_case(tmp_path):
    """ops/gpu/kernel_bench.py, the kernels step's script, here under the interpreter on shapes cut
    to 1/64 (its times mean nothing): every layer, M and path the GPU will time has a row."""
    done = subprocess.run([sys.executable, "ops/gpu/kernel_bench.py", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["device"].startswith("no CUDA device")
    # layers x M = 1, 16, 64, 256 x (bf16, W4A16 tiles / words / tinygemm, W8A16 tiles); FP8 and gemlite need a GPU
    kinds = {"bf16", "W4A16 tiles", "W4A16 words", "W4A16 tinygemm", "W8A16 tiles"}
    assert len(figures["gemms"]) == 4 * 4 * len(kinds) and {g["kind"] for g in figures["gemms"]} == kinds
    assert all(set(g) == {"layer", "n", "k", "m", "kind", "us"} and g["us"] > 0 for g in figures["gemms"])
    assert set(figures["picks"]) == {"W4A16", "FP8"} and all(len(row) == 4 for row in figures["picks"].values())
