"""compressed-tensors checkpoints (llm-compressor's output, quant_method "compressed-tensors") ->
QuantizedWeight.

The quantization_config is read by the compressed-tensors package itself (its pydantic
QuantizationConfig, presets resolved), and which linear layers a config group quantizes is its own
matcher's answer: targets ("Linear", names, "re:" patterns) less `ignore`, the most specific
target deciding where groups overlap, as its apply_quantization_config decides. Served:

| format          | a layer's tensors (+ weight_zero_point where asymmetric)  | weights          | kind |
| pack-quantized  | weight_packed int32 [N, K * b / 32], weight_shape, scale  | int, 4 or 8 bits | u4*  |
| int-quantized   | weight int8 [N, K], weight_scale                          | int, 8 bits      | u8   |
| float-quantized | weight float8_e4m3fn [N, K], weight_scale                 | float, 8 bits    | e4m3 |
* u8 for 8 bits, and for 4 bits in groups that are not whole u4 chunks of 32.
Scales per tensor, channel or group, and for FP8 per block (fp8.py's expand_blocks). An int code
q in [-2^(b-1), 2^(b-1)) is kept as q + 2^(b-1): w = (q - zp) * s has min -(2^(b-1) + zp) * s.
Activations are not quantized here: W8A8 checkpoints (int8 or FP8 inputs, dynamic per token, or
static with an input_scale, which is dropped) serve as weight-only on the torch ops, as
transformers' `dequantize=True` load computes them (a backend that multiplies e4m3 weights in FP8
quantizes activations its own way). Anything else (another format, other bit widths, output
activations, sparsity, transforms, a kv_cache_scheme other than FP8's) is one ConfigError naming it.
An FP8 kv_cache_scheme's `k_proj/v_proj.output_scale` tensors are the KV cache's per-layer scales
under `--kv-cache-dtype fp8` (gpu/quant/kv_scales.py reads them; without it they are unused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from conveyor.config.errors import ConfigError
from conveyor.config.quant import QuantConfig
from conveyor.gpu.quant.formats.fp8 import SCALE_DTYPES, expand_blocks
from conveyor.gpu.quant.scheme import QuantScheme, expect
from conveyor.gpu.quant.weight import CHUNK, QuantizedWeight, pack_u4

# format -> (weight type, bits served, scale strategies served); int-quantized and float-quantized
# are naive-quantized by another name (the weight in its narrow dtype).
FORMATS = {
    "pack-quantized": ("int", (4, 8), ("tensor", "channel", "group")),
    "int-quantized": ("int", (8,), ("tensor", "channel", "group")),
    "float-quantized": ("float", (8,), ("tensor", "channel", "group", "block")),
    "naive-quantized": (None, (8,), ("tensor", "channel", "group", "block")),
}
STORED = {"int": torch.int8, "float": torch.float8_e4m3fn}


class CompressedTensors(QuantScheme):
    def __init__(self, config: QuantConfig) -> None:
        super().__init__(config)
        ct = parse(self.spec)
        # target -> its group's scheme, in the config's order (a later group's same target wins)
        self.targets: dict[str, Any] = {t: scheme for scheme in ct.config_groups.values() for t in scheme.targets}
        self.ignore: list[str] = list(ct.ignore or [])
        self.layers: dict[str, Any] = {}  # prefix -> its QuantizationScheme, set by quantized_layers
        formats = {check_group(name, scheme, scheme.format or ct.format) for name, scheme in ct.config_groups.items()}
        packed = {fmt == "pack-quantized" for fmt in formats}
        zero_points = {not scheme.weights.symmetric for scheme in ct.config_groups.values()}
        # Every layer's required tensors are the same (gpu/quant/load.py converts on the last one).
        if len(packed) > 1:
            raise ConfigError(f"compressed-tensors config groups in formats {', '.join(sorted(formats))} together are not served")
        if len(zero_points) > 1:
            raise ConfigError("compressed-tensors config groups with symmetric and asymmetric weights together are not served")
        self.formats, self.packed = sorted(formats), packed.pop()
        self.required = ("weight_packed", "weight_scale", "weight_shape") if self.packed else ("weight", "weight_scale")
        self.required += ("weight_zero_point",) if zero_points.pop() else ()

    def quantized_layers(self, tensors: Mapping[str, torch.dtype], candidates: set[str]) -> set[str]:
        from compressed_tensors.utils import is_match, match_targets

        linear = torch.nn.Linear(1, 1, device="meta")  # the matcher reads class targets ("Linear") off a module
        for prefix in sorted(candidates):
            if is_match(prefix, linear, self.targets, self.ignore):
                self.layers[prefix] = self.targets[match_targets(prefix, linear, self.targets)[0]]
            elif f"{prefix}.weight_packed" in tensors or tensors.get(f"{prefix}.weight") in STORED.values():
                raise ConfigError(f"layer {prefix} is stored quantized, but no config group of quantization_config targets it")
        return set(self.layers)

    def convert(self, prefix: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        args = self.layers[prefix].weights
        n, k = shape
        scales, group = group_scales(prefix, parts["weight_scale"], args, shape)
        if args.type == "float":
            expect(prefix, "weight", parts["weight"], shape, (torch.float8_e4m3fn,))
            return QuantizedWeight("e4m3", group, parts["weight"], scales, None)
        from compressed_tensors.compressors import unpack_from_int32

        bits, groups = args.num_bits, k // group
        if self.packed:
            expect(prefix, "weight_shape", parts["weight_shape"], (2,))
            if parts["weight_shape"].tolist() != [n, k]:
                raise ConfigError(f"tensor {prefix}.weight_shape is {parts['weight_shape'].tolist()}, expected {[n, k]}")
            expect(prefix, "weight_packed", parts["weight_packed"], (n, -(-k * bits // 32)), (torch.int32,))
            q = unpack_from_int32(parts["weight_packed"], bits, torch.Size((n, k)))  # [N, K] int8, signed
        else:
            expect(prefix, "weight", parts["weight"], shape, (torch.int8,))
            q = parts["weight"]
        zero = torch.zeros(n, groups)
        if "weight_zero_point" in parts:
            zp = parts["weight_zero_point"]
            if self.packed and args.strategy in ("group", "channel"):  # packed along the output rows
                expect(prefix, "weight_zero_point", zp, (-(-n * bits // 32), groups), (torch.int32,))
                zp = unpack_from_int32(zp, bits, torch.Size((n, groups)), packed_dim=0)
            if args.strategy == "tensor" and zp.numel() == 1:
                zp = zp.reshape(1)
            expect(prefix, "weight_zero_point", zp, (1,) if args.strategy == "tensor" else (n, groups))
            zero = zp.float().expand(n, groups)
        offset = 1 << (bits - 1)
        codes = (q.to(torch.int16) + offset).to(torch.uint8)
        mins = -(offset + zero) * scales
        if bits == 4 and group % CHUNK == 0:
            return QuantizedWeight("u4", group, pack_u4(codes), scales, mins)
        return QuantizedWeight("u8", group, codes, scales, mins)

    def describe(self) -> str:
        return f"compressed-tensors {', '.join(self.formats)}, activations not quantized"


def parse(spec: dict[str, Any]) -> Any:
    """config.json's quantization_config -> the package's QuantizationConfig, or a ConfigError."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError
    except ImportError:
        raise ConfigError(
            "compressed-tensors checkpoints are read by the compressed-tensors package: pip install 'conveyor[compressed-tensors]'"
        ) from None
    for key in ("sparsity_config", "transform_config"):
        if spec.get(key):  # sparse-24 weights, Hadamard rotations
            raise ConfigError(f"compressed-tensors quantization_config {key} is not served: {spec[key]}")
    kv = spec.get("kv_cache_scheme")
    if kv and (kv.get("type") != "float" or kv.get("num_bits") != 8 or kv.get("strategy", "tensor") != "tensor"):
        raise ConfigError(f"compressed-tensors kv_cache_scheme is not served (only FP8 with a scale per layer): {kv}")
    try:
        return QuantizationConfig.model_validate(spec)
    except (ValidationError, ValueError, KeyError, NotImplementedError) as e:
        first = e.errors()[0] if isinstance(e, ValidationError) else None
        where = ".".join(map(str, first["loc"])) if first else ""
        raise ConfigError(f"compressed-tensors quantization_config {where}: {first['msg'] if first else e}") from None


