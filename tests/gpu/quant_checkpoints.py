"""Tiny quantized checkpoints for the format tests, each written by its format's own packer from a
float checkpoint (conveyor/tiny): compressed-tensors' compressors over transformers' model of it,
scales from the package's calculate_qparams; transformers' FineGrainedFP8 quantizer (Fp8Quantize)
for HF FP8. Deterministic: the float weights are seeded and both packers round to nearest.
Also: `dequantized`, the float checkpoint whose quantized layers hold a reference dequantizer's
weights (the float model that logits are compared with).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
# A layer's tensors that make its weight, in either format (a float layer has `weight` alone).
WEIGHT_PARTS = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_scale_inv", "input_scale")


def copy_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any] | None) -> Path:
    """src's files with `tensors` as its weights and `quantization_config` in its config.json."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    save_file({name: t.contiguous() for name, t in tensors.items()}, dst / WEIGHTS)
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_compressed(src: Path, dst: Path, fmt: str, groups: dict[str, Any], ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """src quantized by compressed-tensors: its config groups applied to transformers' model,
    each weight's scale and zero point from calculate_qparams over the strategy's min and max,
    then ModelCompressor compresses the model into `fmt` and writes its config."""
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = QuantizationConfig(config_groups=groups, ignore=list(ignore), format=fmt, quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, config)
    modules: list[Any] = list(model.modules())
    for module in modules:
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            lo, hi = _ranges(module.weight.data, scheme.weights)
            scale, zero_point = calculate_qparams(lo, hi, scheme.weights)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    copy_checkpoint(src, dst, dict(model.state_dict()), None)
    compressor.update_config(str(dst))
    return dst


def _ranges(w: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max of w [N, K] over each scale's elements, in the scale's shape."""
    n, k = w.shape
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy == "group":
        g = w.view(n, k // args.group_size, args.group_size)
        return g.amin(-1), g.amax(-1)
    bn, bk = args.block_structure  # block: tiles that divide the weight
    tiles = w.view(n // bn, bn, k // bk, bk)
    return tiles.amin((1, 3)), tiles.amax((1, 3))


def decompress_layer(config: dict[str, Any], parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompression of one layer's tensors (by suffix) to its float weight."""
    from compressed_tensors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    ct = QuantizationConfig.model_validate(config)
    (scheme,) = ct.config_groups.values()  # the tests' checkpoints have one group
    assert isinstance(scheme, QuantizationScheme)
    compressor: Any = BaseCompressor.get_value_from_registry(scheme.format or ct.format)
    return compressor.decompress(parts, scheme)["weight"]


def write_fp8(src: Path, dst: Path, block: tuple[int, int] | None) -> Path:
    """src's linear weights (all but the LM head) quantized by transformers' FineGrainedFP8
    quantizer: e4m3 codes and `weight_scale_inv` per bn x bk tile, or one per tensor ([1, 1])."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=block)  # type: ignore[arg-type]  # None: per tensor, as it allows
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=config))
    tensors = {}
    for name, t in load_file(src / WEIGHTS).items():
        linear = t.ndim == 2 and "embed_tokens" not in name and not name.startswith("lm_head")
        tensors.update(quantize.convert({name: t}) if linear else {name: t})  # type: ignore[arg-type]  # it takes a dict
    spec = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
    return copy_checkpoint(src, dst, tensors, {**spec, "modules_to_not_convert": ["lm_head"]})


def dequantized(quantized: Path, dst: Path, layer_weight: Callable[[str, dict[str, torch.Tensor]], torch.Tensor]) -> Path:
    """The float checkpoint of `quantized`: each quantized layer's `weight` is layer_weight(prefix,
    its tensors by suffix), the rest as stored."""
    floats: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(quantized / WEIGHTS).items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in WEIGHT_PARTS:
            layers.setdefault(prefix, {})[suffix] = t
        else:  # biases, norms
            floats[name] = t
    for prefix, parts in layers.items():
        quantized_layer = "weight_scale" in parts or "weight_scale_inv" in parts
        floats[f"{prefix}.weight"] = layer_weight(prefix, parts).float() if quantized_layer else parts["weight"]
    return copy_checkpoint(quantized, dst, floats, None)


def served_greedy(path: Path, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """conveyor's greedy continuation of each prompt, served from `path` on the CPU."""
    from conveyor import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    return [out.outputs[0].token_ids for out in outputs]


def transformers_greedy(model: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """A transformers model's argmax continuation of each prompt, token by token."""
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(num_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outputs.append(ids[len(prompt) :])
    return outputs
