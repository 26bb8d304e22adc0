"""The C++ quantized linear (gpu/backends/cpu/kernels/quant_linear.cpp, .py) against the
reference, QuantizedWeight.dequantize() + F.linear in float64: every kind, with and without
mins, bias and act-order perm, on odd shapes, through each path, in every ISA variant this
machine can run (tests/kernels/cpu_isa.py: on an AVX-512 VNNI machine, 512-bit products with and
without VNNI and 256-bit ones with AVX-VNNI and without, vpmaddubsw). Then through the cpu ops
(prepare, quant_linear, the fallback), and in context: the tiny model quantized at load decodes
the same greedy tokens on the cpu backend as on torch's.

Tolerances, relative to scale = |x| |W|^T + |bias| (what the sum's rounding is relative to):
- float paths (direct, dequantize): 1e-5. float32 sums of up to 1536 products in another order
  than the reference's differ by about sqrt(K) * 2^-24 ~ 2e-6 of it (measured: 2e-7); a wrong
  scale, min, code or group moves an output by 1e-2 of it or more.
- int8 paths, x in p int8 planes: x is quantized, each element within half a step of its block
  of 32's max / 127 / 128^(p - 1), so |y - ref| <= sum_k |w_k| * step_k / 2 (+ the float 1e-5),
  a bound that holds for every output. At p = 3 it is about float's own rounding (22 bits of x);
  at p = 1 (llama.cpp's Q8_1 precision) it is loose, so one plane is also held to x quantized
  the same way in torch, exactly but for an input whose rounding ties (one step of one input).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.gpu.backends.cpu.kernels import isa
from conveyor.gpu.backends.cpu.kernels import quant_linear as qlm
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear, QuantArgs, cpu_quant_linear
from conveyor.gpu.backends.cpu.ops import CpuOps
from conveyor.gpu.models.layers import Linear
from conveyor.gpu.quant.weight import QuantizedWeight, quantize_groups
from tests.kernels.cpu_isa import variant_params

NATIVE = cpu_quant_linear()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="no C++ compiler for the CPU kernels")

BUILDS = variant_params(int8=True)  # ISA variant names (isa.py), each path once outside -m slow


def build(name: str) -> CpuQuantLinear:
    """The kernel built for the ISA variant `name` (one this CPU runs: BUILDS skips the others)."""
    assert NATIVE is not None
    if name == "native":
        return NATIVE
    lib = load_library("quant_linear", name)
    assert lib is not None, f"quant_linear.cpp did not build for {name}"
    return CpuQuantLinear(lib)


GROUPS = {"u4": (32, 64, 128), "u8": (16, 32, 64, 128), "e4m3": (16, 32)}
SHAPES = [(1, 32), (17, 96), (200, 1536), (5, 64 * 3)]  # (N, K)
ROWS = [1, 3, 8, 9, 33, 600]


def cases(kind: str):
    """(N, K, G, M, mins, bias, perm) over every shape and row count, the options cycling."""
    options = itertools.cycle(itertools.product((True, False), (True, False), (False, True)))
    for (n, k), m in itertools.product(SHAPES, ROWS):
        groups = [g for g in GROUPS[kind] if k % g == 0]
        mins, bias, perm = next(options)
        yield n, k, groups[(n + m) % len(groups)], m, mins and kind != "e4m3", bias, perm


def weight(kind: str, n: int, k: int, group: int, mins: bool, perm: bool, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = quantize_groups(torch.randn(n, k, generator=g), kind, group)
    w.mins = w.mins if mins else None
    w.perm = torch.randperm(k, generator=g) if perm else None
    return w


def quantized_x(x: torch.Tensor, planes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x in one int8 plane, as the kernel rounds it; each element's last-plane
    step), blocks of 32 along K."""
    m, k = x.shape
    blocks = F.pad(x, (0, -k % 32)).view(m, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    one = ((blocks * inv).round() * (amax / 127)).view(m, -1)[:, :k]
    step = (amax / 127 / 128 ** (planes - 1)).expand_as(blocks).reshape(m, -1)[:, :k]
    return one, step


@pytest.mark.parametrize("half", [False, True], ids=["float32-scales", "float16-scales"])
@pytest.mark.parametrize("build_name", BUILDS)
@pytest.mark.parametrize("path", ["direct", "int8", "int8x2", "int8x3", "dequantize"])
@pytest.mark.parametrize("kind", ["u4", "u8", "e4m3"])
def test_matches_the_reference(kind, path, build_name, half):
    """half: scales and mins stored as float16 (QuantizedWeight.compact, as GGUF's are)."""
    kernel = build(build_name)
    for i, (n, k, group, m, mins, with_bias, perm) in enumerate(cases(kind)):
        w = weight(kind, n, k, group, mins, perm, seed=i)
        if half:
            w.scales, w.mins = w.scales.half().float(), None if w.mins is None else w.mins.half().float()
            w.compact()
            assert w.scales.dtype == torch.float16
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(m, k, generator=g)
        bias = torch.randn(n, generator=g) if with_bias else None
        got = kernel(x, w, bias, path=path).double()
        dense = w.dequantize().double()
        want = F.linear(x.double(), dense, None if bias is None else bias.double())
        scale = x.abs().double() @ dense.abs().t() + (0 if bias is None else bias.abs().double())
        err = (got - want).abs()
        where = f"{kind} N={n} K={k} G={group} M={m} mins={mins} bias={with_bias} perm={perm}"
        planes = {"int8": 1, "int8x2": 2, "int8x3": 3}.get(path) if kind != "e4m3" and kernel.has_int8 else None
        if planes is None:  # a float path (e4m3 and builds without AVX2 take direct for int8)
            assert (err <= 1e-5 * scale).all(), where
            continue
        xk = x if w.perm is None else x[:, w.perm]  # the kernel's input order, whose blocks it quantizes
        wk = dense if w.perm is None else dense[:, w.perm]
        one, step = quantized_x(xk, planes)
        assert (err <= (step / 2).double() @ wk.abs().t() + 1e-5 * scale).all(), where
        if planes == 1:
            emulated = F.linear(one.double(), wk, None if bias is None else bias.double())
            tie = (step.double().unsqueeze(1) * wk.abs().unsqueeze(0)).amax(-1)  # [M, N]: one step of one input
            assert ((got - emulated).abs() <= 1e-5 * scale + tie).all(), where


@pytest.mark.parametrize("path", ["direct", "dequantize"])
def test_every_e4m3_code_decodes_exactly(path):
    """Each of the 254 finite float8_e4m3fn codes (subnormals included) read through the identity:
    y[m, 0] = w[0, m], exactly. Under flush-to-zero too: no step of the decode makes a float32
    subnormal (e4m3's smallest, 2^-9, is a normal float32)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] + [0, 0], dtype=torch.uint8)
    w = QuantizedWeight("e4m3", 16, codes.view(torch.float8_e4m3fn).view(1, 256), torch.ones(1, 16), None)
    want = codes.view(torch.float8_e4m3fn).float()
    old = torch.set_flush_denormal(True)
    try:
        got = NATIVE(torch.eye(256), w, path=path)[:, 0]
    finally:
        torch.set_flush_denormal(old)
    assert torch.equal(got, want)


def test_many_rows_are_decoded_in_slices(monkeypatch):
    monkeypatch.setattr(qlm, "SCRATCH_FLOATS", 1000)  # 10 rows of 96 at a time: 20 slices and a bias each
    w = weight("u4", 200, 96, 32, mins=True, perm=False, seed=7)
    x, bias = torch.randn(40, 96), torch.randn(200)
    want = F.linear(x.double(), w.dequantize().double(), bias.double())
    got = NATIVE(x, w, bias, path="dequantize")
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-4)


def test_the_row_count_picks_the_path(monkeypatch):
    calls: list[int] = []
    fn = NATIVE._fn
    monkeypatch.setattr(NATIVE, "_fn", lambda *args: calls.append(args[3]) or fn(*args))
    gemm = NATIVE._gemm
    monkeypatch.setattr(NATIVE, "_gemm", lambda *args: calls.append(-1) or gemm(*args))
    u4, e4m3 = weight("u4", 48, 64, 32, True, False, 0), weight("e4m3", 48, 64, 32, False, False, 0)
    counts = (1, 2, qlm.INT8_MAX_ROWS, qlm.INT8_MAX_ROWS + 1, qlm.DEQUANTIZE_MIN_ROWS - 1, qlm.DEQUANTIZE_MIN_ROWS)
    for w, rows in itertools.product((u4, e4m3), counts):
        NATIVE(torch.randn(rows, 64), w)
    direct, dequantize = qlm.PATHS["direct"], qlm.PATHS["dequantize"]
    int8 = NATIVE.int8_path if NATIVE.has_int8 else direct
    several = int8 if NATIVE.int8_max_rows > 1 else direct
    assert NATIVE.int8_max_rows in {1, qlm.INT8_MAX_ROWS, *qlm.INT8_MAX_ROWS_WITHOUT_VNNI.values()}
    at_limit = int8 if NATIVE.int8_max_rows >= qlm.INT8_MAX_ROWS else direct
    assert calls[:6] == [int8, several, at_limit, direct, direct, dequantize]
    assert calls[6:] == [direct] * 5 + [dequantize]  # e4m3: no int8 path
    assert NATIVE.int8_path == qlm.PATHS["int8x3"]  # the default: x to 22 bits (see quant_linear.py)
    calls.clear()  # the limit itself, whichever build this is
    for rows in (NATIVE.int8_max_rows, NATIVE.int8_max_rows + 1):
        NATIVE(torch.randn(rows, 64), u4)
    assert calls == ([int8, direct] if NATIVE.has_int8 else [direct, direct])
    calls.clear()  # where oneDNN takes bfloat16 inputs, the dequantize path from fewer rows
    for bfloat16, rows in itertools.product((False, True), (qlm.DEQUANTIZE_MIN_ROWS_BF16 - 1, qlm.DEQUANTIZE_MIN_ROWS_BF16)):
        monkeypatch.setattr(qlm.onednn, "bfloat16_products", lambda bfloat16=bfloat16: bfloat16)
        NATIVE(torch.randn(rows, 64), u4)
    assert calls == [direct, direct, direct, dequantize]


@pytest.mark.parametrize("build_name", variant_params(int8=True))
def test_int8_row_limit_follows_the_byte_products(build_name):
    """Each build says which byte products it has and at what width: VNNI's vpdpbusd takes int8 to
    INT8_MAX_ROWS; vpmaddubsw to 5 rows in ymm (AVX2), one in zmm (quant_linear.py's table)."""
    kernel = build(build_name)
    paths = isa.kernel_paths(isa.build_features(isa.variant(build_name)))
    assert kernel.has_int8 == (paths.int8 is not None)
    vnni = paths.int8 is not None and paths.int8.startswith("vpdpbusd")
    zmm = paths.int8 is not None and "zmm" in paths.int8
    assert kernel.int8_max_rows == (qlm.INT8_MAX_ROWS if vnni else 1 if zmm else 5)


def test_mismatched_shapes_are_refused():
    w = weight("u4", 8, 64, 32, True, False, 0)
    with pytest.raises(ValueError, match="do not match"):
        NATIVE(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="do not match"):
        NATIVE(torch.randn(2, 64), w, torch.randn(9))


class Block(nn.Module):
    """Two quantized layers as the loader leaves them: no float weight, `quantized` set."""

    def __init__(self, ops: CpuOps, first: QuantizedWeight, second: QuantizedWeight) -> None:
        super().__init__()
        self.first, self.second = Linear(64, 48, True, ops), Linear(64, 48, False, ops)
        for layer, w in ((self.first, first), (self.second, second)):
            layer.register_parameter("weight", None)  # as gpu/quant/load.py leaves it
            layer.quantized = w


def test_cpu_ops_prepare_and_take_the_layers_they_support():
    ops = CpuOps(None, None, NATIVE)
    supported = weight("u8", 48, 64, 16, True, True, 1)
    unsupported = weight("u8", 48, 64, 16, True, False, 2)
    unsupported.scales = unsupported.scales.t().contiguous().t()  # a column-major view: not the kernel's
    block = Block(ops, supported, unsupported)
    ops.prepare(block)
    assert isinstance(supported.prepared, QuantArgs) and unsupported.prepared is None
    x = torch.randn(5, 64)
    for layer, w in ((block.first, supported), (block.second, unsupported)):
        want = F.linear(x.double(), w.dequantize().double(), None if layer.bias is None else layer.bias.double())
        assert torch.allclose(layer(x).double(), want, rtol=0, atol=1e-4)
    as_double = ops.quant_linear(x.double(), supported, None)  # not the kernel's dtype: the reference
    assert as_double.dtype == torch.float64 and torch.equal(as_double, F.linear(x.double(), supported.dequantize(dtype=torch.float64)))


def grouped_layers(ops: CpuOps, weights: list[QuantizedWeight], bias: bool) -> tuple[Linear, ...]:
    layers = []
    for w in weights:
        n, k = w.shape
        layer = Linear(k, n, bias, ops)
        layer.register_parameter("weight", None)  # as gpu/quant/load.py leaves it
        layer.quantized = w
        layers.append(layer)
    return tuple(layers)


@pytest.mark.parametrize("rows", [1, 3, qlm.DEQUANTIZE_MIN_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_layers_of_one_input_multiply_as_one_weight(rows, bias, monkeypatch):
    """q/k/v-like layers of 48, 16 and 16 outputs through ops.linears: one kernel call, each
    output what the layer alone gives (the same path's sums), and each layer's weight afterwards a
    view of the stacked one (no byte stored twice); a second step reuses the stack."""
    ops = CpuOps(None, None, NATIVE)
    weights = [weight("u4", n, 64, 32, True, False, seed) for seed, n in enumerate((48, 16, 16))]
    layers = grouped_layers(ops, weights, bias)
    ops.prepare(nn.ModuleList(layers))
    x = torch.randn(rows, 64)
    alone = [layer(x) for layer in layers]
    dequantized = [w.dequantize() for w in weights]
    calls = []
    call = CpuQuantLinear.__call__
    monkeypatch.setattr(CpuQuantLinear, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    for _ in range(2):
        together = ops.linears(x, layers)
        assert all(a.shape == t.shape and t.is_contiguous() for a, t in zip(alone, together))
        assert all(torch.allclose(a, t, rtol=1e-5, atol=1e-4) for a, t in zip(alone, together))
    assert len(calls) == 2  # one per step, not one per layer
    stacked = ops._groups[tuple(map(id, layers))]
    assert stacked is not None and stacked.bounds == (0, 48, 64, 80)
    assert stacked.quantized is not None
    base = stacked.quantized.qweight.untyped_storage().data_ptr()
    assert all(layer.quantized.qweight.untyped_storage().data_ptr() == base for layer in layers)
    for layer, w in zip(layers, dequantized):  # each layer alone still gives its own product
        assert torch.equal(layer.quantized.dequantize(), w)


def test_layers_that_do_not_stack_are_multiplied_one_by_one():
    """Different kinds, an act-order perm, or a float layer: each layer's own product."""
    ops = CpuOps(None, None, NATIVE)
    kinds = [weight("u4", 16, 64, 32, True, False, 0), weight("u8", 16, 64, 16, True, False, 1)]
    perms = [weight("u4", 16, 64, 32, True, True, 2), weight("u4", 16, 64, 32, True, True, 3)]
    for weights in (kinds, perms):
        layers = grouped_layers(ops, weights, False)
        ops.prepare(nn.ModuleList(layers))
        x = torch.randn(2, 64)
        got = ops.linears(x, layers)
        assert ops._groups[tuple(map(id, layers))] is None
        assert all(torch.equal(g, layer(x)) for g, layer in zip(got, layers))
    float_layer = Linear(64, 16, False, ops)
    mixed = (grouped_layers(ops, [weight("u4", 16, 64, 32, True, False, 4)], False)[0], float_layer)
    ops.prepare(nn.ModuleList(mixed))
    assert [g.shape for g in ops.linears(torch.randn(2, 64), mixed)] == [(2, 16), (2, 16)]
    assert ops._groups[tuple(map(id, mixed))] is None


def test_the_tiny_model_decodes_the_torch_backends_tokens(monkeypatch):
    """--quantization int8 (u8 codes, groups of 128 or a whole row) on the cpu backend, whose
    decode steps take the int8x3 path and prefill the dequantize one, against the torch backend's
    reference (dequantize + F.linear): the same greedy tokens. One int8 plane did not keep them
    (4 prompts: 3 diverged within 2 tokens), so this is the test the default plane count meets."""
    from conveyor import LLM, SamplingParams

    calls = []
    call = CpuQuantLinear.__call__
    monkeypatch.setattr(CpuQuantLinear, "__call__", lambda self, x, *a, **k: calls.append(x.shape[0]) or call(self, x, *a, **k))
    prompts = ["Hello, my name is", "The capital of France is", "1 2 3 4", "a"]
    greedy, tokens = SamplingParams(max_tokens=24, temperature=0), {}
    for backend in ("torch", "cpu"):
        outputs = LLM("tiny", quantization="int8", attention_backend=backend).generate(prompts, greedy)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["cpu"] == tokens["torch"]
    assert min(calls) <= qlm.INT8_MAX_ROWS < max(calls)  # both kinds of step went through the kernel
