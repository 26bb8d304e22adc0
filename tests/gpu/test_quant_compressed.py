"""compressed-tensors checkpoints (gpu/quant/formats/compressed.py), written by the package's own
compressors from a tiny float model (tests/gpu/quant_checkpoints.py): each layer's QuantizedWeight
against the package's decompression of the same tensors, logits against a float model holding
those decompressed weights, greedy tokens against transformers' own load of the checkpoint on the
CPU (`dequantize=True`: the weights decompressed, activations as they come, as conveyor serves
W8A8), and the configs and tensors conveyor refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.config import ConfigError
from conveyor.config.quant import QuantConfig
from conveyor.gpu.loading.loader import checkpoint_header, load_model
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.quant.scheme import scheme_for
from conveyor.tiny.checkpoint import make_checkpoint
from tests.conftest import SMALL
from tests.gpu.quant_checkpoints import (
    WEIGHTS,
    copy_checkpoint,
    decompress_layer,
    dequantized,
    served_greedy,
    transformers_greedy,
    write_compressed,
)
from tests.gpu.test_gpu_model import forward_prompts, random_prompts

pytest.importorskip("compressed_tensors")


def weights(bits: int, kind: str, strategy: str, symmetric: bool = True, **more) -> dict:
    return dict(num_bits=bits, type=kind, strategy=strategy, symmetric=symmetric, **more)


def w8a8(kind: str, strategy: str, **more) -> dict:
    """8-bit weights with 8-bit inputs quantized per token as they come (dynamic)."""
    return dict(
        weights=weights(8, kind, strategy, **more), input_activations=dict(num_bits=8, type=kind, strategy="token", dynamic=True)
    )


LLAMA, QWEN2 = "LlamaForCausalLM", "Qwen2ForCausalLM"
# name -> (architecture, format, the config group's scheme, the QuantizedWeight kind expected)
CASES = {
    "w4a16-group-asym": (LLAMA, "pack-quantized", dict(weights=weights(4, "int", "group", False, group_size=32)), "u4"),
    "w4a16-channel": (QWEN2, "pack-quantized", dict(weights=weights(4, "int", "channel")), "u4"),
    "w8a16-group-asym": (LLAMA, "pack-quantized", dict(weights=weights(8, "int", "group", False, group_size=32)), "u8"),
    "w8a8-int": (LLAMA, "int-quantized", w8a8("int", "channel"), "u8"),
    "w8a8-fp8": (LLAMA, "float-quantized", w8a8("float", "channel"), "e4m3"),
    "fp8-block": (QWEN2, "float-quantized", w8a8("float", "block", block_structure=[32, 32]), "e4m3"),
}
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compressed")
    floats = {arch: make_checkpoint(root / arch, arch, seed=7, **SMALL) for arch in (LLAMA, QWEN2)}
    groups = {name: {"group_0": {"targets": ["Linear"], **scheme}} for name, (_, _, scheme, _) in CASES.items()}
    return {name: write_compressed(floats[arch], root / name, fmt, groups[name]) for name, (arch, fmt, _, _) in CASES.items()}


def spec_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def layers_of(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each quantized layer's tensors, by suffix."""
    tensors = load_file(path / WEIGHTS)
    prefixes = {name.rpartition(".")[0] for name in tensors if name.endswith(".weight_scale")}
    return {p: {n.rpartition(".")[2]: t for n, t in tensors.items() if n.rpartition(".")[0] == p} for p in prefixes}


@pytest.mark.parametrize("name", CASES)
def test_dequantize_equals_the_package_decompression(name, checkpoints):
    path = checkpoints[name]
    scheme = scheme_for(QuantConfig("compressed-tensors", json.dumps(spec_of(path))))
    layers = layers_of(path)
    assert scheme.quantized_layers(checkpoint_header(path), set(layers) | {"lm_head"}) == set(layers)  # lm_head: ignored
    for prefix, parts in layers.items():
        expected = decompress_layer(spec_of(path), parts)
        weight = scheme.convert(prefix, dict(parts), tuple(expected.shape))
        assert weight.kind == CASES[name][3]
        # float32 scales: code * s + min rounds twice where the package's (q - zp) * s rounds once
        torch.testing.assert_close(weight.dequantize(), expected, rtol=2**-20, atol=2**-20 * float(expected.abs().max()))


