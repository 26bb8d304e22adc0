"""AWQ and GPTQ checkpoints made here, in the layouts AutoAWQ and AutoGPTQ / GPTQModel publish,
from a tiny float checkpoint (conveyor/tiny/): deterministic, no GPU, no quantization package.

The quantization is plain min/max (or absmax where sym), not AWQ's or GPTQ's search: the tests
judge the reading of the published layout, whose tensors any quantizer fills the same way.
- AWQ GEMM (AutoAWQ `WQLinear_GEMM`): qweight int32 [K, N / 8], output 8c + ORDER[i] in bits 4i of
  word c, ORDER = (0, 2, 4, 6, 1, 3, 5, 7); qzeros int32 [K / G, N / 8] the same; scales fp16 [K / G, N].
- GPTQ (AutoGPTQ `QuantLinear.pack`): qweight int32 [K * b / 32, N], input r * (32 / b) + i in
  bits b * i of row r; qzeros int32 [K / G, N * b / 32], output packed the same way, zero - 1 in
  checkpoint_format "gptq", the zero in "gptq_v2"; scales fp16 [K / G, N]; g_idx int32 [K].
  act-order (desc_act) takes the inputs in a seeded random order: input order[j] is in group j // G.
Neither AutoAWQ (deprecated; pinned to older torch and transformers) nor GPTQModel installs here
without CUDA, so these are written from the layout. When written, conveyor's readers were checked
once against those packages' own packers, run from their sources on CPU (AutoAWQ 0.2.9
`WQLinear_GEMM.from_linear` and `dequantize_gemm`; GPTQModel 7.7.0 `pack_original` and its v2 -> v1
zero-point export, 4 and 8 bits, with and without act-order): every weight equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> codes [N, K], zeros [N, G'] (integers) and fp16 scales [N, G'], input k in
    group g_idx[k]: min/max onto 0..2^b - 1, or symmetric about the zero 2^(b - 1)."""
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)], 1).clamp(max=0)
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)], 1).clamp(min=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    scales = ((hi - lo) / top).clamp_min(1e-6).half()
    zeros = torch.full_like(lo, 1 << (bits - 1)) if sym else (-lo / scales.float()).round().clamp(0, top)
    codes = (w / scales.float()[:, g_idx] + zeros[:, g_idx]).round().clamp(0, top)
    return codes.long(), zeros.long(), scales


def _pack(fields: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """fields (non-negative ints) -> int32 words, 32 / bits fields a word along `axis`: field i of
    word c is element c * (32 / bits) + order[i] (order: 0, 1, ... unless given)."""
    per = 32 // bits
    order = order or tuple(range(per))
    fields = np.moveaxis(fields.astype(np.uint32), axis, 0)
    words = np.zeros((fields.shape[0] // per, *fields.shape[1:]), dtype=np.uint32)
    for i, j in enumerate(order):
        words |= fields[j::per] << np.uint32(bits * i)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, 0, axis)).view(np.int32))


def pack_awq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    codes, zeros, scales = quantize(w, 4, torch.arange(k) // group, sym=False)
    return {
        "qweight": _pack(codes.T.numpy(), 4, 1, AWQ_ORDER),
        "qzeros": _pack(zeros.T.numpy(), 4, 1, AWQ_ORDER),
        "scales": scales.T.contiguous(),
    }


def pack_gptq(w: torch.Tensor, bits: int, group: int, *, sym: bool, v2: bool, act_order: bool, seed: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g_idx = torch.arange(k) // group
    if act_order:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty_like(g_idx).index_copy_(0, order, torch.arange(k) // group)  # g_idx[order[j]] = j // G
    codes, zeros, scales = quantize(w, bits, g_idx, sym)
    stored = zeros if v2 else zeros - 1
    assert int(stored.min()) >= 0, "gptq v1 cannot store a zero point of 0"
    return {
        "qweight": _pack(codes.T.numpy(), bits, 0),
        "qzeros": _pack(stored.T.numpy(), bits, 1),
        "scales": scales.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def write_quantized(source: Path, root: Path, quantization_config: dict[str, Any], pack, skip: tuple[str, ...] = ()) -> Path:
    """source's checkpoint with every decoder linear but those named in `skip` replaced by
    pack(weight) -> {suffix: tensor}, and config.json's quantization_config set."""
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight" and prefix.endswith(LINEARS) and not any(s in prefix for s in skip):
            tensors |= {f"{prefix}.{part}": t for part, t in pack(tensor.float()).items()}
        else:
            tensors[name] = tensor
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}, indent=2))
    for side in SIDE_FILES:
        shutil.copy(source / side, root / side)
    return root


def write_float(source: Path, root: Path, weights: dict[str, torch.Tensor]) -> Path:
    """source's files with `weights` ({layer prefix: float [N, K]}) in place of its quantized
    tensors and no quantization_config: the float model a reference dequantizer makes."""
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        prefix, _, suffix = name.rpartition(".")
        if prefix not in weights or suffix == "bias":
            tensors[name] = tensor
        elif suffix == "qweight":
            tensors[f"{prefix}.weight"] = weights[prefix].contiguous()
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config")
    (root / "config.json").write_text(json.dumps(config, indent=2))
    for side in SIDE_FILES:
        shutil.copy(source / side, root / side)
    return root
