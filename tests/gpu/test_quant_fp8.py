"""Hugging Face FP8 checkpoints (gpu/quant/formats/fp8.py), written by transformers' FineGrainedFP8
quantizer from a tiny float model (tests/gpu/quant_checkpoints.py), block-wise and per tensor, and
AutoFP8's per-tensor layout: each layer's QuantizedWeight against transformers' dequantizer, a last
partial tile against the definition, logits against a float model holding the dequantized weights,
greedy tokens against transformers' load that dequantizes FP8 (what it does without a GPU; asked
for, so on a GPU host too) or, for AutoFP8's layout that transformers does not read, against
conveyor serving the dequantized model; and the scales and configs conveyor refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conveyor.config import ConfigError
from conveyor.config.quant import QuantConfig
from conveyor.gpu.loading.loader import checkpoint_header, load_model
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.quant.scheme import scheme_for
from conveyor.tiny.checkpoint import make_checkpoint
from tests.conftest import SMALL
from tests.gpu.quant_checkpoints import WEIGHTS, copy_checkpoint, dequantized, served_greedy, transformers_greedy, write_fp8
from tests.gpu.test_gpu_model import forward_prompts, random_prompts

NUM_TOKENS = 16
CASES = ("block", "tensor", "autofp8")


def autofp8(path: Path, dst: Path) -> Path:
    """A per-tensor checkpoint in AutoFP8's layout: a 0-d `weight_scale` per layer, and static
    activations with an `input_scale` each (dropped by conveyor)."""
    tensors = {}
    for name, t in load_file(path / WEIGHTS).items():
        if name.endswith(".weight_scale_inv"):
            prefix = name.removesuffix(".weight_scale_inv")
            tensors.update({f"{prefix}.weight_scale": t.reshape(()), f"{prefix}.input_scale": torch.tensor(0.05)})
        else:
            tensors[name] = t
    return copy_checkpoint(path, dst, tensors, {"quant_method": "fp8", "activation_scheme": "static"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    llama = make_checkpoint(root / "llama", "LlamaForCausalLM", seed=8, **SMALL)
    qwen2 = make_checkpoint(root / "qwen2", "Qwen2ForCausalLM", seed=9, **SMALL)
    tensor = write_fp8(qwen2, root / "tensor", None)
    return {"block": write_fp8(llama, root / "block", (32, 32)), "tensor": tensor, "autofp8": autofp8(tensor, root / "autofp8")}


def reference_weight(prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' dequantization of one layer (its Fp8Dequantize, as its CPU load runs it)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    scale = parts["weight_scale_inv"] if "weight_scale_inv" in parts else parts["weight_scale"]
    return Fp8Dequantize(SimpleNamespace())._dequantize_one(parts["weight"], scale, torch.float32)


def scheme_of(path: Path):
    spec = json.loads((path / "config.json").read_text())["quantization_config"]
    return scheme_for(QuantConfig("fp8", json.dumps(spec)))


@pytest.mark.parametrize("name", CASES)
def test_dequantize_equals_transformers_dequantizer(name, checkpoints):
    path = checkpoints[name]
    tensors, header = load_file(path / WEIGHTS), checkpoint_header(path)
    scheme = scheme_of(path)
    linears = {n.removesuffix(".weight") for n in tensors if n.endswith(".weight") and tensors[n].ndim == 2 and "embed" not in n}
    layers = scheme.quantized_layers(header, linears)
    assert layers == linears - {"lm_head"} and len(layers) == 14
    for prefix in sorted(layers):
        parts = {s: tensors[f"{prefix}.{s}"] for s in scheme.required}
        weight = scheme.convert(prefix, parts, tuple(parts["weight"].shape))
        assert torch.equal(weight.dequantize(), reference_weight(prefix, parts)), prefix


def test_a_last_partial_tile_takes_its_tile_scale():
    """DeepSeek's [128, 128] tiles over a weight that neither divides: w[n, k] = code * s[n // 128, k // 128]."""
    n, k = 200, 96 + 64  # 2 x 2 tiles, the last ones partial; groups of gcd(160, 128) = 32
    gen = torch.Generator().manual_seed(0)
    codes = (torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=gen) + 0.5
    scheme = scheme_for(QuantConfig("fp8", json.dumps({"quant_method": "fp8", "weight_block_size": [128, 128]})))
    weight = scheme.convert("layer", {"weight": codes, "weight_scale_inv": scale}, (n, k))
    assert weight.group_size == 32 and weight.scales.shape == (n, k // 32)
    rows, cols = torch.arange(n) // 128, torch.arange(k) // 128
    assert torch.equal(weight.dequantize(), codes.float() * scale[rows][:, cols])


@pytest.mark.parametrize("name", CASES)
def test_logits_match_the_dequantized_float_model(name, checkpoints, tmp_path):
    path = checkpoints[name]
    reference = dequantized(path, tmp_path / "float", reference_weight)
    prompts = random_prompts([7, 19], seed=2)
    quantized, floats = read_model_config(path), read_model_config(reference)
    got = forward_prompts(load_model(quantized, "cpu"), quantized, prompts)
    torch.testing.assert_close(got, forward_prompts(load_model(floats, "cpu"), floats, prompts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["block", "tensor"])
def test_greedy_matches_transformers_dequantizing(name, checkpoints):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path = checkpoints[name]
    prompts = random_prompts([5, 12, 30], seed=3)
    config = FineGrainedFP8Config(dequantize=True, modules_to_not_convert=["lm_head"])  # as it loads without a GPU
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config).eval()
    assert served_greedy(path, prompts, NUM_TOKENS) == transformers_greedy(reference, prompts, NUM_TOKENS)


def test_autofp8_greedy_matches_the_dequantized_model(checkpoints, tmp_path):
    path = checkpoints["autofp8"]
    prompts = random_prompts([5, 12, 30], seed=3)
    reference = dequantized(path, tmp_path / "float", reference_weight)
    assert served_greedy(path, prompts, NUM_TOKENS) == served_greedy(reference, prompts, NUM_TOKENS)


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as error:
        load_model(read_model_config(path), "cpu")
    return str(error.value)


def test_a_mismatched_block_scale_names_the_tensor(checkpoints, tmp_path):
    path = checkpoints["block"]
    tensors = load_file(path / WEIGHTS)
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"  # [64, 160] in 32 x 32 tiles: [2, 5]
    tensors[name] = tensors[name][:, :4]
    spec = json.loads((path / "config.json").read_text())["quantization_config"]
    assert refusal(copy_checkpoint(path, tmp_path / "bad", tensors, spec)) == f"tensor {name} has shape (2, 4), expected (2, 5)"


def test_a_per_tensor_scale_must_be_one(checkpoints, tmp_path):
    path = checkpoints["autofp8"]
    tensors = load_file(path / WEIGHTS)
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    tensors[name] = tensors[name].repeat(2)
    bad = copy_checkpoint(path, tmp_path / "bad", tensors, {"quant_method": "fp8", "activation_scheme": "static"})
    assert refusal(bad) == f"tensor {name} has shape (2,), expected one per-tensor scale"


def test_configs_it_cannot_serve_are_named(checkpoints, tmp_path):
    path = checkpoints["block"]
    tensors = load_file(path / WEIGHTS)
    spec = json.loads((path / "config.json").read_text())["quantization_config"]
    ue8m0 = copy_checkpoint(path, tmp_path / "ue8m0", tensors, {**spec, "scale_fmt": "ue8m0"})
    assert refusal(ue8m0) == "fp8 quantization_config scale_fmt 'ue8m0' is not served; served: float"
    three = copy_checkpoint(path, tmp_path / "three", tensors, {**spec, "weight_block_size": [32, 32, 1]})
    assert refusal(three) == "fp8 quantization_config weight_block_size [32, 32, 1]: two positive integers"
