"""lm-evaluation-harness, offline, against the daemon: its `local-completions` model scores a
multiple-choice task defined from a local JSONL file (no dataset download) with the prompt
log-likelihoods of `echo` + `logprobs`, and every log-likelihood matches the same harness's `hf`
backend on the same tiny checkpoint to 1e-3, the accuracies equal. Slow (two harness runs):
`pip install -e '.[test,eval]' && python -m pytest -q -m slow tests/daemon/test_lm_eval.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " a fish"], 0),
    ("Two plus two equals", [" four", " seven", " blue"], 0),
    ("The sky on a clear day is", [" green", " blue", " loud"], 1),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " of trees and rivers"], 0),
    ("A week has seven", [" days", " wheels"], 0),
    ("The quick brown fox jumps over the lazy", [" dog", " car", " idea of a mountain"], 0),
]
TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_task")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "tiny_choice.yaml").write_text(TASK.format(data=data))
    return root


def harness(task_dir: Path, out: Path, model: str, model_args: str) -> tuple[float, list[float]]:
    """One `lm_eval` run: (accuracy, every (request, choice)'s log-likelihood in a fixed order)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", "tiny_choice"]
    command += ["--include_path", str(task_dir), "--output_path", str(out), "--log_samples", "--device", "cpu", "--batch_size", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_tiny_choice_*.jsonl")
    accuracy = json.loads(results.read_text())["results"]["tiny_choice"]["acc,none"]
    docs = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])
    return accuracy, [float(r[0][0]) for doc in docs for r in doc["resps"]]


def test_log_likelihoods_match_the_hf_backend(daemon_factory, checkpoints, task_dir, tmp_path):
    path = checkpoints["LlamaForCausalLM"]
    daemon = daemon_factory("--model", str(path), "--num-kv-blocks", "256")
    served = requests.get(f"{daemon.url}/v1/models", timeout=10).json()["data"][0]["id"]
    served_args = ",".join(
        [f"model={served}", f"base_url={daemon.url}/v1/completions", f"tokenizer={path}", "tokenizer_backend=huggingface"]
        + ["num_concurrent=1", "max_retries=1", "add_bos_token=True"]
    )
    ours = harness(task_dir, tmp_path / "conveyor", "local-completions", served_args)
    # Both tokenize with the BOS token (the hf backend's tokenizer adds it unasked, the API model only when told).
    theirs = harness(task_dir, tmp_path / "hf", "hf", f"pretrained={path},dtype=float32,add_bos_token=True")
    assert len(ours[1]) == len(theirs[1]) == sum(len(c) for _, c, _ in QUESTIONS)
    assert ours[1] == pytest.approx(theirs[1], abs=1e-3)
    assert ours[0] == theirs[0]
