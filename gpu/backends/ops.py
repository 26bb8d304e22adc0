"""The ops half of the backend seam: the elementwise and linear work of the decoder (`Ops`), and
what it reads of a model's linear layers (`LinearLayer`, `LinearProducts`: Protocols, so that no
backend imports a model module). The attention half and the `Backend` bundle are base.py's.

Invariants every implementation keeps: inputs are [T, ...] activations in the model dtype,
flattened across rows as the attention backend's are; a method works in place only where its
docstring says so; `prepare` runs once, after loading and before any CUDA graph is captured.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Protocol, cast

import torch
from torch import nn

from conveyor.gpu.quant.weight import QuantizedWeight


class LinearProducts(Protocol):
    """A model's linear layer as Ops.linears multiplies it (gpu/models/layers.py Linear)."""

    def product(self, x: torch.Tensor) -> torch.Tensor: ...  # x W^T (+ bias), no adapter deltas


class LinearLayer(Protocol):
    """What ops.linear reads from a model's linear layer (gpu/models/layers.py Linear)."""

    @property
    def weight(self) -> torch.Tensor: ...  # [out, in]
    @property
    def bias(self) -> torch.Tensor | None: ...  # [out]
    @property
    def prepared(self) -> object | None: ...  # the ops' own form of the weight, set by ops.prepare; None: plain


class NotRecordable(RuntimeError):
    """A forward did work that Ops.record cannot replay (or the ops record nothing)."""


class Replay(Protocol):
    """A recorded forward (Ops.record)."""

    def replay(self) -> None: ...


