"""LlamaForCausalLM, which also serves MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM, with
their config adapters; and the layers the other families (gemma.py, phi3.py, mixtral.py) build on.

The four differ only in what ModelConfig says, and the adapters here (`llama_config`,
`qwen2_config`, `qwen3_config`, `qwen_windows`) are where their config.json quirks become it:
q/k/v or per-projection biases, tied embeddings, sliding windows, q/k norms, head_dim, GQA, rope.

Invariants:
- activations are [T, H], tokens flattened across sequences ("varlen"); attention finds each
  token's sequence through AttentionMetadata, and each attention layer asks for the metadata of
  its own window (`attn.for_window`);
- no device or backend branches: every layer calls the backend's `ops.*` and `attn.forward(...)`;
- parameter names equal the Hugging Face safetensors names (model.layers.0.self_attn.q_proj.weight,
  ...), so loading is CausalLM's name lookup; projections are kept unfused for that reason (the
  ops may stack q/k/v and gate/up once loaded, each layer's weight a view of its rows:
  gpu/backends/column_groups.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from conveyor.config.model import ModelConfig, implied_windows
from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata, Backend
from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.kv.kv_fp8 import UNIT_SCALES, KVScales
from conveyor.gpu.models.base import CausalLM
from conveyor.gpu.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, column_products
from conveyor.gpu.models.rope import RotaryEmbedding
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.shard import local_units


class Attention(nn.Module):
    """Layer `layer_index`'s attention: its window is config.window_of(layer_index). `kv_scales`:
    its fp8 KV cache scales, 1.0 unless the checkpoint gives them (gpu/quant/kv_scales.py sets them
    at load); a float cache ignores them."""

    kv_scales: KVScales = UNIT_SCALES

    def __init__(
        self, config: ModelConfig, ops: Ops, attn: AttentionBackend, layer_index: int = 0, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.ops, self.attn = ops, attn
        # This rank's heads: a share of the query heads, and of the KV heads or one replica of one.
        self.num_heads = local_units(config.num_heads, tp.size)
        self.num_kv_heads = local_units(config.num_kv_heads, tp.size)
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = config.window_of(layer_index)
        self.make_projections(config, ops, tp)
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # one norm over each head's D, weights [D] shared by the heads
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)

    def make_projections(self, config: ModelConfig, ops: Ops, tp: TensorParallel) -> None:
        """Column-parallel q/k/v (by heads), row-parallel o (one all-reduce)."""
        h, d, heads, kv_heads = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
        self.q_proj = ColumnParallelLinear(h, ((heads, d),), config.qkv_bias, ops, tp)
        self.k_proj = ColumnParallelLinear(h, ((kv_heads, d),), config.qkv_bias, ops, tp)
        self.v_proj = ColumnParallelLinear(h, ((kv_heads, d),), config.qkv_bias, ops, tp)
        self.o_proj = RowParallelLinear(((heads, d),), h, config.o_bias, ops, tp)

    def sibling_projections(self) -> tuple[tuple[ColumnParallelLinear, ...], ...]:
        """The projections that read the layer's input, as `project` multiplies them (ops.linears:
        an ops' prepare may stack them into one weight: gpu/backends/column_groups.py)."""
        return ((self.q_proj, self.k_proj, self.v_proj),)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, Hq * D], k, v [T, Hkv * D] (column views of one product where stacked)."""
        (qkv,) = self.sibling_projections()
        q, k, v = column_products(self.ops, x, qkv)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens, d = x.shape[0], self.head_dim
        q, k, v = self.project(x)
        if self.qk_norm:  # each head's [D] is one row of the norm: [T, Hq * D] -> [T * Hq, D]
            q, k = self.q_norm(q.reshape(-1, d)), self.k_norm(k.reshape(-1, d))
        q = q.view(num_tokens, self.num_heads, d)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, d)
        q, k = self.ops.rotary(positions, q, k, rope.cos_sin)
        meta = self.attn.for_window(meta, self.window)
        out = self.attn.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scales)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU or Gemma's tanh-approximated GELU.
    Column-parallel gate/up, row-parallel down: one all-reduce, or none with reduce=False (the
    caller sums first: an MoE block's shared expert)."""

    def __init__(self, config: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE, reduce: bool = True) -> None:
        super().__init__()
        h, rows, bias = config.hidden_size, ((config.intermediate_size, 1),), config.mlp_bias
        self.gate_proj = ColumnParallelLinear(h, rows, bias, ops, tp)
        self.up_proj = ColumnParallelLinear(h, rows, bias, ops, tp)
        self.down_proj = RowParallelLinear(rows, h, bias, ops, tp, reduce)
        self.ops = ops
        self.gelu = getattr(config, "hidden_act", "silu") == "gelu_pytorch_tanh"

    def sibling_projections(self) -> tuple[tuple[ColumnParallelLinear, ...], ...]:
        """gate and up, which read x (as Attention's)."""
        return ((self.gate_proj, self.up_proj),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act_mul = self.ops.gelu_tanh_mul if self.gelu else self.ops.silu_mul
        (gate_up,) = self.sibling_projections()
        gate, up = column_products(self.ops, x, gate_up)
        return self.down_proj(act_mul(gate, up))  # [T, I / tp] -> [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm MLP. A family with other projections names its classes."""

    attention_class: type[Attention] = Attention
    mlp_class: type[nn.Module] = MLP

    def __init__(self, config: ModelConfig, backend: Backend, layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, backend.ops, backend.attn, layer_index, backend.tp)
        self.mlp = self.mlp_class(config, backend.ops, backend.tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)

    def forward(self, x, residual, positions, rope, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output [T, H], residual: the stream before it (None in the first
        layer, where x is the embedding) -> (this layer's MLP output, the stream before it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.feed_forward(h), residual

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]: the MLP here; a mixture-of-experts layer routes to its experts."""
        return self.mlp(h)


class LlamaForCausalLM(CausalLM):
    """CausalLM over DecoderLayer: Llama, Mistral, Qwen2 and Qwen3 (gpu/models/registry.py)."""

    layer_class = DecoderLayer


def llama_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Llama and Mistral: the generic reading is the whole story (Llama's attention_bias and
    mlp_bias, Mistral's window on every layer)."""
    return cfg


def qwen_windows(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Qwen's transformers 4 layout (its MoE models' too): the window on the layers from
    max_window_layers on, full attention below."""
    if "max_window_layers" not in hf:
        return cfg
    first = int(hf["max_window_layers"])
    return implied_windows(hf, cfg, lambda i: i >= first)


def qwen2_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Qwen2: a bias on q/k/v whatever attention_bias says, and none on o_proj."""
    return qwen_windows(hf, dataclasses.replace(cfg, qkv_bias=True, o_bias=False))


def qwen3_config(hf: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Qwen3: an RMSNorm over each query and key head before rope."""
    return qwen_windows(hf, dataclasses.replace(cfg, qk_norm=True))
