"""ModelConfig: what the serving code needs from a Hugging Face checkpoint directory.

Reads `config.json` (and `generation_config.json` for stop ids) without importing torch or
transformers, so every stage can build it cheaply. Both the transformers 4 spellings
(`torch_dtype`, `rope_theta`, `max_window_layers`) and the transformers 5 ones (`dtype`,
`rope_parameters`, `layer_types`) are read. A field that would change the computation and that no
family here implements (an activation, a partial rotary, an unknown rope or layer type) is refused
at start with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from conveyor.config.errors import ConfigError

# The architectures the worker implements, each with the model family that reads it (the family's
# decoder is in gpu/models/, whose MODEL_CLASSES maps the same names to classes). A later family
# adds a row here and one there.
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi3",
    # Mixture of experts (gpu/models/mixtral.py, qwen3_moe.py; routing in gpu/models/moe.py).
    "MixtralForCausalLM": "moe",
    "Qwen2MoeForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_FAMILIES)
# Qwen2's bias on q/k/v whatever attention_bias says, and none on o_proj.
QKV_BIAS_ONLY = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
# MLP activations the ops implement (hidden_act / hidden_activation in config.json).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Each rope type with the rope_scaling fields it needs (gpu/rope.py builds the tables); a
# (str,) tuple marks a list of numbers (longrope's per-dimension factors).
ROPE_TYPE_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
LIST_ROPE_FIELDS = ("short_factor", "long_factor")
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
    # rope_type plus its parameters, as (key, value) pairs so the dataclass stays hashable
    # (longrope's factor lists as tuples). Gemma 3: the global layers' rope.
    rope_scaling: tuple[tuple[str, float | str | tuple[float, ...]], ...]
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama when attention_bias)
    o_bias: bool  # o_proj carries a bias (Llama attention_bias)
    mlp_bias: bool
    sliding_window: int | None  # the window of the windowed layers (every layer, unless layer_windows says otherwise)
    dtype: str  # one of DTYPES: the checkpoint's, or the --dtype override
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    served_name: str
    # Fields later families added; defaults keep the Llama meaning.
    # One window per layer (None: full attention) where layers differ (Gemma 2/3, Qwen2/3 with
    # max_window_layers); empty: every layer has sliding_window.
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # one of ACTIVATIONS: the MLP's gate activation
    qk_norm: bool = False  # RMSNorm over each head's q and k before rope (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma); None: head_dim's
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the LM head's logits (Gemma 2)
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' rope base (default rope type)

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    @property
    def family(self) -> str:
        """The model family that runs this architecture (gpu/models/)."""
        return ARCHITECTURE_FAMILIES[self.architecture]

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
            rope_params, local_theta = _rope_parameters(hf, arch)
            scaling = _rope_scaling(hf, arch, rope_params, max_pos)
            limit = _context_limit(max_pos, dict(scaling))
            num_layers = int(hf["num_hidden_layers"])
            windows = _layer_windows(hf, arch, num_layers)
            window = next((w for w in windows if w is not None), None)
            cfg = cls(
                path=str(root.resolve()),
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_params.get("rope_theta", hf.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position_embeddings=max_pos,
                max_model_len=min(max_model_len or limit, limit),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=arch in QKV_BIAS_ONLY or bool(hf.get("attention_bias", False)),
                o_bias=arch not in QKV_BIAS_ONLY and bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                sliding_window=window,
                dtype=_dtype(dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"),
                bos_token_id=_first(gen.get("bos_token_id", hf.get("bos_token_id"))),
                eos_token_ids=_ids(gen.get("eos_token_id", hf.get("eos_token_id"))),
                served_name=served_name or root.resolve().name,
                layer_windows=windows if len(set(windows)) > 1 else (),
                hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu"),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
                query_pre_attn_scalar=_number(hf.get("query_pre_attn_scalar")) if arch.startswith("Gemma") else None,
                attn_logit_softcap=_number(hf.get("attn_logit_softcapping")),
                final_logit_softcap=_number(hf.get("final_logit_softcapping")),
                local_rope_theta=local_theta,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed config.json in {root}: {e!r}") from None
        _check_rope_scaling(dict(cfg.rope_scaling), root)
        _check_unsupported(hf, cfg, root)
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


def _rope_parameters(hf: dict[str, Any], arch: str) -> tuple[dict[str, Any], float | None]:
    """(the global rope's parameters, Gemma 3's local rope base or None). transformers 5 writes
    Gemma 3's as rope_parameters per layer type; transformers 4 as rope_scaling, rope_theta and
    rope_local_base_freq."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"unsupported rope_type {local['rope_type']!r} on the sliding layers")
        glob = dict(params.get("full_attention") or {})
        return glob, float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    if arch == "Gemma3ForCausalLM":
        params.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        return params, float(hf.get("rope_local_base_freq", 10000.0))
    return params, None


