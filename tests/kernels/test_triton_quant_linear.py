"""The triton backend's quantized linear (gpu/backends/triton/quant_linear.py, fp8_linear.py, and
TritonOps' prepare / quant_linear) against QuantizedWeight.dequantize() + F.linear.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py), on odd shapes. The reference is computed in float32 from the exact
dequantized weight; the error allowed is a fraction of the output's largest magnitude: 1e-5 for
float32, 1e-3 for float16 (about two fp16 ulps there: the kernel rounds once, at the end), 8e-3
for bfloat16. Test scales and mins are float16 values, as AWQ, GPTQ and GGUF publish them, so the
float16 copies the kernel reads for 16-bit activations are exact (test_kernel_weight_* covers the
rounding). bf16, FP8 through torch._scaled_mm and CUDA-graph capture need a GPU (marked cuda).
"""

from __future__ import annotations

import textwrap
import types

import pytest
import torch
import torch.nn.functional as F

from conveyor.gpu.quant.weight import QuantizedWeight, pack_u4
from tests.triton_compile import compile_for_sm90

pytest.importorskip("triton")

from conveyor.gpu.backends.torch import TorchOps  # noqa: E402
from conveyor.gpu.backends.triton.backend import TritonOps  # noqa: E402
from conveyor.gpu.backends.triton.fp8_linear import (  # noqa: E402
    Fp8Weight,
    can_multiply_in_fp8,
    fp8_linear,
    fp8_reference,
    fp8_weight,
    quantize_per_token,
)
from conveyor.gpu.backends.triton.quant_linear import KernelWeight, _config, kernel_takes, kernel_weight, quant_linear  # noqa: E402
from conveyor.gpu.backends.triton.quant_linear_reduce import sum_splits  # noqa: E402
from conveyor.gpu.models.layers import Linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SHAPES = [(1, 16, 64), (3, 48, 96), (17, 80, 160)]  # (M, N, K)


def random_weight(kind, n, k, group, *, mins=True, perm=False, seed=0, device=DEVICE) -> QuantizedWeight:
    """Random codes over the whole range, float16-exact scales (and mins) around a real layer's."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "e4m3":
        codes = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        mins = False
    else:
        q = torch.randint(0, 16 if kind == "u4" else 256, (n, k), generator=gen)
        codes = pack_u4(q) if kind == "u4" else q.to(torch.uint8)
    groups = (n, k // group)
    scales = (0.002 + 0.01 * torch.rand(groups, generator=gen)).half().float()
    low = (-8 * scales * (1 + 0.1 * torch.randn(groups, generator=gen))).half().float() if mins else None
    order = torch.randperm(k, generator=gen) if perm else None
    return QuantizedWeight(kind, group, codes, scales, low, order).to(device)


def inputs(m, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(m, k, generator=gen).to(dtype).to(DEVICE), torch.randn(n, generator=gen).to(dtype).to(DEVICE)


def reference(x, weight: QuantizedWeight, bias) -> torch.Tensor:
    return F.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())


def assert_matches(y: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tolerance: float | None = None) -> None:
    """y in `dtype` within tolerance (default: TOLERANCE's) x the largest |expected| of it."""
    assert y.dtype == dtype and y.shape == expected.shape
    error = (y.float() - expected.float()).abs().max().item()
    assert error <= (tolerance or TOLERANCE[dtype]) * expected.float().abs().max().item(), error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("kind", "group"), [("u4", 32), ("u4", "K"), ("u8", 16), ("u8", "K"), ("e4m3", 32), ("e4m3", "K")])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_kernel_matches_dequantized_reference(m, n, k, kind, group, dtype):
    """Groups of 32 or 16 inputs, and one group a row (K = 160: 32-input blocks, five a group)."""
    weight = random_weight(kind, n, k, k if group == "K" else group, seed=m)
    x, bias = inputs(m, k, n, dtype, seed=m)
    assert_matches(quant_linear(x, kernel_weight(weight, dtype), bias), reference(x, weight, bias), dtype)


@pytest.mark.parametrize("kind", ["u4", "u8"])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("perm", [False, True])
def test_mins_bias_and_act_order(kind, mins, bias, perm):
    """Each option on and off, in float16: a symmetric weight (no mins), GPTQ's act-order."""
    m, n, k = 5, 48, 128
    weight = random_weight(kind, n, k, 64 if kind == "u4" else 32, mins=mins, perm=perm, seed=7)
    x, b = inputs(m, k, n, torch.float16, seed=3)
    b = b if bias else None
    assert_matches(quant_linear(x, kernel_weight(weight, torch.float16), b), reference(x, weight, b), torch.float16)


