"""The routed experts of a mixture-of-experts block as a grouped GEMM over expert-sorted tokens.

Computes `Ops.moe_experts` (gpu/backends/ops.py) for the triton backend: `fused_moe(x [T, H],
gate_up [E, 2I, H], down [E, H, I], topk_weights [T, K], topk_ids [T, K])` -> [T, H] in x's
dtype. Its reference is gpu/backends/torch/moe.py's grouped_moe, which its test compares with.

Invariants: x has unit stride along H and gate_up, down share its dtype (the wrapper checks);
everything is sized from shapes alone and the expert sort runs on the device, so there is no host
sync and a decode step that calls it can be captured in a CUDA graph; its roundings follow the
reference's (`fused_moe` says where they differ). Tuned for: nothing yet measured (no GPU here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.gpu.backends.triton.silu_mul import silu_mul


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    PAIRS_PER_ROW: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """c[p] = b[e] @ a[p // PAIRS_PER_ROW] (times weights[p] with HAS_WEIGHTS) for the pairs p of
    this program's BLOCK_M slots, all of expert e. a [rows, K], b [E, N, K], c [num_pairs, N]."""
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:  # a padding block past the last expert's group
        return
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pairs < num_pairs  # padding slots hold num_pairs
    rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(
            b_base + cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=k_valid[:, None] & col_valid[None, :], other=0.0
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]
    out = acc.to(c_ptr.dtype.element_ty)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) * w[:, None]).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :], out, mask=valid[:, None] & col_valid[None, :])


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_pairs [P] int32: the pair ids t * K + k grouped by expert, pair
    order kept inside a group, each group padded with T * K to a multiple of block_m;
    block_experts [P / block_m] int32: each block's expert, -1 past the last group)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    size = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # [E]: group e holds slots [ends[e] - padded[e], ends[e])
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]  # place inside its group
    sorted_pairs = torch.full((size,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[ends[expert_of] - padded[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, block_starts, right=True)  # the group whose slots hold the block
    return sorted_pairs, torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)


def _grouped_gemm(a, b, c, weights, sorted_pairs, block_experts, pairs_per_row: int, block_m: int) -> None:
    """Grid: (P / BLOCK_M, cdiv(N, BLOCK_N)), P = T * K + min(E, T * K) * (BLOCK_M - 1) rounded up
    to BLOCK_M (the most padding the groups can need); padding blocks past the last group return
    at once. A program multiplies BLOCK_M gathered rows of `a` by one expert's [N, K] weight (read
    transposed through its strides) in BLOCK_K steps, accumulating in float32."""
    n, k = b.shape[1], b.shape[2]
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        c if weights is None else weights,
        sorted_pairs,
        block_experts,
        c.shape[0],
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        PAIRS_PER_ROW=pairs_per_row,
        HAS_WEIGHTS=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=max(16, min(64, triton.next_power_of_2(k))),
        # The interpreter's bf16 arithmetic is wrong: compute in float32 there.
        UPCAST=a.dtype == torch.bfloat16 and a.device.type != "cuda",
        # float32 models get exact float32 products, not TF32: they are the reference precision.
        PRECISION="ieee" if a.dtype == torch.float32 else None,
        num_warps=4,
    )


def fused_moe(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], topk_weights [T, K], topk_ids [T, K] -> [T, H]
    in x's dtype: each token's K experts, weighted and summed.

    A (token, choice) pair p = t * K + k goes to expert topk_ids[t, k]. `sort_by_expert` lays the
    T * K pairs out grouped by expert, each group padded to a multiple of BLOCK_M with an invalid
    id, so that every BLOCK_M slots belong to one expert (`block_experts`). Then:
    1. one grouped GEMM: inter[p] = gate_up[e] @ x[p // K]               [T * K, 2I]
    2. silu_mul.py on its halves: act[p] = silu(gate) * up                [T * K, I]
    3. the same grouped GEMM: y[p] = weight[p] * (down[e] @ act[p])        [T * K, H]
    4. out[t] = sum over k of y[t * K + k] (torch)                         [T, H]
    BLOCK_M is 16 for decode-sized steps and 64 otherwise, the usual starting points for an H100.

    Roundings follow the torch path: each GEMM rounds to the activation dtype; the routing weight
    multiplies that rounded product in float32 and the result rounds again. The final sum over K
    rounds once (torch's sum), where the reference rounds after each add: fp16 results agree
    within about one ulp. bf16 loads are upcast at once under the interpreter, whose bf16
    arithmetic is wrong."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, intermediate = down.shape
    if x.dim() != 2 or x.shape[1] != hidden or x.stride(1) != 1:
        raise ValueError(f"fused_moe: x {tuple(x.shape)} (strides {x.stride()}) is not [T, {hidden}] with unit stride along H")
    if gate_up.shape != (num_experts, 2 * intermediate, hidden) or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(
            f"fused_moe: gate_up {tuple(gate_up.shape)} {gate_up.dtype} / down {tuple(down.shape)} {down.dtype} do not fit x"
        )
    if topk_weights.shape != topk_ids.shape or num_tokens != x.shape[0]:
        raise ValueError(f"fused_moe: topk_weights {tuple(topk_weights.shape)} / topk_ids {tuple(topk_ids.shape)} are not [T, K]")
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if num_pairs <= 64 else 64
    sorted_pairs, block_experts = sort_by_expert(topk_ids, num_experts, block_m)
    inter = torch.empty(num_pairs, 2 * intermediate, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, inter, None, sorted_pairs, block_experts, top_k, block_m)
    act = silu_mul(inter[:, :intermediate], inter[:, intermediate:], out=inter[:, :intermediate])  # [T * K, I], rows 2I apart
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, down, y, topk_weights.contiguous(), sorted_pairs, block_experts, 1, block_m)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
