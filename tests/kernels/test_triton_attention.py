"""The Triton paged attention kernels (plain and split-K) against their torch reference.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before the
kernel modules import triton's jit), so shapes stay tiny: every program instance costs
milliseconds. Tolerances against the float32 reference: 1e-5 for float32; 5e-3 for float16
(P is rounded to float16 before the P @ V product, and the output is float16); 2e-2 for bfloat16.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_compile import compile_for_sm90

pytest.importorskip("triton")

from conveyor.gpu.backends.triton.paged_attention import num_splits_for, paged_attention  # noqa: E402
from conveyor.gpu.backends.triton.paged_attention_launch import DEFAULT_VARIANT, Tiling, Variant  # noqa: E402
from conveyor.gpu.backends.triton.paged_attention_reference import reference_paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (Hkv, Hq / Hkv): MHA, GQA 2 and 4, MQA (one kv head; 8 query heads leave 8-token tiles, so
# chunks span several), and a group that is not a power of two.
HEAD_LAYOUTS = [(2, 1), (2, 2), (2, 4), (1, 4), (1, 8), (2, 3)]


def make_step(
    rows: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    share_prefix: bool = False,
    extra_columns: int = 1,
):
    """rows: (cached context before the step, new queries) per row -> the kernel's arguments.
    Blocks come from a shuffled pool; with share_prefix every row reads row 0's first block too
    (a shared prompt prefix). Table padding holds random block ids the kernel must not read."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [context + q_len for context, q_len in rows]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + extra_columns
    tables = torch.randint(0, num_blocks, (len(rows), width), generator=gen, dtype=torch.int32)
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor([pool.pop() for _ in range(count)], dtype=torch.int32)
    if share_prefix:
        tables[1:, 0] = tables[0, 0]
    starts = [0]
    for _, q_len in rows:
        starts.append(starts[-1] + q_len)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    return (
        q,
        kv_cache,
        tables.to(DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        head_dim**-0.5,
    )


def assert_matches(args, sliding_window=None, num_splits=None, out=None, variant=DEFAULT_VARIANT):
    got = paged_attention(*args, sliding_window, out, num_splits=num_splits, variant=variant)
    want = reference_paged_attention(*args, sliding_window)
    tol = TOLERANCE[args[0].dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return got


row_strategy = st.one_of(
    st.tuples(st.integers(0, 70), st.just(1)),  # a decode (or a one-token chunk) after cached context
    st.tuples(st.integers(0, 40), st.integers(2, 20)),  # a prompt chunk, possibly after cached blocks
)
step_strategy = st.fixed_dictionaries(
    dict(
        rows=st.lists(row_strategy, min_size=1, max_size=3),
        heads=st.sampled_from(HEAD_LAYOUTS),
        head_dim=st.sampled_from([32, 64, 128, 256]),
        block_size=st.sampled_from([16, 32]),
        dtype=st.sampled_from([torch.float32, torch.float16]),
        window=st.one_of(st.none(), st.integers(1, 48)),
        share_prefix=st.booleans(),
        seed=st.integers(0, 2**16),
    )
)


def _step_args(step):
    return make_step(
        step["rows"], *step["heads"], step["head_dim"], step["block_size"], step["dtype"], step["seed"], step["share_prefix"]
    )


@settings(max_examples=15, deadline=None)
@given(step=step_strategy)
def test_mixed_step_matches_reference(step):
    assert_matches(_step_args(step), step["window"], num_splits=1)


@settings(max_examples=5, deadline=None)
@given(step=step_strategy, num_splits=st.integers(2, 4))
def test_split_k_matches_reference(step, num_splits):
    assert_matches(_step_args(step), step["window"], num_splits=num_splits)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128, 256])
def test_head_dims_and_block_sizes(head_dim, block_size):
    """Every supported head dim (16 and 32: the tiny test models'; 80 pads to 128 lanes) with both
    block sizes, on a step that mixes a decode, a fresh prompt and a chunk after cached blocks."""
    assert_matches(make_step([(37, 1), (0, 9), (20, 5)], 2, 2, head_dim, block_size, torch.float16), sliding_window=None)


@pytest.mark.parametrize("num_kv_heads,group", HEAD_LAYOUTS)
def test_decode_only_step(num_kv_heads, group):
    """T == B takes the 16-row tiles; groups up to 8 fill them, and a window cuts the context."""
    args = make_step([(50, 1), (3, 1), (90, 1)], num_kv_heads, group, 32, 16, torch.float32)
    assert_matches(args)
    assert_matches(args, sliding_window=20)
    assert_matches(args, sliding_window=20, num_splits=3)


@pytest.mark.parametrize("window", [None, 30])
def test_chunk_spanning_several_tiles(window):
    """A 70-token chunk after 10 cached tokens is two 64-token tiles (MHA): the second tile's
    keys end at its own last query, its first query's window starts inside the first tile's."""
    args = make_step([(10, 70), (0, 1), (5, 3)], 1, 1, 32, 16, torch.float32)
    assert_matches(args, sliding_window=window)
    assert_matches(args, sliding_window=window, num_splits=2)


