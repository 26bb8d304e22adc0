"""LoRA adapters through the whole daemon, as vLLM users drive them: --lora-modules at start,
/v1/load_lora_adapter and /v1/unload_lora_adapter while streams run, a request's `model` picking
its adapter, /v1/models listing them; each adapter's greedy text equal to peft's, the base's
untouched; the bad commands' 4xx with the daemon serving on."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import pytest
import requests

from tests.gpu.test_lora import make_adapters, peft_greedy

pytest.importorskip("peft")
# A daemon of its own with peft references (about 45 s on two cores): the slow group (-m slow); the in-process
# tests cover the same behaviour in the default run.
pytestmark = pytest.mark.slow
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    base = checkpoints["LlamaForCausalLM"]
    return base, make_adapters(base, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def daemon(daemon_factory, setup):
    base, paths = setup
    args = ["--model", str(base), "--enable-lora", "--lora-modules", f"attn8={paths['attn8']}", "--max-loras", "2"]
    return daemon_factory(*args, "--max-lora-rank", "8", "--num-kv-blocks", "256", "--max-num-batched-tokens", "32")


def complete(daemon, model: str, prompt: list[int], stream: bool = False) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if not stream:
        response = daemon.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]
    response = daemon.post("/v1/completions", {**body, "stream": True}, stream=True)
    assert response.status_code == 200, response.text
    ids = []
    for line in response.iter_lines():
        if line.startswith(b"data: {"):
            ids += json.loads(line[6:])["choices"][0]["token_ids"]
    return ids


def test_adapters_by_model_name_loaded_while_serving(daemon, setup):
    base, paths = setup
    models = {m["id"]: m for m in requests.get(f"{daemon.url}/v1/models", timeout=10).json()["data"]}
    base_name = next(name for name, m in models.items() if "parent" not in m)
    assert models["attn8"]["parent"] == base_name
    prompt = daemon.post("/tokenize", {"prompt": "The quick brown fox jumps"}).json()["tokens"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(complete, daemon, name, prompt, True) for name in (base_name, "attn8")]
        loaded = daemon.post("/v1/load_lora_adapter", {"lora_name": "mlp8", "lora_path": paths["mlp8"]})
        assert loaded.status_code == 200, loaded.text
        late = pool.submit(complete, daemon, "mlp8", prompt)
        got = [f.result() for f in running] + [late.result()]
    expected = [peft_greedy(base, None, prompt), peft_greedy(base, paths["attn8"], prompt), peft_greedy(base, paths["mlp8"], prompt)]
    assert got == expected
    assert len({tuple(e) for e in expected}) == 3
    assert "mlp8" in {m["id"] for m in requests.get(f"{daemon.url}/v1/models", timeout=10).json()["data"]}


def test_unloading_lets_requests_in_flight_finish(daemon, setup):
    base, paths = setup
    assert daemon.post("/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": paths["attn8"]}).status_code == 200
    prompt = [5, 6, 7, 8, 9, 10]
    body = {"model": "gone", "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
    stream = daemon.post("/v1/completions", {**body, "stream": True, "return_token_ids": True}, stream=True)
    lines = stream.iter_lines()
    ids = json.loads(next(line for line in lines if line.startswith(b"data: {"))[6:])["choices"][0]["token_ids"]
    assert daemon.post("/v1/unload_lora_adapter", {"lora_name": "gone"}).status_code == 200  # while it streams
    ids += [t for line in lines if line.startswith(b"data: {") for t in json.loads(line[6:])["choices"][0]["token_ids"]]
    assert ids == peft_greedy(base, paths["attn8"], prompt)
    after = daemon.post("/v1/completions", {"model": "gone", "prompt": prompt, "max_tokens": 2})
    assert after.status_code == 404 and after.json()["error"]["param"] == "model"


def test_bad_commands(daemon, setup, tmp_path):
    base, paths = setup
    not_adapter = tmp_path / "empty"
    not_adapter.mkdir()
    wrong_target = tmp_path / "wrong"
    wrong_target.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (wrong_target / name).write_bytes((Path(paths["attn8"]) / name).read_bytes())
    config = json.loads((wrong_target / "adapter_config.json").read_text())
    (wrong_target / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "w9"]}))
    models = requests.get(f"{daemon.url}/v1/models", timeout=10).json()["data"]
    base_name = next(m["id"] for m in models if "parent" not in m)
    for path, body, status, param in [
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(not_adapter)}, 400, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["all16"]}, 400, "lora_path"),  # rank 16 > 8
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(wrong_target)}, 400, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "attn8", "lora_path": paths["attn8"]}, 400, "lora_name"),  # twice
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": base_name}, 400, "lora_name"),
        ("/v1/unload_lora_adapter", {"lora_name": "never"}, 404, "lora_name"),
        ("/v1/completions", {"model": "never", "prompt": "x", "max_tokens": 1}, 404, "model"),
    ]:
        response = daemon.post(path, body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)
    assert complete(daemon, "attn8", [5, 6, 7]) == peft_greedy(base, paths["attn8"], [5, 6, 7])  # still serving


def test_metrics_count_adapters(daemon):
    text = requests.get(f"{daemon.url}/metrics", timeout=10).text
    assert any(line.startswith("conveyor_lora_requests_total{") and 'adapter="attn8"' in line for line in text.splitlines())
    assert daemon.metric("conveyor_lora_adapter_loads_total") > 0
    assert daemon.metric("conveyor_lora_adapters_resident") >= 1
