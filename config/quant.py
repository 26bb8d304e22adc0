"""QuantConfig: how a checkpoint's linear weights are stored, read from config.json's
`quantization_config` (or asked for with `--quantization`, to quantize a float checkpoint as it
loads).

Only the method and the published fields travel here, as the file gives them (a JSON string, so
the dataclass stays frozen and hashable); each method's reader in gpu/quant/ interprets them, so
config/ stays free of torch and of the formats' packages. A method conveyor cannot serve is one
ConfigError line naming it and the ones it can.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from conveyor.config.errors import ConfigError

# config.json quant_method -> the name gpu/quant/ knows it by. "gguf" is written by conveyor's
# own GGUF conversion (gpu/loading/gguf/convert.py), which keeps the file's blocks packed.
CHECKPOINT_METHODS = {
    "gguf": "gguf",
    "awq": "awq",
    "gptq": "gptq",
    "compressed-tensors": "compressed-tensors",
    "fp8": "fp8",
}
# --quantization: a float checkpoint quantized as it loads.
ONLINE_METHODS = ("int8", "fp8")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: str  # a value of CHECKPOINT_METHODS, or "online-int8" / "online-fp8"
    spec_json: str = "{}"  # the quantization_config as published

    @property
    def spec(self) -> dict[str, Any]:
        return json.loads(self.spec_json)

    @property
    def online(self) -> bool:
        return self.method.startswith("online-")


def read_quantization(hf: dict[str, Any], online: str | None) -> QuantConfig | None:
    """The checkpoint's QuantConfig (config.json as read), or the online one `--quantization`
    asks for; None: float weights served as they are."""
    spec = hf.get("quantization_config")
    if spec is None:
        if online is None:
            return None
        if online not in ONLINE_METHODS:
            raise ConfigError(f"--quantization {online}: one of {', '.join(ONLINE_METHODS)}")
        return QuantConfig(f"online-{online}")
    if not isinstance(spec, dict):
        raise ConfigError(f"config.json's quantization_config is not an object: {spec!r}")
    name = str(spec.get("quant_method", "")).lower()
    method = CHECKPOINT_METHODS.get(name)
    if method is None:
        raise ConfigError(
            f"quantization method {name or '(none)'!r} in config.json is not served; "
            f"served: {', '.join(CHECKPOINT_METHODS)} checkpoints, and --quantization {' or '.join(ONLINE_METHODS)} on float ones"
        )
    if online is not None:
        raise ConfigError(f"--quantization {online}: the checkpoint is already quantized ({name})")
    return QuantConfig(method, json.dumps(spec, sort_keys=True))
