"""--tensor-parallel-size is refused, with one line naming the reason, where the model cannot be
split over that many ranks (conveyor/engine_config.py `check_tensor_parallel`), and accepted where it can:
KV heads split evenly or replicated (fewer KV heads than ranks, dividing them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.config import ConfigError
from conveyor.engine_config import build_engine_config


def config_dir(root: Path, **fields) -> str:
    """A checkpoint directory holding only config.json: building the config reads nothing else."""
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 509,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **fields,
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf))
    return str(root)


@pytest.mark.parametrize(
    ("fields", "tp", "device", "message"),
    [
        ({}, 3, "cpu", "--tensor-parallel-size 3: the model's 4 attention heads do not split evenly over 3 ranks"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, 3, "cpu", "the model's 4 KV heads neither split evenly over 3"),
        ({"intermediate_size": 90}, 4, "cpu", "the model's intermediate_size 90 does not split evenly over 4 ranks"),
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 30, "num_experts": 4, "num_experts_per_tok": 2},
            4,
            "cpu",
            "the model's moe_intermediate_size 30 does not split evenly over 4 ranks",
        ),
        (
            {
                "architectures": ["Qwen2MoeForCausalLM"],
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 50,
                "num_experts": 4,
                "num_experts_per_tok": 2,
            },
            4,
            "cpu",
            "the model's shared_expert_intermediate_size 50 does not split evenly over 4 ranks",
        ),
        ({}, 2, "cuda", "--tensor-parallel-size 2: only"),
    ],
)
def test_impossible_splits_are_refused_in_one_line(tmp_path, fields, tp, device, message):
    import torch

    if device == "cuda" and torch.cuda.device_count() >= tp:
        pytest.skip("this machine has the devices")
    with pytest.raises(ConfigError) as e:
        build_engine_config(config_dir(tmp_path / "m", **fields), device=device, tensor_parallel_size=tp)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 2), (2, 4), (1, 4), (4, 2)])
def test_kv_heads_split_or_replicated_are_accepted(tmp_path, kv_heads, tp):
    config = build_engine_config(config_dir(tmp_path / "m", num_key_value_heads=kv_heads), device="cpu", tensor_parallel_size=tp)
    assert config.parallel.tensor_parallel_size == tp
