"""Paged attention against a dense float64 reference, on random data in shuffled blocks: the torch
backend, and the cpu backend's C++ kernel (gpu/backends/cpu/kernels) on the same cases, each through the
seam (gpu/backends/base.py): allocate_kv_caches, build_metadata, forward."""

from __future__ import annotations

import types

import pytest
import torch

from conveyor.gpu.backends.cpu import CpuAttention
from conveyor.gpu.backends.cpu.kernels import paged_attention_kernel
from conveyor.gpu.backends.torch import TorchAttention, TorchMetadata
from conveyor.gpu.backends.torch.attention import write_kv

needs_kernel = pytest.mark.skipif(paged_attention_kernel() is None, reason="no C++ compiler for the CPU kernel")


def dense_reference(q, k, v, window, softcap=None):
    """q [q_len, Hq, D] at the last q_len of k/v's [L, Hkv, D] positions -> [q_len, Hq, D]; softcap:
    each scaled score s becomes softcap * tanh(s / softcap) first (Gemma 2)."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, head_dim = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * head_dim**-0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def attention_backend(num_kv_heads, head_dim, kernel=None, softcap=None):
    """The torch backend, or with `kernel` the cpu backend's attention, for one float32 layer."""
    model = types.SimpleNamespace(
        num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype="float32", attn_logit_softcap=softcap
    )
    cpu = torch.device("cpu")
    return TorchAttention(model, cpu) if kernel is None else CpuAttention(model, cpu, kernel)


