"""SpeculativeConfig: `--speculative-config`, vLLM's JSON, read once into a frozen dataclass.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5,
                           "disable_by_batch_size": 16}'

`LLM(speculative_config={...})` takes the same keys as a dict. Every key is checked here, so a bad
config is one ConfigError line at start-up naming the key, never a failure at the first request.
The proposers and the verification live in gpu/spec/; the scheduler's side (which rows speculate,
their lookahead slots) in stages/scheduler/speculation.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig

# The methods the engine runs: n-gram prompt lookup, a draft model (a smaller checkpoint with the
# target's vocabulary: `model`), and an EAGLE-3 head (`model`: a one-layer head fed the hidden
# states of three of the target's layers, in the published checkpoint layout).
METHODS = ("ngram", "draft_model", "eagle3")
WITH_MODEL = ("draft_model", "eagle3")
DRAFT_LENGTHS = ("adaptive", "fixed")
# prompt_lookup_min / _max when neither is given: a 2-gram is enough evidence on grounded text
# (code edits, summaries that quote), and a 5-gram match is preferred where there is one.
DEFAULT_LOOKUP = (2, 5)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int  # k: draft tokens a row may verify per step
    prompt_lookup_min: int = DEFAULT_LOOKUP[0]  # ngram: the shortest suffix that may match
    prompt_lookup_max: int = DEFAULT_LOOKUP[1]  # ngram: the longest, tried first
    # Past this many running sequences no row speculates (verifying drafts costs compute that a
    # busy batch already fills); None: always.
    disable_by_batch_size: int | None = None
    # "adaptive": each row verifies as many of its k drafts as its recent acceptance makes worth
    # their cost (gpu/spec/draft_length.py); "fixed": every draft it has, up to k, as vLLM does
    # (to read a proposer's acceptance as such, or where verifying is nearly free).
    draft_length: str = "adaptive"
    model: str | None = None  # draft_model, eagle3: the draft's checkpoint directory
    # draft_model, eagle3: the draft's config, read by the front door (conveyor/engine_config.py)
    # in the target's dtype and context length, once it was checked against the target.
    draft: ModelConfig | None = None
    eagle: Eagle3Layout | None = None  # eagle3: what its config.json adds to a Llama layer's


@dataclasses.dataclass(frozen=True)
class Eagle3Layout:
    """An EAGLE-3 head's own keys in its config.json (beside a one-layer Llama config)."""

    draft_vocab_size: int  # its lm_head's rows; d2t maps each to a target id (d + d2t[d])
    aux_layers: tuple[int, int, int]  # the target layers whose inputs it reads, concatenated into fc
    norm_before_residual: bool = False  # the residual stream starts from the normed features


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """The flag's JSON text (or the Python API's dict) -> SpeculativeConfig; None stays None."""
    if value is None:
        return None
    flag = "--speculative-config"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {value!r}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{flag}: unknown keys {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    method = value.get("method")
    if method not in METHODS:
        raise ConfigError(f"{flag}: method must be one of {', '.join(METHODS)}, got {method!r}")
    k = _int(value, "num_speculative_tokens", None, minimum=1)
    if "prompt_lookup_min" in value or "prompt_lookup_max" in value:
        low = _int(value, "prompt_lookup_min", value.get("prompt_lookup_max"), minimum=1)
        high = _int(value, "prompt_lookup_max", low, minimum=1)
    else:
        low, high = DEFAULT_LOOKUP
    if low > high:
        raise ConfigError(f"{flag}: prompt_lookup_min {low} is above prompt_lookup_max {high}")
    disable = value.get("disable_by_batch_size")
    if disable is not None:
        disable = _int(value, "disable_by_batch_size", None, minimum=1)
    draft_length = value.get("draft_length", "adaptive")
    if draft_length not in DRAFT_LENGTHS:
        raise ConfigError(f"{flag}: draft_length must be one of {', '.join(DRAFT_LENGTHS)}, got {draft_length!r}")
    model = value.get("model")
    if method in WITH_MODEL and not isinstance(model, str):
        raise ConfigError(f'{flag}: method {method!r} needs "model": the draft checkpoint\'s directory')
    if method not in WITH_MODEL and model is not None:
        raise ConfigError(f"{flag}: method {method!r} takes no model")
    return SpeculativeConfig(method, k, low, high, disable, draft_length, model)


def _int(value: dict[str, Any], key: str, default: int | None, *, minimum: int) -> int:
    got = value.get(key, default)
    if got is None:
        raise ConfigError(f"--speculative-config: {key} is required")
    if not isinstance(got, int) or isinstance(got, bool) or got < minimum:
        raise ConfigError(f"--speculative-config: {key} must be an integer of at least {minimum}, got {got!r}")
    return got
