"""The decoder shared by LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM.

The three differ only in what ModelConfig already says: biases on q/k/v (Qwen2) or on every
projection (Llama attention_bias / mlp_bias), tied embeddings, a sliding window (Mistral), the
head_dim, GQA and the rope type. Tokens are flattened across sequences ("varlen"): activations
are [T, H] and attention finds each token's sequence through AttentionMetadata.

Parameter names equal the Hugging Face safetensors names (model.layers.0.self_attn.q_proj.weight,
...), so loading is a name lookup. Projections are kept unfused for that reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.config.model import ModelConfig
from conveyor.gpu.attention import AttentionMetadata, paged_attention
from conveyor.gpu.cpu_kernels.fused_ops import CpuFusedOps, supports
from conveyor.gpu.cpu_kernels.packed_linear import pack_linear_weight, packed_linear, packed_linear_available, use_packed
from conveyor.gpu.cpu_kernels.small_linear import CpuSmallLinear
from conveyor.gpu.rope import RotaryEmbedding


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) with two CPU float32 paths for narrow layers (see
    MAX_IN_FEATURES in gpu/cpu_kernels/small_linear.py), chosen by the step's rows:
    - most row counts: the C++ kernel of gpu/cpu_kernels/small_linear.cpp. It reads
      the weight transposed, so `use_cpu_linear` moves the weight's storage to [in, out] and
      leaves `weight` a transposed view of it: torch's GEMM serves what the kernel does not
      take from the same memory.
    - many rows, in multiples of 64 (`use_packed`): oneDNN on a blocked copy of the weight
      (gpu/cpu_kernels/packed_linear.py), where torch has it."""

    small: CpuSmallLinear | None = None
    packed: torch.Tensor | None = None  # oneDNN's copy of the weight, for steps of many rows

    def use_cpu_linear(self, small: CpuSmallLinear | None) -> None:
        weight_t = self.weight.data.t().contiguous()  # no copy when already moved
        if small is not None and small.supports_weight(weight_t):
            self.weight.data = weight_t.t()  # [out, in] view of [in, out] storage
            self.small = small
            self.packed = pack_linear_weight(self.weight.data) if packed_linear_available() else None
        else:
            self.weight.data = self.weight.data.contiguous()
            self.small = self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.small
        if small is not None and x.dim() == 2 and supports(x):
            if self.packed is not None and use_packed(x.shape[0]):
                return packed_linear(x, self.packed, self.bias)
            if x.shape[0] <= small.max_rows:
                return small(x, self.weight.t(), self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """With `residual`, the pre-norm residual add is folded in: returns (norm(x + residual),
    x + residual), so the C path (`ops`, set by use_cpu_ops) adds and normalises in one pass."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops: CpuFusedOps | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.ops is not None and supports(x) and (residual is None or supports(residual)):
            out = self.ops.rms_norm(x, self.weight, self.eps, residual)  # residual += x in place
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # As HF: normalise in float32, cast back, then scale (the order matters in bf16).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h, d = config.hidden_size, config.head_dim
        self.q_proj = Linear(h, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)
        self.ops: CpuFusedOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place: on a CPU each [T, intermediate] temporary is megabytes of memory traffic.
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.ops is not None and supports(gate) and supports(up):
            return self.down_proj(self.ops.silu_mul(gate, up))
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, rope, meta, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output [T, H], residual: the stream before it (None in the first
        layer, where x is the embedding) -> (this layer's MLP output, the stream before it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """The `model.` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM and Qwen2ForCausalLM (see models/__init__.py).

    `rope_device` is explicit so the model can be built on the meta device (no init cost) while
    the rope table, which is computed rather than loaded, lands on the real one.
    """

    def __init__(self, config: ModelConfig, rope_device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding.from_config(config, rope_device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids, positions [T] int64; kv_caches one [2, N, bs, Hkv, D] per layer -> [T, H]."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rope, meta, kv_cache)
        return self.model.norm(x, residual)[0]

    def use_cpu_ops(self, ops: CpuFusedOps | None, small_linear: CpuSmallLinear | None = None) -> None:
        """Route RMSNorm, the rotary embedding and SiLU * up through the C ops, and the linears the
        small-linear kernel supports through it (None: torch). A weight tied to the embedding
        keeps its layout: the embedding's row lookups need it."""
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, RMSNorm | MLP):
                module.ops = ops
            if isinstance(module, Linear) and not (tied and module is self.lm_head):
                module.use_cpu_linear(small_linear)
        self.rope.ops = ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (the matmul runs in the model dtype, as HF)."""
        return self.lm_head(hidden).float()
