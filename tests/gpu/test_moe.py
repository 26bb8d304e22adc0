"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers on tiny random
checkpoints, and the pieces they are made of: config fields, routing, the grouped expert path,
checkpoint name mapping.

The runner-level and Python-API tests go through the registered families: gpu/models/registry.py
(each family's config adapter fills ModelConfig.moe) and the MoE models' own load_weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conveyor.config import ConfigError, EngineConfig, MoeConfig, config_from_json, config_to_json
from conveyor.gpu.backends.torch.moe import grouped_moe, per_token_moe
from conveyor.gpu.models import CausalLM, build_model, read_model_config
from conveyor.gpu.models.mixtral import MixtralForCausalLM, MoeForCausalLM
from conveyor.gpu.models.moe import expert_weight_target, route
from conveyor.gpu.models.registry import ARCHITECTURES
from tests.gpu.test_gpu_model import drive_greedy, forward_prompts, hf_greedy, random_prompts
from tests.moe_checkpoints import MOE_ARCHS, checkpoint_tensors, hf_model, model_config

DENSE = {"vocab_size": 64, "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 8}


def build(name: str, backend=None) -> CausalLM:
    config = model_config(name)
    model = build_model(config, "cpu", backend)
    model.load_weights(checkpoint_tensors(name))
    return model.eval().requires_grad_(False)


def moe_fields(root: Path, fields: dict) -> MoeConfig:
    """The MoE fields of a config.json holding `fields` (over small dense ones), as the registry reads them."""
    (root / "config.json").write_text(json.dumps({**DENSE, **fields}))
    moe = read_model_config(root).moe
    assert moe is not None
    return moe


def _random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    return torch.rand(num_tokens, top_k, generator=gen), ids


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 4, 2), (13, 8, 2), (30, 8, 3), (9, 6, 1)])
def test_grouped_experts_equal_a_per_token_loop(num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, inter = 24, 20
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 4
    down = torch.randn(num_experts, hidden, inter, generator=gen) / 4
    weights, ids = _random_routing(num_tokens, num_experts, top_k, seed=num_tokens)
    ids[:, 0] = 0  # one expert every token chose, and (with 6 to 8 experts) likely some none did
    out = grouped_moe(x, gate_up, down, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, per_token_moe(x, gate_up, down, weights, ids), rtol=1e-5, atol=1e-5)


def test_routing_renormalises_as_each_family_does(tmp_path):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]], dtype=torch.float16)
    mixtral = moe_fields(
        tmp_path, {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "intermediate_size": 8, "num_local_experts": 4}
    )
    weights, ids = route(logits, mixtral)
    assert ids.tolist() == [[0, 1], [2, 3]] and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    qwen = moe_fields(
        tmp_path, {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2}
    )
    weights, _ = route(logits, qwen)  # no renormalisation, rounded to the logits' dtype
    probs = torch.softmax(logits.float(), -1)
    assert weights.dtype == torch.float16
    torch.testing.assert_close(weights.float(), probs.topk(2).values, rtol=1e-3, atol=1e-3)
    weights, _ = route(logits, dataclasses.replace(qwen, norm_topk_prob=True))
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(2), rtol=1e-3, atol=1e-3)


def test_moe_fields_per_family(tmp_path):
    mixtral = moe_fields(tmp_path, {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 3, "intermediate_size": 14})
    assert (mixtral.num_experts, mixtral.top_k, mixtral.moe_intermediate_size) == (8, 2, 14)  # transformers' defaults
    assert mixtral.sparse_layers == (0, 1, 2) and mixtral.block_name == "block_sparse_moe" and mixtral.norm_topk_prob
    qwen3 = moe_fields(
        tmp_path,
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_hidden_layers": 6,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 8,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        },
    )
    assert qwen3.sparse_layers == (1, 5) and qwen3.shared_expert_intermediate_size == 0 and not qwen3.norm_topk_prob
    qwen2 = moe_fields(
        tmp_path, {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 2, "shared_expert_intermediate_size": 12}
    )
    assert qwen2.shared_expert_intermediate_size == 12 and qwen2.sparse_layers == (0, 1)
    (tmp_path / "config.json").write_text(json.dumps({**DENSE, "architectures": ["LlamaForCausalLM"], "num_experts": 8}))
    assert read_model_config(tmp_path).moe is None  # a dense family's adapter takes no MoE fields


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"architectures": ["MixtralForCausalLM"], "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"architectures": ["Qwen2MoeForCausalLM"], "hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
        ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok 3"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 0}, "malformed"),
    ],
)
def test_moe_fields_refuse_with_one_line(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message) as info:
        moe_fields(tmp_path, fields)
    assert "\n" not in str(info.value)


