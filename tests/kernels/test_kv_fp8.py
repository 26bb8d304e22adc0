"""The fp8 KV cache (gpu/kv/kv_fp8.py) on every attention backend (torch, cpu's C++ kernel, triton
under the interpreter), through the seam: allocate_kv_caches, write_kv, build_metadata, forward.

- round trip: what a backend writes reads back as the e4m3 rounding of the input (torch's cast
  of x / scale, clamped to +-448), within e4m3's bound: 2^-4 relative for normal codes (half an
  ulp of a 3-bit mantissa), 2^-10 * scale absolute for subnormal ones;
- every finite code (all 254) read back exactly by each kernel, through a one-token context,
  whose output is its value times v_scale;
- attention over an fp8 cache equals attention over the e4m3-rounded keys and values to float32
  rounding (the kernels change only how they read), and stays within the bound that the rounding
  above implies of the float cache's attention (`fp8_error_bound`).
"""

from __future__ import annotations

import importlib.util
import math
import types
from typing import Any

import pytest
import torch

from conveyor.config.engine import CacheConfig
from conveyor.gpu.backends import select
from conveyor.gpu.backends.cpu.kernels import paged_attention_kernel
from conveyor.gpu.kv.kv_cache import copy_blocks, num_blocks_for_memory
from conveyor.gpu.kv.kv_fp8 import FP8, FP8_MAX, UNIT_SCALES, KVScales, dequantize_kv, quantize_kv

BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(paged_attention_kernel() is None, reason="no C++ compiler")),
    pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")),
]
SCALES = [UNIT_SCALES, KVScales(k=0.5, v=2.0)]
# (context cached before the step, new tokens) per row: decodes, a chunk after context, a fresh prompt.
STEP = [(19, 1), (5, 9), (0, 12), (33, 1)]


def attention(name: str, kv_dtype: str | None, num_kv_heads: int, head_dim: int, dtype: str = "float32", device: str = "cpu"):
    shape = dict(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim)
    model: Any = types.SimpleNamespace(**shape, dtype=dtype, attn_logit_softcap=None)
    attn = select(name, device, model, kv_dtype).attn
    assert type(attn).__name__.lower().startswith(name), "the backend under test, not a fallback"
    return attn


def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The e4m3 rounding of x / scale, times scale: what an fp8 cache reads back, in float32."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def test_quantize_round_trip_is_the_e4m3_rounding_within_its_bound():
    x = torch.cat([torch.tensor([0.0, -0.0, 1e-5, 2**-9, 3 * 2**-10, 0.3, -447.0, 448.0, 449.0, 1e6, -1e6]), torch.randn(4000) * 4])
    for scale in (1.0, 0.25, 3.0):
        given = x.clone()
        codes = quantize_kv(x, scale)
        assert torch.equal(x, given)  # the input is left as it was
        assert codes.dtype == FP8 and not codes.float().isnan().any()
        back = dequantize_kv(codes, scale, torch.float32)
        assert torch.equal(back, rounded(x, scale))
        inside = (x / scale).abs() <= FP8_MAX
        error = (back - x).abs()[inside]
        assert (error <= x.abs()[inside] / 16 + 2**-10 * scale).all()
        assert back[~inside].abs().max() == FP8_MAX * scale  # saturated, not NaN or inf