@pytest.mark.parametrize("kind", ["u4", "u8", "e4m3"])
def test_prefill_sized_steps_take_the_wide_tiles(kind):
    """More than 64 rows: 64 x 64 tiles, K whole (masked rows and columns at both ends)."""
    weight = random_weight(kind, 80, 128, 64, seed=70)
    x, bias = inputs(70, 128, 80, torch.float16, seed=70)
    assert_matches(quant_linear(x, kernel_weight(weight, torch.float16), bias), reference(x, weight, bias), torch.float16)


def test_nibble_order_is_the_chunk_layout():
    """One code set per input: the output names which input each nibble fed (input i of a
    one-row weight gets code i % 16 with a scale of 1, x is one-hot)."""
    k = 64
    q = torch.arange(k).remainder(16).unsqueeze(0)  # [1, K]
    weight = QuantizedWeight("u4", k, pack_u4(q), torch.ones(1, 1), None).to(DEVICE)
    x = torch.eye(k, device=DEVICE)  # [K, K]: row i picks input i
    y = quant_linear(x, kernel_weight(weight, torch.float32))  # [K, 1]
    assert y.squeeze(1).tolist() == q.squeeze(0).float().tolist()


def test_decode_splits_k_until_enough_bytes_are_in_flight():
    """(BLOCK_M, BLOCK_N, splits, num_warps) by shape: an 8B Llama's 4096 outputs split K in 4,
    its 14336 not; SmolLM2's 576 outputs over 18 blocks of 32 split in 6 (3 blocks each, none
    empty); more than 16 rows never split."""
    assert _config(1, 4096, 4096 // 128) == (16, 32, 4, 4)
    assert _config(16, 14336, 4096 // 128) == (16, 32, 1, 4)
    assert _config(1, 576, 576 // 32) == (16, 32, 6, 4)
    assert _config(1, 16, 2) == (16, 16, 2, 4)
    assert _config(17, 16, 2)[2] == _config(300, 4096, 32)[2] == 1


def test_sum_splits_matches_torch():
    gen = torch.Generator().manual_seed(0)
    partial, bias = torch.randn(3, 5, 300, generator=gen).to(DEVICE), torch.randn(300, generator=gen).half().to(DEVICE)
    out = sum_splits(partial, bias, torch.empty(5, 300, dtype=torch.float16, device=DEVICE))
    torch.testing.assert_close(out, (partial.sum(0) + bias.float()).half(), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="bias"):
        sum_splits(partial, bias[:10], out)


def test_kernel_weight_keeps_the_codes_and_rounds_scales_only_where_safe():
    weight = random_weight("u4", 16, 64, 32)
    wide = kernel_weight(weight, torch.float32)
    assert wide.scales is weight.scales and wide.codes.data_ptr() == weight.qweight.data_ptr()
    half = kernel_weight(weight, torch.bfloat16)
    assert half.scales.dtype == torch.float16 and half.mins.dtype == torch.float16
    assert half.codes.data_ptr() == weight.qweight.data_ptr()  # packed as stored, no copy
    tiny = random_weight("u8", 16, 64, 32, mins=False)
    tiny.scales.mul_(1e-4)  # under fp16's normal range: kept float32
    assert kernel_weight(tiny, torch.float16).scales.dtype == torch.float32
    e4m3 = random_weight("e4m3", 16, 64, 64)
    assert kernel_weight(e4m3, torch.float16).codes.dtype == torch.uint8


def test_rejects_mismatched_inputs():
    weight = kernel_weight(random_weight("u4", 16, 64, 32), torch.float32)
    with pytest.raises(ValueError, match="x "):
        quant_linear(torch.randn(2, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="bias"):
        quant_linear(torch.randn(2, 64, device=DEVICE), weight, torch.randn(8, device=DEVICE))
    narrow = random_weight("u8", 16, 64, 8)
    assert not kernel_takes(narrow)
    with pytest.raises(ValueError, match="groups of 8"):
        quant_linear(torch.randn(2, 64, device=DEVICE), kernel_weight(narrow, torch.float32))
    assert quant_linear(torch.randn(0, 64, device=DEVICE), weight).shape == (0, 16)


class _Model(torch.nn.ModuleList):
    """What TritonOps.prepare reads of a model: its modules, and config.dtype."""

    def __init__(self, dtype: str, layers: list[Linear]) -> None:
        super().__init__(layers)
        self.config = types.SimpleNamespace(dtype=dtype)


def test_ops_prepare_once_and_dispatch_by_form(monkeypatch):
    """prepare: the kernel's form (float16 scales for a float16 model), a weight two layers share
    prepared once, a group the kernel cannot take left to the reference; quant_linear: each form
    to its path, and an unprepared weight still to the kernel."""
    ops = TritonOps()
    shared, narrow = random_weight("u4", 16, 64, 32), random_weight("u8", 16, 64, 8)
    layers = [Linear(64, 16, False, ops) for _ in range(3)]
    for layer, weight in zip(layers, (shared, shared, narrow)):
        layer.quantized = weight
    ops.prepare(_Model("float16", layers))
    assert isinstance(shared.prepared, KernelWeight) and shared.prepared.scales.dtype == torch.float16
    assert narrow.prepared is None  # groups of 8: the reference

    calls = []
    import conveyor.gpu.backends.triton.backend as backend

    monkeypatch.setattr(backend, "quant_linear", lambda x, w, b: calls.append(w) or quant_linear(x, w, b))
    x = torch.randn(3, 64, device=DEVICE).half()
    assert_matches(layers[0](x), reference(x, shared, None), torch.float16)
    assert_matches(layers[2](x), reference(x, narrow, None), torch.float16)
    assert calls == [shared.prepared]
    loose = random_weight("u8", 16, 64, 16)
    torch.testing.assert_close(ops.quant_linear(x.float(), loose, None), reference(x.float(), loose, None), rtol=1e-5, atol=1e-5)
    assert calls[-1].scales is loose.scales  # unprepared: the float32 scales as they are


def test_per_token_fp8_rounding():
    """fp8_linear's activation quantization, which runs on any device: each row's largest
    magnitude maps to 448, every value within e4m3's rounding (3 mantissa bits)."""
    x = torch.randn(4, 96) * torch.tensor([[0.01], [1.0], [30.0], [0.0]])
    xq, scale = quantize_per_token(x)
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (4, 1)
    assert torch.equal(xq.float().abs().amax(1)[:3], torch.full((3,), 448.0))
    back = xq.float() * scale
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all()
    weight = random_weight("e4m3", 16, 96, 96, device="cpu")
    assert not can_multiply_in_fp8(weight)  # on a CPU: the kernel reads it weight-only
    close = (fp8_reference(x, weight) - reference(x, weight, None)).abs().max()
    assert close <= 0.1 * reference(x, weight, None).abs().max()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the model runs on a CPU, under the interpreter")
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_model_logits_on_the_triton_backend_match_the_reference(method):
    """A tiny Llama quantized at load (--quantization int8: u8 in groups of a whole row, 64 and
    160 inputs; fp8: e4m3 a scale per channel, read weight-only on a CPU), through the loader
    and TritonOps.prepare, against the same model on the torch backend's reference."""
    from conveyor.gpu.backends import Backend
    from conveyor.gpu.backends.torch import TorchAttention
    from conveyor.gpu.backends.triton.backend import TritonAttention
    from conveyor.gpu.loading.loader import load_model
    from conveyor.gpu.models.registry import read_model_config
    from tests.gpu.test_gpu_model import forward_prompts, random_prompts
    from tests.gpu_checkpoints import checkpoint

    config = read_model_config(checkpoint("llama"), quantization=method)
    cpu = torch.device("cpu")
    triton_model = load_model(config, cpu, Backend("triton", TritonAttention(config, cpu), TritonOps(), "triton"))
    torch_model = load_model(config, cpu, Backend("torch", TorchAttention(config, cpu), TorchOps(), "torch"))
    prepared = [m.quantized.prepared for m in triton_model.modules() if getattr(m, "quantized", None) is not None]
    assert prepared and all(isinstance(p, KernelWeight) for p in prepared)
    prompts = random_prompts([9, 1, 6], seed=2)
    ours, ref = forward_prompts(triton_model, config, prompts), forward_prompts(torch_model, config, prompts)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


COMPILE_FOR_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton.quant_linear import NUM_STAGES, _quant_linear_kernel as fn
    from conveyor.gpu.backends.triton.quant_linear_reduce import _sum_splits_kernel as reduce

    def compile(fn, types, constexprs, num_stages=3):
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
        # As the launcher specializes them at run time: 16-byte aligned pointers and sizes, so loads pipeline.
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
        return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=num_stages))

    aligned = {"x_ptr", "q_ptr", "scales_ptr", "mins_ptr", "bias_ptr", "y_ptr", "N", "K", "stride_xm", "stride_qn", "stride_ym",
               "partial_ptr", "out_ptr", "stride_om"}
    cases = [(0, "bf16", "fp16", True, False), (0, "fp16", "fp32", False, False), (1, "bf16", "fp16", True, False),
             (1, "fp32", "fp32", True, False), (2, "bf16", "fp32", False, True), (2, "fp16", "fp16", False, False)]
    for kind, dtype, scales, has_mins, native in cases:
        for block_m, block_n, split in ((16, 32, 4), (16, 32, 1), (64, 64, 1)):
            constexprs = dict(GROUP=128, KIND=kind, HAS_MINS=has_mins, HAS_BIAS=True, FP8_NATIVE=native, BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=128, SPLIT=split, UPCAST=False,
                              PRECISION="ieee" if dtype == "fp32" else None)
            out = "*fp32" if split > 1 else "*" + dtype
            types = dict(x_ptr="*" + dtype, q_ptr="*u8", scales_ptr="*" + scales, mins_ptr="*" + scales, bias_ptr="*" + dtype,
                         y_ptr=out)
            kernel = compile(fn, types, constexprs, NUM_STAGES)
            assert kernel.metadata.shared <= 160 * 1024, (kind, dtype, block_m, kernel.metadata.shared)  # H100: 227 KB an SM
            assert "ld.local" not in kernel.asm["ptx"]  # no register spills
        compile(reduce, dict(partial_ptr="*fp32", bias_ptr="*" + dtype, out_ptr="*" + dtype),
                dict(SPLITS=4, HAS_BIAS=True, BLOCK=256))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU tests compile and run the kernel")
def test_kernel_compiles_for_sm90():
    compile_for_sm90(COMPILE_FOR_SM90, timeout_s=300)


# On a GPU.


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["u4", "u8", "e4m3"])
@pytest.mark.parametrize(("m", "n", "k"), [*SHAPES, (1, 4096, 4096), (16, 1024, 4096), (64, 4096, 1024), (300, 512, 2048)])
def test_bf16_and_model_sized_shapes_on_cuda(m, n, k, kind):
    """bf16 (wrong under the interpreter), groups of 32 and 128 (FP8's block-wise scales, read
    weight-only with the hardware's e4m3 conversion), and decode / prefill-sized shapes."""
    group = 128 if k % 128 == 0 else 32
    weight = random_weight(kind, n, k, group, seed=k)
    for dtype in (torch.bfloat16, torch.float16):
        x, bias = inputs(m, k, n, dtype, seed=n)
        assert_matches(quant_linear(x, kernel_weight(weight, dtype), bias), reference(x, weight, bias), dtype)


def _per_channel_fp8(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    from conveyor.gpu.quant.weight import quantize_groups

    gen = torch.Generator().manual_seed(seed)
    return quantize_groups(torch.randn(n, k, generator=gen) * 0.05, "e4m3", k).to(DEVICE)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 64), (3, 48, 96), (17, 4096, 1024), (256, 1024, 4096)])
