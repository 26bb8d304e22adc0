"""The Triton K/V write against its torch reference: every element equal (a copy, no arithmetic).

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before the
kernel module imports triton's jit).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_compile import compile_for_sm90

pytest.importorskip("triton")

from conveyor.gpu.backends.triton.kv_write import reference_write_kv, write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_write(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0, num_padding=0):
    """A cache of random values, and k, v for num_tokens distinct random slots plus num_padding
    padding tokens (slot -1) scattered among them."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots = torch.cat([slots, torch.full((num_padding,), -1)])[torch.randperm(num_tokens + num_padding, generator=gen)]
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return cache, k, v, slots.to(DEVICE)


def assert_writes_like_reference(cache, k, v, slots):
    want = cache.clone()
    reference_write_kv(want, k, v, slots)
    write_kv(cache, k, v, slots)
    assert torch.equal(cache, want)


@settings(max_examples=15, deadline=None)
@given(
    num_tokens=st.integers(0, 12),
    num_padding=st.integers(0, 3),
    block_size=st.sampled_from([16, 32]),
    heads=st.sampled_from([(1, 16), (2, 32), (3, 64), (4, 128), (1, 256)]),  # (Hkv, D); 3 heads pad to 4
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(num_tokens, num_padding, block_size, heads, dtype, seed):
    """bf16 too: a load and a store, which the interpreter gets right."""
    assert_writes_like_reference(*make_write(num_tokens, 3, block_size, *heads, dtype, seed, num_padding))


def test_padding_tokens_write_nothing():
    cache, k, v, _ = make_write(4, 2, 16, 2, 32, torch.float32)
    before = cache.clone()
    write_kv(cache, k, v, torch.full((4,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


def test_strided_k_and_v_views_of_a_fused_buffer():
    """k and v as views into a [T, Hq + 2 * Hkv, D] qkv buffer (the model's fused projection)."""
    cache, _, _, slots = make_write(5, 2, 16, 2, 32, torch.float32)
    qkv = torch.randn(5, 4 + 2 * 2, 32, device=DEVICE)
    assert_writes_like_reference(cache, qkv[:, 4:6], qkv[:, 6:8], slots)


def test_casts_to_the_cache_dtype():
    cache, k, v, slots = make_write(6, 2, 16, 2, 32, torch.float16)
    assert_writes_like_reference(cache, k.float(), v.float(), slots)


def test_rejects_mismatched_inputs():
    cache, k, v, slots = make_write(4, 2, 16, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="int64"):
        write_kv(cache, k, v, slots.int())
    with pytest.raises(ValueError, match="must be"):
        write_kv(cache, k[:, :1], v[:, :1], slots)


# Compiled for an H100 (sm_90) to a cubin with Triton's bundled ptxas, no GPU needed, in a fresh
# process without the interpreter: it catches what the interpreter lets through.
COMPILE_FOR_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton.kv_write import _write_kv_kernel as fn

    for dtype, source in (("bf16", "bf16"), ("fp16", "bf16"), ("fp32", "bf16"), ("u8", "u8")):  # u8: fp8 codes, as bytes
        constexprs = dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128)
        types = dict(kv_ptr="*" + dtype, k_ptr="*" + source, v_ptr="*" + source, slot_mapping_ptr="*i64")
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU tests compile and run the kernel")
def test_kernel_compiles_for_sm90():
    compile_for_sm90(COMPILE_FOR_SM90, timeout_s=120)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bfloat16_on_cuda(head_dim):
    assert_writes_like_reference(*make_write(300, 40, 16, 8, head_dim, torch.bfloat16, num_padding=20))
