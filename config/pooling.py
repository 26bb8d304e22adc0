"""PoolingConfig: how an embedding checkpoint turns its hidden states into one vector, as its
sentence-transformers files declare it.

Decoder embedding models (Qwen3-Embedding, gte-Qwen2) ship as a causal LM plus
`modules.json`, whose modules name a `sentence_transformers.models.Pooling` (its
`config.json`, usually `1_Pooling/config.json`: `pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`) and, often, a `...models.Normalize`. A
checkpoint with such a Pooling module is served for embeddings (/v1/embeddings); any other is
generative. The vector is the final norm's hidden state at the last prompt token, their mean,
or the first token's; truncated to a request's `dimensions` where `config.json` says the model
was trained for it (`matryoshka_dimensions`, or `is_matryoshka`), then scaled to unit length
when normalized. Anything else the files ask for (max pooling, a Dense layer, several modes at
once) is one ConfigError line, never a silently different vector.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from conveyor.config.errors import ConfigError

MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "first"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST = "sentence_transformers.models."
_KNOWN_MODULES = {_ST + "Transformer", _ST + "Pooling", _ST + "Normalize"}


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    mode: str  # "last", "mean" or "first"
    normalize: bool
    # Lengths a request's `dimensions` may take: () none (the full width only); None any up to the width.
    matryoshka: tuple[int, ...] | None = ()

    @property
    def needs_every_position(self) -> bool:
        """Mean pooling reads every prompt token's hidden state: a prefix-cache hit's are never computed."""
        return self.mode == "mean"


def read_pooling(root: Path, hf: dict[str, Any]) -> PoolingConfig | None:
    """The checkpoint's pooling, or None for a generative model (no modules.json Pooling)."""
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise ConfigError(f"{modules_file}: not a list of modules")
    kinds = [m.get("type", "") for m in modules if isinstance(m, dict)]
    pooling = [m for m in modules if isinstance(m, dict) and m.get("type") == _ST + "Pooling"]
    if not pooling:
        return None
    unknown = [k for k in kinds if k not in _KNOWN_MODULES]
    if unknown:
        raise ConfigError(f"{modules_file}: module {unknown[0]!r} is not supported (Transformer, Pooling, Normalize are)")
    settings = _json(root / pooling[0].get("path", "1_Pooling") / "config.json")
    asked = [key for key in (*MODES, *_UNSUPPORTED_MODES) if settings.get(key)]
    if len(asked) != 1 or asked[0] not in MODES:
        raise ConfigError(f"{root}: pooling {asked or 'none'} is not supported; one of {', '.join(MODES)} is")
    return PoolingConfig(MODES[asked[0]], _ST + "Normalize" in kinds, _matryoshka(hf))


def check_dimensions(pooling: PoolingConfig, width: int, dimensions: int | None) -> None:
    """A ValueError saying why a request's `dimensions` cannot be served, if it cannot."""
    if dimensions is None or dimensions == width:
        return
    if pooling.matryoshka == ():
        raise ValueError(f"dimensions: this model was not trained for truncated vectors; it gives {width}")
    if not 1 <= dimensions <= width:
        raise ValueError(f"dimensions must be in [1, {width}]")
    if pooling.matryoshka is not None and dimensions not in pooling.matryoshka:
        raise ValueError(f"dimensions must be one of {', '.join(map(str, (*pooling.matryoshka, width)))}")


def _matryoshka(hf: dict[str, Any]) -> tuple[int, ...] | None:
    dims = hf.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(sorted(dims))
    return None if hf.get("is_matryoshka") else ()


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
