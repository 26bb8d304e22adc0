"""How config.json's rope fields become ModelConfig's: the global rope's base and scaling, the
windowed layers' base where the file has a rope per layer type, and the context the scaling serves.

transformers 4 writes `rope_theta` and `rope_scaling` (`type` or `rope_type`), transformers 5
`rope_parameters` (with the base inside, or one per layer type: Gemma 3's). The scaling is kept as
sorted (key, value) pairs (`rope_items`) so ModelConfig stays hashable, lists as tuples. Each rope
type needs the fields ROPE_TYPE_FIELDS lists, checked once the family's adapter has had its say
(Phi-3 renames its older spellings); gpu/models/rope.py builds the tables from them. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.config.errors import ConfigError

# Each rope type with the rope_scaling fields it needs (gpu/models/rope.py builds the tables); a
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


def rope_parameters(hf: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """(the global rope's parameters, the windowed layers' rope base or None). transformers 5
    writes a rope per layer type in rope_parameters (Gemma 3's); a transformers 4 family that has
    a second base names it in its own field, which its adapter reads."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"unsupported rope_type {local['rope_type']!r} on the sliding layers")
        glob = dict(params.get("full_attention") or {})
        return glob, float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    return params, None


def read_rope_scaling(hf: dict[str, Any], params: dict[str, Any], max_pos: int) -> tuple[tuple[str, Any], ...]:
    """The global rope's parameters (`rope_parameters`) as ModelConfig.rope_scaling: the base left
    out (it is rope_theta), the type spelled `rope_type`, the context a stretching type starts
    from filled in."""
    scaling = dict(params)
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    if scaling["rope_type"] == "dynamic":
        # HF's dynamic NTK scales from max_position_embeddings, whatever rope_scaling says.
        scaling["original_max_position_embeddings"] = max_pos
    if scaling["rope_type"] in ("yarn", "llama3", "longrope"):
        scaling["original_max_position_embeddings"] = original_max_position(hf, scaling, max_pos)
    for name in LIST_ROPE_FIELDS:
        if isinstance(scaling.get(name), list):
            scaling[name] = tuple(float(x) for x in scaling[name])
    return rope_items(scaling)


def original_max_position(hf: dict[str, Any], scaling: dict[str, Any], max_pos: int) -> Any:
    """The context a yarn, llama3 or longrope scaling stretches, as HF's standardize_rope_params
    finds it: a top-level value first (Phi-3 style), then the scaling's, else max_position_embeddings."""
    return hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") or max_pos


def context_limit(max_pos: int, scaling: dict[str, Any]) -> int:
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


def check_rope_scaling(scaling: dict[str, Any], root: Path) -> None:
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


def rope_items(scaling: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A rope_scaling dict as ModelConfig keeps it: sorted (key, value) pairs of its scalars and
    tuples (hashable)."""
    return tuple(sorted((k, v) for k, v in scaling.items() if isinstance(v, (int, float, str, tuple))))
