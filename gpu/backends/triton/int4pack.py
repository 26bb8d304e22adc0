"""W4A16 through PyTorch's own int4 GEMM (tinygemm, `torch.ops.aten._weight_int4pack_mm`): a
u4 QuantizedWeight converted once, at load, to the layout and scales that kernel reads.

tinygemm dequantizes w[n, k] = (q - 8) * scale + zero, one (scale, zero) per group of G inputs
and output n, from `scales_and_zeros` [K / G, N, 2]. Ours is q * s + m (gpu/quant/weight.py), so
scale = s and zero = m + 8 s: the same weight, exactly in float32 (the CPU twin,
`_weight_int4pack_mm_for_cpu`, which the tests compare with the dequantized reference). On CUDA
tinygemm takes bf16 only: x, the output and scales_and_zeros; s and m + 8 s rounded to bf16
(unit roundoff 2^-8) move a weight by at most 2^-8 (|q - 8| s + |m + 8 s|) (the test's bound),
about the rounding a bf16 checkpoint's weights carry anyway. So on CUDA the form is for bf16 models.

Layouts (the op's, not ours): on CUDA `_convert_weight_to_int4pack` takes [N, K / 2] uint8, the
even input in the high nibble, and gives [N / 8, K / (16 t), 32, t / 2] int32 (t inner K tiles);
on a CPU its twin takes the codes [N, K] int32 and keeps rows in tiles of 64. So a stack of
layers (gpu/backends/column_groups.py) cuts to one layer's rows by views (`int4pack_rows`) where
its rows are whole tiles (any 8B stack on CUDA), its scales_and_zeros by a small copy (the op
wants them contiguous).

Invariants: any u4 group size the op takes (32, 64, 128, 256), with or without mins; GPTQ's
act-order `perm` gathers x's columns first (one index_select), as quant_linear.py does; N a
multiple of 16, K of 16 t. Nothing syncs with the host: a decode step captures in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch

from conveyor.gpu.quant.weight import QuantizedWeight

GROUPS = (32, 64, 128, 256)  # the group sizes tinygemm takes
INNER_K_TILES = (8, 4, 2)  # the first whose 16 t inputs divide K (8: gpt-fast's choice)


@dataclasses.dataclass(frozen=True)
class Int4PackWeight:
    """A u4 weight as tinygemm reads it (TritonOps.prepare may set one, by gemm_picks.py)."""

    packed: torch.Tensor  # CUDA: [N / 8, K / (16 t), 32, t / 2] int32; CPU: the twin's own layout
    scales_and_zeros: torch.Tensor  # [K / G, N, 2]: (s, m + 8 s); bf16 on CUDA
    group_size: int
    n: int
    perm: torch.Tensor | None  # [K] int64: x's column for each input; None: as is


def int4pack_takes(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether tinygemm can multiply `weight` for activations of `dtype` (bf16 on CUDA; any float
    dtype through the CPU twin, which the tests use)."""
    n, k = weight.shape
    cuda = weight.qweight.device.type == "cuda"
    return (
        weight.kind == "u4"
        and weight.group_size in GROUPS
        and n % 16 == 0  # the CPU twin's least; CUDA's tiles are of 8
        and k % 32 == 0
        and (dtype == torch.bfloat16 if cuda else dtype.is_floating_point)
        and (not cuda or torch.cuda.get_device_capability(weight.qweight.device) >= (8, 0))
    )


def int4pack_weight(weight: QuantizedWeight, dtype: torch.dtype) -> Int4PackWeight:
    """Convert `weight` (int4pack_takes) once; its codes and scales are left as they are."""
    n, k = weight.shape
    q = weight.codes().to(torch.int32)  # [N, K] in 0..15, the kernel's input order
    tiles = next(t for t in INNER_K_TILES if k % (16 * t) == 0)
    if weight.qweight.device.type == "cuda":
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles)
    scales = weight.scales.float()  # [N, K / G]
    zeros = 8 * scales if weight.mins is None else weight.mins.float() + 8 * scales
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()  # [K / G, N, 2]
    return Int4PackWeight(packed, scales_and_zeros, weight.group_size, n, weight.perm)


def int4pack_rows(form: Int4PackWeight, rows: slice) -> Int4PackWeight:
    """A stack's form -> its output rows `rows`: whole tiles of 8 rows on CUDA; on a CPU of 64
    (the twin's), the last one as long as it is."""
    start, stop = rows.start or 0, form.n if rows.stop is None else rows.stop
    cuda = form.packed.dim() == 4
    tile = 8 if cuda else 64
    if start % tile or (stop % tile and stop != form.n):
        raise ValueError(f"int4pack_rows: rows {start}:{stop} are not whole tiles of {tile}")
    packed = form.packed[start // 8 : stop // 8] if cuda else form.packed[start:stop]
    return dataclasses.replace(form, packed=packed, scales_and_zeros=form.scales_and_zeros[:, start:stop].contiguous(), n=stop - start)


def int4pack_linear(x: torch.Tensor, form: Int4PackWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 on CUDA) -> x @ W^T + bias [M, N] in x's dtype."""
    if form.perm is not None:
        x = x.index_select(1, form.perm)  # the op's input j is x[:, perm[j]]
    x = x.contiguous()
    if x.is_cuda:
        y = torch.ops.aten._weight_int4pack_mm(x, form.packed, form.group_size, form.scales_and_zeros)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, form.packed, form.group_size, form.scales_and_zeros)
    return y if bias is None else y + bias.to(y.dtype)