def test_checkpoint_names_map_to_stacked_rows(tmp_path):
    mixtral = moe_fields(tmp_path, {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 1, "intermediate_size": 5})
    prefix = "model.layers.0.block_sparse_moe.experts"
    assert expert_weight_target(f"{prefix}.3.w1.weight", mixtral) == (f"{prefix}.gate_up_proj", 3, slice(0, 5))
    assert expert_weight_target(f"{prefix}.3.w3.weight", mixtral) == (f"{prefix}.gate_up_proj", 3, slice(5, 10))
    assert expert_weight_target(f"{prefix}.7.w2.weight", mixtral) == (f"{prefix}.down_proj", 7, slice(None))
    assert expert_weight_target("model.layers.0.block_sparse_moe.gate.weight", mixtral) is None
    qwen2 = moe_fields(tmp_path, {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 1, "moe_intermediate_size": 4})
    assert expert_weight_target("model.layers.0.mlp.experts.0.up_proj.weight", qwen2) == (
        "model.layers.0.mlp.experts.gate_up_proj",
        0,
        slice(4, 8),
    )
    assert expert_weight_target("model.layers.0.mlp.shared_expert.up_proj.weight", qwen2) is None


def test_saved_checkpoints_hold_one_tensor_per_expert():
    """What the loader must map: transformers saves Mixtral's and Qwen's experts one by one."""
    names = {name for name, _ in checkpoint_tensors("mixtral")}
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names
    names = {name for name, _ in checkpoint_tensors("qwen3_moe_norm")}
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.self_attn.q_norm.weight" in names


def test_loader_names_what_is_missing_or_misshapen():
    config = model_config("mixtral")
    model = MixtralForCausalLM(config)
    tensors = [(n, t) for n, t in checkpoint_tensors("mixtral") if n != "model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(ConfigError, match=r"lacks 1 weight\(s\): model.layers.1.block_sparse_moe.experts.gate_up_proj"):
        model.load_weights(tensors)
    bad = [(n, torch.zeros(3, 3) if n.endswith("experts.2.w2.weight") else t) for n, t in checkpoint_tensors("mixtral")]
    with pytest.raises(ConfigError, match=r"experts.2.w2.weight has shape \(3, 3\), expected \(64, 128\)") as info:
        model.load_weights(bad)
    assert "\n" not in str(info.value)


def test_every_family_runs_the_one_forward():
    """MoE included: CausalLM's forward (per-layer rope tables, the embed hook), not a copy of it."""
    for name, arch in ARCHITECTURES.items():
        assert issubclass(arch.model, CausalLM) and arch.model.forward is CausalLM.forward, name
    assert issubclass(MixtralForCausalLM, MoeForCausalLM)


@pytest.mark.parametrize("name", MOE_ARCHS)
def test_moe_fields_travel_in_the_json_config(name):
    """Read once, with config.json: the stages get them in the engine config, not from the file again."""
    config = EngineConfig(model=model_config(name))
    assert config.model.moe is not None
    assert config_from_json(config_to_json(config)) == config


@pytest.mark.parametrize("name", MOE_ARCHS)
def test_prompt_logits_match_hf(name):
    model = build(name)
    lengths = [5, 17, 1, 30]
    ours = forward_prompts(model, model.config, random_prompts(lengths, seed=3))
    hf = hf_model(name)
    start = 0
    for prompt in random_prompts(lengths, seed=3):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        got = ours[start : start + len(prompt)]
        start += len(prompt)
        assert got.shape == ref.shape
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), name


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_norm"])
def test_greedy_through_the_runner_matches_hf(name):
    """ModelRunner, chunked prefill (7 tokens a step), sequences joining late and one preempted and
    resumed, against transformers' generate."""
    from conveyor.config import CacheConfig, EngineConfig, ParallelConfig
    from conveyor.gpu.step.runner import ModelRunner

    config = model_config(name)
    engine = EngineConfig(model=config, cache=CacheConfig(block_size=4, num_kv_blocks=256), parallel=ParallelConfig(device="cpu"))
    runner = ModelRunner(engine)
    runner.initialize_cache(runner.num_available_blocks())
    prompts = random_prompts([3, 12, 20, 9], seed=5)
    ours = drive_greedy(runner, prompts, max_new=8, join_at=[0, 0, 2, 4], preempt={6: 1})
    hf = hf_model(name)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, 8), (name, len(prompt))


def test_python_api_greedy_matches_hf():
    """LLM(...).generate end to end (tokenizer, scheduler with a 16-token budget that chunks the
    long prompt beside the others' decodes, runner on the default backend, detokenizer) on Mixtral,
    against transformers' generate on the same prompt ids."""
    from conveyor.llm import LLM
    from conveyor.wire.messages import SamplingParams

    name = "mixtral_tokenizer"
    config = model_config(name)
    llm = LLM(config.path, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog, and then it runs back home again.", "Dear team"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    hf = hf_model(name)
    assert max(len(out.prompt_token_ids) for out in outputs) > 16  # chunked
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 6), out.prompt
