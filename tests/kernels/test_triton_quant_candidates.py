"""Issue 48's quantized GEMM candidates against QuantizedWeight.dequantize() + F.linear: the
W4A16 words kernel (quant_linear_words.py, under Triton's interpreter), tinygemm's conversion
(int4pack.py, through torch's CPU twin of the op), FP8's one-launch activation quantization
(fp8_quant_rows.py, bit for bit against its torch reference) and gemm_picks.py's table; each
kernel compiled for sm_90 with its registers and no spills (ptxas -v). Tolerances and weights as
test_triton_quant_linear.py's. On CUDA (marked): tinygemm itself, in bf16, and graphs.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.triton_compile import compile_for_sm90

pytest.importorskip("triton")

from conveyor.gpu.backends.triton import gemm_picks, quant_forms  # noqa: E402
from conveyor.gpu.backends.triton.fp8_linear import quantize_per_token  # noqa: E402
from conveyor.gpu.backends.triton.fp8_quant_rows import quantize_rows  # noqa: E402
from conveyor.gpu.backends.triton.int4pack import Int4PackWeight, int4pack_linear, int4pack_rows, int4pack_takes, int4pack_weight  # noqa: E402
from conveyor.gpu.backends.triton.quant_linear import KernelWeight  # noqa: E402
from conveyor.gpu.backends.triton.quant_linear_words import WordWeight, word_weight, words_config, words_linear, words_rows  # noqa: E402
from conveyor.gpu.quant.weight import QuantizedWeight  # noqa: E402
from tests.kernels.test_triton_quant_linear import DEVICE, assert_matches, inputs, random_weight, reference  # noqa: E402


def stacked(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights stacked by rows, as gpu/backends/column_groups.py stacks q/k/v and gate/up."""
    mins = None if weights[0].mins is None else torch.cat([w.mins for w in weights])  # type: ignore[misc]
    return QuantizedWeight(
        "u4", weights[0].group_size, torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]), mins
    )


# The words kernel (quant_linear_words.py), under the interpreter off CUDA.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("m", "n", "k", "group"), [(1, 48, 256, 128), (5, 80, 384, 32), (16, 64, 256, 64), (17, 40, 256, 256), (70, 48, 256, 128)]
)
def test_words_kernel_matches_dequantized_reference(m, n, k, group, dtype):
    """Groups smaller and larger than the 128-input block; 1..16 rows in one tile of 16 (K split),
    17 in one of 32, 70 in two of 64; N not a multiple of the 64-output tile."""
    weight = random_weight("u4", n, k, group, seed=m)
    x, bias = inputs(m, k, n, dtype, seed=m)
    assert_matches(words_linear(x, word_weight(weight, dtype), bias), reference(x, weight, bias), dtype)


@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("perm", [False, True])
def test_words_symmetric_and_act_order(mins, perm):
    """GPTQ's symmetric weights (no mins) and act-order (x gathered by perm first)."""
    weight = random_weight("u4", 32, 256, 128, mins=mins, perm=perm, seed=5)
    x, _ = inputs(3, 256, 32, torch.float16, seed=5)
    assert_matches(words_linear(x, word_weight(weight, torch.float16)), reference(x, weight, None), torch.float16)


def test_words_layout_puts_input_16i_plus_r_in_nibble_i_of_word_r():
    """One output row with code j % 16 for input j: word r of block 0 holds inputs r, 16 + r, ...
    in nibbles 0..7, so every nibble i equals (16 i + r) % 16 = r."""
    from conveyor.gpu.quant.weight import pack_u4

    q = torch.arange(256).remainder(16).unsqueeze(0)
    words = word_weight(QuantizedWeight("u4", 128, pack_u4(q), torch.ones(1, 2), None), torch.float32).words  # [32, 1]
    nibbles = (words.squeeze(1).to(torch.int64) & 0xFFFFFFFF).unsqueeze(1) >> (4 * torch.arange(8)) & 0xF  # [32, 8]
    assert torch.equal(nibbles[:16], torch.arange(16).unsqueeze(1).expand(16, 8))


