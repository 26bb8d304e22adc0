"""Mixture-of-experts feed-forward: a router picks K of E experts per token, the ops run them.

Owns the layers every MoE family shares (`route`, `Experts`, `SparseMoeBlock`) and the loading
of per-expert checkpoint tensors into stacked parameters (`expert_weight_target`,
`load_moe_weights`). Which layers are sparse, and how a family routes, is ModelConfig.moe
(config/moe.py), filled by the family's config adapter; transformers' modeling code is the
reference for every family.

Invariants:
- the experts are stacked, `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its
  up rows) and `experts.down_proj` [E, H, I], so one `ops.moe_experts` call serves them all; the
  router is `gate.weight` [E, H], the checkpoint's name;
- tensor parallelism splits each expert's intermediate dim (`expert_split`): a rank's experts,
  and its shared expert, give partial sums that the block adds and all-reduces once; the router
  and the shared expert's gate are whole on every rank, so every rank routes every token alike.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch
from torch import nn

from conveyor.config.model import ModelConfig
from conveyor.config.moe import MoeConfig
from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.models.base import CausalLM, check_loaded, copy_weight
from conveyor.gpu.models.layers import Linear
from conveyor.gpu.models.llama import MLP
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.shard import Split, cut, local_units, splits_of


def route(router_logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, K], float32 or the logits' dtype as the family does;
    expert ids [T, K] int64), as transformers' top-k routers compute them: a softmax over the E
    logits in float32, then the top K. Mixtral always renormalises them to sum 1 and keeps them
    float32 to scale the experts' outputs; Qwen3-MoE and Qwen2-MoE renormalise only where
    `norm_topk_prob`, then round them to the model dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if moe.float32_weights else weights.to(router_logits.dtype)), ids


class Experts(nn.Module):
    """E SiLU-gated experts, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    """The feed-forward of a sparse layer: [T, H] -> [T, H]. `moe` is the whole model's; each
    expert holds this rank's I / tp intermediate rows. A shared expert (Qwen2-MoE) is a dense
    SiLU MLP every token runs, scaled by sigmoid(shared_expert_gate(x)) and added to the routed
    experts' sum before the one all-reduce."""

    def __init__(self, config: ModelConfig, moe: MoeConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.moe, self.ops, self.tp = moe, ops, tp
        self.gate = Linear(config.hidden_size, moe.num_experts, False, ops)  # the router
        self.experts = Experts(moe.num_experts, config.hidden_size, local_units(moe.moe_intermediate_size, tp.size))
        self.shared_expert: MLP | None = None
        if moe.shared_expert_intermediate_size:
            shared = dataclasses.replace(config, intermediate_size=moe.shared_expert_intermediate_size, mlp_bias=False)
            self.shared_expert = MLP(shared, ops, tp, reduce=False)  # summed with the experts, reduced once
            self.shared_expert_gate = Linear(config.hidden_size, 1, False, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe)  # [T, K] each
        out = self.ops.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)  # [T, H] partial
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


_EXPERT_TENSOR = re.compile(r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.weight")


def expert_weight_target(name: str, moe: MoeConfig) -> tuple[str, int, slice] | None:
    """A checkpoint tensor of one expert (`model.layers.3.mlp.experts.7.up_proj.weight`) -> (our
    stacked parameter, expert, its rows there): gate [I, H] -> gate_up_proj[e, :I], up [I, H]
    -> gate_up_proj[e, I:], down [H, I] -> down_proj[e]. None: not an expert's tensor."""
    match = _EXPERT_TENSOR.fullmatch(name)
    if match is None or match["projection"] not in moe.expert_projections:
        return None
    gate, up, _ = moe.expert_projections
    size, prefix, projection = moe.moe_intermediate_size, match["prefix"], match["projection"]
    if projection == gate:
        return f"{prefix}.gate_up_proj", int(match["expert"]), slice(0, size)
    if projection == up:
        return f"{prefix}.gate_up_proj", int(match["expert"]), slice(size, 2 * size)
    return f"{prefix}.down_proj", int(match["expert"]), slice(None)


def expert_split(name: str, moe: MoeConfig) -> Split:
    """How one expert's checkpoint tensor is cut over the ranks: gate and up [I, H] by rows, down
    [H, I] by columns."""
    down = name.rsplit(".", 2)[-2] == moe.expert_projections[2]
    return Split(1 if down else 0, ((moe.moe_intermediate_size, 1),))


def load_moe_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of `model` from checkpoint (name, tensor) pairs: experts' tensors into
    their stacked rows, everything else by name, each cut to this rank's slice. ConfigError
    names a shape that disagrees or a tensor that never came."""
    moe, tp = model.config.moe, model.backend.tp
    assert moe is not None, "a mixture-of-experts model's config has its moe fields (its family's config adapter)"
    params = dict(model.named_parameters())
    splits = splits_of(model)
    local = dataclasses.replace(moe, moe_intermediate_size=local_units(moe.moe_intermediate_size, tp.size))
    missing = set(params)
    num_filled: dict[str, int] = {}  # stacked parameter -> expert tensors copied into it
    for name, tensor in tensors:
        target = expert_weight_target(name, local)
        key = target[0] if target else name
        if key not in params:
            continue  # extras (rotary inv_freq, a tied lm_head shipped anyway) are ignored
        tensor = cut(tensor, expert_split(name, moe) if target else splits.get(name), tp.rank, tp.size)
        copy_weight(name, tensor, params[key][target[1], target[2]] if target else params[key])
        num_filled[key] = num_filled.get(key, 0) + 1
        if not target or num_filled[key] == moe.num_experts * (2 if key.endswith("gate_up_proj") else 1):
            missing.discard(key)
    check_loaded(missing, model.config.path)