def test_writes_into_a_strided_out_and_reads_a_strided_q():
    """q a view into a fused [T, 3 * Hq, D] buffer, out a view into a wider buffer."""
    q, *rest = make_step([(5, 3), (0, 4)], 2, 2, 32, 16, torch.float32)
    fused = torch.randn(q.shape[0], 3 * q.shape[1], q.shape[2], device=DEVICE)
    fused[:, : q.shape[1]] = q
    wide = torch.zeros(q.shape[0], 2 * q.shape[1], q.shape[2], device=DEVICE)
    got = assert_matches((fused[:, : q.shape[1]], *rest), out=wide[:, : q.shape[1]])
    assert got.data_ptr() == wide.data_ptr()
    assert wide[:, q.shape[1] :].abs().sum() == 0


def test_bfloat16_loads_and_upcasts():
    """bf16 caches: under the interpreter the kernel upcasts right after loading (its bf16
    arithmetic is wrong), so this runs on CPU too; on CUDA it is the native bf16 path."""
    args = make_step([(30, 1), (10, 6)], 2, 2, 64, 16, torch.bfloat16)
    assert_matches(args)
    assert_matches(args, num_splits=2)


# The candidates ops/gpu/attention_bench.py times against the default: more keys per loop step
# (several cache blocks per load), decode rows mapped to programs directly, another pipeline depth.
VARIANTS = [Variant(keys_per_step=32), Variant(keys_per_step=64), Variant(direct_decode=True), Variant(64, True, 2)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_variants_compute_the_same_attention(variant, block_size):
    """Each variant on a decode-only step (where direct_decode applies) and a mixed one (where it
    must not), plain and split-K, with a window that starts inside a loop step."""
    decodes = make_step([(50, 1), (3, 1), (90, 1)], 2, 4, 32, block_size, torch.float32)
    mixed = make_step([(37, 1), (0, 9), (20, 5)], 2, 2, 32, block_size, torch.float32)
    for args in (decodes, mixed):
        assert_matches(args, variant=variant)
        assert_matches(args, sliding_window=20, num_splits=3, variant=variant)


def test_direct_decode_only_where_every_row_decodes():
    """direct_decode launches one program per row, and only for T == B (query_lens >= 1 makes
    every row one token then); a mixed step keeps the searched tiles."""
    decodes, mixed = make_step([(5, 1), (7, 1)], 2, 4, 32, 16, torch.float32), make_step([(5, 3), (7, 1)], 2, 4, 32, 16, torch.float32)
    direct = Variant(direct_decode=True)
    assert Tiling.of(*decodes[:3], None, None, direct).num_tiles == 2
    assert Tiling.of(*decodes[:3], None, None).num_tiles == 2 // 4 + 2
    assert not Tiling.of(*mixed[:3], None, None, direct).direct_decode
    with pytest.raises(ValueError, match="power of two"):
        Tiling.of(*decodes[:3], None, None, Variant(keys_per_step=24))


def test_split_heuristic():
    assert num_splits_for(num_rows=2, num_tokens=2, num_kv_heads=8, max_keys=8192, num_sms=132) == 8
    assert num_splits_for(num_rows=1, num_tokens=1, num_kv_heads=8, max_keys=32768, num_sms=132) == 16  # capped
    assert num_splits_for(num_rows=2, num_tokens=2, num_kv_heads=8, max_keys=512, num_sms=132) == 2  # short contexts
    assert num_splits_for(num_rows=16, num_tokens=16, num_kv_heads=8, max_keys=8192, num_sms=132) == 1  # SMs full
    assert num_splits_for(num_rows=2, num_tokens=9, num_kv_heads=8, max_keys=8192, num_sms=132) == 1  # a chunk


def test_rejects_mismatched_inputs():
    q, kv_cache, tables, starts, seq_lens, scale = make_step([(5, 1)], 2, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, kv_cache, tables.long(), starts, seq_lens, scale)
    with pytest.raises(ValueError, match="float16"):
        paged_attention(q.half(), kv_cache, tables, starts, seq_lens, scale)
    with pytest.raises(ValueError, match="query heads"):
        paged_attention(q[:, :3], kv_cache, tables, starts, seq_lens, scale)


# Compiles the kernels for an H100 (sm_90) all the way to a cubin, with Triton's bundled ptxas: no
# GPU needed. It catches what the interpreter lets through (types that change in a loop, an
# unsupported construct, shared memory past the limit). A fresh process: the interpreter's jit
# wraps kernels in a way the compiler cannot take.
COMPILE_FOR_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton import paged_attention, paged_attention_reduce, paged_attention_split_k

    def compile_(fn, types, constexprs, num_warps=4):
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
        options = dict(num_warps=num_warps)
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
        assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)

    # The last: an fp8 cache, its e4m3 codes passed as bytes.
    for dtype, head_dim, block_m, group, fp8 in [("bf16", 128, 16, 4, False), ("fp16", 256, 64, 1, False), ("bf16", 128, 16, 4, True)]:
        constexprs = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_D=head_dim, BLOCK_M=block_m,
                          BLOCK_Q=block_m // group, BLOCK_N=16, HAS_WINDOW=True, UPCAST=False, PRECISION=None, KV_FP8=fp8)
        types = dict(out_ptr="*" + dtype, q_ptr="*" + dtype, kv_ptr="*u8" if fp8 else "*" + dtype, block_tables_ptr="*i32",
                     query_start_loc_ptr="*i32", seq_lens_ptr="*i32", scale_log2="fp32", v_scale="fp32",
                     o_part_ptr="*fp32", m_part_ptr="*fp32", l_part_ptr="*fp32")
        num_warps = 8 if head_dim >= 256 else 4
        compile_(paged_attention._paged_attention_kernel, types, constexprs, num_warps)
        compile_(paged_attention_split_k._paged_attention_split_kernel, types, dict(constexprs, NUM_SPLITS=8), num_warps)
        reduce_constexprs = dict(NUM_SPLITS=8, HEAD_DIM=head_dim, BLOCK_S=8, BLOCK_D=head_dim)
        compile_(paged_attention_reduce._reduce_splits_kernel, types, reduce_constexprs)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU tests compile and run the kernels")
