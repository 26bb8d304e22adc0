"""The Triton elementwise kernels (add + RMSNorm, rotary, SiLU x up) against their torch references.

On a CPU they run under Triton's interpreter (set below, before triton is imported). Tolerances:
fp16 results equal the torch path's bit for bit for rotary, within one fp16 ulp (rtol 1e-3) for
the norm and the activation (float32 reductions and exp in another order); fp32 within 1e-5. The
interpreter rounds float32 -> bf16 by truncation, so bf16 is compared on a GPU only (marked gpu).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.triton_compile import compile_for_sm90

pytest.importorskip("triton")

from conveyor.gpu.backends.triton.add_rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm  # noqa: E402
from conveyor.gpu.backends.triton.rotary import apply_rotary_, rotary_reference  # noqa: E402
from conveyor.gpu.backends.triton.silu_mul import silu_mul, silu_mul_reference  # noqa: E402
from conveyor.gpu.models.rope import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}  # rtol = atol, per dtype
ROPE_SCALINGS = [
    {},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0},
]
PROPERTY = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


def _rope_table(rotary_dim: int, scaling: dict, max_positions: int = 256) -> torch.Tensor:
    return RotaryEmbedding(rotary_dim, 10000.0, scaling, max_positions, DEVICE).cos_sin


def _check_norm(
    num_tokens: int, hidden: int, dtype: torch.dtype, row_stride: int, with_residual: bool, weight_dtype: torch.dtype | None = None
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7919 + hidden)
    # Rows strided by row_stride >= hidden: x is a view into a wider buffer, as a fused projection's output.
    x = torch.randn(num_tokens, row_stride, generator=gen).to(dtype).to(DEVICE)[:, :hidden]
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(weight_dtype or dtype).to(DEVICE)
    expected, expected_residual = add_rms_norm_reference(x, residual if with_residual else None, weight, 1e-6)
    out = add_rms_norm(x, residual, weight, 1e-6) if with_residual else rms_norm(x, weight, 1e-6)
    assert out.dtype == expected.dtype == dtype
    _assert_close(out, expected, TOLERANCE[dtype])
    if with_residual:
        torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)  # one rounded add, as torch's


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_torch(dtype, with_residual):
    _check_norm(3, 96, dtype, 96, with_residual)


@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_with_a_float32_weight_scales_before_the_cast(with_residual):
    # Gemma's order (its (1 + w) kept in float32): one rounding, at the end, to the activation dtype.
    _check_norm(3, 96, torch.float16, 96, with_residual, weight_dtype=torch.float32)
    x, weight = torch.randn(2, 64, dtype=torch.float16, device=DEVICE), 1 + 0.1 * torch.randn(64, device=DEVICE)
    h = x.float()
    once = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).half()
    _assert_close(rms_norm(x, weight, 1e-6), once, TOLERANCE[torch.float16])


def test_rms_norm_at_a_model_width_and_a_non_power_of_two():
    _check_norm(2, 8192, torch.float32, 8192, True)
    _check_norm(2, 4100, torch.float16, 4100, True)


@PROPERTY
@given(
    num_tokens=st.integers(1, 4),
    hidden=st.integers(1, 300),
    pad=st.integers(0, 17),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    with_residual=st.booleans(),
)
def test_rms_norm_property(num_tokens, hidden, pad, dtype, with_residual):
    _check_norm(num_tokens, hidden, dtype, hidden + pad, with_residual)


def test_rms_norm_rejects_a_transposed_input():
    x = torch.randn(8, 4).t()
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(x, torch.ones(8), 1e-6)


def _check_rotary(num_tokens, num_q_heads, num_kv_heads, head_dim, rotary_dim, dtype, scaling) -> None:
    cos_sin = _rope_table(rotary_dim, scaling)
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_q_heads * 7 + head_dim)
    # q and k are views into one [T, (Hq + 2 Hkv) * D] qkv buffer, as the attention projection gives them.
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()
    positions = torch.randint(0, cos_sin.shape[0], (num_tokens,), generator=gen).to(DEVICE)
    expected_q, expected_k = rotary_reference(q, k, positions, cos_sin)
    apply_rotary_(q, k, positions, cos_sin)
    tolerance = 0.0 if dtype == torch.float16 else TOLERANCE[dtype]  # fp32 on a GPU may fuse into FMAs
    _assert_close(q, expected_q, tolerance)
    _assert_close(k, expected_k, tolerance)
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=lambda s: s.get("rope_type", "default"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_matches_rope_py_for_each_scaling(scaling, dtype):
    _check_rotary(3, 4, 2, 64, 64, dtype, scaling)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotary_head_dims_and_partial_rotary(head_dim):
    _check_rotary(2, 2, 1, head_dim, head_dim, torch.float16, {})
    _check_rotary(2, 2, 1, head_dim, head_dim // 2, torch.float32, {})  # the last D/2 dims pass through


@PROPERTY
@given(
    num_tokens=st.integers(1, 4),
    num_kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 8]),
    head_dim=st.sampled_from([64, 128, 256]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_rotary_property(num_tokens, num_kv_heads, group, head_dim, dtype):
    _check_rotary(num_tokens, num_kv_heads * group, num_kv_heads, head_dim, head_dim, dtype, {})


def _check_silu_mul(num_tokens: int, width: int, dtype: torch.dtype, in_place: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 13 + width)
    gate_up = (3 * torch.randn(num_tokens, 2 * width, generator=gen)).to(dtype).to(DEVICE)  # a fused gate_up projection
    gate, up = gate_up[:, :width], gate_up[:, width:]
    expected = silu_mul_reference(gate, up)
    out = silu_mul(gate, up, out=gate if in_place else None)
    _assert_close(out, expected, TOLERANCE[dtype])
    if in_place:
        assert out.data_ptr() == gate.data_ptr()


@PROPERTY
@given(
    num_tokens=st.integers(1, 3),
    width=st.integers(1, 2100),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    in_place=st.booleans(),
)
def test_silu_mul_property(num_tokens, width, dtype, in_place):
    _check_silu_mul(num_tokens, width, dtype, in_place)


@pytest.mark.cuda
def test_bf16_on_a_gpu():
    # Rotary and the residual add round exactly as torch does; the norm and silu within one bf16 ulp.
    x, residual = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    expected, expected_residual = add_rms_norm_reference(x, residual, weight, 1e-5)
    _assert_close(add_rms_norm(x, residual, weight, 1e-5), expected, TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    for scaling in ROPE_SCALINGS:
        cos_sin = _rope_table(128, scaling)
        q, k = (
            torch.randn(5, 32, 128, device="cuda", dtype=torch.bfloat16),
            torch.randn(5, 8, 128, device="cuda", dtype=torch.bfloat16),
        )
        positions = torch.randint(0, cos_sin.shape[0], (5,), device="cuda")
        expected_q, expected_k = rotary_reference(q, k, positions, cos_sin)
        apply_rotary_(q, k, positions, cos_sin)
        torch.testing.assert_close(q, expected_q, rtol=0, atol=0)
        torch.testing.assert_close(k, expected_k, rtol=0, atol=0)
    gate, up = torch.randn(4, 14336, device="cuda", dtype=torch.bfloat16), torch.randn(4, 14336, device="cuda", dtype=torch.bfloat16)
    _assert_close(silu_mul(gate, up), silu_mul_reference(gate, up), TOLERANCE[torch.bfloat16])


# Compiled for an H100 (sm_90a) to a cubin with Triton's bundled ptxas, no GPU needed, in a fresh
# process without the interpreter: it catches what the interpreter lets through, and ptxas -v says
# whether the wrappers' warp counts spill registers at the widest shapes they serve.
COMPILE_FOR_SM90 = textwrap.dedent("""
    import os, re, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton import add_rms_norm, rotary, silu_mul

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

    def compile_(fn, types, constexprs, num_warps, **launch_options):
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
        options = dict(num_warps=num_warps, **launch_options)
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
        if fn is rotary._rotary_kernel:  # each product rounded before the sum, as torch: no fused multiply-add
            assert not re.search(r"\\bfma\\.", kernel.asm["ptx"]), (constexprs, types)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True, text=True)
        spills = re.search(r"(\\d+) bytes spill stores", info.stderr)
        assert spills and spills.group(1) == "0", (fn.__name__, constexprs, info.stderr[-2000:])

    for act, weight in (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp32")):
        types = dict(x_ptr="*" + act, residual_ptr="*" + act, weight_ptr="*" + weight, out_ptr="*" + act, eps="fp32")
        for block, residual in ((8192, True), (4096, False), (128, True)):
            constexprs = dict(HAS_RESIDUAL=residual, BLOCK_H=block)
            compile_(add_rms_norm._add_rms_norm_kernel, types, constexprs, min(max(block // 256, 1), 16))
    for dtype in ("bf16", "fp16", "fp32"):
        types = dict(q_ptr="*" + dtype, k_ptr="*" + dtype, positions_ptr="*i64", cos_sin_ptr="*fp32")
        for half, q_heads, kv_heads in ((64, 32, 8), (64, 64, 8), (128, 16, 2), (40, 4, 1)):
            block_half = triton.next_power_of_2(half)
            constexprs = dict(HALF=half, BLOCK_HALF=block_half, BLOCK_Q_HEADS=q_heads, BLOCK_KV_HEADS=kv_heads)
            compile_(rotary._rotary_kernel, types, constexprs, min(max(q_heads * block_half // 1024, 4), 16), **rotary.COMPILE_OPTIONS)
        types = dict(gate_ptr="*" + dtype, up_ptr="*" + dtype, out_ptr="*" + dtype)
        compile_(silu_mul._silu_mul_kernel, types, dict(BLOCK=silu_mul.BLOCK), 4)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU test compiles and runs the kernels")
def test_kernels_compile_for_sm90_without_spills():
    compile_for_sm90(COMPILE_FOR_SM90, timeout_s=240)