@pytest.mark.parametrize("name", CASES)
def test_logits_match_the_decompressed_float_model(name, checkpoints, tmp_path):
    path = checkpoints[name]
    reference = dequantized(path, tmp_path / "float", lambda prefix, parts: decompress_layer(spec_of(path), parts))
    prompts = random_prompts([7, 19], seed=2)
    quantized, floats = read_model_config(path), read_model_config(reference)
    assert quantized.quantization is not None and floats.quantization is None
    got = forward_prompts(load_model(quantized, "cpu"), quantized, prompts)
    torch.testing.assert_close(got, forward_prompts(load_model(floats, "cpu"), floats, prompts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_greedy_matches_transformers(name, checkpoints):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    path = checkpoints[name]
    prompts = random_prompts([5, 12, 30], seed=3)
    config = CompressedTensorsConfig(dequantize=True)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config).eval()
    assert served_greedy(path, prompts, NUM_TOKENS) == transformers_greedy(reference, prompts, NUM_TOKENS)


def with_config(path: Path, dst: Path, **changes) -> Path:
    """A copy of checkpoint `path` whose quantization_config has `changes` (None: dropped)."""
    spec = {k: v for k, v in {**spec_of(path), **changes}.items() if v is not None}
    return copy_checkpoint(path, dst, load_file(path / WEIGHTS), spec)


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as error:
        load_model(read_model_config(path), "cpu")
    return str(error.value)


def test_configs_it_cannot_serve_are_named(checkpoints, tmp_path):
    path = checkpoints["w4a16-group-asym"]
    group = spec_of(path)["config_groups"]["group_0"]
    two_bit = {"group_0": {**group, "weights": {**group["weights"], "num_bits": 2}}}
    assert "config group group_0: 2-bit asymmetric int weights are not served in pack-quantized" in refusal(
        with_config(path, tmp_path / "2bit", config_groups=two_bit)
    )
    assert "format 'sparse-24-bitmask' is not served" in refusal(
        with_config(path, tmp_path / "sparse", format="sparse-24-bitmask", config_groups={"group_0": {**group, "format": None}})
    )
    kv = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}
    assert "kv_cache_scheme is not served (only FP8" in refusal(with_config(path, tmp_path / "kv", kv_cache_scheme=kv))
    assert "no config group of quantization_config targets it" in refusal(
        with_config(path, tmp_path / "ignored", ignore=["lm_head", "re:.*down_proj$"])
    )


def test_an_fp8_kv_cache_scheme_gives_the_fp8_cache_its_scales(checkpoints, tmp_path):
    """An FP8 kv_cache_scheme is served: its output scales reach the attention layers under
    --kv-cache-dtype fp8."""
    from conveyor.gpu.backends import select

    path = checkpoints["w4a16-group-asym"]
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    target = with_config(path, tmp_path / "kv", kv_cache_scheme=kv)
    tensors = load_file(target / WEIGHTS)
    tensors["model.layers.0.self_attn.k_proj.output_scale"] = torch.tensor([0.5])
    tensors["model.layers.0.self_attn.v_proj.output_scale"] = torch.tensor([0.25])
    save_file(tensors, target / WEIGHTS, metadata={"format": "pt"})
    config = read_model_config(target)
    model = load_model(config, "cpu", select("torch", "cpu", config, "float8_e4m3fn"))
    scales = model.model.layers[0].self_attn.kv_scales
    assert (scales.k, scales.v) == (0.5, 0.25)


def test_a_mismatched_scale_names_the_tensor(checkpoints, tmp_path):
    path = checkpoints["w8a8-int"]
    tensors = load_file(path / WEIGHTS)
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:-1]
    bad = copy_checkpoint(path, tmp_path / "bad", tensors, spec_of(path))
    assert refusal(bad) == f"tensor {name} has shape (63, 1), expected (64, 1)"


def test_a_mismatched_zero_point_names_the_tensor(checkpoints, tmp_path):
    path = checkpoints["w4a16-group-asym"]
    tensors = load_file(path / WEIGHTS)
    name = "model.layers.0.self_attn.o_proj.weight_zero_point"
    tensors[name] = torch.cat([tensors[name], tensors[name]])
    bad = copy_checkpoint(path, tmp_path / "bad", tensors, spec_of(path))
    assert refusal(bad) == f"tensor {name} has shape (16, 2), expected (8, 2)"
