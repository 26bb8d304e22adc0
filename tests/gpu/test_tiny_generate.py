"""conveyor/tiny/generate.py: the benchmark checkpoint generator, run at the tiny shape (the
Llama-3-8B one is checked by its parameter count on the meta device, without weights)."""

from __future__ import annotations

import json

import torch
import transformers
from safetensors.torch import load_file

from conveyor.gpu.models.registry import read_model_config
from conveyor.tiny.generate import SHAPES, main


def test_generates_a_loadable_bfloat16_checkpoint(tmp_path):
    assert main([str(tmp_path / "bf16"), "--shape", "tiny", "--dtype", "bfloat16", "--seed", "3"]) == 0
    assert main([str(tmp_path / "fp32"), "--shape", "tiny", "--dtype", "float32", "--seed", "3"]) == 0
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["hidden_size"] == SHAPES["tiny"]["hidden_size"]
    assert read_model_config(tmp_path / "bf16").dtype == "bfloat16"

    # Cast tensor by tensor as drawn: the same numbers as the float32 checkpoint, rounded once.
    bf16, fp32 = load_file(tmp_path / "bf16" / "model.safetensors"), load_file(tmp_path / "fp32" / "model.safetensors")
    assert bf16.keys() == fp32.keys()
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16


def test_llama3_8b_shape_has_its_parameter_count():
    shape = {k: v for k, v in SHAPES["llama3-8b"].items() if k != "rope_theta"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
