"""The C++ small linear (gpu/backends/cpu/kernels/small_linear.cpp; its row kernel too, for the
weights it does not take) against torch's, oneDNN's packed
weights (gpu/backends/cpu/kernels/onednn_linear.py), and the cpu backend's ops (gpu/backends/cpu/ops.py),
whose `prepare` moves a Linear's weight to the transposed storage the kernel reads and whose
`linear` picks a path by rows.

The model-level check, logits against Hugging Face with every C++ op on, is in test_gpu_model.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.gpu.backends.cpu.kernels import cpu_small_linear
from conveyor.gpu.backends.cpu.kernels.onednn_linear import (
    PACKED_MIN_ROWS,
    onednn_available,
    pack_linear_weight,
    packed_linear,
)
from conveyor.gpu.backends.cpu.kernels.small_linear import ROW_MAX_ROWS
from conveyor.gpu.backends.cpu.ops import CpuOps, SmallLinearWeight
from conveyor.gpu.backends.torch import TorchOps
from conveyor.gpu.models.layers import Linear

small = cpu_small_linear()
pytestmark = pytest.mark.skipif(small is None, reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 300])
@pytest.mark.parametrize(("k", "n", "bias"), [(256, 688, False), (5, 48, True), (1024, 16, True)])
def test_matches_torch(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = small(x, w.t().contiguous(), b)
    assert torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def cpu_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    """A Linear on the cpu ops with the small-linear kernel, prepared as at load."""
    ops = CpuOps(None, small)
    layer = Linear(in_features, out_features, bias, ops)
    ops.prepare(layer)
    return layer


def test_linear_moves_its_weight_and_back_without_changing_results():
    layer = Linear(64, 96, True, TorchOps())
    x = torch.randn(7, 64)
    want = layer(x)
    storage = layer.weight.data.clone()

    layer.ops = ops = CpuOps(None, small)
    ops.prepare(layer)
    assert isinstance(layer.prepared, SmallLinearWeight) and not layer.weight.is_contiguous()  # a view of [in, out] storage
    assert layer.weight.t().is_contiguous() and torch.equal(layer.weight, storage)
    assert (layer.prepared.packed is not None) == (onednn_available() and small.packs)
    assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    for rows in (PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 2047, small.max_rows + 1):  # each side of each switch
        tall = torch.randn(rows, 64)
        assert torch.allclose(layer(tall), F.linear(tall, storage, layer.bias), rtol=1e-5, atol=1e-4)

    layer.ops = ops = CpuOps(None, None)  # no small-linear kernel (it does not pay on this CPU)
    ops.prepare(layer)
    assert layer.prepared is None
    assert layer.weight.is_contiguous() and torch.equal(layer.weight, storage)


def test_layers_the_kernel_does_not_take_keep_torch():
    wide = cpu_linear(2048, 32, bias=False)  # more input features than the kernel takes
    odd = cpu_linear(64, 40, bias=False)  # N not a multiple of 16
    for layer in (wide, odd):
        assert layer.prepared is None and layer.weight.is_contiguous()


def test_bad_arguments_raise():
    wt = torch.randn(8, 32)
    with pytest.raises(ValueError, match="do not match"):
        small(torch.randn(2, 9), wt)
    with pytest.raises(ValueError, match="do not match"):
        small(torch.randn(2, 8), wt, torch.randn(31))
    with pytest.raises(ValueError, match="contiguous float32"):
        small(torch.randn(2, 8).double(), wt)
    with pytest.raises(ValueError, match="contiguous float32"):
        small(torch.randn(8, 2).t(), wt)


def test_a_head_tied_to_the_embedding_keeps_its_layout():
    from conveyor.gpu.backends import Backend
    from conveyor.gpu.backends.cpu.kernels import cpu_fused_ops
    from conveyor.gpu.backends.torch import TorchAttention
    from conveyor.gpu.loading.loader import load_model
    from conveyor.gpu.models.registry import read_model_config
    from tests.gpu_checkpoints import checkpoint

    config = read_model_config(checkpoint("qwen2"))
    backend = Backend("cpu", TorchAttention(config, torch.device("cpu")), CpuOps(cpu_fused_ops(), small), "small linears")
    model = load_model(config, "cpu", backend)  # prepared at load
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.prepared is None and model.model.embed_tokens.weight.is_contiguous()
    assert isinstance(model.model.layers[0].mlp.up_proj.prepared, SmallLinearWeight)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weights_match_torch(bias):
    assert onednn_available()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(688, 256, generator=g)
    b = torch.randn(688, generator=g) if bias else None
    packed = pack_linear_weight(w)
    for rows in (PACKED_MIN_ROWS + 64, PACKED_MIN_ROWS + 88, PACKED_MIN_ROWS + 127):  # 576 as is, 600 and 639 padded
        x = torch.randn(rows, 256, generator=g)
        y = packed_linear(x, packed, b)
        assert y.shape == (rows, 688) and y.is_contiguous()
        assert torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_layer_routes_by_rows(monkeypatch):
    """Which path serves a step: spy on both. oneDNN takes many rows (padded to a multiple of 64,
    so its per-shape primitives are reused), the C++ kernel the rest."""
    layer = cpu_linear(64, 96, bias=False)
    assert isinstance(layer.prepared, SmallLinearWeight)
    if layer.prepared.packed is None:
        pytest.skip("no oneDNN packed weights on this CPU (or in this torch)")
    calls = []
    import conveyor.gpu.backends.cpu.kernels.onednn_linear as packed

    monkeypatch.setattr(packed, "packed_linear", lambda x, p, b: calls.append(("packed", len(x))) or packed_linear(x, p, b))

    assert small is not None  # the test is skipped without the kernel
    kernel = small

    class SmallSpy:
        max_rows = kernel.max_rows

        def __call__(self, x, w, b):
            calls.append(("small", len(x)))
            return small(x, w, b)

    monkeypatch.setattr(layer.ops, "small_linear", SmallSpy())
    for rows in (1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 2047, 2048):
        layer(torch.randn(rows, 64))
    assert calls == [("small", 1), ("small", 511), ("packed", 512), ("packed", 2047), ("packed", 2048)]


def test_without_packed_weights_rows_past_the_limit_go_to_a_gemm(monkeypatch):
    """AVX2: the kernel takes steps up to small.max_rows rows, a GEMM (oneDNN's or torch's) the rest."""
    layer = cpu_linear(64, 96, bias=False)
    if layer.prepared.packed is not None:
        pytest.skip("packed weights serve the many-row steps on this CPU")
    calls = []

    assert small is not None  # the test is skipped without the kernel
    kernel = small

    class SmallSpy:
        max_rows = kernel.max_rows

        def __call__(self, x, w, b):
            calls.append(len(x))
            return small(x, w, b)

    monkeypatch.setattr(layer.ops, "small_linear", SmallSpy())
    for rows in (1, small.max_rows, small.max_rows + 1):
        x = torch.randn(rows, 64)
        assert torch.allclose(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
    assert calls == [1, small.max_rows]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, ROW_MAX_ROWS])
@pytest.mark.parametrize("k,n", [(16, 7), (64, 96), (1536, 577), (2048, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_row_kernel_matches_torch(rows, k, n, bias):
    """The row kernel reads the weight as stored, [N, K]: every row count it takes, N not a
    multiple of its block of rows (the tail one row at a time), K wider than small_linear takes."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    assert small.takes_rows(x, w, b)
    assert torch.allclose(small.rows(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_row_kernel_refuses_what_it_cannot_read():
    w = torch.randn(32, 64)
    refused = [
        (torch.randn(ROW_MAX_ROWS + 1, 64), w, None),  # past its rows: oneDNN's
        (torch.randn(2, 48), torch.randn(32, 48)[:, :40].contiguous(), None),  # K = 40, not a multiple of 16
        (torch.randn(2, 64), w.t().contiguous().t(), None),  # a transposed view
        (torch.randn(2, 64).double(), w.double(), None),
        (torch.randn(2, 64), w, torch.randn(31)),
    ]
    for x, weight, bias in refused:
        assert not small.takes_rows(x, weight, bias)
    with pytest.raises(ValueError, match="takes_rows"):
        small.rows(*refused[0])


def test_wide_layers_take_the_row_kernel_for_few_rows(monkeypatch):
    """A layer small_linear does not take (2048 inputs) goes to the row kernel up to ROW_MAX_ROWS
    rows, so a decode step records (program.py refuses torch's GEMM); oneDNN's or torch's GEMM past it."""
    layer = cpu_linear(2048, 48, bias=True)
    assert layer.prepared is None
    calls = []
    kernel = small

    class RowSpy:
        takes_rows = staticmethod(kernel.takes_rows)

        def rows(self, x, w, b):
            calls.append(len(x))
            return kernel.rows(x, w, b)

    monkeypatch.setattr(layer.ops, "small_linear", RowSpy())
    for rows in (1, ROW_MAX_ROWS, ROW_MAX_ROWS + 1):
        x = torch.randn(rows, 2048)
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert calls == [1, ROW_MAX_ROWS]