def check_group(name: str, scheme: Any, fmt: str) -> str:
    """The group's format, if served; or a ConfigError naming the group and what it asks."""
    what = f"compressed-tensors config group {name}"
    if fmt not in FORMATS:
        raise ConfigError(f"{what}: format {fmt!r} is not served; served: {', '.join(FORMATS)}")
    kind, bits, strategies = FORMATS[fmt]
    w, inputs = scheme.weights, scheme.input_activations
    if w is None or scheme.output_activations is not None:
        raise ConfigError(f"{what}: only weight quantization is served (it quantizes {'outputs' if w else 'no weights'})")
    if kind is not None and w.type != kind or w.num_bits not in bits or w.type == "float" and not w.symmetric:
        sym, served = "symmetric" if w.symmetric else "asymmetric", f"{' or '.join(map(str, bits))}-bit {kind or 'int or float'}"
        raise ConfigError(f"{what}: {w.num_bits}-bit {sym} {w.type} weights are not served in {fmt} (served: {served})")
    if w.strategy not in strategies or w.dynamic:
        raise ConfigError(f"{what}: {'dynamic ' if w.dynamic else ''}{w.strategy} weight scales are not served in {fmt}")
    if inputs is not None and inputs.num_bits != 8:
        raise ConfigError(f"{what}: {inputs.num_bits}-bit input activations are not served")
    return fmt


def group_scales(prefix: str, scale: torch.Tensor, args: Any, shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """weight_scale -> (scales [N, K / G] float32, G)."""
    n, k = shape
    if args.strategy == "block":
        return expand_blocks(prefix, "weight_scale", scale, (args.block_structure[0], args.block_structure[1]), shape)
    group = args.group_size if args.strategy == "group" else k
    if k % group:
        raise ConfigError(f"tensor {prefix}.weight_scale: groups of {group} do not divide the {k} inputs")
    if args.strategy == "tensor" and scale.numel() == 1:  # (1,) as the package writes it, or a scalar
        scale = scale.reshape(1)
    expect(prefix, "weight_scale", scale, (1,) if args.strategy == "tensor" else (n, k // group), SCALE_DTYPES)
    return scale.float().expand(n, k // group).contiguous(), group
