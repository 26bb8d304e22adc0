"""ModelConfig reads both transformers 4 and 5 spellings of config.json and refuses what the
decoder cannot run, with one clear line."""

from __future__ import annotations

import json

import pytest

from conveyor.config import ConfigError, EngineConfig, config_from_json, config_to_json
from conveyor.gpu.models.registry import read_model_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}


def load(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    return read_model_config(tmp_path)


def test_transformers_4_and_5_spellings_agree(tmp_path):
    v4 = load(tmp_path, torch_dtype="bfloat16", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    v5 = load(tmp_path, dtype="bfloat16", rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0})
    assert v4 == v5
    assert (v5.dtype, v5.rope_theta, v5.rope_type, v5.num_kv_heads, v5.head_dim) == ("bfloat16", 5e5, "linear", 4, 8)


def test_qwen2_biases_and_windows(tmp_path):
    qwen = load(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False)
    assert (qwen.qkv_bias, qwen.o_bias, qwen.sliding_window) == (True, False, None)
    # Windows on the layers from max_window_layers on, full attention below (issue 17).
    mixed = load(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=True, max_window_layers=1)
    assert mixed.layer_windows == (None, 64) and [mixed.window_of(i) for i in range(2)] == [None, 64]


def test_max_model_len_is_capped_by_the_model(tmp_path):
    assert load(tmp_path).max_model_len == 128
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert read_model_config(tmp_path, max_model_len=64).max_model_len == 64


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"dtype": "int8"}, "unsupported dtype"),
        ({"rope_parameters": {"rope_type": "su-2"}}, "unsupported rope_type"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "needs a number for short_factor"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "needs a number for factor"),
        ({"hidden_size": None}, "malformed config.json"),
    ],
)
def test_refusals(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, **fields)


def test_engine_config_round_trips_through_json(tmp_path):
    config = EngineConfig(
        model=load(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    )
    assert config_from_json(config_to_json(config)) == config


def test_config_imports_neither_gpu_nor_the_front_door():
    """config/ declares; reading a checkpoint with its family (gpu/models/registry.py) and resolving
    --model (conveyor/engine_config.py, conveyor/default_model.py) happen above it. Lazy imports count."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "config"
    for file in root.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                assert not name.startswith(("conveyor.gpu", "conveyor.default_model", "conveyor.engine_config")), (file.name, name)


def test_family_fields_no_adapter_took_are_refused(tmp_path):
    """Soft-capping is Gemma's: the generic check refuses it wherever the family's adapter left it."""
    gemma = load(tmp_path, architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    assert (gemma.attn_logit_softcap, gemma.final_logit_softcap) == (50.0, 30.0)
    for arch in ("LlamaForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        with pytest.raises(ConfigError, match=f"unsupported logit soft-capping for {arch}") as info:
            load(tmp_path, architectures=[arch], final_logit_softcapping=30.0)
        assert "\n" not in str(info.value)