def test_words_stack_concatenates_along_n_and_cuts_to_each_layer():
    """A stack's form, cut to a layer's rows (views of the stack's tensors), multiplies as that
    layer's own weight: the form is concatenable along N."""
    parts = [random_weight("u4", n, 256, 128, seed=n) for n in (32, 16, 48)]
    whole = word_weight(stacked(parts), torch.float16)
    assert torch.equal(whole.words[:, 32:48], word_weight(parts[1], torch.float16).words)
    x, _ = inputs(2, 256, 16, torch.float16)
    start = 0
    for part in parts:
        rows = words_rows(whole, slice(start, start + part.shape[0]))
        assert rows.words.data_ptr() == whole.words[:, start:].data_ptr()
        assert_matches(words_linear(x, rows), reference(x, part, None), torch.float16)
        start += part.shape[0]


def test_words_config_reads_codes_once_up_to_64_rows():
    """Up to 64 rows: one row tile (the codes read once); K split toward 512 programs while the
    float32 partials stay under a quarter of the codes' bytes."""
    assert words_config(1, 4096, 4096) == (16, 64, 8)  # 64 tiles x 8 splits of 4 blocks
    assert words_config(1, 28672, 4096) == (16, 64, 2)
    assert words_config(16, 4096, 4096) == (16, 64, 4)
    assert words_config(64, 4096, 14336) == (64, 64, 3)
    assert words_config(64, 4096, 4096) == (64, 64, 1)
    assert words_config(33, 6144, 4096)[0] == 64 and words_config(256, 6144, 4096) == (64, 64, 1)


def test_words_rejects_mismatched_inputs():
    form = word_weight(random_weight("u4", 16, 128, 128), torch.float32)
    with pytest.raises(ValueError, match="x "):
        words_linear(torch.randn(2, 64, device=DEVICE), form)
    with pytest.raises(ValueError, match="N-minor"):
        words_linear(torch.randn(2, 128, device=DEVICE), WordWeight(form.words, form.scales.t(), None, 128, None))
    assert words_linear(torch.randn(0, 128, device=DEVICE), form).shape == (0, 16)


# tinygemm's conversion (int4pack.py), through the CPU twin of the op.


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU twin; on CUDA the cuda-marked test runs the op itself")
@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize(("mins", "perm"), [(True, False), (False, False), (False, True)])
def test_int4pack_conversion_is_exact_through_the_cpu_twin(group, mins, perm):
    """AWQ's (mins: -zero x scale), GPTQ's symmetric and GPTQ act-order weights, converted to
    scales_and_zeros (s, m + 8 s) in float32: the op's product equals the dequantized reference
    to float32 rounding."""
    weight = random_weight("u4", 32, 512, group, mins=mins, perm=perm, seed=group)
    assert int4pack_takes(weight, torch.float32)
    x, bias = inputs(5, 512, 32, torch.float32, seed=group)
    assert_matches(int4pack_linear(x, int4pack_weight(weight, torch.float32), bias), reference(x, weight, bias), torch.float32)


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU twin's row layout")
def test_int4pack_stack_cuts_to_each_layer():
    """The twin keeps rows in tiles of 64: a stack of 64 + 32 rows cuts at 64."""
    parts = [random_weight("u4", n, 256, 128, seed=n) for n in (64, 32)]
    whole = int4pack_weight(stacked(parts), torch.float32)
    x, _ = inputs(3, 256, 32, torch.float32)
    with pytest.raises(ValueError, match="tiles of 64"):
        int4pack_rows(whole, slice(16, 48))
    for part, rows in zip(parts, (slice(0, 64), slice(64, 96))):
        assert_matches(int4pack_linear(x, int4pack_rows(whole, rows)), reference(x, part, None), torch.float32)


def test_int4pack_takes_what_the_op_takes():
    assert not int4pack_takes(random_weight("u8", 16, 128, 128), torch.float32)
    assert not int4pack_takes(random_weight("u4", 24, 128, 128), torch.float32)  # N not a multiple of 16
    assert not int4pack_takes(random_weight("u4", 16, 1024, 512), torch.float32)  # groups of 512


def test_bf16_scales_and_zeros_move_a_group_by_at_most_its_rounding():
    """On CUDA tinygemm reads (s, m + 8 s) in bf16 (unit roundoff 2^-8): each weight moves by at
    most 2^-8 (|q - 8| s + |m + 8 s|)."""
    weight = random_weight("u4", 64, 256, 128, seed=3, device="cpu")
    exact = int4pack_weight(weight, torch.float32).scales_and_zeros  # [K / G, N, 2]
    rounded = exact.bfloat16().float()
    q = weight.codes().view(64, 2, 128) - 8  # [N, groups, G]
    s, z = exact[..., 0].t().unsqueeze(-1), exact[..., 1].t().unsqueeze(-1)
    sr, zr = rounded[..., 0].t().unsqueeze(-1), rounded[..., 1].t().unsqueeze(-1)
    moved = (q * sr + zr - (q * s + z)).abs()
    assert (moved <= 2**-8 * (q.abs() * s.abs() + z.abs()) + 1e-12).all()
    assert moved.max() > 0  # bf16 does round them: the bound is not vacuous


