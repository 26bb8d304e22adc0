"""Mixture-of-experts feed-forward: a router picks K of E experts per token, the ops run them.

How each family routes (transformers' modeling code is the reference):
- Mixtral: softmax over the E router logits in float32, the top K, always renormalised to sum 1;
  the weights stay float32 when they scale the experts' outputs.
- Qwen3-MoE and Qwen2-MoE: the same softmax and top K, renormalised only where
  `norm_topk_prob`, then rounded to the model dtype.
- Qwen2-MoE adds a shared expert: a dense SiLU MLP that every token runs, scaled by
  sigmoid(shared_expert_gate(x)) and added to the routed experts' sum.
Which layers are sparse: every layer in Mixtral; in Qwen MoE layer i where
(i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (the others keep a dense MLP
of intermediate_size).

Parameters: the block's router is `gate.weight` [E, H] (the checkpoint's name); the experts are
stacked, `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
`experts.down_proj` [E, H, I], so one `ops.moe_experts` call (one grouped GEMM on a GPU) serves
every expert. Checkpoints store one tensor per expert and projection: `expert_weight_target`
says which rows of which stacked parameter each one fills, and `load_moe_weights` loads a whole
model that way.

Tensor parallelism splits every expert's intermediate dim (Megatron's MLP split inside each
expert): a rank holds I / tp of each expert's gate and up rows and the matching down columns
(`expert_split`), so its experts' sum is a partial sum over the intermediate dim, and so is the
shared expert's (its down_proj does not reduce); the block adds the two and all-reduces once. The
router and the shared expert's gate are whole on every rank: each rank routes every token alike.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import Ops
from conveyor.gpu.models.layers import Linear
from conveyor.gpu.models.llama import MLP
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.shard import Split, cut, local_units, splits_of

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# transformers' config defaults, which save_pretrained leaves out of config.json.
_QWEN_DEFAULTS = {
    "Qwen3MoeForCausalLM": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "Qwen2MoeForCausalLM": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408),
}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    num_experts: int  # E
    top_k: int  # K experts per token
    moe_intermediate_size: int  # I of each routed expert
    norm_topk_prob: bool  # renormalise the K chosen probabilities to sum 1
    float32_weights: bool  # the routing weights scale the experts in float32 (Mixtral), else in the model dtype
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[int, ...]  # the layers with an MoE block; the others have a dense MLP
    block_name: str  # the block's module name in the checkpoint: "block_sparse_moe" (Mixtral) or "mlp"
    expert_projections: tuple[str, str, str]  # the checkpoint's names of each expert's gate, up and down


def moe_fields(hf: dict[str, Any]) -> MoeConfig:
    """The MoE part of a checkpoint's config.json (the rest is ModelConfig's). Missing keys take
    transformers' defaults for the family (Mixtral: 8 experts, top 2)."""
    arch = next((a for a in hf.get("architectures") or [] if a in MOE_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"not a mixture-of-experts architecture: {hf.get('architectures')!r}; supported: {', '.join(MOE_ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{arch} with hidden_act {hf['hidden_act']!r} is not supported: only silu")
    try:
        num_layers = int(hf["num_hidden_layers"])
        if arch == "MixtralForCausalLM":
            cfg = MoeConfig(
                num_experts=_num_experts(hf, 8),
                top_k=int(hf.get("num_experts_per_tok", 2)),
                moe_intermediate_size=int(hf["intermediate_size"]),
                norm_topk_prob=True,
                float32_weights=True,
                shared_expert_intermediate_size=0,
                sparse_layers=tuple(range(num_layers)),
                block_name="block_sparse_moe",
                expert_projections=("w1", "w3", "w2"),
            )
        else:
            defaults = _QWEN_DEFAULTS[arch]
            # Only Qwen2-MoE has a shared expert (transformers' default size: 5632).
            shared = int(hf.get("shared_expert_intermediate_size", 5632)) if arch == "Qwen2MoeForCausalLM" else 0
            step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
            num_experts = _num_experts(hf, defaults["num_experts"])
            cfg = MoeConfig(
                num_experts=num_experts,
                top_k=int(hf.get("num_experts_per_tok", defaults["num_experts_per_tok"])),
                moe_intermediate_size=int(hf.get("moe_intermediate_size", defaults["moe_intermediate_size"])),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                float32_weights=False,
                shared_expert_intermediate_size=shared,
                sparse_layers=tuple(i for i in range(num_layers) if num_experts > 0 and (i + 1) % step == 0 and i not in dense),
                block_name="mlp",
                expert_projections=("gate_proj", "up_proj", "down_proj"),
            )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"malformed mixture-of-experts fields in config.json ({arch}): {e!r}") from None
    if cfg.sparse_layers and not 0 < cfg.top_k <= cfg.num_experts:
        raise ConfigError(f"{arch}: num_experts_per_tok {cfg.top_k} must be in 1..num_experts ({cfg.num_experts})")
    if cfg.sparse_layers and cfg.moe_intermediate_size <= 0:
        raise ConfigError(f"{arch}: the experts' intermediate size must be positive, not {cfg.moe_intermediate_size}")
    return cfg


def _num_experts(hf: dict[str, Any], default: int) -> int:
    # transformers 5 writes Mixtral's and Qwen3-MoE's count as num_local_experts, older files
    # Qwen's as num_experts.
    return int(hf.get("num_local_experts", hf.get("num_experts", default)))


def route(router_logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, K], float32 or the logits' dtype as the family does;
    expert ids [T, K] int64), as transformers' top-k routers compute them."""
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
    expert holds this rank's I / tp intermediate rows."""

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


def load_moe_weights(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], moe: MoeConfig, tp: TensorParallel = SINGLE
) -> None:
    """Fill every parameter of `model` from checkpoint (name, tensor) pairs: experts' tensors into
    their stacked rows, everything else by name, each cut to rank tp.rank's slice. ConfigError
    names a shape that disagrees or a tensor that never came."""
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
        dest = params[key][target[1], target[2]] if target else params[key]
        if tensor.shape != dest.shape:
            raise ConfigError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        num_filled[key] = num_filled.get(key, 0) + 1
        if not target or num_filled[key] == moe.num_experts * (2 if key.endswith("gate_up_proj") else 1):
            missing.discard(key)
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (" ..." if len(missing) > 3 else "")
        raise ConfigError(f"checkpoint lacks {len(missing)} weight(s): {shown}")
