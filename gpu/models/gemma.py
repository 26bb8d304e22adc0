"""Gemma2ForCausalLM and Gemma3ForCausalLM (text only): Llama's decoder with Gemma's differences,
and their config adapters (`gemma2_config`, `gemma3_config`), which read Gemma's own config.json
names; soft-capping is refused for every family whose adapter does not take it.

Owns what differs from llama.py; the rest is llama.py's layers and CausalLM's one forward:
- RMSNorm scales by (1 + weight) in float32, every norm (q/k norms included): `after_load` folds
  the 1 in and keeps the sum in float32, which the ops read as Gemma's order (scale, then cast);
- four norms per layer (`GemmaDecoderLayer`): attention and MLP outputs are normalised before the
  residual add, and the MLP input by pre_feedforward_layernorm;
- embeddings scaled by sqrt(hidden_size) (`embed`), and final logit soft-capping (`compute_logits`);
- read from ModelConfig, not coded here: GeGLU (hidden_act), the attention scale
  query_pre_attn_scalar^-1/2, attention logit soft-capping (Gemma 2, read by the backend),
  sliding-window and global layers interleaved (layer_windows), Gemma 3's q/k norms (qk_norm)
  and its windowed layers' own rope base (local_rope_theta, gpu/models/rope.py `layer_tables`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from conveyor.config.model import ModelConfig, implied_windows, number
from conveyor.gpu.backends.base import Backend
from conveyor.gpu.models.base import CausalLM
from conveyor.gpu.models.layers import RMSNorm
from conveyor.gpu.models.llama import MLP, Attention
from conveyor.gpu.sampling.argmax import argmax_rows


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend, layer_index: int = 0) -> None:
        super().__init__()
        ops, h, eps = backend.ops, config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, ops, backend.attn, layer_index, backend.tp)
        self.mlp = MLP(config, ops, backend.tp)
        self.input_layernorm = RMSNorm(h, eps, ops)
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(h, eps, ops)

    def forward(self, x, residual, positions, rope, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.DecoderLayer: (the last sublayer's normalised output [T, H], the stream
        before it, None in the first layer) -> (this layer's, the stream before it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, rope, meta, kv_cache))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(CausalLM):
    """Serves Gemma2ForCausalLM and Gemma3ForCausalLM (gpu/models/registry.py)."""

    layer_class = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, H], scaled by sqrt(hidden_size), the factor rounded to the model dtype first (as HF)."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)

    def after_load(self) -> None:
        """Add Gemma's 1 to every RMSNorm weight once, in float32, so the norms are llama.py's and
        the ops' fused kernels serve them. HF computes (1 + w.float()) per call and scales the
        float32 normalised x by it before one cast to the activation dtype; a float32 weight asks
        the ops for that order (Ops.rms_norm). Rounding 1 + w to bf16 and the normalised x before
        the product, as the Llama order does, put bf16 logprobs 0.03-0.05 nats off HF's on a CPU."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.data = module.weight.data.float() + 1.0

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [N, V] in the model dtype; capped there too, as HF
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if upcast else logits

    def compute_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Capping saturates: logits that differ can tie once capped, and the argmax of the capped
        # ones (the lowest id of a tie) is not the product's: the capped logits' own, in the model dtype.
        if self.config.final_logit_softcap is None:
            return super().compute_greedy(hidden)
        return argmax_rows(self.compute_logits(hidden, upcast=False))


def gemma2_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Gemma 2: query_pre_attn_scalar, both soft-caps, and (transformers 4) a window on every
    other layer from the first."""
    return implied_windows(hf, _gemma(hf, cfg), lambda i: i % 2 == 0)


def gemma3_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Gemma 3: Gemma 2's fields, q/k norms, and (transformers 4) a window on all layers but every
    sliding_window_pattern-th, whose rope bases are rope_theta (default 1e6, not 1e4) and
    rope_local_base_freq (transformers 5 writes a rope per layer type, read generically)."""
    cfg = _gemma(hf, dataclasses.replace(cfg, qk_norm=True))
    if cfg.local_rope_theta is None:
        params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        theta = params.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
        cfg = dataclasses.replace(cfg, rope_theta=float(theta), local_rope_theta=float(hf.get("rope_local_base_freq", 10000.0)))
    return implied_windows(hf, cfg, lambda i: (i + 1) % int(hf.get("sliding_window_pattern", 6)) != 0)


def _gemma(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(
        cfg,
        query_pre_attn_scalar=number(hf.get("query_pre_attn_scalar")),
        attn_logit_softcap=number(hf.get("attn_logit_softcapping")),
        final_logit_softcap=number(hf.get("final_logit_softcapping")),
    )
