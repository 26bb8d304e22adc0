"""QuantizedWeight, the form every quantized checkpoint loads into: the u4 chunk order, the
reference dequantization (groups, mins, act-order), the tensor-parallel cut against cutting the
float weight, and its refusals."""

from __future__ import annotations

import pytest
import torch

from conveyor.config.errors import ConfigError
from conveyor.gpu.parallel.shard import Split, cut
from conveyor.gpu.quant.weight import QuantizedWeight, pack_u4, quantize_groups


def test_u4_chunks_hold_input_j_low_and_j_plus_16_high():
    q = torch.arange(64).remainder(16).reshape(1, 64)
    packed = pack_u4(q)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    assert packed[0, 0].item() == q[0, 0].item() | (q[0, 16].item() << 4)
    assert packed[0, 16].item() == q[0, 32].item() | (q[0, 48].item() << 4)
    weight = QuantizedWeight("u4", 32, packed, torch.ones(1, 2), torch.zeros(1, 2))
    assert torch.equal(weight.codes(), q.float())


@pytest.mark.parametrize("kind,group", [("u4", 32), ("u8", 16), ("e4m3", 64)])
def test_quantize_then_dequantize_rounds_to_the_nearest_step(kind, group):
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(0))
    weight = quantize_groups(w, kind, group)
    assert weight.shape == (24, 128)
    error = (weight.dequantize() - w).abs()
    if kind == "e4m3":  # 3 mantissa bits: within half of 2^-3 of the value (and above e4m3's subnormals)
        assert (error <= w.abs() / 16 + 1e-6).all()
    else:  # within half a step of the group's scale
        step = weight.scales.repeat_interleave(group, dim=1)
        assert (error <= step / 2 * (1 + 1e-5)).all()
    assert weight.nbytes < w.numel() * w.element_size() / (3 if kind == "u4" else 2)


def test_act_order_puts_each_input_back():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    weight = quantize_groups(w[:, perm], "u8", 32)  # the kernel's column j is input perm[j]
    ordered = QuantizedWeight("u8", 32, weight.qweight, weight.scales, weight.mins, perm=perm)
    torch.testing.assert_close(ordered.dequantize()[:, perm], weight.dequantize())
    torch.testing.assert_close(ordered.dequantize(), w, atol=0.02, rtol=0)


@pytest.mark.parametrize("kind", ["u4", "u8"])
@pytest.mark.parametrize(
    "split", [Split(0, ((4, 8),)), Split(0, ((2, 8), (2, 8))), Split(1, ((4, 32),)), Split(0, ((30, 1),), pad=True)]
)
def test_the_cut_equals_cutting_the_float_weight(kind, split):
    rows = 30 if split.pad else 32
    w = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3))
    weight = quantize_groups(w, kind, 32)
    for rank in range(2):
        ours = weight.cut(split, rank, 2, "layer").dequantize()
        torch.testing.assert_close(ours, cut(weight.dequantize(), split, rank, 2), rtol=0, atol=0)


def test_a_cut_through_a_group_or_an_act_order_is_refused():
    weight = quantize_groups(torch.randn(4, 96), "u4", 32)
    with pytest.raises(ConfigError, match=r"weight mlp\.down_proj: groups of 32 inputs do not split over 2 ranks"):
        weight.cut(Split(1, ((96, 1),)), 0, 2, "mlp.down_proj")
    ordered = QuantizedWeight("u4", 32, weight.qweight, weight.scales, weight.mins, perm=torch.arange(96))
    with pytest.raises(ConfigError, match=r"act-order"):
        ordered.cut(Split(1, ((3, 32),)), 0, 3, "mlp.down_proj")


def test_scales_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match=r"scales \(4, 2\) do not match a \[4, 128\] weight in groups of 32"):
        QuantizedWeight("u8", 32, torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4, 2), None)
    with pytest.raises(ValueError, match=r"group size 16 does not fit"):
        QuantizedWeight("u4", 16, torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 8), None)


@pytest.mark.parametrize("kind", ["u8", "e4m3"])
def test_one_group_per_row_splits_into_one_group_per_rank(kind):
    """Per-channel scales (--quantization fp8, W8A8): each rank's columns keep their row's scale."""
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(4))
    weight = quantize_groups(w, kind, 96)
    split = Split(1, ((96, 1),))
    pieces = [weight.cut(split, rank, 2, "o_proj") for rank in range(2)]
    assert [p.group_size for p in pieces] == [48, 48]
    torch.testing.assert_close(torch.cat([p.dequantize() for p in pieces], dim=1), weight.dequantize(), rtol=0, atol=0)


def test_compact_stores_float16_scales_only_where_exact():
    """GGUF-like scales (float16 values widened) become float16 with the same dequantized weight,
    and bytes drop from 0.75 to 0.625 per u4 weight in groups of 32; one scale float16 cannot
    hold keeps the weight float32 (scales and mins together)."""
    w = quantize_groups(torch.randn(64, 128), "u4", 32)
    w.scales, w.mins = w.scales.half().float(), w.mins.half().float()
    before, nbytes = w.dequantize(), w.nbytes
    w.compact()
    assert w.scales.dtype == w.mins.dtype == torch.float16
    assert torch.equal(w.dequantize(), before) and w.nbytes == nbytes * 5 // 6
    w.compact()  # idempotent
    assert w.scales.dtype == torch.float16
    inexact = quantize_groups(torch.randn(64, 128), "u4", 32)
    inexact.scales, inexact.mins[0, 0] = inexact.scales.half().float(), 1 / 3
    inexact.compact()
    assert inexact.scales.dtype == inexact.mins.dtype == torch.float32