def run_case(seq_lens, q_lens, num_heads, num_kv_heads, window, block_size=4, head_dim=16, seed=0, kernel=None, softcap=None):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5  # a few blocks nobody owns
    ids = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous tables
    attn = attention_backend(num_kv_heads, head_dim, kernel, softcap)
    (cache,) = attn.allocate_kv_caches(num_blocks, block_size)
    tables = torch.zeros(len(seq_lens), max(-(-n // block_size) for n in seq_lens), dtype=torch.int32)
    full_k, full_v, queries, new_k, new_v, positions, slots = [], [], [], [], [], [], []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        n = -(-seq_len // block_size)
        tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)])
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        old = range(seq_len - q_len)  # earlier steps' context, already in the cache
        old_slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size for p in old])
        (kernel.write_kv if kernel else write_kv)(cache, k[: len(old)], v[: len(old)], old_slots.long())
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen))
        new_k.append(k[seq_len - q_len :])
        new_v.append(v[seq_len - q_len :])
        positions += range(seq_len - q_len, seq_len)
        new_pos = range(seq_len - q_len, seq_len)
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in new_pos]

    meta = attn.build_metadata(q_lens, seq_lens, tables, torch.tensor(positions), block_size, window)
    assert meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc.tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_tokens) == (max(q_lens), max(seq_lens), sum(q_lens))
    out = attn.forward(torch.cat(queries), torch.cat(new_k), torch.cat(new_v), cache, meta, head_dim**-0.5)

    start = 0
    for i, q in enumerate(queries):
        expected = dense_reference(q, full_k[i], full_v[i], window, softcap)
        got = out[start : start + len(q)]
        start += len(q)
        assert torch.allclose(got.double(), expected, atol=1e-5), f"row {i}"
        # Every context token, old and new, sits in the cache where the block table says.
        pos = torch.arange(seq_lens[i])
        blocks, offsets = tables[i].long()[pos // block_size], pos % block_size
        if kernel is None:  # [2, N, bs, Hkv, D]
            stored_k, stored_v = cache[0, blocks, offsets], cache[1, blocks, offsets]
        else:  # [2, N, Hkv, bs * D], the kernel's order inside a block: keys [Hkv, D, bs], values [Hkv, bs, D]
            assert cache.shape == (2, cache.shape[1], num_kv_heads, block_size * head_dim)
            stored_k = cache[0].view(-1, num_kv_heads, head_dim, block_size)[blocks, :, :, offsets]
            stored_v = cache[1].view(-1, num_kv_heads, block_size, head_dim)[blocks, :, offsets]
        assert torch.equal(stored_k, full_k[i]) and torch.equal(stored_v, full_v[i])
    return meta


HEADS = [(8, 2), (4, 4)]  # GQA with 4 queries per kv head, and plain multi-head


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_decode_and_prefill_batch(num_heads, num_kv_heads, window):
    # decode, chunk after context, fresh prompt, decode, one-token prompt, last chunk of one token
    seq_lens = [9, 23, 11, 30, 1, 14]
    q_lens = [1, 7, 11, 1, 1, 1]
    meta = run_case(seq_lens, q_lens, num_heads, num_kv_heads, window)
    assert sorted(i for d in meta.decodes for i in d.token_index.tolist()) == [0, 19, 20, 21]
    assert [(c.start, c.end, c.is_fresh) for c in meta.prefills] == [(1, 8, False), (8, 19, True)]


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("window", [None, 3])
def test_all_decode_batch(num_heads, num_kv_heads, window):
    meta = run_case([5, 17, 2, 40], [1, 1, 1, 1], num_heads, num_kv_heads, window, seed=1)
    # Contexts of 2 to 40 tokens: bucketed by length, so no row is padded to 20x its context.
    assert len(meta.decodes) > 1 and meta.prefills == []
    assert sorted(i for d in meta.decodes for i in d.token_index.tolist()) == [0, 1, 2, 3]
    similar = run_case([30, 33, 31, 36], [1, 1, 1, 1], num_heads, num_kv_heads, window, seed=2)
    assert len(similar.decodes) == 1 and similar.decodes[0].token_index is None  # the fast path


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_only_batch(window):
    meta = run_case([13, 8, 21], [13, 3, 9], 8, 2, window, block_size=8, seed=2)
    assert meta.decodes == [] and len(meta.prefills) == 3


def test_window_longer_than_context_changes_nothing():
    gen_args = dict(num_heads=8, num_kv_heads=2, seed=3)
    run_case([10, 12], [4, 1], window=64, **gen_args)


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads", [*HEADS, (12, 4)])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 20])  # the specialised widths, and the generic loop
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_kernel_matches_reference(num_heads, num_kv_heads, head_dim, window):
    kernel = paged_attention_kernel()
    # decode, chunk after context, fresh prompt, decode, one-token prompt, last chunk of one token
    meta = run_case(
        [9, 23, 11, 30, 1, 14],
        [1, 7, 11, 1, 1, 1],
        num_heads,
        num_kv_heads,
        window,
        head_dim=head_dim,
        kernel=kernel,
    )
    assert not isinstance(meta, TorchMetadata)  # no masks built


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 16, 32])  # 16: the specialised width
def test_cpu_kernel_long_contexts_across_block_sizes(block_size):
    seq_lens = [1, 70, 300, 129, 64, 33]
    run_case(seq_lens, [1, 1, 1, 40, 64, 1], 8, 2, None, block_size=block_size, seed=4, kernel=paged_attention_kernel())
    run_case(seq_lens, [1, 1, 1, 40, 64, 1], 8, 2, 50, block_size=block_size, seed=5, kernel=paged_attention_kernel())


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window", [None, 300, 517])
def test_cpu_kernel_splits_long_decode_contexts(block_size, window):
    """A step of fewer rows than twice the threads walks each decode token's keys in parts of 256
    (paged_attention.cpp's kPartTokens), merged after: one row always splits, whatever the thread
    count. Contexts that do and do not end on a block, windows starting inside a block and
    inside a part, a part of a single key (769 = 3 x 256 + 1)."""
    kernel = paged_attention_kernel()
    for seed, (seq_lens, q_lens) in enumerate([([700], [1]), ([769], [1]), ([1030, 513], [1, 1]), ([600, 90], [1, 40])]):
        run_case(seq_lens, q_lens, 9, 3, window, block_size=block_size, head_dim=64, seed=seed, kernel=kernel)


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (6, 2), (10, 2), (12, 2), (14, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_cpu_kernel_decode_heads_side_by_side(num_heads, num_kv_heads, head_dim, softcap):
    """Decode tokens in blocks of 16 (paged_attention_decode.h's attend_heads): a kv head's query
    heads in passes of up to four, so groups of 1, 2, 3, 5, 6, 7 and 8 cover every pass width and
    every remainder; contexts within a block, ending on one and across several, a window starting
    inside a block; and the scores capped (Gemma 2)."""
    for window in (None, 21):
        run_case(
            [1, 9, 16, 40, 300],
            [1, 1, 1, 1, 1],
            num_heads,
            num_kv_heads,
            window,
            block_size=16,
            head_dim=head_dim,
            seed=num_heads * head_dim,
            kernel=paged_attention_kernel(),
            softcap=softcap,
        )


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 4), (8, 1), (12, 4), (4, 4)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("window", [None, 5, 37])
def test_cpu_kernel_prompt_tiles(num_heads, num_kv_heads, head_dim, window):
    """Blocks of 16 and specialised widths: prompt chunks attend several tokens at a time.
    Chunk lengths that are and are not multiples of the tile, chunks after cached context,
    tiles straddling a block edge, windows inside one block and across several."""
    run_case(
        [9, 23, 11, 30, 1, 14, 200, 70, 17, 6],
        [1, 7, 11, 1, 1, 1, 200, 33, 2, 5],
        num_heads,
        num_kv_heads,
        window,
        block_size=16,
        head_dim=head_dim,
        seed=num_heads + head_dim,
        kernel=paged_attention_kernel(),
    )


