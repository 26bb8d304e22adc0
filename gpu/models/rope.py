"""Rotary position embeddings (RoPE): the cos/sin tables of rope types "default", "linear",
"dynamic", "yarn", "llama3" and "longrope" (Phi-3). The rotation itself is the backend ops'
(`ops.rotary`, in the "rotate half" (GPT-NeoX) layout of HF Llama, Mistral and Qwen2).

Owns `RotaryEmbedding.cos_sin` [P, D] float32 on the model's device, P = max_model_len: row p
holds position p's cos (first half) and sin (second half), times YaRN's or LongRoPE's attention
factor, computed once with HF's `modeling_rope_utils` formulas and the arithmetic HF uses per
step (float32 position * float32 inv_freq), so logits match HF's. A step indexes it by its
flattened positions, which must lie in [0, P).

The table depends only on the config, never on a step, so prompt logits do not depend on how a
prompt is chunked or batched; where that makes dynamic NTK and LongRoPE differ from HF is
`RotaryEmbedding`'s docstring. Gemma 3's windowed layers rotate on a second, default-type table
on their own base (`local_rope_theta`): `layer_tables` gives each layer its table, shared.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from conveyor.config.model import ModelConfig

RopeScaling = dict[str, Any]  # values: numbers, the rope_type, longrope's factor tuples


def inverse_frequencies(head_dim: int, rope_theta: float, rope_scaling: RopeScaling) -> torch.Tensor:
    """inv_freq [head_dim // 2] float32 for the configured rope type (dynamic: inside the original context)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = rope_scaling.get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        # Positions divided by `factor` is the same as frequencies divided by it.
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_frequencies(head_dim, rope_theta, rope_scaling)
    if rope_type == "longrope":
        return _longrope_frequencies(head_dim, rope_theta, rope_scaling["short_factor"])
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def attention_factor(rope_scaling: RopeScaling, max_positions: int | None = None) -> float:
    """The factor HF multiplies cos and sin by: YaRN's, from `attention_factor` or the mscales;
    LongRoPE's, from `attention_factor` or the context growth (`factor`, else
    max_positions / original: the checkpoint's max_position_embeddings); else 1."""
    if rope_scaling.get("rope_type") == "longrope":
        if "attention_factor" in rope_scaling:
            return float(rope_scaling["attention_factor"])
        original = float(rope_scaling["original_max_position_embeddings"])
        factor = float(rope_scaling.get("factor") or (max_positions or original) / original)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if rope_scaling.get("rope_type") != "yarn":
        return 1.0
    if "attention_factor" in rope_scaling:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])
    mscale, mscale_all_dim = float(rope_scaling.get("mscale", 0)), float(rope_scaling.get("mscale_all_dim", 0))
    if mscale and mscale_all_dim:  # DeepSeek's spelling: the ratio of two mscales
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def dynamic_ntk_frequencies(head_dim: int, rope_theta: float, rope_scaling: RopeScaling, seq_lens: torch.Tensor) -> torch.Tensor:
    """inv_freq [S, head_dim // 2] float32 for the int64 sequence lengths [S], as HF's dynamic NTK.

    Float32 arithmetic throughout, as HF's when `seq_len` is a tensor (its value during generate)."""
    factor = float(rope_scaling["factor"])
    original = int(rope_scaling["original_max_position_embeddings"])
    seq_lens = torch.clamp(seq_lens.to(device="cpu", dtype=torch.int64), min=original)
    base = rope_theta * ((factor * seq_lens / original) - (factor - 1)) ** (head_dim / (head_dim - 2))  # [S]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (base[:, None] ** exponents[None, :])


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_frequencies(head_dim: int, rope_theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    """inv_freq [D/2] with each frequency divided by its own factor (in HF's order of operations)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * rope_theta**exponents)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(head_dim: int, rope_theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), those turning more than beta_fast times are kept, with a
    linear ramp between."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)  # HF's `or`: a 0 means the default too
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:  # the dimension that turns num_rotations times
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)

    pos_freqs = rope_theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolation = 1 - ramp  # [D/2]: 1 where the dimension keeps its frequency
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding:
    """Holds the cos/sin table on the model's device, which `ops.rotary` indexes in place of HF's
    per-step computation. A plain object, not a module: it is derived from the config, never loaded.

    Dynamic NTK has no single frequency set: HF recomputes inv_freq from the current sequence
    length once it exceeds the original maximum. Row p gets the frequencies of seq_len =
    max(p + 1, original max), which is what HF computes when it decodes token by token (the keys
    cached at earlier positions keep the frequencies they were rotated with, here as in HF), and
    rows inside the original context are exactly the default table. Two other choices differ:
    - HF prefilling a prompt longer than the original maximum in one forward uses the whole
      prompt's length for every position of it (and, in a batch, the longest row's), so its
      prompt logits depend on how the prompt was chunked and batched; ours do not.
    - vLLM fixes the base at the longest length (max_position_embeddings * factor) for every
      position, so it changes even the positions inside the original context; ours keep them exact.
    LongRoPE (Phi-3) is dynamic the same way: HF divides the frequencies by `short_factor` while
    the sequence fits the original context and by `long_factor` once it does not, so row p uses
    long_factor where p + 1 exceeds original_max_position_embeddings (what HF's forward computes
    when called token by token), and every row is scaled by the attention factor. HF's `generate`
    for Phi-3 goes further: when a sequence first passes the original context it drops the KV
    cache and recomputes every earlier key with the long factors, so past that point its tokens
    can differ from ours (as from vLLM's, which does not recompute either). Prompts longer than
    the original context differ as under dynamic NTK."""

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: RopeScaling,
        max_positions: int,
        device: torch.device | str = "cpu",
        max_position_embeddings: int | None = None,
    ) -> None:
        # Computed on the CPU (explicitly, so a surrounding `torch.device("meta")` is ignored).
        positions = torch.arange(max_positions, dtype=torch.int64, device="cpu")
        inv_freq = inverse_frequencies(head_dim, rope_theta, rope_scaling)[None, :]  # [1, D/2]
        if rope_scaling.get("rope_type") == "dynamic":
            original = int(rope_scaling["original_max_position_embeddings"])
            if max_positions > original:  # rows past the original context: [P, D/2]
                longer = dynamic_ntk_frequencies(head_dim, rope_theta, rope_scaling, positions + 1)
                inv_freq = torch.where((positions >= original)[:, None], longer, inv_freq)
        if rope_scaling.get("rope_type") == "longrope":
            original = int(rope_scaling["original_max_position_embeddings"])
            long = _longrope_frequencies(head_dim, rope_theta, rope_scaling["long_factor"])
            inv_freq = torch.where((positions >= original)[:, None], long[None, :], inv_freq)  # [P, D/2]
        freqs = positions.float()[:, None] * inv_freq  # [P, D/2], as HF: float32 product
        scale = attention_factor(rope_scaling, max_position_embeddings)
        # [P, D]: cos in the first half, sin in the second, so one index_select serves both.
        self.cos_sin = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).to(device)
        self.head_dim = head_dim

    @classmethod
    def from_config(cls, config: ModelConfig, device: torch.device | str = "cpu") -> RotaryEmbedding:
        # Table covers the positions a sequence may reach (max_model_len).
        return cls(
            config.head_dim,
            config.rope_theta,
            dict(config.rope_scaling),
            max(config.max_model_len, 1),
            device,
            config.max_position_embeddings,
        )


def layer_tables(config: ModelConfig, table: RotaryEmbedding, device: torch.device | str = "cpu") -> list[RotaryEmbedding]:
    """Each layer's table: the model's `table`, except Gemma 3's windowed layers, which share one
    on `local_rope_theta` with no scaling."""
    if config.local_rope_theta is None:
        return [table] * config.num_layers
    local = RotaryEmbedding(config.head_dim, config.local_rope_theta, {"rope_type": "default"}, max(config.max_model_len, 1), device)
    return [local if config.window_of(i) is not None else table for i in range(config.num_layers)]
