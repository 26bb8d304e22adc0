"""`--quantization int8 | fp8` and the quantization config's refusals: a float checkpoint's
projections quantized as they load (the LM head and the embedding stay float) serve the greedy
tokens of a float checkpoint holding those weights dequantized; a method conveyor cannot serve,
or --quantization on a quantized checkpoint, is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor import LLM, SamplingParams
from conveyor.config.errors import ConfigError
from conveyor.engine_config import build_engine_config
from conveyor.gpu.models.layers import Linear
from conveyor.gpu.quant.formats.online import INT8_GROUP
from conveyor.gpu.quant.weight import quantize_groups
from conveyor.tiny.checkpoint import make_checkpoint

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog", "a"]
SIZES = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("online") / "hf", "Qwen2ForCausalLM", seed=7, **SIZES)


def dequantized_copy(source: Path, target: Path, kind: str) -> Path:
    """source with each projection replaced by what `kind` quantization at load makes of it."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    for name, w in tensors.items():
        if name.endswith("proj.weight"):
            group = INT8_GROUP if kind == "u8" else w.shape[1]
            tensors[name] = quantize_groups(w, kind, group).dequantize().to(w.dtype)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("method,kind", [("int8", "u8"), ("fp8", "e4m3")])
def test_quantized_at_load_serves_the_dequantized_weights_tokens(method, kind, checkpoint, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(checkpoint), device="cpu", num_kv_blocks=64, quantization=method)
    model = llm.runner.model
    projections = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]
    assert projections and all(m.weight is None and m.quantized.kind == kind for m in projections)
    assert model.lm_head.quantized is None and model.lm_head.weight is not None
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    reference = LLM(str(dequantized_copy(checkpoint, tmp_path / "deq", kind)), device="cpu", num_kv_blocks=64)
    assert ours == [o.outputs[0].token_ids for o in reference.generate(PROMPTS, params)]


def test_an_unserved_method_is_one_line(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ConfigError, match=r"quantization method 'bitsandbytes' in config.json is not served; served: gguf, awq"):
        build_engine_config(str(bad), device="cpu")
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    with pytest.raises(ConfigError, match=r"--quantization int8: the checkpoint is already quantized \(gguf\)"):
        build_engine_config(str(bad), device="cpu", quantization="int8")


def test_a_quantized_layer_without_its_tensors_is_named(checkpoint, tmp_path):
    """A GGUF-marked checkpoint whose q_proj has blocks but no type: the loader names the tensor."""
    bad = tmp_path / "half"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.gguf_blocks"] = torch.zeros(128, 72, dtype=torch.uint8)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError,
        match=r"quantized layer model\.layers\.0\.self_attn\.q_proj lacks tensor model\.layers\.0\.self_attn\.q_proj\.gguf_type",
    ):
        LLM(str(bad), device="cpu", num_kv_blocks=16)