def test_kernels_compile_for_sm90():
    compile_for_sm90(COMPILE_FOR_SM90, timeout_s=240)


# The decode candidates at Llama-3-8B's shape (Hq 32, Hkv 8, D 128, bf16, blocks of 16), compiled
# as the launcher specializes them (16-divisible pointers and strides: the loads then pipeline
# through cp.async), and ptxas's own count of spilled bytes, which the PTX cannot show.
COMPILE_VARIANTS_FOR_SM90 = textwrap.dedent("""
    import os, re, subprocess, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton import paged_attention, paged_attention_split_k

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    aligned = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kv", "stride_kb", "stride_ks", "stride_kh"}
    types = dict(out_ptr="*bf16", q_ptr="*bf16", kv_ptr="*bf16", block_tables_ptr="*i32", query_start_loc_ptr="*i32",
                 seq_lens_ptr="*i32", scale_log2="fp32", v_scale="fp32", softcap_log2="fp32", o_part_ptr="*fp32",
                 m_part_ptr="*fp32", l_part_ptr="*fp32")
    for keys, direct, stages in [(16, False, 3), (32, False, 3), (64, False, 3), (64, True, 3), (64, True, 2)]:
        constexprs = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_D=128, BLOCK_M=16, BLOCK_Q=4, BLOCK_N=keys,
                          HAS_WINDOW=False, HAS_SOFTCAP=False, UPCAST=False, PRECISION=None, KV_FP8=False, DIRECT_DECODE=direct)
        split = paged_attention_split_k._paged_attention_split_kernel
        for fn, extra in [(paged_attention._paged_attention_kernel, {}), (split, dict(NUM_SPLITS=4))]:
            c = dict(constexprs, **extra)
            signature = {n: "constexpr" if n in c else types.get(n, "i32") for n in fn.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n in aligned}
            kernel = triton.compile(ASTSource(fn, signature, c, attrs), target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=4, num_stages=stages))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
                ptx.write(kernel.asm["ptx"]); ptx.flush()
                report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull],
                                        capture_output=True, text=True, check=True).stderr
            spilled = sum(int(n) for n in re.findall(r"(\\d+) bytes spill stores", report))
            assert spilled == 0, (fn.__name__, keys, direct, stages, report)
            assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, keys, kernel.metadata.shared)
            if stages > 1:  # the block table's indirection must not stop the pipeliner
                assert "cp.async" in kernel.asm["ptx"], (fn.__name__, keys, direct, stages)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU tests compile and run the kernels")
def test_decode_variants_compile_for_sm90_without_spills():
    compile_for_sm90(COMPILE_VARIANTS_FOR_SM90, timeout_s=240)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bfloat16_on_cuda_matches_torch(head_dim):
    """On CUDA, bf16 against the float32 reference: Llama-like heads, long contexts, both kernels."""
    args = make_step([(1000, 1), (300, 64), (0, 128), (2000, 1)], 8, 4, head_dim, 16, torch.bfloat16)
    assert_matches(args)
    assert_matches(args, sliding_window=256)
    decodes = make_step([(3000, 1), (1500, 1)], 8, 4, head_dim, 16, torch.bfloat16)
    assert_matches(decodes)  # the heuristic picks split-K here on any GPU with >= 32 SMs
    assert_matches(decodes, num_splits=1)
    assert math.isfinite(paged_attention(*decodes).float().abs().max().item())