# FP8's activation quantization in one launch (fp8_quant_rows.py).


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_rows_is_bit_exact_against_torch(dtype):
    """Rows of very different magnitudes, zeros of both signs, e4m3 subnormals, ties (1.0625 lies
    between 1 and 1.125: even is 1), and a row longer than one chunk (3000 > 2048)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3000, generator=gen) * torch.tensor([[1e-3], [1.0], [50.0], [0.0], [1e4]])
    x[1, :9] = torch.tensor([1e-9, -1e-9, 0.0, -0.0, 3.0, -3.0, 1e-6, 1.0625 * 3 / 448, 17 * 3 / 448])
    x[1, 9] = 3.0  # the row's amax: scale 3 / 448, so the two before are 1.0625 and 17 (ties)
    x = x.to(dtype).to(DEVICE)
    q, scale = quantize_rows(x)
    expected_q, expected_scale = quantize_per_token(x)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


def test_quantize_rows_rounds_every_bf16_value_as_torch_does():
    """Every finite bf16 magnitude up to 448 in one row whose amax is 448 (scale 1)."""
    v = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    v = v[torch.isfinite(v) & (v.abs() <= 448)]
    row = torch.cat([v, torch.tensor([448.0])]).unsqueeze(0).to(DEVICE)
    q, scale = quantize_rows(row)
    assert scale.item() == 1.0
    assert torch.equal(q.view(torch.uint8), quantize_per_token(row)[0].view(torch.uint8))


# gemm_picks.py's table and quant_forms.py's forms.


def test_the_committed_table_keeps_todays_forms():
    """Until a GPU run fills the table, a u4 weight's form is quant_linear.py's, no copy."""
    weight = random_weight("u4", 16, 128, 128)
    assert not gemm_picks.picks_more(weight)
    assert isinstance(quant_forms.form_of(weight, torch.float16), KernelWeight)


def test_picked_forms_follow_the_rows(monkeypatch):
    """A table naming several kernels: the weight holds each named form, a step takes its row
    bucket's, a kernel that cannot take the weight falls back to the default, and a stack's
    Picked cuts to each layer's rows."""
    table = {"W4A16": ("tinygemm", "words", "tiles", "words"), "FP8": ("scaled_mm",) * 4}
    monkeypatch.setattr(gemm_picks, "PICKS", table)
    parts = [random_weight("u4", n, 256, 128, seed=n) for n in (64, 32)]
    whole = stacked(parts)
    form = quant_forms.form_of(whole, torch.float16)  # fp16: tinygemm's CUDA op takes bf16 only
    assert isinstance(form, gemm_picks.Picked)
    expected = [Int4PackWeight if DEVICE == "cpu" else KernelWeight, WordWeight, KernelWeight, WordWeight, WordWeight]
    assert [type(form.form_for(m)) for m in (1, 16, 64, 256, 1000)] == expected
    layer = quant_forms.rows_of(form, slice(64, 96))
    assert isinstance(layer, gemm_picks.Picked) and layer.by_bucket == form.by_bucket
    for m in (1, 9, 40):
        x, _ = inputs(m, 256, 32, torch.float16, seed=m)
        chosen = layer.form_for(m)
        y = words_linear(x, chosen) if isinstance(chosen, WordWeight) else None
        if isinstance(chosen, KernelWeight):
            from conveyor.gpu.backends.triton.quant_linear import quant_linear

            y = quant_linear(x, chosen)
        if isinstance(chosen, Int4PackWeight):
            y = int4pack_linear(x, chosen)
        assert y is not None
        assert_matches(y, reference(x, parts[1], None), torch.float16)


