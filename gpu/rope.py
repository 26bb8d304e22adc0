"""Rotary position embeddings (RoPE) for the decoder, rope types "default", "linear", "llama3".

The inverse frequencies follow Hugging Face's `modeling_rope_utils` formulas so that logits match
HF numerically. cos/sin are precomputed once for every position up to `max_positions` in float32,
with the same arithmetic HF uses per step (float32 position * float32 inv_freq), then indexed by
the flattened positions of a step. The rotation itself is the backend ops' (`ops.rotary`: the
"rotate half" (GPT-NeoX) layout that HF Llama, Mistral and Qwen2 checkpoints use).
"""

from __future__ import annotations

import math

import torch

from conveyor.config.model import ModelConfig


def inverse_frequencies(head_dim: int, rope_theta: float, rope_scaling: dict[str, float | str]) -> torch.Tensor:
    """inv_freq [head_dim // 2] float32 for the configured rope type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = rope_scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Positions divided by `factor` is the same as frequencies divided by it.
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, float | str]) -> torch.Tensor:
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


class RotaryEmbedding:
    """Holds the cos/sin table on the model's device, which `ops.rotary` indexes in place of HF's
    per-step computation. A plain object, not a module: it is derived from the config, never loaded."""

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict[str, float | str],
        max_positions: int,
        device: torch.device | str = "cpu",
    ) -> None:
        # Computed on the CPU (explicitly, so a surrounding `torch.device("meta")` is ignored).
        inv_freq = inverse_frequencies(head_dim, rope_theta, rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], as HF: float32 product
        # [P, D]: cos in the first half, sin in the second, so one index_select serves both.
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        self.head_dim = head_dim

    @classmethod
    def from_config(cls, config: ModelConfig, device: torch.device | str = "cpu") -> RotaryEmbedding:
        # Table covers the positions a sequence may reach (the max_position_embeddings at most).
        return cls(
            config.head_dim,
            config.rope_theta,
            dict(config.rope_scaling),
            max(config.max_model_len, 1),
            device,
        )