@needs_kernel
def test_cpu_kernel_rejects_what_it_cannot_read():
    kernel = paged_attention_kernel()
    q, cache = torch.randn(1, 4, 8), torch.zeros(2, 2, 2, 4 * 8)  # [2, N, Hkv, bs * D]
    one = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        kernel(q, cache, one.long(), torch.tensor([0, 1], dtype=torch.int32), one[0], None, 1.0)
    with pytest.raises(ValueError, match="float32"):
        kernel(q.double(), cache.double(), one, torch.tensor([0, 1], dtype=torch.int32), one[0], None, 1.0)
    with pytest.raises(ValueError, match="heads"):  # 3 query heads cannot share 2 kv heads
        kernel(torch.randn(1, 3, 8), cache, one, torch.tensor([0, 1], dtype=torch.int32), one[0], None, 1.0)
    with pytest.raises(ValueError, match="KV cache must be"):  # the torch backend's layout is not the kernel's
        kernel(q, torch.zeros(2, 2, 4, 2, 8), one, torch.tensor([0, 1], dtype=torch.int32), one[0], None, 1.0)


def test_cpu_kernels_can_be_switched_off(monkeypatch, tmp_path):
    from conveyor.gpu.backends.cpu.kernels import build, fused_ops, paged_attention

    loaders = (build.load_library, paged_attention.paged_attention_kernel, fused_ops.cpu_fused_ops)

    def forget() -> None:
        for loader in loaders:
            loader.cache_clear()

    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "0")
    forget()
    try:
        assert paged_attention.paged_attention_kernel() is None and fused_ops.cpu_fused_ops() is None
        monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "1")
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))  # nothing built there yet
        forget()
        # logged, and the torch paths serve
        assert paged_attention.paged_attention_kernel() is None and fused_ops.cpu_fused_ops() is None
    finally:
        forget()


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats(tmp_path):
    # A library linked with -ffast-math sets flush-to-zero for the whole process when it loads,
    # which changed torch's results and broke hypothesis's float strategies in this very suite.
    # A fresh build in a fresh process, so the check sees what loading does.
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from conveyor.gpu.backends.cpu.kernels import paged_attention_kernel\n"
        "assert paged_attention_kernel() is not None\n"
        "tiny = torch.tensor([1e-40]) * torch.tensor([1.0])\n"
        "print(tiny.item() != 0.0, 5e-324 * 1.0 != 0.0)\n"
    )
    env = {**__import__("os").environ, "CONVEYOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
