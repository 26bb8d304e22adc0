"""ModelConfig: what the serving code needs from a Hugging Face checkpoint directory.

Reads `config.json` (and `generation_config.json` for stop ids) without importing torch or
transformers, so every stage can build it cheaply. Both the transformers 4 spellings
(`torch_dtype`, `rope_theta`) and the transformers 5 ones (`dtype`, `rope_parameters`) are read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from conveyor.config.errors import ConfigError

# The model families the worker implements; all share one decoder (gpu/models/llama.py).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Each rope type with the rope_scaling fields it needs (gpu/rope.py builds the tables).
ROPE_TYPE_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_TYPE_FIELDS)
DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # rope_type plus its parameters, as (key, value) pairs so the dataclass stays hashable.
    rope_scaling: tuple[tuple[str, float | str], ...]
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama when attention_bias)
    o_bias: bool  # o_proj carries a bias (Llama attention_bias)
    mlp_bias: bool
    sliding_window: int | None
    dtype: str  # one of DTYPES: the checkpoint's, or the --dtype override
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    served_name: str

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str | None = None,
        max_model_len: int | None = None,
        served_name: str | None = None,
    ) -> ModelConfig:
        root = Path(path).expanduser()
        if not root.is_dir():
            raise ConfigError(f"model path {str(path)!r} is not a directory")
        hf = _read_json(root / "config.json", required=True)
        gen = _read_json(root / "generation_config.json", required=False)

        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in {root}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            max_pos = int(hf.get("max_position_embeddings", 2048))
            scaling = _rope_scaling(hf, max_pos)
            limit = _context_limit(max_pos, dict(scaling))
            cfg = cls(
                path=str(root.resolve()),
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(hf),
                rope_scaling=scaling,
                max_position_embeddings=max_pos,
                max_model_len=min(max_model_len or limit, limit),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                sliding_window=_sliding_window(hf),
                dtype=_dtype(dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"),
                bos_token_id=_first(gen.get("bos_token_id", hf.get("bos_token_id"))),
                eos_token_ids=_ids(gen.get("eos_token_id", hf.get("eos_token_id"))),
                served_name=served_name or root.resolve().name,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed config.json in {root}: {e!r}") from None
        _check_rope_scaling(dict(cfg.rope_scaling), root)
        return cfg


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise ConfigError(f"no config.json in {path.parent}: not a Hugging Face checkpoint") from None
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope_scaling(hf: dict[str, Any], max_pos: int) -> tuple[tuple[str, float | str], ...]:
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    if scaling["rope_type"] == "dynamic":
        # HF's dynamic NTK scales from max_position_embeddings, whatever rope_scaling says.
        scaling["original_max_position_embeddings"] = max_pos
    elif scaling["rope_type"] in ("yarn", "llama3"):
        # As HF's standardize_rope_params: a top-level value first (Phi-3 style), else max_position_embeddings.
        original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or max_pos
    return tuple(sorted((k, v) for k, v in scaling.items() if isinstance(v, (int, float, str))))


def _context_limit(max_pos: int, scaling: dict[str, float | str]) -> int:
    """The longest context the rope table serves: max_position_embeddings, except where the scaling
    exists to go past it (as vLLM derives it): YaRN to original_max_position_embeddings x factor,
    dynamic NTK to max_position_embeddings x factor."""
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 1:
        return max_pos
    if scaling["rope_type"] == "yarn":
        return max(max_pos, int(float(scaling["original_max_position_embeddings"]) * factor))
    if scaling["rope_type"] == "dynamic":
        return int(max_pos * factor)
    return max_pos


def _check_rope_scaling(scaling: dict[str, float | str], root: Path) -> None:
    rope_type = str(scaling["rope_type"])
    if rope_type not in ROPE_TYPE_FIELDS:
        raise ConfigError(f"unsupported rope_type {rope_type!r} in {root}; supported: {', '.join(ROPE_TYPE_FIELDS)}")
    missing = [name for name in ROPE_TYPE_FIELDS[rope_type] if not isinstance(scaling.get(name), (int, float))]
    if missing:
        raise ConfigError(f"rope_scaling of type {rope_type!r} in {root} needs a number for {', '.join(missing)}")


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The window every layer applies, or None; a window on only some layers is refused."""
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window") is False:
        return None
    if "layer_types" in hf:  # transformers 5 spells out each layer's attention
        kinds = set(hf["layer_types"])
    elif "max_window_layers" in hf:  # Qwen2: layers from max_window_layers on are windowed
        first, num_layers = int(hf["max_window_layers"]), int(hf["num_hidden_layers"])
        kinds = {"full_attention"} if first >= num_layers else {"sliding_attention"} if first == 0 else {"mixed"}
    else:
        kinds = {"sliding_attention"}
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ConfigError("a sliding window on only some layers is not supported")
    return int(window)


def _dtype(name: str) -> str:
    name = str(name).removeprefix("torch.")
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if name not in DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return name


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _first(value: Any) -> int | None:
    ids = _ids(value)
    return ids[0] if ids else None
