"""TritonBackend: the seam of gpu/backends/base.py filled with this package's Triton kernels.

`triton_backend(model, device)` builds it for `select` (gpu/backends/__init__.py): TritonAttention
(KV write, one paged_attention launch per mixed step) and TritonOps (add + RMSNorm, rotary,
SiLU x up as Triton kernels; MoE experts as fused_moe.py's grouped GEMM; linear is torch's, as
cuBLAS already does the GEMM, q/k/v and gate/up one product each (gpu/backends/column_groups.py);
a quantized linear is quant_linear.py's dequantize-in-GEMM kernel, or FP8 in the tensor cores
where fp8_linear.py takes the weight (quant_forms.py); LoRA shrink and expand as lora.py's kernels,
or over tokens grouped by slot, lora_sgmv_*.py's, at the row counts lora_groups.py's table gives them).

Invariants:
- the KV cache is one zeroed tensor per layer, [2, num_blocks, block_size, Hkv, D] in the KV
  dtype (the model's, or fp8 e4m3 codes) (0 keys, 1 values): gpu/kv/kv_cache.py's layout, so
  `copy_blocks` is the base class's;
- the metadata is the base class's AttentionMetadata: the kernels need no masks, and their grids
  come from shapes alone, so decode steps capture in CUDA graphs (`supports_decode_graphs`);
- importing this module imports triton, so gpu/backends/__init__.py imports it only when the
  backend is selected; on a CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1 set
  before triton is imported), and `triton_backend` refuses otherwise with a ConfigError.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
import triton
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata, Backend
from conveyor.gpu.backends.column_groups import ColumnGroups
from conveyor.gpu.backends.ops import LinearLayer, Ops
from conveyor.gpu.backends.triton.add_rms_norm import add_rms_norm, rms_norm
from conveyor.gpu.backends.triton.fp8_linear import Fp8Weight, fp8_linear
from conveyor.gpu.backends.triton.gemm_picks import Picked
from conveyor.gpu.backends.triton.int4pack import Int4PackWeight, int4pack_linear
from conveyor.gpu.backends.triton.kv_write import write_kv
from conveyor.gpu.backends.triton.lora import lora_expand, lora_shrink
from conveyor.gpu.backends.triton.lora_groups import kernel_for, lora_groups
from conveyor.gpu.backends.triton.lora_sgmv_expand import sgmv_expand
from conveyor.gpu.backends.triton.lora_sgmv_shrink import sgmv_shrink
from conveyor.gpu.backends.triton.paged_attention import paged_attention
from conveyor.gpu.backends.triton.quant_forms import form_of, form_type, rows_of
from conveyor.gpu.backends.triton.quant_linear import KernelWeight, kernel_takes, kernel_weight, quant_linear
from conveyor.gpu.backends.triton.quant_linear_words import WordWeight, words_linear
from conveyor.gpu.backends.triton.rotary import apply_rotary_
from conveyor.gpu.backends.triton.silu_mul import silu_mul
from conveyor.gpu.kv.kv_fp8 import UNIT_SCALES, KVScales
from conveyor.gpu.quant.weight import QuantizedWeight


class TritonAttention(AttentionBackend):
    # The kernels size their grids from shapes and read seq lens, tables and slots on the device.
    supports_decode_graphs = True

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]

    def write_kv(self, kv_cache, k, v, meta: AttentionMetadata, kv_scales: KVScales = UNIT_SCALES) -> None:
        write_kv(kv_cache, k, v, meta.slot_mapping, kv_scales)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        # k, v are in the cache already (write_kv ran first): the kernel reads every key from there.
        return paged_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window=meta.sliding_window,
            softcap=self.softcap,
            k_scale=kv_scales.k if self.kv_fp8 else 1.0,
            v_scale=kv_scales.v if self.kv_fp8 else 1.0,
        )


class TritonOps(Ops):
    name = "triton"

    def __init__(self, lora_kernels: tuple[tuple[int, str], ...] | None = None) -> None:
        self.lora_kernels = lora_kernels  # LoRA's kernels by a pass's rows (None: lora_groups.py's KERNEL_BY_ROWS)
        self.columns = ColumnGroups()  # q/k/v and gate/up stacked by prepare

    def prepare(self, model: nn.Module) -> None:
        """q/k/v and gate/up stacked into one weight each (gpu/backends/column_groups.py); then each
        quantized weight (a tied head's is its embedding's, prepared once) gets the form its kernel
        reads (quant_forms.py), a stacked layer's its rows of the stack's."""
        config = getattr(model, "config", None)
        dtype = getattr(torch, config.dtype) if config is not None else torch.float32
        done: set[int] = set()
        for group, layers in self.columns.prepare(model):
            if group.quantized is None:
                continue
            group.quantized.prepared = form = form_of(group.quantized, dtype)
            for layer, rows in zip(layers, group.rows()):
                own = cast(QuantizedWeight, layer.quantized)
                own.prepared = rows_of(form, rows) if form is not None and form_type(own) is type(form) else form_of(own, dtype)
                done.add(id(own))
        weights = {id(w): w for w in (getattr(m, "quantized", None) for m in model.modules()) if isinstance(w, QuantizedWeight)}
        for key, weight in weights.items():
            if key not in done:
                weight.prepared = form_of(weight, dtype)

    def linears(self, x: torch.Tensor, layers: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        group = self.columns.get(layers)
        return super().linears(x, layers) if group is None else group.products(self, x)

    def quant_linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        prepared = weight.prepared
        if isinstance(prepared, Picked):  # gemm_picks.py's kernel for this many rows
            prepared = prepared.form_for(x.shape[0])
        if isinstance(prepared, (WordWeight, Int4PackWeight)):
            return words_linear(x, prepared, bias) if isinstance(prepared, WordWeight) else int4pack_linear(x, prepared, bias)
        if isinstance(prepared, Fp8Weight):
            return fp8_linear(x, prepared, bias)
        if isinstance(prepared, KernelWeight):
            return quant_linear(x, prepared, bias)
        if kernel_takes(weight):  # not prepared (a layer built outside the loader): float32 scales, as they are
            return quant_linear(x, kernel_weight(weight, torch.float32), bias)
        return super().quant_linear(x, weight, bias)

    def moe_experts(
        self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The fused-MoE kernel (gpu/backends/triton/fused_moe.py): a grouped GEMM over
        expert-sorted tokens, no host sync."""
        from conveyor.gpu.backends.triton.fused_moe import fused_moe

        return fused_moe(x, gate_up, down, topk_weights, topk_ids)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps), residual  # residual += x in place

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        apply_rotary_(q, k, positions, cos_sin)
        return q, k

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate, up, out=gate)

    def linear(self, x: torch.Tensor, layer: LinearLayer) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def lora_b(self, num_slots: int, out: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Stored [out, S, R], each output's R values contiguous, as lora.py's expand reduces them
        within a thread. Stored [S, R, out] (the default), the same kernel cost a layer 1.9x the base
        products at 64 rows and 3.4x at 256, against 1.5x and 1.8x so, on an H200 (docs/benchmarks.md)."""
        return torch.zeros(out, num_slots, rank, dtype=dtype, device=device).permute(1, 0, 2)

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """lora.py's kernel: each token's slot read on the device, no host sync."""
        return lora_shrink(x, a, slots)

    def lora_expand(
        self, y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        return lora_expand(y, xa, b, scales, slots)

    def lora_groups(self, slots: torch.Tensor, num_slots: int) -> torch.Tensor | None:
        """The tokens grouped by slot (lora_groups.py) where the table picks SGMV for the pass's rows."""
        return lora_groups(slots, num_slots) if kernel_for(slots.shape[0], self.lora_kernels) == "sgmv" else None

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
        """With groups: the SGMV kernels (tiles of one slot's tokens on the tensor cores); else lora.py's."""
        if groups is None:
            return lora_expand(y, lora_shrink(x, a, slots), b, scales, slots)
        return sgmv_expand(y, sgmv_shrink(x, a, groups), b, scales, groups)


def triton_backend(model: ModelConfig, device: torch.device, kv_dtype: str | None = None) -> Backend:
    """The triton Backend for `model` on `device`: CUDA, or CPU under the interpreter; its KV
    cache in `kv_dtype` (None: the model's dtype)."""
    interpreted = triton.knobs.runtime.interpret
    if device.type != "cuda" and not interpreted:
        raise ConfigError(
            f"--attention-backend triton runs on CUDA, or on {device.type} only under Triton's interpreter "
            "(set TRITON_INTERPRET=1 in the environment)"
        )
    how = "under Triton's interpreter, slow: for testing" if interpreted else "compiled"
    return Backend(
        name="triton",
        attn=TritonAttention(model, device, kv_dtype),
        ops=TritonOps(),
        description=(
            "triton (paged attention, KV write, add + RMSNorm, rotary, SiLU x up, quantized linear as Triton kernels, "
            f"{how}; linear in torch)"
        ),
    )