class Ops(abc.ABC):
    """Elementwise and linear work of the decoder. Inputs are [T, ...] activations in the model
    dtype; a method may work in place where it says so, and returns what the model uses next."""

    name: str = "ops"

    def prepare(self, model: nn.Module) -> None:  # noqa: B027 (a hook: most ops need nothing)
        """Once, after the weights are loaded: re-layout weights (setting each Linear's
        `prepared`). The default keeps every weight as loaded."""

    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H], weight [H] -> [T, H] in x's dtype, normalised in float32. A weight in x's
        dtype scales the normalised x after its cast back (Llama's order in HF); a float32 weight
        scales it in float32, cast once at the end (Gemma's, whose (1 + w) HF computes in float32)."""

    @abc.abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, H] -> (rms_norm(x + residual), x + residual). The sum may be written
        into `residual` in place (and returned as it)."""

    @abc.abstractmethod
    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64, q [T, Hq, D], k [T, Hkv, D], cos_sin [P, D] float32 (cos in the
        first half, sin in the second: gpu/models/rope.py) -> rotated (q, k), "rotate half" (NeoX)
        layout, cos/sin cast to q's dtype first (as HF). May rotate q and k in place."""

    @abc.abstractmethod
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [T, I] -> silu(gate) * up [T, I]; may overwrite gate and return it."""

    @abc.abstractmethod
    def linear(self, x: torch.Tensor, layer: LinearLayer) -> torch.Tensor:
        """x [T, in] -> x @ layer.weight.T + layer.bias, [T, out]."""

    def quant_linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, K] -> x @ W^T + bias [T, N] in x's dtype, W the quantized weight's [N, K]
        (gpu/quant/weight.py). The default dequantizes the whole weight on every call: the
        reference, on any device; backends override it with kernels that read it packed."""
        return torch.nn.functional.linear(x, weight.dequantize(dtype=x.dtype), bias)

    def embedding(self, ids: torch.Tensor, table: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        """ids [T] int64, each a row of the table (this rank's: gpu/models/layers.py
        VocabParallelEmbedding) -> those rows [T, H]. table: the float [V, H], rows in its own
        dtype, or a QuantizedWeight [V, H] (a GGUF table kept packed), rows decoded to `dtype` (the
        activations'). The default is torch's, on any device: F.embedding (which raises on an id
        outside the table), or the rows dequantized (which index the codes as torch does)."""
        if isinstance(table, QuantizedWeight):
            return table.dequantize(rows=ids, dtype=dtype)
        return torch.nn.functional.embedding(ids, table)

    def argmax_product(self, x: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [T, in] -> (ids [T] int64, valid [T] bool): each row's argmax of the layer's product, id
        for id the full product's (the first of equals; valid False, id 0, where not finite), where
        the ops find it for less (ParallelLMHead.argmax); None, the default: take the product."""
        return None

    records: bool = False  # whether `record` can record at all (the cpu ops, their replay library built)

    def record(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Replay]:
        """forward() run once with its kernel calls recorded -> (its output, a Replay that makes
        the same calls again on what their tensors then hold, writing that same output), the
        CPU's counterpart of a CUDA graph (gpu/backends/cpu/kernels/program.py). Raises
        NotRecordable where these ops cannot, or forward did work a replay would skip; the
        default records nothing (CUDA captures graphs instead: gpu/step/cuda_graphs.py)."""
        raise NotRecordable(f"the {self.name} ops record no kernel calls")

    def linears(self, x: torch.Tensor, layers: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        """x [T, in] through column-parallel layers that all read it (q/k/v, gate/up) -> each
        one's product, in order (their products alone: the model adds their adapters' deltas,
        layers.column_products). The model keeps them as the checkpoint's separate layers; a
        backend may multiply them as one weight. The default multiplies each layer's."""
        return [cast(LinearProducts, layer).product(x) for layer in layers]

    def lora_b(self, num_slots: int, out: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Every slot's B, zeroed, [S, out, R], stored as this backend's expand reads it best
        (gpu/lora/slots.py). The default stores [S, R, out], each slot's B^T: rows of outputs."""
        return torch.zeros(num_slots, rank, out, dtype=dtype, device=device).transpose(1, 2)

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x [T, in], a [S, R, in] (each slot's A, zero rows past its rank), slots [T] int64 (each
        token's slot; -1: no adapter) -> xa [T, R] float32: x[t] @ a[slots[t]].T, 0 where slots[t] < 0.
        A backend may give it as [P, T, R] partial sums instead, which its lora_expand adds (the
        Triton kernels split `in` over programs so). The default multiplies x by every slot's A at
        once (one [T, S R] product: S R is small next to `in`) and keeps each token's own: no host
        sync, no per-slot loop."""
        num_slots, rank, _ = a.shape
        every = (x @ a.reshape(num_slots * rank, -1).T).view(-1, num_slots, rank)  # [T, S, R]
        own = every[torch.arange(x.shape[0], device=x.device), slots.clamp(min=0)]  # [T, R]
        return own.float() * (slots >= 0).unsqueeze(1)

    def lora_expand(
        self, y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """y [T, out] += scales[slots[t]] * (xa[t] @ b[slots[t]].T) for every token with a slot, in
        y's dtype, in place; b [S, out, R] (any strides), scales [S] float32. Returns y. The default
        puts each token's scaled xa in its slot's R columns of a [T, S R] row and multiplies once by
        every slot's B side by side ([out, S R]: a view of lora_b's storage)."""
        num_slots, out, rank = b.shape
        tokens = torch.arange(xa.shape[0], device=xa.device)
        valid = slots >= 0
        own = slots.clamp(min=0)
        spread = xa.new_zeros(xa.shape[0], num_slots, rank)  # [T, S, R]
        spread[tokens, own] = xa * (scales[own] * valid).unsqueeze(1)
        side_by_side = b.permute(1, 0, 2).reshape(out, num_slots * rank)  # [out, S R]
        return y.add_((spread.view(xa.shape[0], num_slots * rank).to(b.dtype) @ side_by_side.T).to(y.dtype))

    def lora_groups(self, slots: torch.Tensor, num_slots: int) -> torch.Tensor | None:
        """A pass's slots [T] -> what this backend's lora_add reads beside them, computed once a pass
        for all its projections (gpu/lora/slots.py; inside a decode graph, so replays recompute it):
        the Triton backend's tokens grouped by slot (triton/lora_groups.py). None, the default: nothing."""
        return None

    def lora_add(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        scales: torch.Tensor,
        slots: torch.Tensor,
        groups: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y [T, out] += scales[s] * x[t] A_s^T B_s^T for every token with a slot s = slots[t]: a
        projection's whole update (gpu/lora/slots.py), in place; returns y; groups: lora_groups(slots).
        The default is lora_expand(lora_shrink); a backend may do both in one call (the cpu kernels)."""
        return self.lora_expand(y, self.lora_shrink(x, a, slots), b, scales, slots)

    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [T, I] -> gelu(gate, tanh approximation) * up [T, I] (Gemma's GeGLU, HF's
        gelu_pytorch_tanh); may overwrite gate. The default is torch's, on any device."""
        return torch.nn.functional.gelu(gate, approximate="tanh").mul_(up)

    def moe_experts(
        self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts of a mixture-of-experts block (gpu/models/moe.py): x [T, H], gate_up
        [E, 2I, H] (each expert's gate rows, then its up rows), down [E, H, I], topk_ids [T, K],
        topk_weights [T, K] -> [T, H] in x's dtype: for each token, the sum over its K experts e of
        weight * down[e] @ (silu(gate[e] @ x) * (up[e] @ x)). The default is torch's, tokens
        grouped by expert (gpu/backends/torch/moe.py)."""
        from conveyor.gpu.backends.torch.moe import grouped_moe  # here, not at the top: that package imports this module

        return grouped_moe(x, gate_up, down, topk_weights, topk_ids)
