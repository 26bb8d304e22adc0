"""The Triton backend end to end under Triton's interpreter: its greedy output equals the torch
backend's through a real `conveyor serve --attention-backend triton --device cpu` daemon on the
tiny default model, and through the Python API on two more checkpoints: Qwen2 (q/k/v biases,
tied embeddings) and Mistral with a sliding window shorter than the longer prompts.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported, and the
daemon's stages inherit it. The interpreter costs tens of milliseconds per kernel launch and
more per attention launch, so the models are small, the outputs short, and the prompts go as one
batch. A token budget of 16 cuts the 37-token prompt into chunks that share steps with the other
rows' decodes, so one attention launch sees decode rows, a chunk after cached blocks and a fresh
chunk together; its sequence spans three blocks of 16.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.config import ConfigError
from conveyor.llm import LLM
from conveyor.tiny.checkpoint import make_checkpoint
from conveyor.wire.messages import SamplingParams
from tests.conftest import SMALL

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the interpreter is off where CUDA is present: tests/daemon/test_gpu_e2e.py runs it there",
)

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then it runs back home.",
    "Dear team, the meeting moves to Thursday at ten. Please bring the notes from last week and the budget sheet.",
]
NUM_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)  # logprobs: the cumulative one too
ENGINE = dict(device="cpu", max_num_batched_tokens=16, num_kv_blocks=64)


@pytest.fixture(scope="module")
def models(checkpoints, default_model, tmp_path_factory) -> dict[str, str]:
    window = make_checkpoint(tmp_path_factory.mktemp("swa") / "m", "MistralForCausalLM", seed=7, sliding_window=8, **SMALL)
    return {"tiny-llama": str(default_model), "qwen2": str(checkpoints["Qwen2ForCausalLM"]), "mistral-window-8": str(window)}


def greedy(model: str, backend: str) -> list[tuple[list[int], float | None]]:
    outputs = LLM(model, attention_backend=backend, **ENGINE).generate(PROMPTS, GREEDY)
    return [(out.outputs[0].token_ids, out.outputs[0].cumulative_logprob) for out in outputs]


@pytest.fixture(scope="module")
def torch_greedy(models) -> dict[str, list[tuple[list[int], float | None]]]:
    return {name: greedy(path, "torch") for name, path in models.items()}


@pytest.mark.parametrize("name", ["qwen2", "mistral-window-8"])
def test_llm_api_greedy_equals_the_torch_backend(name, models, torch_greedy):
    got = greedy(models[name], "triton")
    for (ids, logprob), (want_ids, want_logprob) in zip(got, torch_greedy[name]):
        assert len(ids) == NUM_TOKENS
        assert ids == want_ids
        assert logprob == pytest.approx(want_logprob, abs=1e-3)  # float32 both ways: rounding only


def test_daemon_serves_with_the_triton_backend(daemon_factory, models, torch_greedy):
    daemon = daemon_factory("--model", models["tiny-llama"], "--attention-backend", "triton", "--max-num-batched-tokens", "16")
    body = {"prompt": PROMPTS, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = daemon.post("/v1/completions", body)  # the prompts as one batch, as LLM.generate runs them
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [ids for ids, _ in torch_greedy["tiny-llama"]]
    assert "attention backend: triton" in daemon.output()  # the worker's start-up line


def test_triton_on_cpu_needs_the_interpreter(models, monkeypatch):
    import triton

    from conveyor.gpu.backends.triton.backend import triton_backend
    from conveyor.gpu.models.registry import read_model_config

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        triton_backend(read_model_config(models["tiny-llama"]), torch.device("cpu"))
