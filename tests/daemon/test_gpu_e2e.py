"""On CUDA: the daemon end to end on the Triton backend, bf16, against transformers in bf16.

Skipped without a CUDA device (marked gpu). The checkpoint is generated (conveyor/tiny), in
bfloat16, at a shape whose attention is a real model's (head_dim 128, GQA 4) so the kernels run
the tiles they were written for, with a prompt longer than a block and a token budget that cuts
it into chunks next to other rows' decodes.

The tolerance, stated once: bf16 rounds differently in any two implementations, so after a near
tie the two greedy continuations may part for good, and comparing whole continuations token by
token would be a coin toss. Instead transformers scores conveyor's own continuation in one
teacher-forced forward pass, and at every position
- conveyor's token is transformers' argmax, or within ARGMAX_MARGIN of its logit (a near tie);
- conveyor's logprob of it is within LOGPROB_TOLERANCE of transformers';
- and at least MIN_EXACT of all positions are transformers' exact argmax.
A wrong kernel (a missed mask, a wrong block, a wrong head) picks tokens far below the argmax
at once; rounding does not.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.tiny.checkpoint import make_checkpoint
from tests.conftest import Daemon

pytestmark = pytest.mark.cuda

SHAPE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1)
# Logits have a std of ~4 (the generator's LOGIT_GAIN), so the top ones lie in [8, 16), where a
# bf16 ulp is 0.0625: both bounds are four ulps. On CPU, conveyor's torch backend in bf16 against
# transformers in bf16 on this test's checkpoint and prompts differed by at most 0.11 in logprob
# and never in argmax; a wrong kernel is off by whole units.
ARGMAX_MARGIN = 0.25
LOGPROB_TOLERANCE = 0.25
MIN_EXACT = 0.9
NUM_TOKENS = 24
PROMPT_LENGTHS = (1, 7, 40, 90)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gpu-e2e") / "llama-bf16", "LlamaForCausalLM", seed=11, dtype="bfloat16", **SHAPE)


@pytest.fixture(scope="module")
def hf_bf16(bf16_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.bfloat16).to("cuda").eval()


@pytest.fixture
def cuda_daemon():
    """Daemons stopped as each test ends, not with the module as conftest's daemon_factory does:
    each takes gpu_memory_utilization of the device for its KV cache, so while one runs the next
    finds no memory left (measured on an H200: budget -1.16 GiB)."""
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        started.append(Daemon(*args))
        return started[-1]

    yield start
    for daemon in started:
        daemon.stop()


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, 4000, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize(
    "backend, extra",
    [
        ("triton", ("--enforce-eager",)),
        ("auto", ()),  # decode steps replay CUDA graphs
        ("auto", ("--num-scheduler-steps", "8")),  # graphs inside multi-step windows
    ],
)
def test_daemon_on_cuda_agrees_with_transformers_in_bf16(backend, extra, cuda_daemon, bf16_checkpoint, hf_bf16):
    args = f"--model {bf16_checkpoint} --device cuda --attention-backend {backend} --max-num-batched-tokens 64".split()
    daemon = cuda_daemon(*args, *extra)
    assert "attention backend: triton (" in daemon.output()  # auto is triton on CUDA
    assert ("CUDA graphs:" in daemon.output()) == ("--enforce-eager" not in extra)
    body = {"max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": 0}
    exact = total = 0
    for prompt in prompts():
        response = daemon.post("/v1/completions", {**body, "prompt": prompt})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert len(ids) == NUM_TOKENS

        with torch.inference_mode():
            logits = hf_bf16(torch.tensor([prompt + ids], device="cuda")).logits[0, len(prompt) - 1 : -1].float()  # [N, V]
        picked = logits.gather(1, torch.tensor(ids, device="cuda")[:, None])[:, 0]  # [N]
        best = logits.max(dim=1).values
        assert (picked >= best - ARGMAX_MARGIN).all(), (prompt[:8], ids, (best - picked).max().item())
        hf_logprobs = torch.log_softmax(logits, dim=1).gather(1, torch.tensor(ids, device="cuda")[:, None])[:, 0]
        assert (hf_logprobs.cpu() - torch.tensor(logprobs)).abs().max().item() < LOGPROB_TOLERANCE
        exact += int((picked == best).sum())
        total += len(ids)
    assert exact >= MIN_EXACT * total, f"{exact} of {total} tokens are transformers' exact argmax"
