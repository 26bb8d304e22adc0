"""The routed experts of a mixture-of-experts block in plain torch, tokens grouped by expert.

What `Ops.moe_experts` computes by default (gpu/backends/ops.py), on any device: each token t
chose K experts (topk_ids [T, K]) with weights (topk_weights [T, K]); its output is

    sum over k of  topk_weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = topk_ids[t, k]

Rather than one small product per (token, expert) pair, the T * K pairs are sorted by expert so
each expert runs two GEMMs over all of its tokens at once: E iterations at most, each as wide as
the expert's share of the step. Experts no token chose cost nothing.

Roundings follow Hugging Face's expert loop: each product rounds to the activation dtype, the
weight multiplies in its own dtype (float32 for Mixtral, the model's for Qwen MoE: the caller
decides), the weighted output rounds back and is summed into a zeroed [T, H] in expert order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_moe(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I], topk_weights [T, K],
    topk_ids [T, K] int -> [T, H] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_experts, intermediate = down.shape[0], down.shape[2]
    flat_ids = topk_ids.reshape(-1)  # [T * K]: pair p is token p // K's k-th choice
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, token order kept inside a group
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # host sync: this path plans on the host
    token_of_pair = order // top_k  # [T * K] in sorted order
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of_pair[start : start + count]
        gate, up = F.linear(x[tokens], gate_up[expert]).split(intermediate, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, down[expert])  # [n, H]
        out.index_add_(0, tokens, (y * weights[start : start + count, None]).to(x.dtype))
        start += count
    return out


def per_token_moe(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The same sum one (token, expert) pair at a time: the definition, for tests."""
    intermediate = down.shape[2]
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = (gate_up[e].double() @ x[t].double()).split(intermediate)
            out[t] += float(topk_weights[t, k]) * (down[e].double() @ (F.silu(gate) * up))
    return out.to(x.dtype)
