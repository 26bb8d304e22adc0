"""Speculative decoding on a CUDA device (the GPU runbook's tests step runs these; skipped
without one): each proposer's greedy output is the engine's own without speculation, in float32
so that a verifying pass's kernels (several query tokens a row) and a decode's (one) agree to
the last bit. With n-gram the decode passes that verify nothing still run through CUDA graphs;
a draft model or an EAGLE-3 head runs every pass eagerly."""

from __future__ import annotations

import pytest

from conveyor import LLM
from conveyor.tiny.eagle3 import make_eagle3_head
from conveyor.wire.messages import SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42, 43, 44, 45] * 3, [9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)


def generate(target, spec=None):
    options = {"speculative_config": {**spec, "draft_length": "fixed"}} if spec else {}  # every draft verified: exactness, not pay
    llm = LLM(str(target), device="cuda", dtype="float32", num_kv_blocks=256, **options)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_greedy_output_is_the_engines_own(checkpoints, tmp_path, method):
    target = checkpoints["LlamaForCausalLM"]
    spec = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
        "eagle3": {
            "method": "eagle3",
            "model": str(make_eagle3_head(target, tmp_path / "head", draft_vocab_size=1024, aux_layers=(1, 0, 1))),
            "num_speculative_tokens": 3,
        },
    }[method]
    base, base_llm = generate(target)
    got, llm = generate(target, spec)
    assert got == base
    if method == "draft_model":  # the draft is the target: every draft holds
        assert llm.core.scheduler.num_steps < base_llm.core.scheduler.num_steps
    assert (llm.runner.graphs is not None) == (method == "ngram" and base_llm.runner.graphs is not None)