def test_fp8_scaled_mm_matches_its_reference(m, n, k, dtype):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    weight = _per_channel_fp8(n, k, seed=m)
    assert can_multiply_in_fp8(weight)
    x, bias = inputs(m, k, n, dtype, seed=k)
    y = fp8_linear(x, fp8_weight(weight), bias)
    # The same exact FP8 products, summed by the tensor cores (FP8 accumulation keeps fewer bits than float32).
    assert_matches(y, fp8_reference(x, weight, bias), dtype, tolerance=max(TOLERANCE[dtype], 1e-3))
    ops = TritonOps()
    layer = Linear(k, n, True, ops)
    layer.quantized, layer.bias.data = weight, bias
    ops.prepare(_Model({torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype], [layer]))
    assert isinstance(weight.prepared, Fp8Weight)
    torch.testing.assert_close(layer(x), y, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["u4", "e4m3"])
def test_a_quantized_linear_captures_in_a_cuda_graph(kind):
    """Replaying a captured quant_linear with new activations gives the eager result (u4 through
    the Triton kernel; e4m3 per channel through _scaled_mm where the device has FP8)."""
    if kind == "e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    n, k = 1024, 2048
    weight = random_weight("u4", n, k, 128) if kind == "u4" else _per_channel_fp8(n, k)
    ops = TritonOps()
    layer = Linear(k, n, False, ops)
    layer.quantized = weight
    ops.prepare(_Model("bfloat16", [layer]))
    static = torch.randn(4, k, device=DEVICE, dtype=torch.bfloat16)
    layer(static)  # compiles the kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    fresh = torch.randn(4, k, device=DEVICE, dtype=torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    exact = kind == "u4"  # the Triton kernels are deterministic; cuBLAS may pick another algorithm when capturing
    torch.testing.assert_close(out, layer(fresh), rtol=0 if exact else 1.6e-2, atol=0 if exact else 1e-3)