def run_step(attn, rows, group: int, scales: KVScales, seed: int = 0, block_size: int = 16):
    """One mixed step through the seam: each row's earlier context written first, then forward.
    -> (out [T, Hq, D], per-row (q, k, v) with k, v the whole context [L, Hkv, D], the cache)."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = attn.num_kv_heads, attn.head_dim
    needed = [-(-(c + n) // block_size) for c, n in rows]
    pool = torch.randperm(sum(needed) + 2, generator=gen).tolist()
    (cache,) = attn.allocate_kv_caches(sum(needed) + 2, block_size)
    tables = torch.zeros(len(rows), max(needed), dtype=torch.int32)
    data, old_slots, old_k, old_v = [], [], [], []
    positions: list[int] = []
    for i, (context, new) in enumerate(rows):
        tables[i, : needed[i]] = torch.tensor([pool.pop() for _ in range(needed[i])], dtype=torch.int32)
        k = torch.randn(context + new, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(context + new, num_kv_heads, head_dim, generator=gen)
        data.append((torch.randn(new, num_kv_heads * group, head_dim, generator=gen), k, v))
        old_slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(context)]
        old_k.append(k[:context])
        old_v.append(v[:context])
        positions += range(context, context + new)
    device, dtype = attn.device, attn.dtype  # the step's tensors there, in the model dtype; `data` stays float32 on the CPU
    old = types.SimpleNamespace(slot_mapping=torch.tensor(old_slots, device=device))
    attn.write_kv(cache, torch.cat(old_k).to(device, dtype), torch.cat(old_v).to(device, dtype), old, scales)
    q_lens, seq_lens = [n for _, n in rows], [c + n for c, n in rows]
    meta = attn.build_metadata(q_lens, seq_lens, tables.to(device), torch.tensor(positions, device=device), block_size, None)
    q = torch.cat([d[0] for d in data]).to(device, dtype)
    new_k = torch.cat([k[c:] for (_, k, _), (c, _) in zip(data, rows)]).to(device, dtype)
    new_v = torch.cat([v[c:] for (_, _, v), (c, _) in zip(data, rows)]).to(device, dtype)
    return attn.forward(q, new_k, new_v, cache, meta, head_dim**-0.5, scales).cpu(), data, cache


def dense(q, k, v):
    """q [n, Hq, D] at the last n of k, v's [L, Hkv, D] positions, causal, in float64 -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * q.shape[-1] ** -0.5
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def fp8_error_bound(q, k, v, scales: KVScales) -> torch.Tensor:
    """[n, Hq, 1]: how far attention over e4m3-rounded k, v may be from the exact one. Each key
    element moves by at most |k| / 16 + 2^-10 * k_scale, so each score by at most eps = scale *
    sum_d |q_d| (|k_d| / 16 + 2^-10 k_scale); a softmax weight then changes by a factor within
    e^(+-2 eps), so sum_j (p'_j - p_j) v'_j is at most (e^(2 eps) - 1) max|v'|; each value
    element moves by at most |v| / 16 + 2^-10 * v_scale, which the weights (summing to 1) carry
    over at most once. Maxima over the whole context: an upper bound for every query."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)  # [L, Hq, D]
    dk = k.abs() / 16 + 2**-10 * scales.k
    eps = torch.einsum("qhd,khd->qhk", q.double().abs(), dk).amax(-1, keepdim=True) * q.shape[-1] ** -0.5  # [n, Hq, 1]
    v_max = (v.abs() * (1 + 1 / 16) + 2**-10 * scales.v).amax((0, 2))[None, :, None]  # [1, Hq, 1]
    dv = (v.abs() / 16 + 2**-10 * scales.v).amax((0, 2))[None, :, None]
    return (torch.exp(2 * eps) - 1) * v_max + dv


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
@pytest.mark.parametrize("head_dim,group", [(32, 2), (16, 3)])  # the C++ kernel's specialised and generic paths
def test_fp8_cache_attention(name, scales, head_dim, group):
    fp8 = attention(name, "float8_e4m3fn", 2, head_dim)
    out, data, cache = run_step(fp8, STEP, group, scales)
    assert cache.dtype == FP8
    float_out, _, _ = run_step(attention(name, None, 2, head_dim), STEP, group, UNIT_SCALES)
    start = 0
    for q, k, v in data:
        got, exact = out[start : start + len(q)].double(), float_out[start : start + len(q)].double()
        start += len(q)
        # (a) the same function of the rounded keys and values, to float32 rounding
        expected = dense(q, rounded(k, scales.k), rounded(v, scales.v))
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()
        # (b) near the float cache's answer, as e4m3's mantissa allows
        bound = fp8_error_bound(q, k, v, scales)
        assert ((got - exact).abs() <= bound).all()
        assert torch.allclose(exact, dense(q, k, v), atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("head_dim", [32, 16])
def test_every_code_reads_back_exactly(name, head_dim):
    """One sequence per D codes, each a context of one token whose value holds them: its query
    sees only that key, so the output is the value, code * v_scale, exactly."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()]  # the 254 finite codes (0x7f, 0xff are NaN: never written)
    values = torch.cat([values, values.new_zeros(-len(values) % head_dim)]).view(-1, 1, head_dim)  # [rows, Hkv 1, D]
    attn = attention(name, "float8_e4m3fn", 1, head_dim)
    rows = len(values)
    (cache,) = attn.allocate_kv_caches(rows, 16)
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    meta = attn.build_metadata([1] * rows, [1] * rows, tables, torch.zeros(rows, dtype=torch.int64), 16, None)
    keys = torch.randn(rows, 1, head_dim)
    for v_scale in (1.0, 0.5):
        scales = KVScales(k=1.0, v=v_scale)
        out = attn.forward(torch.randn(rows, 1, head_dim), keys, values * v_scale, cache, meta, 1.0, scales)
        assert torch.equal(out, values * v_scale)