COMPILE_FOR_SM90 = textwrap.dedent("""
    import os, subprocess, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton.quant_linear_words import NUM_STAGES, _words_kernel as words
    from conveyor.gpu.backends.triton.fp8_quant_rows import _quantize_rows_kernel as quantize

    PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

    def compile(fn, types, constexprs, aligned, num_stages=3):
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
        return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=num_stages))

    def registers(kernel):
        # ptxas -v on the kernel's PTX: its registers, and no bytes spilled.
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
        assert " 0 bytes spill stores, 0 bytes spill loads" in out, out
        return int(out.split("Used ")[1].split(" registers")[0])

    aligned = {"x_ptr", "w_ptr", "s_ptr", "m_ptr", "bias_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wk", "stride_sg", "stride_ym"}
    for dtype, group, has_mins in (("bf16", 128, True), ("fp16", 32, False), ("bf16", 256, True)):
        for block_m, split in ((16, 8), (16, 1), (32, 2), (64, 1)):
            out = "*fp32" if split > 1 else "*" + dtype
            types = dict(x_ptr="*" + dtype, w_ptr="*i32", s_ptr="*fp16", m_ptr="*fp16", bias_ptr="*" + dtype, y_ptr=out)
            constexprs = dict(GROUP=group, HAS_MINS=has_mins, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=64, SPLIT=split,
                              UPCAST=False, PRECISION=None)
            kernel = compile(words, types, constexprs, aligned, NUM_STAGES)
            used = registers(kernel)
            assert used <= 168 and kernel.metadata.shared <= 160 * 1024, (dtype, group, block_m, used, kernel.metadata.shared)
            print(f"words {dtype} G={group} BLOCK_M={block_m} SPLIT={split}: {used} registers, {kernel.metadata.shared} B shared")
    for dtype in ("bf16", "fp16", "fp32"):
        kernel = compile(quantize, dict(x_ptr="*" + dtype, q_ptr="*u8", scale_ptr="*fp32"), dict(BLOCK=2048),
                         {"x_ptr", "q_ptr", "K", "stride_xm", "stride_qm"})
        print(f"quantize_rows {dtype}: {registers(kernel)} registers")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU tests compile and run the kernels")
def test_candidates_compile_for_sm90_without_spills():
    compile_for_sm90(COMPILE_FOR_SM90, timeout_s=400)


# On a GPU.


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("m", "n", "k", "group"), [(1, 4096, 4096, 128), (16, 1024, 4096, 32), (64, 512, 14336, 128), (3, 48, 256, 256)]
)
def test_tinygemm_and_words_on_cuda(m, n, k, group):
    """tinygemm in bf16 (the conversion's nibble order and tiles on the real op) and the words
    kernel in bf16, against the exact dequantized reference; a stack cut in tiles of 8 rows."""
    weight = random_weight("u4", n, k, group, seed=k)
    x, bias = inputs(m, k, n, torch.bfloat16, seed=n)
    assert int4pack_takes(weight, torch.bfloat16)
    assert_matches(int4pack_linear(x, int4pack_weight(weight, torch.bfloat16), bias), reference(x, weight, bias), torch.bfloat16)
    assert_matches(words_linear(x, word_weight(weight, torch.bfloat16), bias), reference(x, weight, bias), torch.bfloat16)
    top = int4pack_rows(int4pack_weight(stacked([weight, weight]), torch.bfloat16), slice(n, 2 * n))
    assert_matches(int4pack_linear(x, top, bias), reference(x, weight, bias), torch.bfloat16)


@pytest.mark.cuda
def test_picked_forms_capture_in_cuda_graphs(monkeypatch):
    """Each row bucket's kernel replayed from a graph with new activations gives the eager result."""
    monkeypatch.setattr(gemm_picks, "PICKS", {"W4A16": ("tinygemm", "words", "tiles", "words"), "FP8": ("scaled_mm",) * 4})
    weight = random_weight("u4", 1024, 2048, 128)
    form = quant_forms.form_of(weight, torch.bfloat16)
    assert isinstance(form, gemm_picks.Picked)
    from conveyor.gpu.backends.triton.backend import TritonOps

    weight.prepared = form
    ops = TritonOps()
    for m in (1, 16, 64):
        static = torch.randn(m, 2048, device=DEVICE, dtype=torch.bfloat16)
        ops.quant_linear(static, weight, None)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.quant_linear(static, weight, None)
        fresh = torch.randn(m, 2048, device=DEVICE, dtype=torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(out, ops.quant_linear(fresh, weight, None), rtol=0, atol=0)
        assert_matches(out, reference(fresh, weight, None), torch.bfloat16)
