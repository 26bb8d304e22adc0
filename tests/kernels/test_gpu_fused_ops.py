"""The C++ fused ops (gpu/backends/cpu/kernels/fused_ops.cpp), alone and as the cpu backend's ops, against
the torch backend's ops they replace.

The model-level check, logits against Hugging Face with every C++ op on, is in test_gpu_model.py;
here each op alone, at sizes on both sides of the one-thread threshold, and its argument checks.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.gpu.backends.cpu import CpuOps
from conveyor.gpu.backends.cpu.kernels import cpu_fused_ops
from conveyor.gpu.backends.torch import TorchOps
from conveyor.gpu.models.layers import RMSNorm
from conveyor.gpu.models.llama import MLP
from conveyor.gpu.models.rope import RotaryEmbedding

ops = cpu_fused_ops()
cpu_ops, torch_ops = CpuOps(ops, None), TorchOps()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler for the CPU kernels")

TOKENS = [1, 7, 300]  # 300 x 256 floats is past the serial threshold


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_with_and_without_the_residual(tokens):
    g = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(256, 1e-5, torch_ops)
    norm.weight.data = torch.randn(256, generator=g)
    x, residual = torch.randn(tokens, 256, generator=g), torch.randn(tokens, 256, generator=g)
    want_plain = norm(x)
    want, want_residual = norm(x, residual.clone())

    norm.ops = cpu_ops
    assert close(norm(x), want_plain)
    stream = residual.clone()
    got, got_residual = norm(x, stream)
    assert got_residual is stream and close(stream, residual + x)  # added in place
    assert close(got, want) and close(got_residual, want_residual)


@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_in_place_matches_the_torch_rotation(tokens):
    g = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(head_dim=32, rope_theta=10000.0, rope_scaling={}, max_positions=512)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    q, k = torch.randn(tokens, 8, 32, generator=g), torch.randn(tokens, 4, 32, generator=g)
    want_q, want_k = torch_ops.rotary(positions, q, k, rope.cos_sin)

    got_q, got_k = cpu_ops.rotary(positions, q.clone(), k.clone(), rope.cos_sin)
    assert close(got_q, want_q) and close(got_k, want_k)


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(tokens):
    g = torch.Generator().manual_seed(tokens)
    gate, up = torch.randn(tokens, 688, generator=g) * 4, torch.randn(tokens, 688, generator=g)
    want = torch.nn.functional.silu(gate) * up
    got = ops.silu_mul(gate.clone(), up)
    assert close(got, want)


def test_mlp_takes_the_c_path_only_for_what_it_supports():
    class Config:
        hidden_size, intermediate_size, mlp_bias = 16, 40, False

    mlp = MLP(Config(), torch_ops)
    x = torch.randn(5, 16)
    want = mlp(x)
    mlp.ops = cpu_ops
    assert close(mlp(x), want)
    assert close(mlp.double()(x.double()).float(), want)  # float64: the torch path serves


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="rms_norm"):
        ops.rms_norm(torch.randn(3, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="rms_norm"):
        ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-5, torch.randn(2, 8))
    with pytest.raises(ValueError, match="rotary"):
        ops.rotary(torch.randn(2, 4, 8), torch.randn(2, 2, 6), torch.zeros(2, dtype=torch.int64), torch.randn(4, 8))
    with pytest.raises(ValueError, match="int64"):
        ops.rotary(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.zeros(2, dtype=torch.int32), torch.randn(4, 8))
    with pytest.raises(ValueError, match="silu_mul"):
        ops.silu_mul(torch.randn(4), torch.randn(5))