@pytest.mark.parametrize("name", BACKENDS)
def test_written_codes_are_the_rounding_of_the_input(name):
    """What write_kv leaves in the cache, read in the backend's own layout."""
    attn = attention(name, "float8_e4m3fn", 2, 32)
    (cache,) = attn.allocate_kv_caches(3, 16)
    k, v = torch.randn(5, 2, 32) * 50, torch.randn(5, 2, 32) / 50
    slots = torch.tensor([17, 0, 40, 5, 31])
    scales = KVScales(k=0.25, v=1.0)
    attn.write_kv(cache, k, v, types.SimpleNamespace(slot_mapping=slots), scales)
    if name == "cpu":  # [2, N, Hkv, bs * D]: keys [D, bs], values [bs, D] per (block, head)
        blocks, offsets = slots // 16, slots % 16
        stored_k = cache[0].view(-1, 2, 32, 16)[blocks, :, :, offsets]
        stored_v = cache[1].view(-1, 2, 16, 32)[blocks, :, offsets]
    else:  # [2, N, bs, Hkv, D]
        stored_k, stored_v = cache[0].view(-1, 2, 32)[slots], cache[1].view(-1, 2, 32)[slots]
    assert torch.equal(dequantize_kv(stored_k, scales.k, torch.float32), rounded(k, scales.k))
    assert torch.equal(dequantize_kv(stored_v, scales.v, torch.float32), rounded(v, scales.v))


def test_block_copies_move_fp8_codes():
    """copy_blocks on fp8 caches (torch has no float8 index_copy_ on a CPU: they go as bytes)."""
    cache = torch.randn(2, 4, 16, 2, 8).to(FP8)
    before = cache.view(torch.uint8).clone()
    copy_blocks([cache], [(0, 3), (1, 2)])
    after = cache.view(torch.uint8)
    assert torch.equal(after[:, 3], before[:, 0]) and torch.equal(after[:, 2], before[:, 1])
    assert torch.equal(after[:, :2], before[:, :2])


@pytest.mark.parametrize("dtype,ratio", [("bfloat16", 2), ("float32", 4)])
def test_an_fp8_block_takes_a_byte_a_value(dtype, ratio):
    float_attn, fp8_attn = attention("torch", None, 2, 64, dtype), attention("torch", "float8_e4m3fn", 2, 64, dtype)
    assert float_attn.bytes_per_block(16) == ratio * fp8_attn.bytes_per_block(16) == ratio * 2 * 16 * 2 * 64
    (cache,) = fp8_attn.allocate_kv_caches(10, 16)
    assert cache.nbytes == 10 * fp8_attn.bytes_per_block(16)
    memory = CacheConfig(cpu_kv_cache_gib=1 / 64)
    blocks = [num_blocks_for_memory(a.bytes_per_block(16), memory, "cpu") for a in (float_attn, fp8_attn)]
    assert blocks[1] == ratio * blocks[0]


def test_kernels_refuse_scales_on_a_float_cache():
    pytest.importorskip("triton")
    from conveyor.gpu.backends.triton.paged_attention import paged_attention

    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8"):
        paged_attention(
            torch.randn(1, 1, 16),
            torch.zeros(2, 1, 16, 1, 16),
            one[:, None],
            torch.tensor([0, 1], dtype=torch.int32),
            one,
            1.0,
            k_scale=2.0,
        )
    kernel = paged_attention_kernel()
    if kernel is not None:
        with pytest.raises(ValueError, match="fp8"):
            kernel(
                torch.randn(1, 1, 16),
                torch.zeros(2, 1, 1, 256),
                one[:, None],
                torch.tensor([0, 1], dtype=torch.int32),
                one,
                None,
                1.0,
                v_scale=math.pi,
            )


@pytest.mark.cuda
@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
def test_fp8_cache_attention_on_cuda(scales):
    """The triton backend compiled, bf16 queries over an fp8 cache, Llama's head size: against the
    rounded keys and values within the bf16 tolerance of tests/kernels/test_triton_attention.py."""
    rows = [(1000, 1), (300, 64), (0, 128), (2000, 1)]
    out, data, _ = run_step(attention("triton", "float8_e4m3fn", 8, 128, "bfloat16", "cuda"), rows, 4, scales)
    start = 0
    for q, k, v in data:
        got = out[start : start + len(q)].double()
        start += len(q)
        # the kernel saw bf16 q, k and v: round them so, then through e4m3
        bf16 = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
        expected = dense(bf16(q), rounded(bf16(k), scales.k), rounded(bf16(v), scales.v))
        assert torch.allclose(got, expected, atol=2e-2, rtol=2e-2), (got - expected).abs().max()
