"""AdapterInfo: a PEFT LoRA adapter directory, read and checked against the model without torch.

`read_adapter_info(name, path, model, max_rank)` reads `adapter_config.json` and the header of
`adapter_model.safetensors` (a little-endian u64 length, then that many bytes of JSON: each
tensor's dtype, shape and offsets), so the torch-free scheduler refuses a bad adapter where it is
named; gpu/lora/weights.py loads the tensors. Which modules an adapter covers follows PEFT's own
matching (`_targeted`: a list of names matched as suffixes, a regex string matched whole,
`exclude_modules`, `layers_to_transform` with `layers_pattern`) over the model's module paths,
`model.layers.{i}.self_attn.q_proj`: those its checkpoint holds, else every layer's seven (the
MLP's only on a mixture-of-experts model's dense layers).

Refusals are LoraErrors, one line naming the key at fault: not an adapter directory, another
peft_type, a field that changes the computation beyond y += scaling * x A^T B^T (DoRA, biases,
modules_to_save, per-module rank_pattern / alpha_pattern, ...: UNSUPPORTED), a module outside
LORA_TARGETS or absent from the model, a rank over max_rank, a tensor missing, unexpected, or of
the wrong shape or dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = LORA_TARGETS[:4]  # under self_attn; the others under mlp
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FLOAT_DTYPES = ("F16", "BF16", "F32")
# A LoRA target's path in the model (`model.layers.3.mlp.up_proj`), and its tensors in the file.
_MODULE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)")
_TENSOR = re.compile(r"base_model\.model\.(model\.layers\.\d+\.\w+\.\w+)\.lora_([AB])\.weight")
# adapter_config.json fields that change the computation beyond y += scaling * (x A^T) B^T, refused
# when set (truthy); rank_pattern / alpha_pattern would give each module its own scaling.
UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "fully trained copies of modules",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "lora_bias": "a bias on lora_B",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on parameters (MoE experts)",
    "layer_replication": "replicated layers",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
}
# init_lora_weights values whose adapter was trained on base weights changed at initialisation.
CHANGED_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")


class LoraError(ConfigError):
    """An adapter that cannot be served: one line naming the key at fault."""


Fail = Callable[[str], LoraError]  # what is wrong -> the error naming the adapter


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: frozenset[str]  # a subset of LORA_TARGETS


def read_adapter_info(name: str, path: str, model: ModelConfig, max_rank: int) -> AdapterInfo:
    """The adapter in directory `path`, checked against `model` and --max-lora-rank; a LoraError
    naming the key at fault otherwise."""
    root = Path(path).expanduser()

    def fail(what: str) -> LoraError:
        return LoraError(f"LoRA adapter {name!r} ({path}): {what}")

    if not (root / CONFIG_FILE).is_file():
        raise fail(f"not a LoRA adapter (no {CONFIG_FILE} in a directory)")
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")
    rank, scaling = _rank_and_scaling(config, max_rank, fail)
    modules = _model_modules(model)
    expected = _targeted(config, modules, fail)
    header = _read_weights_header(root, fail)
    _check_tensors(header, expected, modules, rank, model, fail)
    return AdapterInfo(name, str(root), rank, scaling, frozenset(target for _, target in expected))


def _rank_and_scaling(config: dict[str, Any], max_rank: int, fail: Fail) -> tuple[int, float]:
    if config.get("peft_type") != "LORA":
        raise fail(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise fail(f"{key} {config[key]!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise fail(f"bias {config['bias']!r}: trained biases are not supported (only 'none')")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(CHANGED_BASE):
        raise fail(f"init_lora_weights {init!r}: trained on changed base weights (convert it to a plain LoRA first)")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise fail(f"r {rank!r} is not a positive integer")
    if rank > max_rank:
        raise fail(f"r {rank} is over --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise fail(f"lora_alpha {alpha!r} is not a number")
    return rank, float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _targeted(config: dict[str, Any], modules: dict[str, tuple[int, str] | None], fail: Fail) -> set[tuple[int, str]]:
    """The (layer, target) pairs PEFT wrapped: the model's modules that the config matches
    (peft's check_target_module_exists, over `modules`)."""
    targets = config.get("target_modules")
    if targets == "all-linear":  # PEFT saves the names it chose; an older file may keep the alias
        targets = list(LORA_TARGETS)
    matches: Callable[[str], object]
    if isinstance(targets, str):
        try:
            matches = re.compile(targets).fullmatch
        except re.error as e:
            raise fail(f"target_modules {targets!r} is not a regular expression: {e}") from None
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        for target in targets:
            if target.rsplit(".", 1)[-1] not in LORA_TARGETS:
                raise fail(f"target_modules {target!r} is not one of {', '.join(LORA_TARGETS)}")
        matches = functools.partial(_matches_names, targets, config.get("layers_to_transform"), config.get("layers_pattern"))
    else:
        raise fail(f"target_modules {targets!r} is neither a list of names nor a regular expression")
    excluded = config.get("exclude_modules") or []
    found = set()
    for module, pair in modules.items():
        if _excluded(excluded, module) or not matches(module):
            continue
        if pair is None:
            raise fail(f"target_modules {targets!r} names {module}, not one of {', '.join(LORA_TARGETS)} of a decoder layer")
        found.add(pair)
    if not found:
        raise fail(f"target_modules {targets!r} names no module of this model")
    return found


def _matches_names(names: list[str], layers: int | list[int] | None, patterns: str | list[str] | None, module: str) -> bool:
    if not any(module == name or module.endswith("." + name) for name in names):
        return False
    if layers is None or layers == []:
        return True
    patterns = [patterns] if isinstance(patterns, str) else patterns or [r"[^.]*"]
    found = next((m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(\d+)\.", module))), None)
    return found is not None and int(found.group(1)) in (layers if isinstance(layers, list) else [layers])


def _excluded(excluded: str | list[str], module: str) -> bool:
    if isinstance(excluded, str):
        return re.fullmatch(excluded, module) is not None
    return any(module == name or module.endswith("." + name) for name in excluded)


@functools.cache
def _model_modules(model: ModelConfig) -> dict[str, tuple[int, str] | None]:
    """The model's modules by PEFT path -> (layer, target) for a LoRA target, None for another:
    the modules its checkpoint holds tensors of, or, without a readable checkpoint, every
    layer's seven targets (the MLP's only on dense layers)."""
    sparse = set(model.moe.sparse_layers) if model.moe else set()
    checkpoint = _checkpoint_modules(Path(model.path))
    modules: dict[str, tuple[int, str] | None] = {}
    for layer in range(model.num_layers):
        for target in LORA_TARGETS:
            attention = target in ATTENTION_TARGETS
            path = f"model.layers.{layer}.{'self_attn' if attention else 'mlp'}.{target}"
            if (path in checkpoint) if checkpoint else (attention or layer not in sparse):
                modules[path] = (layer, target)
    return {**{m: None for m in checkpoint}, **modules}


def _checkpoint_modules(root: Path) -> set[str]:
    """The modules (tensor names less their last part) of a checkpoint's safetensors files."""
    index = root / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text())["weight_map"])
        else:
            names = [n for f in sorted(root.glob("*.safetensors")) for n in read_safetensors_header(f)]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {name.rsplit(".", 1)[0] for name in names}


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensors: name -> {"dtype", "shape", "data_offsets"}. ValueError for a
    file that is not one (a header past the file's end, not JSON, offsets past the data)."""
    with open(path, "rb") as f:
        size = path.stat().st_size
        (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\xff"))
        if length > size - 8:
            raise ValueError(f"a header of {length} bytes in a file of {size}")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= size - 8 - length):
            raise ValueError(f"tensor {name!r} has no data_offsets inside the file")
    return header


def _read_weights_header(root: Path, fail: Fail) -> dict[str, dict[str, Any]]:
    path = root / WEIGHTS_FILE
    if not path.is_file():
        other = " (only safetensors are read: save with safe_serialization=True)" if (root / "adapter_model.bin").exists() else ""
        raise fail(f"no {WEIGHTS_FILE}{other}")
    try:
        return read_safetensors_header(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise fail(f"{WEIGHTS_FILE} is not a safetensors file: {e}") from None


def _check_tensors(
    header: dict[str, dict[str, Any]],
    expected: set[tuple[int, str]],
    modules: dict[str, tuple[int, str] | None],
    rank: int,
    model: ModelConfig,
    fail: Fail,
) -> None:
    """Every tensor is lora_A [r, in] or lora_B [out, r] of an expected module, in a float dtype,
    and every expected module has both."""
    seen = set()
    for key, entry in header.items():
        match = _TENSOR.fullmatch(key)
        pair = modules.get(match.group(1)) if match else None
        if match is None:
            raise fail(f"tensor {key}: not a lora_A / lora_B weight of {', '.join(LORA_TARGETS)}")
        if pair is None:
            raise fail(f"tensor {key}: not a LoRA weight of a module of this model")
        if pair not in expected:
            raise fail(f"tensor {key}: its module is not in target_modules")
        fan_in, fan_out = _dims(model, pair[1])
        want = [rank, fan_in] if match.group(2) == "A" else [fan_out, rank]
        if entry.get("shape") != want:
            raise fail(f"tensor {key}: shape {entry.get('shape')} is not {want} (r, and this model's sizes)")
        if entry.get("dtype") not in FLOAT_DTYPES:
            raise fail(f"tensor {key}: dtype {entry.get('dtype')} is not one of {', '.join(FLOAT_DTYPES)}")
        seen.add((*pair, match.group(2)))
    for layer, target in sorted(expected):
        for half in "AB":
            if (layer, target, half) not in seen:
                block = "self_attn" if target in ATTENTION_TARGETS else "mlp"
                raise fail(f"tensor base_model.model.model.layers.{layer}.{block}.{target}.lora_{half}.weight is missing")


def _dims(model: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of a target projection."""
    hidden, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[target]
