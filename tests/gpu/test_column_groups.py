"""q/k/v and gate/up as one product each (gpu/backends/column_groups.py).

On the torch backend a family's float32 logits with the stacks equal those of the separate
products bit for bit (each output is the same dot product over K: the GEMM's order of sums over K
does not change with N here); a step issues one product per group (counted at the dispatcher);
each layer's weight and bias are views of its group's stack and the model holds no second copy.
Quantized groups (u4, u8, e4m3) stack as their rows do, on the torch backend and on the triton
backend under Triton's interpreter, each layer alone still giving its own product; groups that
cannot stack are multiplied apart.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conveyor.gpu.backends import torch_backend
from conveyor.gpu.backends.column_groups import sibling_groups
from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.backends.torch import TorchOps
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.base import CausalLM
from conveyor.gpu.models.layers import Linear
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.quant.weight import QuantizedWeight, quantize_groups
from tests import moe_checkpoints
from tests.gpu.test_gpu_model import forward_prompts, random_prompts
from tests.gpu_checkpoints import ARCHS, checkpoint

CPU = torch.device("cpu")


class Apart(TorchOps):
    """The torch ops without the stacks: every layer multiplied alone, as before them."""

    def prepare(self, model: nn.Module) -> None:
        pass


def path_of(arch: str) -> Path:
    return moe_checkpoints.checkpoint(arch) if arch in moe_checkpoints.MOE_ARCHS else checkpoint(arch)


def load(arch: str, ops: Ops | None = None, quantization: str | None = None) -> tuple[CausalLM, object]:
    config = read_model_config(path_of(arch), quantization=quantization)
    backend = torch_backend(config, CPU)
    return load_model(config, CPU, backend if ops is None else dataclasses.replace(backend, ops=ops)), config


class CountProducts(TorchDispatchMode):
    """Counts the matrix products (F.linear's: aten linear, or mm / addmm where it decomposes)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.linear, torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages under `tensors` (a view's storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def model_tensors(model: nn.Module) -> list[torch.Tensor | None]:
    """Every tensor the model's weights hold: parameters and quantized layers' parts."""
    tensors: list[torch.Tensor | None] = list(model.parameters())
    for m in model.modules():
        w = getattr(m, "quantized", None)
        if isinstance(w, QuantizedWeight):
            tensors += [w.qweight, w.scales, w.mins, w.perm]
    return tensors


# Qwen2-MoE's shared expert is 48 rows wide. On this CPU (AVX-512) torch's elementwise kernels walk
# a row of a strided view 32 floats at a time and its last 16 in a scalar loop, whose SiLU rounds
# apart from the vector one that a contiguous gate gets throughout: ulps, not the product's doing.
ULPS_APART = {"qwen2_moe"}


@pytest.mark.parametrize("arch", ARCHS + moe_checkpoints.MOE_ARCHS)
def test_stacked_logits_equal_the_separate_products_bit_for_bit(arch):
    stacked, config = load(arch)
    apart, _ = load(arch, Apart())
    groups = sibling_groups(stacked)
    assert len(stacked.backend.ops.columns._stacks) == len(groups)  # every declared group stacked
    assert len(groups) == (0 if arch == "phi3" else 2 * config.num_layers) or arch in moe_checkpoints.MOE_ARCHS
    prompts = random_prompts([37, 50, 1, 20])
    ours, ref = forward_prompts(stacked, config, prompts), forward_prompts(apart, config, prompts)
    if arch in ULPS_APART:
        assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max()
    else:
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"])
def test_a_step_issues_one_product_per_group(quantization):
    """Llama (biases everywhere): 4 products a layer (q/k/v, o, gate/up, down) against 7, plus
    the LM head; each layer's weight and bias a view of its stack's rows (quantized: its codes,
    scales and mins), whose storage is the only one."""
    (stacked, config), (apart, _) = (load("llama", ops, quantization) for ops in (None, Apart()))
    counts = []
    for model in (stacked, apart):
        with CountProducts() as counter:
            forward_prompts(model, config, random_prompts([5, 1]))
        counts.append(counter.count)
    layers = config.num_layers
    assert counts == [4 * layers + 1, 7 * layers + 1]
    for group in sibling_groups(stacked):
        stack = stacked.backend.ops.columns.get(group)
        assert stack is not None and stack.bias is not None
        for layer, rows in zip(group, stack.rows()):
            parts = [(layer.bias, stack.bias)]
            if quantization is None:
                parts.append((layer.weight, stack.weight))
            else:
                mine, whole = layer.quantized, stack.quantized
                parts += [(mine.qweight, whole.qweight), (mine.scales, whole.scales)]
            for own, whole in parts:
                assert own.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                bits = (lambda t: t.view(torch.uint8)) if own.dtype == torch.float8_e4m3fn else (lambda t: t)
                assert torch.equal(bits(own), bits(whole[rows])) and own.is_contiguous()


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_the_stacks_hold_no_second_copy(arch, quantization):
    """The model's weights take as many bytes stacked as apart: the stacks are the layers' own storage."""
    (stacked, _), (apart, _) = (load(arch, ops, quantization) for ops in (None, Apart()))
    stacks = stacked.backend.ops.columns._stacks.values()
    extra = [t for s in stacks for t in (s.weight, s.bias) + ((s.quantized.qweight, s.quantized.scales) if s.quantized else ())]
    assert stacks and storage_bytes(model_tensors(stacked) + extra) == storage_bytes(model_tensors(apart))


class Siblings(nn.Module):
    """Layers of one input, declared as a model's attention declares q/k/v (or not: `declared`
    False, left apart); `config` for TritonOps.prepare."""

    def __init__(self, layers: list[Linear], dtype: str = "float32", declared: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.config = types.SimpleNamespace(dtype=dtype)
        self.declared = declared

    def sibling_projections(self) -> tuple[tuple[Linear, ...], ...]:
        return (tuple(self.layers),) if self.declared else ()  # type: ignore[arg-type]


def quantized_layers(ops: Ops, kinds: list[tuple[str, int]], k: int = 64, bias: bool = True) -> list[Linear]:
    """One quantized layer per (kind, group size), 48, 16, 16, ... outputs: q/k/v-like."""
    gen = torch.Generator().manual_seed(len(kinds))
    layers = []
    for i, (kind, group) in enumerate(kinds):
        n = 48 if i == 0 else 16
        layer = Linear(k, n, bias, ops)
        layer.register_parameter("weight", None)  # as gpu/quant/load.py leaves it
        layer.quantized = quantize_groups(torch.randn(n, k, generator=gen), kind, group)
        if bias:
            layer.bias.data.normal_(generator=gen)
        layers.append(layer.requires_grad_(False))
    return layers


def triton_ops() -> Ops:
    pytest.importorskip("triton")
    from conveyor.gpu.backends.triton.backend import TritonOps

    return TritonOps()


INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the interpreter: on CUDA, the cuda test below")


@pytest.mark.parametrize("kind,group", [("u4", 32), ("u8", 16), ("e4m3", 64)])
@pytest.mark.parametrize("make_ops", [TorchOps, pytest.param(triton_ops, marks=INTERPRETED)], ids=["torch", "triton"])
def test_quantized_groups_stack_and_each_layer_still_multiplies_alone(make_ops, kind, group):
    ops = make_ops()
    layers = quantized_layers(ops, [(kind, group)] * 3)
    alone = [layer.quantized.dequantize() for layer in layers]
    ops.prepare(Siblings(layers))
    stack = ops.columns.get(tuple(layers))
    assert stack is not None and stack.bounds == (0, 48, 64, 80) and stack.quantized is not None
    x = torch.randn(3, 64)
    together = ops.linears(x, tuple(layers))
    for layer, w, y in zip(layers, alone, together):
        want = torch.nn.functional.linear(x, w, layer.bias)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)  # the layer alone: its rows of the stack
        assert torch.equal(layer.quantized.dequantize(), w)
    form = stack.quantized.prepared
    if form is not None:  # triton: each layer's form (its float16 scales too) is its rows of the stack's
        for name in ("codes", "scales"):
            base = getattr(form, name).untyped_storage().data_ptr()
            assert all(getattr(layer.quantized.prepared, name).untyped_storage().data_ptr() == base for layer in layers)


def test_groups_that_cannot_stack_are_multiplied_apart():
    """Different kinds, an act-order perm, biases on some layers only, float and quantized mixed:
    no stack, the layers untouched, each product its own."""
    ops = TorchOps()
    kinds = quantized_layers(ops, [("u4", 32), ("u8", 32)])
    perm = quantized_layers(ops, [("u4", 32), ("u4", 32)])
    perm[1].quantized.perm = torch.randperm(64)
    some_bias = [Linear(64, 16, True, ops), Linear(64, 16, False, ops)]
    mixed = [quantized_layers(ops, [("u4", 32)], bias=False)[0], Linear(64, 16, False, ops)]
    for layers in (kinds, perm, some_bias, mixed):
        before = [getattr(layer, "quantized", None) or layer.weight for layer in layers]
        storages = [t.qweight if isinstance(t, QuantizedWeight) else t for t in before]
        ptrs = [t.untyped_storage().data_ptr() for t in storages]
        ops.prepare(Siblings(layers))
        assert ops.columns.get(tuple(layers)) is None
        now = [getattr(layer, "quantized", None) or layer.weight for layer in layers]
        assert [(t.qweight if isinstance(t, QuantizedWeight) else t).untyped_storage().data_ptr() for t in now] == ptrs
        x = torch.randn(2, 64)
        assert all(torch.equal(y, layer(x)) for y, layer in zip(ops.linears(x, tuple(layers)), layers))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stacking_on_cuda_allocates_nothing_that_stays():
    """bf16 Llama on the triton backend: after prepare the device holds what it held before (the
    layers' own tensors freed as their stacks took their place)."""
    from conveyor.gpu.backends import select

    config = read_model_config(checkpoint("llama"), dtype="bfloat16")
    backend = select("triton", "cuda", config)
    model = load_model(config, "cuda", dataclasses.replace(backend, ops=Apart()))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    backend.ops.prepare(model)
    torch.cuda.synchronize()
    assert len(backend.ops.columns._stacks) == 2 * config.num_layers
    assert torch.cuda.memory_allocated() <= before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,group", [("u4", 128), ("u8", 128), ("e4m3", 4096)])
def test_stacked_groups_on_cuda_equal_the_layers_apart(kind, group):
    """Llama-3-8B's q/k/v (4096, 1024, 1024 outputs of 4096 inputs) with Qwen2's biases, bf16
    activations, on the triton backend: the stack's outputs (e4m3 per channel: FP8 in the tensor
    cores, H100 and up) against an unstacked copy of the same weights, layer by layer; then the
    stacked call captured in a CUDA graph and replayed gives them again."""
    from conveyor.gpu.backends.triton.backend import TritonOps

    torch.manual_seed(0)
    weights = [quantize_groups(torch.randn(n, 4096, device="cuda") * 0.02, kind, group) for n in (4096, 1024, 1024)]
    biases = [torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 for n in (4096, 1024, 1024)]
    forms = []
    for declared in (True, False):
        ops = TritonOps()
        layers = []
        for w, b in zip(weights, biases):
            layer = Linear(4096, w.shape[0], True, ops).to("cuda", torch.bfloat16).requires_grad_(False)
            layer.register_parameter("weight", None)
            layer.quantized, layer.bias.data = dataclasses.replace(w), b.clone()  # a copy: stacking re-points its tensors
            layers.append(layer)
        ops.prepare(Siblings(layers, "bfloat16", declared))
        assert (ops.columns.get(tuple(layers)) is not None) == declared
        forms.append(lambda x, ops=ops, layers=tuple(layers): ops.linears(x, layers))
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    stacked, apart = forms[0](x), forms[1](x)
    for s, a in zip(stacked, apart):
        assert s.shape == a.shape and (s.float() - a.float()).abs().max() <= 1e-2 * a.float().abs().max()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forms[0](x)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(c, s) for c, s in zip(captured, stacked))
