"""ModelConfig: what the serving code needs from a Hugging Face checkpoint directory.

`ModelConfig.from_checkpoint(path, adapters)` reads `config.json` (and `generation_config.json`
for stop ids) without importing torch or transformers, in three steps: the generic reading of the
fields every family names alike (both the transformers 4 spellings, `torch_dtype`, `rope_theta`,
and the transformers 5 ones, `dtype`, `rope_parameters`, `layer_types`); then the architecture's
config adapter, which adds its family's quirks (gpu/models/registry.py maps each architecture to
its own, beside its model); then the generic checks. `max_model_len` is derived last, from the
rope scaling the adapter left.

Refusals are one line naming the field: an architecture with no adapter, a field that would
change the computation and that no family implements (an activation, a partial rotary, an unknown
rope or layer type), and a family field (FAMILY_FIELDS: logit soft-capping) that the file asks
for and its adapter did not take. Nothing here knows an architecture by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from conveyor.config.errors import ConfigError
from conveyor.config.moe import MoeConfig
from conveyor.config.pooling import PoolingConfig, read_pooling
from conveyor.config.quant import QuantConfig, read_quantization
from conveyor.config.rope_fields import check_rope_scaling, context_limit, read_rope_scaling, rope_parameters
from conveyor.config.vision import VisionConfig

# MLP activations the ops implement (hidden_act / hidden_activation in config.json).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DTYPES = ("float32", "float16", "bfloat16")
# config.json fields only some families implement -> (the ModelConfig field their adapter sets,
# what the refusal calls it). The generic reading leaves these None.
FAMILY_FIELDS: dict[str, tuple[str, str]] = {
    "attn_logit_softcapping": ("attn_logit_softcap", "logit soft-capping"),
    "final_logit_softcapping": ("final_logit_softcap", "logit soft-capping"),
}


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
    moe: MoeConfig | None = None  # a mixture-of-experts model's routing and experts (config/moe.py); None: dense
    # How the linear weights are stored (config/quant.py); None: in `dtype`, as loaded.
    quantization: QuantConfig | None = None
    # An embedding checkpoint's pooling (config/pooling.py); None: a generative model.
    pooling: PoolingConfig | None = None
    # A vision-language model's vision tower and projector (config/vision.py); None: text alone.
    vision: VisionConfig | None = None

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        adapters: Mapping[str, ConfigAdapter],
        *,
        dtype: str | None = None,
        max_model_len: int | None = None,
        served_name: str | None = None,
        quantization: str | None = None,
    ) -> ModelConfig:
        """The checkpoint's config, read generically, then by the adapter of the first of its
        `architectures` that `adapters` names (the registry's: gpu/models/registry.py
        `read_model_config`). `dtype`, `max_model_len` and `served_name` override the file's;
        `quantization` is --quantization (config/quant.py)."""
        root = Path(path).expanduser()
        if not root.is_dir():
            raise ConfigError(f"model path {str(path)!r} is not a directory")
        hf = _read_json(root / "config.json", required=True)
        gen = _read_json(root / "generation_config.json", required=False)
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in adapters), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in {root}; supported: {', '.join(adapters)}"
            )
        try:
            # A vision-language model nests its language model's fields in text_config: the
            # generic reading takes those, and the adapter sees the whole file.
            text = hf
            if isinstance(hf.get("text_config"), dict):  # the text model's own fields win over the wrapper's (dtype, ids)
                outer = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
                text = {**outer, **hf["text_config"], "architectures": archs}
            cfg = adapters[arch](hf, _generic(text, gen, arch, root, dtype, served_name))
            limit = context_limit(cfg.max_position_embeddings, dict(cfg.rope_scaling))
            cfg = dataclasses.replace(
                cfg,
                max_model_len=min(max_model_len or limit, limit),
                quantization=read_quantization(hf, quantization),
                pooling=read_pooling(root, hf),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"malformed config.json in {root}: {e!r}") from None
        check_rope_scaling(dict(cfg.rope_scaling), root)
        _check_unsupported(hf, cfg, root)
        return cfg


# A family's config quirks: (config.json as read, the generic ModelConfig) -> the family's
# ModelConfig (dataclasses.replace). Each lives beside its model in gpu/models/.
ConfigAdapter = Callable[[dict[str, Any], ModelConfig], ModelConfig]


def _generic(
    hf: dict[str, Any], gen: dict[str, Any], arch: str, root: Path, dtype: str | None, served_name: str | None
) -> ModelConfig:
    """What every family names alike. max_model_len is max_position_embeddings until the caller
    derives it from the adapted rope scaling."""
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    max_pos = int(hf.get("max_position_embeddings", 2048))
    rope_params, local_theta = rope_parameters(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    num_layers = int(hf["num_hidden_layers"])
    return with_layer_windows(
        ModelConfig(
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
            rope_scaling=read_rope_scaling(hf, rope_params, max_pos),
            max_position_embeddings=max_pos,
            max_model_len=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=None,
            dtype=_dtype(dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            bos_token_id=_first(gen.get("bos_token_id", hf.get("bos_token_id"))),
            eos_token_ids=_ids(gen.get("eos_token_id", hf.get("eos_token_id"))),
            served_name=served_name or root.resolve().name,
            hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu"),
            local_rope_theta=local_theta,
        ),
        _layer_windows(hf, num_layers),
    )


def with_layer_windows(cfg: ModelConfig, windows: tuple[int | None, ...]) -> ModelConfig:
    """cfg with one window per layer (None: full attention): `sliding_window` the window,
    `layer_windows` the list only where the layers differ."""
    window = next((w for w in windows if w is not None), None)
    return dataclasses.replace(cfg, sliding_window=window, layer_windows=windows if len(set(windows)) > 1 else ())


def implied_windows(hf: dict[str, Any], cfg: ModelConfig, windowed: Callable[[int], bool]) -> ModelConfig:
    """cfg with the window on the layers i where windowed(i) only, for a transformers 4
    config.json, whose family fields imply each layer's kind (Qwen's max_window_layers, Gemma's
    pattern). A file that spells them out in layer_types, or has no window in effect, was read
    generically and is kept."""
    if "layer_types" in hf or cfg.sliding_window is None:
        return cfg
    return with_layer_windows(cfg, tuple(cfg.sliding_window if windowed(i) else None for i in range(cfg.num_layers)))


def number(value: Any) -> float | None:
    """A config.json number that may be null."""
    return None if value is None else float(value)


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise ConfigError(f"no config.json in {path.parent}: not a Hugging Face checkpoint") from None
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def _layer_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention). transformers 5 spells out each layer's
    kind in layer_types; a transformers 4 config without it windows every layer, unless its family
    implies otherwise (its adapter: `implied_windows`)."""
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
    return (window,) * num_layers


def _check_unsupported(hf: dict[str, Any], cfg: ModelConfig, root: Path) -> None:
    """Config fields that would change what the model computes and that no family here reads,
    or that this architecture's adapter did not take."""
    if cfg.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"unsupported hidden_act {cfg.hidden_act!r} in {root}; supported: {', '.join(ACTIVATIONS)}")
    rope = dict(cfg.rope_scaling)
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ConfigError(f"unsupported partial_rotary_factor {partial} in {root}: rope over the whole head only")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"unsupported use_bidirectional_attention in {root}: causal attention only")
    for key, (field, what) in FAMILY_FIELDS.items():
        if hf.get(key) and getattr(cfg, field) is None:
            raise ConfigError(f"unsupported {what} for {cfg.architecture} in {root}")


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
