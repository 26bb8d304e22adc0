"""oneDNN's float32 products on weights as stored (gpu/backends/cpu/kernels/onednn_linear.py):
equal to F.linear up to float32 reassociation, taken from ONEDNN_MIN_ROWS rows, and the GEMM of
every cpu-backend product no kernel of ours takes: wide float layers, a tied head, a quantized
weight's decoded slices. (The packed form and the narrow layers' routing:
test_gpu_small_linear.py.)

Tolerance: float32 sums of K products in another order differ by about sqrt(K) * 2^-24 of
|x| |W|^T; 1e-5 of that scale is far above it and far below a wrong row, column or bias.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conveyor.gpu.backends.cpu import ops as cpu_ops
from conveyor.gpu.backends.cpu.kernels import cpu_quant_linear, cpu_small_linear, isa
from conveyor.gpu.backends.cpu.kernels import onednn_linear as onednn
from conveyor.gpu.backends.cpu.kernels import quant_linear as qlm
from conveyor.gpu.backends.cpu.ops import CpuOps
from conveyor.gpu.models.layers import Linear
from conveyor.gpu.quant.weight import quantize_groups

needs_onednn = pytest.mark.skipif(not onednn.onednn_available(), reason="torch without oneDNN's linear ops")


def close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    want = x.double() @ w.double().T + (0 if b is None else b.double())  # not F.linear: tests spy on it
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return got.dtype == x.dtype and got.shape == want.shape and bool(((got.double() - want).abs() <= 1e-5 * scale).all())


class Spy:
    """Counts the rows of each product it passes on to `fn`."""

    def __init__(self, fn):
        self.fn, self.rows = fn, []

    def __call__(self, x, *args):
        self.rows.append(x.shape[0])
        return self.fn(x, *args)


@needs_onednn
@pytest.mark.parametrize("rows", [onednn.ONEDNN_MIN_ROWS, 64, 333, 2048])
@pytest.mark.parametrize(("k", "n", "bias", "strided"), [(576, 960, False, False), (1536, 576, True, False), (96, 40, True, True)])
def test_equals_f_linear(rows, k, n, bias, strided):
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(k, n, generator=g).t() if strided else torch.randn(n, k, generator=g)  # a [in, out] storage's view
    b = torch.randn(n, generator=g) if bias else None
    assert close(onednn.linear(x, w, b), x, w, b)


def test_few_rows_and_other_dtypes_stay_torchs(monkeypatch):
    spy = Spy(F.linear)
    monkeypatch.setattr(onednn.F, "linear", spy)
    w = torch.randn(48, 32)
    onednn.linear(torch.randn(onednn.ONEDNN_MIN_ROWS - 1, 32), w, None)  # a decode step's rows
    onednn.linear(torch.randn(300, 32, dtype=torch.float64), w.double(), None)
    monkeypatch.setattr(onednn, "onednn_available", lambda: False)  # torch without oneDNN: every product torch's
    x = torch.randn(300, 32)
    assert close(onednn.linear(x, w, None), x, w, None)
    assert spy.rows == [onednn.ONEDNN_MIN_ROWS - 1, 300, 300]


@needs_onednn
def test_many_rows_are_onednns(monkeypatch):
    spy = Spy(F.linear)
    monkeypatch.setattr(onednn.F, "linear", spy)
    x, w = torch.randn(onednn.ONEDNN_MIN_ROWS, 32), torch.randn(48, 32)
    assert close(onednn.linear(x, w, None), x, w, None) and spy.rows == []


@needs_onednn
def test_a_wide_float_layer_takes_onednn_from_its_rows(monkeypatch):
    """A layer small_linear declines (more than 1024 inputs, as SmolLM2's down_proj): small_linear's
    row kernel for a decode step's rows (test_gpu_small_linear.py), oneDNN from ONEDNN_MIN_ROWS,
    torch's F.linear never."""
    ops = CpuOps(None, cpu_small_linear())
    layer = Linear(1536, 64, True, ops)
    ops.prepare(layer)
    spy = Spy(onednn.linear)
    monkeypatch.setattr(cpu_ops.onednn, "linear", spy)
    torch_spy = Spy(F.linear)
    monkeypatch.setattr(onednn.F, "linear", torch_spy)
    for rows in (1, onednn.ONEDNN_MIN_ROWS - 1, onednn.ONEDNN_MIN_ROWS, 500):
        x = torch.randn(rows, 1536)
        assert close(layer(x), x, layer.weight, layer.bias)
    assert spy.rows == [onednn.ONEDNN_MIN_ROWS, 500]
    assert torch_spy.rows == []


quant = cpu_quant_linear()


@needs_onednn
@pytest.mark.skipif(quant is None, reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("rows", [qlm.DEQUANTIZE_MIN_ROWS, 600])
def test_a_quantized_weights_many_rows_multiply_by_onednn(rows, monkeypatch):
    """The dequantize path decodes W into a float scratch and multiplies it by oneDNN: the same
    product as the dequantized reference, in one slice and in several."""
    assert quant is not None
    n, k = 200, 1536
    g = torch.Generator().manual_seed(rows)
    w = quantize_groups(torch.randn(n, k, generator=g), "u4", 32)  # with mins, as Q4_1
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    spy = Spy(onednn.linear)
    monkeypatch.setattr(qlm.onednn, "linear", spy)
    for scratch in (qlm.SCRATCH_FLOATS, 64 * k):  # the whole weight at once; slices of 64 rows
        monkeypatch.setattr(qlm, "SCRATCH_FLOATS", scratch)
        assert close(quant(x, w, b, path="dequantize"), x, w.dequantize(), b)
    assert spy.rows == [rows] * (1 + 4)  # one product, then one per slice of 64 of the 200 rows


@needs_onednn
@pytest.mark.skipif(isa.missing_features(isa.VARIANTS["x86-64-v3"]) != [], reason="this CPU does not run x86-64-v3")
def test_an_isa_variant_holds_onednn_to_its_instructions():
    """CONVEYOR_CPU_ISA=x86-64-v3 measures an AVX2 machine: oneDNN's GEMMs too (its verbose log
    names the ISA it dispatches to), unless the user set ONEDNN_MAX_CPU_ISA."""
    probe = "from conveyor.gpu.backends.cpu.kernels import onednn_linear as o; assert o.onednn_available()"

    def isa_line(**extra: str) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        environ.update(CONVEYOR_CPU_ISA="x86-64-v3", ONEDNN_VERBOSE="1", **extra)
        out = subprocess.run([sys.executable, "-c", probe], env=environ, capture_output=True, text=True, check=True).stdout
        return next(line for line in out.splitlines() if ",isa:" in line)

    assert isa_line().endswith("isa:Intel AVX2")
    assert "AVX2" not in isa_line(ONEDNN_MAX_CPU_ISA="SSE41")


@pytest.fixture
def float32_precision():
    """Sets torch's float32 matmul precision for a test (a process-wide setting), then restores it."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@needs_onednn
def test_medium_precision_rounds_no_further_than_bfloat16(float32_precision):
    """--float32-matmul-precision medium (torch's setting): oneDNN may round x and W to bfloat16
    (8 bits; a product of two such within 2^-8 of its own size, the sum within 2^-8 of |x| |W|^T)
    and accumulates in float32; the result stays float32. On a CPU with AMX it does (so the
    setting reached oneDNN), as `bfloat16_products` says; elsewhere the products stay float32's."""
    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(2048, 576, generator=g), torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    want = x.double() @ w.double().T + b.double()
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    float32_precision("medium")
    got = onednn.linear(x, w, b)
    assert got.dtype == torch.float32
    err = (got.double() - want).abs()
    assert bool((err <= 2**-8 * scale).all())
    assert bool((err > 1e-5 * scale).any()) == onednn.bfloat16_products()
    float32_precision("highest")
    assert not onednn.bfloat16_products()
    assert close(onednn.linear(x, w, b), x, w, b)


def test_the_worker_takes_the_setting():
    """--float32-matmul-precision reaches the worker's process (gpu/step/platform.py) and its
    backend's description; without it the process keeps torch's own. In a fresh process each,
    since the setting is the process's."""
    script = (
        "import sys, torch\n"
        "from conveyor import LLM\n"
        "options = {} if sys.argv[1] == 'default' else {'float32_matmul_precision': sys.argv[1]}\n"
        "llm = LLM('tiny', max_num_seqs=4, **options)\n"
        "print(torch.get_float32_matmul_precision(), 'precision' in llm.runner.backend.description)\n"
    )
    for option, want in (("medium", "medium True"), ("default", "highest False")):
        done = subprocess.run([sys.executable, "-c", script, option], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-2:] == want.split()
