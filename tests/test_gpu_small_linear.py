"""The C++ small linear (gpu/cpu_kernels/small_linear.cpp) against torch's, and the Linear module
that moves its weight to the transposed storage the kernel reads.

The model-level check, logits against Hugging Face with every C++ op on, is in test_gpu_model.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.gpu.cpu_kernels import cpu_small_linear
from conveyor.gpu.models.llama import Linear

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


def test_linear_moves_its_weight_and_back_without_changing_results():
    layer = Linear(64, 96, bias=True)
    x = torch.randn(7, 64)
    want = layer(x)
    storage = layer.weight.data.clone()

    layer.use_small_linear(small)
    assert layer.small is small and not layer.weight.is_contiguous()  # a view of [in, out] storage
    assert layer.weight.t().is_contiguous() and torch.equal(layer.weight, storage)
    assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    tall = torch.randn(small.max_rows + 1, 64)  # past the kernel's rows: torch's GEMM, same memory
    assert torch.allclose(layer(tall), F.linear(tall, storage, layer.bias), rtol=1e-5, atol=1e-4)

    layer.use_small_linear(None)
    assert layer.small is None and layer.weight.is_contiguous() and torch.equal(layer.weight, storage)


def test_layers_the_kernel_does_not_take_keep_torch():
    wide = Linear(2048, 32, bias=False)  # more input features than the kernel takes
    odd = Linear(64, 40, bias=False)  # N not a multiple of 16
    for layer in (wide, odd):
        layer.use_small_linear(small)
        assert layer.small is None and layer.weight.is_contiguous()


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
    from conveyor.config.model import ModelConfig
    from conveyor.gpu.cpu_kernels import cpu_fused_ops
    from conveyor.gpu.loader import load_model
    from tests.gpu_checkpoints import checkpoint

    model = load_model(ModelConfig.from_pretrained(checkpoint("qwen2")), "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.use_cpu_ops(cpu_fused_ops(), small)
    assert model.lm_head.small is None and model.model.embed_tokens.weight.is_contiguous()
    assert model.model.layers[0].mlp.up_proj.small is small
