"""The host side both paged attention kernels share: the launch shape and the input checks.

`Tiling.of(q, kv_cache, block_tables, ...)` derives the tiles, block sizes and constexprs of
paged_attention.py and paged_attention_split_k.py from tensor shapes alone (no device sync, so a
decode step captures in a CUDA graph); `Variant` holds the launch choices a GPU timing picks
(ops/gpu/attention_bench.py); `check_inputs` is the plain wrapper's shape, dtype and stride check.
The device functions the kernels share are paged_attention_tile.py's.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from conveyor.gpu.kv.kv_fp8 import is_fp8


@dataclasses.dataclass(frozen=True)
class Variant:
    """Launch choices the backend leaves at their defaults until a GPU's timing picks others
    (ops/gpu/attention_bench.py times each; docs/benchmarks.md records which won). Every value
    computes the same attention: they change how the work is cut, never what is summed."""

    keys_per_step: int | None = None  # BLOCK_N, a power of two >= 16; None: the block size, in [16, 64]
    direct_decode: bool = False  # a step of decodes only: program r is row r (no tile search, no empty programs)
    num_stages: int | None = None  # Triton's software-pipelining depth; None: Triton's default (3 on CUDA)


DEFAULT_VARIANT = Variant()


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The launch shape both kernels share, derived from tensor shapes alone (no device sync)."""

    num_rows: int  # B
    group: int  # query heads per kv head
    head_dim: int
    block_size: int
    block_d: int  # head_dim padded to a power of two
    block_m: int  # tile rows: block_q tokens x group heads, padded
    block_q: int
    block_n: int  # keys per loop step
    num_tiles: int  # an upper bound: T // block_q + B
    window: int  # 0 without a sliding window
    softcap: float  # 0.0 without a logit soft-cap
    upcast: bool  # compute in float32 after loading
    precision: str | None  # tl.dot's input_precision; None: Triton's default
    num_warps: int
    kv_fp8: bool = False  # the cache holds e4m3 codes (passed as uint8)
    direct_decode: bool = False  # T = B and the variant asked: tile r is row r (find_tile)
    num_stages: int | None = None

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        sliding_window: int | None,
        softcap: float | None = None,
        variant: Variant = DEFAULT_VARIANT,
    ) -> Tiling:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        num_rows = block_tables.shape[0]
        group = num_heads // num_kv_heads
        # A step of decodes only needs one token per tile; chunks fill taller tiles. tl.dot needs >= 16.
        block_m = max(16 if num_tokens == num_rows else 64, triton.next_power_of_2(group))
        block_q = block_m // group
        block_d = max(16, triton.next_power_of_2(head_dim))
        block_n = variant.keys_per_step or max(16, min(block_size, 64))
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"paged_attention: keys_per_step must be a power of two >= 16, got {block_n}")
        direct_decode = variant.direct_decode and num_tokens == num_rows  # every row then holds one query
        return cls(
            num_rows=num_rows,
            group=group,
            head_dim=head_dim,
            block_size=block_size,
            block_d=block_d,
            block_m=block_m,
            block_q=block_q,
            block_n=block_n,
            num_tiles=num_rows if direct_decode else num_tokens // block_q + num_rows,
            window=sliding_window or 0,
            softcap=float(softcap or 0.0),
            # On CPU tensors the kernels run under the interpreter, whose bf16 arithmetic is wrong.
            upcast=q.dtype == torch.bfloat16 and q.device.type != "cuda",
            # float32 caches get exact float32 products, not TF32: they are the reference precision.
            precision="ieee" if q.dtype == torch.float32 else None,
            num_warps=8 if block_d >= 256 else 4,
            kv_fp8=is_fp8(kv_cache.dtype),
            direct_decode=direct_decode,
            num_stages=variant.num_stages,
        )

    def constexprs(self) -> dict:
        stages = {} if self.num_stages is None else {"num_stages": self.num_stages}
        return dict(
            **stages,
            GROUP=self.group,
            HEAD_DIM=self.head_dim,
            BLOCK_SIZE=self.block_size,
            BLOCK_D=self.block_d,
            BLOCK_M=self.block_m,
            BLOCK_Q=self.block_q,
            BLOCK_N=self.block_n,
            HAS_WINDOW=self.window > 0,
            HAS_SOFTCAP=self.softcap > 0,
            UPCAST=self.upcast,
            PRECISION=self.precision,
            KV_FP8=self.kv_fp8,
            DIRECT_DECODE=self.direct_decode,
            num_warps=self.num_warps,
        )


def check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    out: torch.Tensor | None,
) -> None:
    """Shapes, dtypes and unit strides along D that the kernels' pointer arithmetic assumes."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"paged_attention: q must be [T, Hq, D] and kv_cache [2, N, bs, Hkv, D], got {tuple(q.shape)}, {tuple(kv_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"paged_attention: {num_heads} query heads of {head_dim} over a cache of {num_kv_heads} x {kv_cache.shape[4]}"
        )
    if q.dtype != kv_cache.dtype and not is_fp8(kv_cache.dtype):
        raise ValueError(f"paged_attention: q is {q.dtype}, the cache {kv_cache.dtype}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or block_tables.stride(1) != 1:
        raise ValueError("paged_attention: q, kv_cache and block_tables need unit stride along their last dim")
    num_rows = block_tables.shape[0]
    if query_start_loc.shape != (num_rows + 1,) or seq_lens.shape != (num_rows,):
        raise ValueError(
            f"paged_attention: {num_rows} block-table rows, "
            f"query_start_loc {tuple(query_start_loc.shape)}, seq_lens {tuple(seq_lens.shape)}"
        )
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"paged_attention: {name} must be int32, got {t.dtype}")
    if not query_start_loc.is_contiguous() or not seq_lens.is_contiguous():
        raise ValueError("paged_attention: query_start_loc and seq_lens must be contiguous")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"paged_attention: sliding_window must be >= 1, got {sliding_window}")
    if out is not None and (out.shape != q.shape or out.stride(2) != 1):
        raise ValueError(f"paged_attention: out must be {tuple(q.shape)} with unit stride along D")
