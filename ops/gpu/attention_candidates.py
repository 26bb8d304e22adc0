"""The paged attention candidates ops/gpu/attention_bench.py times on one step.

`candidates(step)` -> {name: fn(q) -> out [T, Hq, D], or a string saying why it was skipped}:
- conveyor's Triton kernels as the backend picks them (gpu/backends/triton/paged_attention.py),
  then forced: the plain kernel, split-K with 2, 4 and 8 splits (decode steps), and each launch
  `Variant` (paged_attention_launch.py) with the backend's split choice;
- torch SDPA over the same keys gathered dense beforehand: a sanity reference, the pace of a
  dense kernel on the same bytes (the gather is not timed);
- FlashInfer's paged wrappers, where `import flashinfer` works: BatchDecode on CUDA cores and on
  tensor cores (decode steps), BatchPrefill with its automatic backend (FA3 on Hopper) and FA2
  (mixed steps). Each is planned here, outside the timed call: a plan is host work a step pays
  once for all its layers. The first plan and run of each compiles FlashInfer's kernels (JIT);
  `first_call_s` records that time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from conveyor.gpu.backends.triton.flashinfer_paged_kv import flashinfer_cache, paged_kv_of
from conveyor.gpu.backends.triton.paged_attention import paged_attention
from conveyor.gpu.backends.triton.paged_attention_launch import Variant

Fn = Callable[[torch.Tensor], torch.Tensor]
SPLITS = (2, 4, 8)
VARIANTS = {  # name -> the launch choices it forces; the hypothesis each tests is in docs/benchmarks/gpu-runs.md
    "keys 32": Variant(keys_per_step=32),
    "keys 64": Variant(keys_per_step=64),
    "direct decode": Variant(direct_decode=True),
    "keys 64, direct": Variant(keys_per_step=64, direct_decode=True),
    "keys 64, direct, 2 stages": Variant(keys_per_step=64, direct_decode=True, num_stages=2),
}
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's float workspace (split-KV partials), its docs' size


@dataclasses.dataclass
class Step:
    """One attention call's inputs, conveyor's layout (gpu/backends/base.py)."""

    q: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [2, N, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    query_lens: list[int]
    host_seq_lens: list[int]
    scale: float

    @property
    def is_decode(self) -> bool:
        return self.q.shape[0] == len(self.query_lens)

    def args(self) -> tuple:
        return (self.kv_cache, self.block_tables, self.query_start_loc, self.seq_lens, self.scale)


def candidates(step: Step, flashinfer) -> tuple[dict[str, Fn | str], dict[str, float]]:
    """-> (name -> fn or skip reason, name -> first_call_s for FlashInfer's). flashinfer: the
    module, or a string saying why it is not importable."""
    found: dict[str, Fn | str] = {"triton (backend's pick)": lambda q: paged_attention(q, *step.args())}
    found["triton, one kernel"] = lambda q: paged_attention(q, *step.args(), num_splits=1)
    for splits in SPLITS:
        name = f"triton, split-K {splits}"
        found[name] = (lambda q, s=splits: paged_attention(q, *step.args(), num_splits=s)) if step.is_decode else "decode steps only"
    for name, variant in VARIANTS.items():
        found[f"triton, {name}"] = lambda q, v=variant: paged_attention(q, *step.args(), variant=v)
    found["torch SDPA, dense K/V (sanity)"] = sdpa(step)
    first_calls: dict[str, float] = {}
    for name, make in (("flashinfer decode", decode_wrapper), ("flashinfer decode, tensor cores", decode_wrapper)):
        found[name] = skip_reason(flashinfer, step.is_decode, "decode steps only") or timed_first(
            name, lambda m=make, n=name: m(flashinfer, step, tensor_cores="tensor" in n), first_calls
        )
    for name, backend in (("flashinfer prefill, auto (FA3)", "auto"), ("flashinfer prefill, FA2", "fa2")):
        found[name] = skip_reason(flashinfer, not step.is_decode, "mixed steps only") or timed_first(
            name, lambda b=backend: prefill_wrapper(flashinfer, step, b), first_calls
        )
    return found, first_calls


def skip_reason(flashinfer, applies: bool, otherwise: str) -> str | None:
    if isinstance(flashinfer, str):
        return flashinfer
    return None if applies else otherwise


def timed_first(name: str, make: Callable[[], Fn], first_calls: dict[str, float]) -> Fn | str:
    """Build the wrapper and run it once (FlashInfer's JIT compiles here), timing both."""
    start = time.perf_counter()
    try:
        fn = make()
        torch.cuda.synchronize()
    except Exception as e:  # a candidate that fails is reported, the others still run
        return f"failed: {type(e).__name__}: {str(e)[:300]}"
    first_calls[name] = time.perf_counter() - start
    return fn


def sdpa(step: Step) -> Fn:
    """SDPA per group of rows of one shape, K/V gathered dense [G, Hkv, L, D] beforehand."""
    block_size, num_kv_heads, head_dim = step.kv_cache.shape[2:]
    groups: list[tuple[int, int, int, int]] = []  # (first row, rows, q_len, seq_len)
    for row, shape in enumerate(zip(step.query_lens, step.host_seq_lens)):
        if groups and groups[-1][2:] == shape:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1, *shape)
        else:
            groups.append((row, 1, *shape))
    dense = []
    starts = [0]
    for q_len in step.query_lens:
        starts.append(starts[-1] + q_len)
    for first, rows, q_len, seq_len in groups:
        if q_len not in (1, seq_len):
            raise ValueError("sdpa: a chunk after cached context is not among this bench's steps")
        blocks = step.block_tables[first : first + rows, : -(-seq_len // block_size)].long()  # [G, nb]
        kv = step.kv_cache[:, blocks].flatten(2, 3)[:, :, :seq_len]  # [2, G, L, Hkv, D]
        dense.append((starts[first], rows, q_len, kv[0].transpose(1, 2).contiguous(), kv[1].transpose(1, 2).contiguous()))

    def run(q: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, rows, q_len, k, v in dense:
            qg = q[start : start + rows * q_len].view(rows, q_len, q.shape[1], head_dim).transpose(1, 2)  # [G, Hq, q_len, D]
            o = F.scaled_dot_product_attention(qg, k, v, is_causal=q_len > 1, scale=step.scale, enable_gqa=True)
            out[start : start + rows * q_len] = o.transpose(1, 2).reshape(rows * q_len, q.shape[1], head_dim)
        return out

    return run


def device_buffers(step: Step):
    paged = paged_kv_of(step.block_tables, step.query_lens, step.host_seq_lens, step.kv_cache.shape[2])
    on = step.q.device
    return paged, paged.kv_indptr.to(on), paged.kv_indices.to(on), paged.kv_last_page_len.to(on)


def decode_wrapper(flashinfer, step: Step, tensor_cores: bool) -> Fn:
    """BatchDecodeWithPagedKVCacheWrapper in its CUDA-graph mode (fixed buffers), planned once."""
    paged, indptr, indices, last = device_buffers(step)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=step.q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last,
    )
    _, num_pages, block_size, num_kv_heads, head_dim = step.kv_cache.shape
    wrapper.plan(
        paged.kv_indptr,
        paged.kv_indices,
        paged.kv_last_page_len,
        step.q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        pos_encoding_mode="NONE",
        q_data_type=step.q.dtype,
        kv_data_type=step.kv_cache.dtype,
        sm_scale=step.scale,
    )
    cache = flashinfer_cache(step.kv_cache)
    fn: Fn = lambda q: wrapper.run(q, cache)  # noqa: E731
    fn(step.q)
    return fn


def prefill_wrapper(flashinfer, step: Step, backend: str) -> Fn:
    """BatchPrefillWithPagedKVCacheWrapper (causal, ragged queries), CUDA-graph mode, planned once."""
    paged, indptr, indices, last = device_buffers(step)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=step.q.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        qo_indptr_buf=paged.qo_indptr.to(step.q.device),
        paged_kv_indptr_buf=indptr,
        paged_kv_indices_buf=indices,
        paged_kv_last_page_len_buf=last,
        backend=backend,
    )
    _, num_pages, block_size, num_kv_heads, head_dim = step.kv_cache.shape
    wrapper.plan(
        paged.qo_indptr,
        paged.kv_indptr,
        paged.kv_indices,
        paged.kv_last_page_len,
        step.q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        causal=True,
        sm_scale=step.scale,
        q_data_type=step.q.dtype,
        kv_data_type=step.kv_cache.dtype,
    )
    cache = flashinfer_cache(step.kv_cache)
    fn: Fn = lambda q: wrapper.run(q, cache)  # noqa: E731
    fn(step.q)
    return fn