def _rope_scaling(hf: dict[str, Any], arch: str, params: dict[str, Any], max_pos: int) -> tuple[tuple[str, Any], ...]:
    scaling = dict(params)
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    if scaling["rope_type"] == "dynamic":
        # HF's dynamic NTK scales from max_position_embeddings, whatever rope_scaling says.
        scaling["original_max_position_embeddings"] = max_pos
    if scaling["rope_type"] in ("su", "yarn") and arch == "Phi3ForCausalLM":
        scaling["rope_type"] = "longrope"  # Phi-3's older spellings, as transformers reads them
    if scaling["rope_type"] in ("yarn", "llama3", "longrope"):
        # As HF's standardize_rope_params: a top-level value first (Phi-3 style), else max_position_embeddings.
        original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or max_pos
    for name in LIST_ROPE_FIELDS:
        if isinstance(scaling.get(name), list):
            scaling[name] = tuple(float(x) for x in scaling[name])
    return tuple(sorted((k, v) for k, v in scaling.items() if isinstance(v, (int, float, str, tuple))))


def _context_limit(max_pos: int, scaling: dict[str, Any]) -> int:
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


def _check_rope_scaling(scaling: dict[str, Any], root: Path) -> None:
    rope_type = str(scaling["rope_type"])
    if rope_type not in ROPE_TYPE_FIELDS:
        raise ConfigError(f"unsupported rope_type {rope_type!r} in {root}; supported: {', '.join(ROPE_TYPE_FIELDS)}")
    missing = [
        name
        for name in ROPE_TYPE_FIELDS[rope_type]
        if not isinstance(scaling.get(name), tuple if name in LIST_ROPE_FIELDS else (int, float))
    ]
    if missing:
        raise ConfigError(f"rope_scaling of type {rope_type!r} in {root} needs a number for {', '.join(missing)}")


def _layer_windows(hf: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention). transformers 5 spells out each layer's
    kind in layer_types; transformers 4 configs imply it: Qwen2/3 window the layers from
    max_window_layers on, Gemma 2 every other layer from the first, Gemma 3 all but every
    sliding_window_pattern-th; other families window every layer or none."""
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window") is False:
        return (None,) * num_layers
    window = int(window)
    if "layer_types" in hf:
        kinds = list(hf["layer_types"])
        unknown = set(kinds) - {"full_attention", "sliding_attention"}
        if unknown or len(kinds) != num_layers:
            raise ConfigError(
                f"unsupported layer_types {sorted(unknown) or kinds!r}: one of full_attention, sliding_attention per layer"
            )
        return tuple(window if kind == "sliding_attention" else None for kind in kinds)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") and "max_window_layers" in hf:
        first = int(hf["max_window_layers"])
        return tuple(window if i >= first else None for i in range(num_layers))
    if arch == "Gemma2ForCausalLM":
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if arch == "Gemma3ForCausalLM":
        pattern = int(hf.get("sliding_window_pattern", 6))
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    return (window,) * num_layers


def _check_unsupported(hf: dict[str, Any], cfg: ModelConfig, root: Path) -> None:
    """Config fields that would change what the model computes and that no family here reads."""
    if cfg.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"unsupported hidden_act {cfg.hidden_act!r} in {root}; supported: {', '.join(ACTIVATIONS)}")
    rope = dict(cfg.rope_scaling)
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ConfigError(f"unsupported partial_rotary_factor {partial} in {root}: rope over the whole head only")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"unsupported use_bidirectional_attention in {root}: causal attention only")
    if cfg.family != "gemma" and (cfg.attn_logit_softcap or cfg.final_logit_softcap):
        raise ConfigError(f"unsupported logit soft-capping for {cfg.architecture} in {root}")


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


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
